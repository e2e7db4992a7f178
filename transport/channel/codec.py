"""The only code that turns protocol messages and tensors into bytes, and bytes back into them.

Wire format of one message, as a list of frames:
    frame 0:  msgpack [PROTOCOL_VERSION, tag, {field: value, ...}]
    frame k:  the raw bytes of the message's k-th tensor (tensor fields in declaration order, the
              tensors of a tuple field in tuple order), C-contiguous, native (little-endian) byte
              order; a tensor's body entry is its {"dtype", "shape"} (a tuple field's, a list of them).

Decoding is strict: every field of the tagged struct must be present with its declared type, no
other field may be, nested structs are checked the same way, and strings, lists, binaries and the
control frame are length-limited before anything is allocated for them. Any violation raises
DecodeError, so a loop that receives a message can trust its types. There is no pickle, eval or
torch.load here.

This module never imports torch, nor what does: tensors are tensor_frames.py's business, which registers
itself here (`register_tensors`) when imported - by every module that moves tensors (the KV-transfer core
imports it). A process that never imported it (the proxy, which moves none) refuses messages that carry
tensors rather than load torch to decode them.
"""
from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Union

import msgpack

from epdserve.transport.channel import protocol
from epdserve.transport.channel.limits import DEFAULT_LIMITS, Limits
from epdserve.transport.channel.protocol import MESSAGE_TYPES, PROTOCOL_VERSION, Message, TensorSpec

Buffer = Union[bytes, bytearray, memoryview]


class DecodeError(ValueError):
    """Bytes from a peer that are not a valid message of this protocol version."""


class VersionMismatchError(DecodeError):
    """A well-formed envelope of another protocol version."""

    def __init__(self, peer_version: int):
        super().__init__(f"peer speaks protocol version {peer_version}, this side {PROTOCOL_VERSION}")
        self.peer_version = peer_version


class EncodeError(TypeError):
    """A message built with a value that does not match its declared field type (a local bug)."""


class LimitExceeded(EncodeError):
    """A message the receiver would drop for its size (`Limits`): refused before it is sent. Whoever takes
    requests from users checks their sizes first; this is the backstop that keeps a too-large one from
    vanishing on the wire."""


# Frames up to this size cannot break a string, binary or list limit: `encode` checks only larger ones.
_SMALLEST_LIMIT = min(DEFAULT_LIMITS.max_str_len, DEFAULT_LIMITS.max_bin_len, DEFAULT_LIMITS.max_list_len)

# ---------------------------------------------------------------------------------------------
# Field converters, compiled once per struct from its annotations


class _Tensor:
    """What `torch.Tensor` means in the protocol's annotations, to this codec: a field of tensor frames."""


_TORCH_NAMES = types.SimpleNamespace(Tensor=_Tensor)


@dataclasses.dataclass(frozen=True, slots=True)
class Tensors:
    """How tensor fields travel: a tensor's (dtype, shape), its bytes as a buffer, and the tensor rebuilt
    from both (checked against `Limits`). tensor_frames.py is the one implementation."""

    spec: Callable[[Any], TensorSpec]
    buffer: Callable[[Any], Buffer]
    from_buffer: Callable[[TensorSpec, Buffer, Limits], Any]


_tensors: Tensors | None = None


def register_tensors(tensors: Tensors) -> None:
    """Let messages carry tensors, encoded and decoded by `tensors` (tensor_frames.py registers itself so)."""
    global _tensors
    _tensors = tensors


def _encoding_tensors(path: str) -> Tensors:
    if _tensors is None:
        raise EncodeError(f"{path}: tensors travel only in a process that imported "
                          f"epdserve.transport.channel.tensor_frames")
    return _tensors


def _decoding_tensors(tag: str) -> Tensors:
    if _tensors is None:  # a process that moves no tensors does not load torch for a peer's
        raise DecodeError(f"{tag}: this process takes no tensors")
    return _tensors


