"""Reads a GGUF file (llama.cpp's single-file checkpoint, version 2 or 3): its metadata and its tensors, the
quantized ones as the raw blocks they ship in.

The file is memory-mapped; a tensor is a view of its bytes, read only when used. The metadata is parsed in
one pass (a 262k-entry vocabulary in well under a second: arrays of numbers are read whole, strings one by
one), where the `gguf` package's reader builds a NumPy view per value and takes seconds.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from epdserve.shared.models.gguf_quants import FORMATS, GGMLType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types and, for the fixed-size ones, their struct format.
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch's order: the last dimension is the one a block runs along
    type: GGMLType
    data: np.ndarray  # the tensor's bytes (uint8), as stored

    @property
    def num_elements(self) -> int:
        return int(np.prod(self.shape))


class GGUFFile:
    """metadata: key -> value (numbers, strings, bools; arrays as lists, or NumPy arrays for numbers);
    tensors: name -> GGUFTensor, in the file's order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        if bytes(self._buf[:4]) != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
        self._pos = len(MAGIC)
        version = self._scalar("I")
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        num_tensors, num_keys = self._scalar("Q"), self._scalar("Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_keys):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            dims = [self._scalar("Q") for _ in range(self._scalar("I"))]
            infos.append((name, tuple(reversed(dims)), self._scalar("I"), self._scalar("Q")))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._pos // alignment) * alignment
        data = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, type_id, offset in infos:
            try:
                kind = GGMLType(type_id)
            except ValueError:
                raise ValueError(f"{self.path}: tensor {name!r} has GGML type {type_id}, which is not supported") \
                    from None
            nbytes = FORMATS[kind].nbytes(shape)
            begin = start + offset
            if begin + nbytes > len(data):
                raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
            self.tensors[name] = GGUFTensor(name, shape, kind, data[begin:begin + nbytes])

    # -- parsing ---------------------------------------------------------------------------------------

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from("<" + fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("Q")
        text = str(self._buf[self._pos:self._pos + n], "utf-8", errors="replace")
        self._pos += n
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._scalar("I"), self._scalar("Q")
            if item in _SCALARS and item != 7:
                dtype = np.dtype("<" + _SCALARS[item])
                values = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos).copy()
                self._pos += dtype.itemsize * count
                return values
            return [self._value(item) for _ in range(count)]
        raise ValueError(f"{self.path}: metadata value type {kind} is not defined by GGUF")
