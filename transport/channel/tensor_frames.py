"""Tensors on the wire: a tensor field travels as its (dtype, shape) in the control frame and its raw bytes
in a frame of its own (see codec.py). The only part of the codec that needs torch, plugged into it when this
module is imported (`codec.register_tensors`): messages without tensors - all the proxy ever sends or
receives - are encoded and decoded without it.
"""
from __future__ import annotations

import math
from typing import Union

import torch

from epdserve.transport.channel import codec
from epdserve.transport.channel.codec import DecodeError, EncodeError
from epdserve.transport.channel.limits import DEFAULT_LIMITS, Limits
from epdserve.transport.channel.protocol import TensorSpec

Buffer = Union[bytes, bytearray, memoryview]

# Every dtype the wire carries. Names are torch's without the "torch." prefix.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
        "int64", "int32", "int16", "int8", "uint8", "bool",
    )
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise EncodeError(f"dtype {dtype} cannot travel on the wire") from None


def tensor_spec(tensor: torch.Tensor) -> TensorSpec:
    if not isinstance(tensor, torch.Tensor):
        raise EncodeError(f"expected a tensor, got {type(tensor).__name__}")
    return TensorSpec(dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape))


def tensor_buffer(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as a memoryview of its own storage (a copy only if it is not contiguous).

    The view keeps the storage alive; the caller must not write to the tensor until the bytes are
    sent (ZMQ sends a zero-copy frame from its IO thread).
    """
    if tensor.device.type != "cpu":
        raise EncodeError(f"tensors travel from CPU memory, got one on {tensor.device}")
    dtype_name(tensor.dtype)
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def check_spec(spec: TensorSpec, limits: Limits = DEFAULT_LIMITS) -> tuple[torch.dtype, int]:
    """Validate a (dtype, shape) from the wire; return the dtype and the byte size it implies."""
    dtype = DTYPES.get(spec.dtype)
    if dtype is None:
        raise DecodeError(f"unsupported dtype {spec.dtype!r}")
    if len(spec.shape) > limits.max_tensor_dims or any(d < 0 for d in spec.shape):
        raise DecodeError(f"invalid tensor shape {spec.shape}")
    nbytes = math.prod(spec.shape) * dtype.itemsize  # Python ints: no overflow on hostile shapes
    if nbytes > limits.max_tensor_bytes:
        raise DecodeError(f"tensor of {nbytes} bytes exceeds the limit of {limits.max_tensor_bytes}")
    return dtype, nbytes


def tensor_from_buffer(spec: TensorSpec, buffer: Buffer, limits: Limits = DEFAULT_LIMITS) -> torch.Tensor:
    """Rebuild a tensor from (dtype, shape) and raw bytes, aliasing a writable buffer without a copy."""
    dtype, nbytes = check_spec(spec, limits)
    view = memoryview(buffer).cast("B")
    if view.nbytes != nbytes:
        raise DecodeError(f"tensor {spec.dtype}{list(spec.shape)} needs {nbytes} bytes, frame has {view.nbytes}")
    if nbytes == 0:
        return torch.empty(spec.shape, dtype=dtype)
    if view.readonly:
        view = memoryview(bytearray(view))  # torch may not alias memory it must treat as writable
    raw = torch.frombuffer(view, dtype=torch.uint8)
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()  # misaligned frame: element loads must be aligned on some CPUs
    if dtype is torch.bool and bool((raw > 1).any()):
        raise DecodeError("bool tensor holds bytes other than 0 and 1")
    return raw.view(dtype).view(spec.shape)


codec.register_tensors(codec.Tensors(spec=tensor_spec, buffer=tensor_buffer, from_buffer=tensor_from_buffer))