class _Field:
    """Checks one value against a declared type in both directions (to and from msgpack)."""

    def to_wire(self, value: Any, path: str) -> Any:
        raise NotImplementedError

    def from_wire(self, value: Any, path: str) -> Any:
        raise NotImplementedError


def _fail_encode(path: str, expected: str, value: Any) -> typing.NoReturn:
    raise EncodeError(f"{path}: expected {expected}, got {type(value).__name__}")


def _fail_decode(path: str, expected: str, value: Any) -> typing.NoReturn:
    raise DecodeError(f"{path}: expected {expected}, got {type(value).__name__}")


class _Scalar(_Field):
    def __init__(self, tp: type):
        self.tp = tp

    def to_wire(self, value, path):
        if type(value) is self.tp:
            return value
        if self.tp is float and type(value) is int:  # an int where a float is declared is harmless
            return float(value)
        if self.tp is bytes and isinstance(value, (bytearray, memoryview)):
            return bytes(value)
        _fail_encode(path, self.tp.__name__, value)

    def from_wire(self, value, path):
        # `type(...) is` rather than isinstance: bool is an int subclass and must not pass for one.
        if type(value) is self.tp:
            return value
        if self.tp is float and type(value) is int:
            return float(value)
        _fail_decode(path, self.tp.__name__, value)


class _Enum(_Field):
    def __init__(self, tp: type[enum.Enum]):
        self.tp = tp

    def to_wire(self, value, path):
        if isinstance(value, self.tp):
            return value.value
        _fail_encode(path, self.tp.__name__, value)

    def from_wire(self, value, path):
        try:
            return self.tp(value)
        except (ValueError, TypeError):
            raise DecodeError(f"{path}: {value!r} is not a {self.tp.__name__}") from None


class _Tuple(_Field):
    def __init__(self, item: _Field):
        self.item = item

    def to_wire(self, value, path):
        if not isinstance(value, (tuple, list)):
            _fail_encode(path, "a tuple", value)
        if isinstance(self.item, _Scalar) and self.item.tp is int:
            if all(type(x) is int for x in value):  # fast path: token and block id lists
                return value
        return [self.item.to_wire(x, f"{path}[{i}]") for i, x in enumerate(value)]

    def from_wire(self, value, path):
        if type(value) is not list:
            _fail_decode(path, "an array", value)
        if isinstance(self.item, _Scalar) and self.item.tp is int:
            if all(type(x) is int for x in value):
                return tuple(value)
        return tuple(self.item.from_wire(x, f"{path}[{i}]") for i, x in enumerate(value))


class _Optional(_Field):
    """A union of alternatives (often `X | None`); the first that accepts the value wins."""

    def __init__(self, options: list[_Field], allows_none: bool):
        self.options = options
        self.allows_none = allows_none

    def _try(self, value, path, direction: str, error: type[Exception]):
        if value is None:
            if self.allows_none:
                return None
            raise error(f"{path}: must not be None")
        if len(self.options) == 1:  # `X | None`: X's own error says what is wrong
            return getattr(self.options[0], direction)(value, path)
        for option in self.options:
            try:
                return getattr(option, direction)(value, path)
            except error:
                continue
        raise error(f"{path}: {type(value).__name__} matches none of the declared types")

    def to_wire(self, value, path):
        return self._try(value, path, "to_wire", EncodeError)

    def from_wire(self, value, path):
        return self._try(value, path, "from_wire", DecodeError)


