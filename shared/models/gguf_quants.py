"""GGML's block formats, each split into what every one of them is: small integers q, one float32 scale per
group of consecutive values, and (in the formats with a minimum) one float32 offset per group, so that

    w = scale * q            (Q4_0, Q5_0, Q8_0, Q6_K)
    w = scale * q + offset   (Q4_1, Q5_1, Q4_K, Q5_K)

each operation rounded to float32 on its own, in that order. That is exactly how the reference dequantizer
(the `gguf` package's, which transformers uses to convert a GGUF file) computes every weight, scales and
offsets included (Q4_K's scale is d * sc, its offset -(dmin * m)); so a kernel that unpacks q and applies
scale and offset in these two roundings reproduces the dequantized float32 weights bit for bit.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

QK_K = 256  # the super-block of the K formats


class GGMLType(enum.IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


class Groups(NamedTuple):
    """A tensor's values as q [blocks, block_size] (integers, in int16), scale and offset [blocks, groups]
    (float32; offset None where the format has none); a group is block_size // groups consecutive values."""

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray | None

    def dequantize(self) -> np.ndarray:
        """[blocks, block_size] float32, as the reference computes it."""
        blocks, size = self.q.shape
        groups = self.scale.shape[1]
        q = self.q.reshape(blocks, groups, size // groups).astype(np.float32)
        w = self.scale[:, :, None] * q
        if self.offset is not None:
            w = w + self.offset[:, :, None]
        return w.reshape(blocks, size)


@dataclass(frozen=True, slots=True)
class BlockFormat:
    block_size: int  # values per block
    type_size: int  # bytes per block
    split: Callable[[np.ndarray], Groups] | None  # None: a float format, read as is

    def nbytes(self, shape: tuple[int, ...]) -> int:
        if shape[-1] % self.block_size:
            raise ValueError(f"a row of {shape[-1]} values is not a whole number of {self.block_size}-value blocks")
        return int(np.prod(shape)) // self.block_size * self.type_size


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, chunk: int) -> np.ndarray:
    """Bytes in chunks of `chunk`: each chunk's low nibbles, then its high nibbles."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, chunk) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & np.uint8(0x0F)).reshape(n, -1)


def _split_q4_0(b: np.ndarray) -> Groups:
    return Groups(_nibbles(b[:, 2:], 16).astype(np.int16) - 8, _f16(b[:, :2]), None)


def _split_q4_1(b: np.ndarray) -> Groups:
    return Groups(_nibbles(b[:, 4:], 16).astype(np.int16), _f16(b[:, :2]), _f16(b[:, 2:4]))


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """The 32 values' fifth bits, from the block's 32-bit little-endian mask."""
    bits = np.ascontiguousarray(qh).view("<u4").reshape(-1, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return ((bits & 1) << 4).astype(np.int16)


def _split_q5_0(b: np.ndarray) -> Groups:
    return Groups((_nibbles(b[:, 6:], 16) | _fifth_bits(b[:, 2:6])) - 16, _f16(b[:, :2]), None)


def _split_q5_1(b: np.ndarray) -> Groups:
    return Groups(_nibbles(b[:, 8:], 16) | _fifth_bits(b[:, 4:8]), _f16(b[:, :2]), _f16(b[:, 2:4]))


def _split_q8_0(b: np.ndarray) -> Groups:
    return Groups(np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.int16), _f16(b[:, :2]), None)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and minimums packed in a K block's 12 bytes."""
    n = scales.shape[0]
    d, m, m_d = np.split(scales.reshape(n, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1).reshape(n, 8)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1).reshape(n, 8)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_groups(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    return d * sc, -(dmin * mn)


def _split_q4_k(b: np.ndarray) -> Groups:
    scale, offset = _k_groups(b)
    return Groups(_nibbles(b[:, 16:], 32).astype(np.int16), scale, offset)


def _split_q5_k(b: np.ndarray) -> Groups:
    n = b.shape[0]
    scale, offset = _k_groups(b)
    qh = b[:, 16:48].reshape(n, 1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    q = _nibbles(b[:, 48:], 32) | ((qh & np.uint8(1)).reshape(n, -1) << np.uint8(4))
    return Groups(q.astype(np.int16), scale, offset)


def _split_q6_k(b: np.ndarray) -> Groups:
    n = b.shape[0]
    ql = _nibbles(b[:, :128], 64)
    qh = b[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (ql | ((qh & np.uint8(3)).reshape(n, -1) << np.uint8(4))).astype(np.int16) - 32
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return Groups(q, _f16(b[:, 208:210]) * scales, None)


FORMATS: dict[GGMLType, BlockFormat] = {
    GGMLType.F32: BlockFormat(1, 4, None),
    GGMLType.F16: BlockFormat(1, 2, None),
    GGMLType.BF16: BlockFormat(1, 2, None),
    GGMLType.Q4_0: BlockFormat(32, 18, _split_q4_0),
    GGMLType.Q4_1: BlockFormat(32, 20, _split_q4_1),
    GGMLType.Q5_0: BlockFormat(32, 22, _split_q5_0),
    GGMLType.Q5_1: BlockFormat(32, 24, _split_q5_1),
    GGMLType.Q8_0: BlockFormat(32, 34, _split_q8_0),
    GGMLType.Q4_K: BlockFormat(QK_K, 144, _split_q4_k),
    GGMLType.Q5_K: BlockFormat(QK_K, 176, _split_q5_k),
    GGMLType.Q6_K: BlockFormat(QK_K, 210, _split_q6_k),
}


def split_blocks(kind: GGMLType, data: np.ndarray, shape: tuple[int, ...]) -> Groups:
    """A quantized tensor's bytes -> its Groups, blocks in row-major order (a row is shape[-1] // block_size
    blocks)."""
    fmt = FORMATS[kind]
    if fmt.split is None:
        raise ValueError(f"{kind.name} is a float format: no blocks to split")
    return fmt.split(np.asarray(data, dtype=np.uint8).reshape(-1, fmt.type_size))


def to_float32(kind: GGMLType, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor as float32 of `shape`, every value as the reference dequantizer gives it."""
    data = np.asarray(data, dtype=np.uint8)
    if kind == GGMLType.F32:
        return data.view(np.float32).reshape(shape).copy()
    if kind == GGMLType.F16:
        return data.view(np.float16).astype(np.float32).reshape(shape)
    if kind == GGMLType.BF16:
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return split_blocks(kind, data, shape).dequantize().reshape(shape)