class _Struct(_Field):
    """A dataclass: a msgpack map with exactly its fields."""

    def __init__(self, cls: type):
        self.cls = cls
        self.fields: dict[str, _Field] = {}
        self.tensor_fields: list[str] = []  # fields of one tensor or of a tuple of tensors
        self.tensor_tuples: set[str] = set()  # those of the latter kind

    def compile(self) -> None:
        # The protocol names torch only in annotations (it does not import it), and so does this codec:
        # `torch.Tensor` resolves to a marker here, and tensors themselves are tensor_frames' business.
        hints = typing.get_type_hints(self.cls, {**vars(protocol), "torch": _TORCH_NAMES})
        for f in dataclasses.fields(self.cls):
            if hints[f.name] is _Tensor:
                self.tensor_fields.append(f.name)
                self.fields[f.name] = _struct(TensorSpec)
            elif hints[f.name] == tuple[_Tensor, ...]:
                self.tensor_fields.append(f.name)
                self.tensor_tuples.add(f.name)
                self.fields[f.name] = _Tuple(_struct(TensorSpec))
            else:
                self.fields[f.name] = _compile(hints[f.name], f"{self.cls.__name__}.{f.name}")

    def to_wire(self, value, path):
        if type(value) is not self.cls:
            _fail_encode(path, self.cls.__name__, value)
        body = {}
        for name, conv in self.fields.items():
            item = getattr(value, name)
            if name in self.tensor_tuples:
                if not isinstance(item, tuple):
                    _fail_encode(f"{path}.{name}", "a tuple of tensors", item)
                item = tuple(_encoding_tensors(f"{path}.{name}").spec(t) for t in item)
            elif name in self.tensor_fields:
                item = _encoding_tensors(f"{path}.{name}").spec(item)
            body[name] = conv.to_wire(item, f"{path}.{name}")
        return body

    def tensors(self, message) -> list:
        """The message's tensors in frame order."""
        out = []
        for name in self.tensor_fields:
            value = getattr(message, name)
            out.extend(value) if name in self.tensor_tuples else out.append(value)
        return out

    def from_wire(self, value, path, tensors: Sequence = ()):
        if type(value) is not dict:
            _fail_decode(path, f"a {self.cls.__name__} map", value)
        if value.keys() != self.fields.keys():
            unknown = sorted(map(str, value.keys() - self.fields.keys()))
            missing = sorted(self.fields.keys() - value.keys())
            raise DecodeError(f"{path}: unknown fields {unknown}, missing fields {missing}")
        kwargs = {name: conv.from_wire(value[name], f"{path}.{name}") for name, conv in self.fields.items()}
        for name, tensor in zip(self.tensor_fields, tensors):
            kwargs[name] = tensor  # a tensor, or a tuple of them for a tuple field
        return self.cls(**kwargs)


_STRUCTS: dict[type, _Struct] = {}


def _struct(cls: type) -> _Struct:
    conv = _STRUCTS.get(cls)
    if conv is None:
        conv = _STRUCTS[cls] = _Struct(cls)
        conv.compile()
    return conv


def _compile(tp: Any, where: str) -> _Field:
    origin = typing.get_origin(tp)
    if tp in (int, float, bool, str, bytes):
        return _Scalar(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _Enum(tp)
    if dataclasses.is_dataclass(tp):
        return _struct(tp)
    if origin is tuple:
        args = typing.get_args(tp)
        assert len(args) == 2 and args[1] is Ellipsis, f"{where}: only tuple[T, ...] is supported"
        return _Tuple(_compile(args[0], where))
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        options = [_compile(a, where) for a in args if a is not type(None)]
        return _Optional(options, allows_none=type(None) in args)
    raise AssertionError(f"{where}: no wire form for {tp!r}")


_MESSAGES: dict[str, _Struct] = {tag: _struct(cls) for tag, cls in MESSAGE_TYPES.items()}


# ---------------------------------------------------------------------------------------------
# Messages


def encode(message: Message) -> list[Buffer]:
    """Frames of one message: the msgpack control frame, then one zero-copy frame per tensor field."""
    conv = _MESSAGES.get(getattr(type(message), "TAG", None))
    if conv is None or conv.cls is not type(message):
        raise EncodeError(f"{type(message).__name__} is not a protocol message")
    body = conv.to_wire(message, conv.cls.__name__)
    try:
        head = msgpack.packb([PROTOCOL_VERSION, conv.cls.TAG, body], use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as e:  # e.g. an int beyond 64 bits, a lone surrogate
        raise EncodeError(f"{conv.cls.__name__}: {e}") from e
    if len(head) > _SMALLEST_LIMIT:  # no smaller frame can hold a string, binary or list over its limit
        _check_limits(conv.cls.__name__, body, len(head), DEFAULT_LIMITS)
    tensors = conv.tensors(message)
    return [head, *map(_encoding_tensors(conv.cls.__name__).buffer, tensors)] if tensors else [head]


def _check_limits(path: str, body: Any, head_bytes: int, limits: Limits) -> None:
    """Raise LimitExceeded naming the first part of `body` (a message's msgpack-ready fields) that a
    receiver decoding with `limits` would refuse."""
    if head_bytes > limits.max_message_bytes:
        raise LimitExceeded(f"{path}: {head_bytes} bytes, over the limit of {limits.max_message_bytes}")
    todo = [(path, body)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, str) and len(value) * 4 > limits.max_str_len and \
                len(value.encode()) > limits.max_str_len:
            raise LimitExceeded(f"{where}: a string of {len(value.encode())} bytes, over the limit of "
                                f"{limits.max_str_len}")
        if isinstance(value, (bytes, bytearray, memoryview)) and len(value) > limits.max_bin_len:
            raise LimitExceeded(f"{where}: {len(value)} bytes, over the limit of {limits.max_bin_len}")
        if isinstance(value, (list, tuple)):
            if len(value) > limits.max_list_len:
                raise LimitExceeded(f"{where}: {len(value)} items, over the limit of {limits.max_list_len}")
            todo.extend((f"{where}[{i}]", item) for i, item in enumerate(value) if not isinstance(item, int))
        elif isinstance(value, dict):
            todo.extend((f"{where}.{key}", item) for key, item in value.items())


def decode(frames: Sequence[Buffer], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Parse and validate one message; raise DecodeError on anything but a well-formed one."""
    if not frames:
        raise DecodeError("empty message")
    head = memoryview(frames[0])
    if head.nbytes > limits.max_message_bytes:
        raise DecodeError(f"control frame of {head.nbytes} bytes exceeds the limit of {limits.max_message_bytes}")
    try:
        envelope = msgpack.unpackb(
            head, raw=False, strict_map_key=True, use_list=True,
            max_str_len=limits.max_str_len, max_bin_len=limits.max_bin_len,
            max_array_len=limits.max_list_len, max_map_len=limits.max_map_len, max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise DecodeError(f"malformed msgpack: {e}") from None
    if type(envelope) is not list or len(envelope) != 3:
        raise DecodeError("not a [version, tag, body] envelope")
    version, tag, body = envelope
    if type(version) is not int:
        raise DecodeError("protocol version is not an integer")
    if version != PROTOCOL_VERSION:
        raise VersionMismatchError(version)
    conv = _MESSAGES.get(tag) if type(tag) is str else None
    if conv is None:
        raise DecodeError(f"unknown message tag {str(tag)[:64]!r}")
    if type(body) is not dict:
        raise DecodeError(f"{tag}: body is not a map")
    specs = {name: conv.fields[name].from_wire(body.get(name), f"{conv.cls.__name__}.{name}")
             for name in conv.tensor_fields}
    num_frames = 1 + sum(len(specs[name]) if name in conv.tensor_tuples else 1 for name in conv.tensor_fields)
    if len(frames) != num_frames:
        raise DecodeError(f"{tag}: expected {num_frames} frames, got {len(frames)}")
    tensors, next_frame = [], 1
    for name in conv.tensor_fields:
        if name in conv.tensor_tuples:
            tensors.append(tuple(_decoding_tensors(tag).from_buffer(spec, frames[next_frame + i], limits)
                                 for i, spec in enumerate(specs[name])))
            next_frame += len(specs[name])
        else:
            tensors.append(_decoding_tensors(tag).from_buffer(specs[name], frames[next_frame], limits))
            next_frame += 1
    return conv.from_wire(body, conv.cls.__name__, tensors)
