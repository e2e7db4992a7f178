"""The protocol's shape: one tagged union of frozen, slotted structs with a version."""
import dataclasses
import enum
import hashlib

import msgpack
import pytest
import torch

from epdserve.transport.channel import protocol
from epdserve.transport.channel.protocol import MESSAGE_TYPES, PROTOCOL_VERSION, Message
from epdserve.transport.channel import codec
from epdserve.transport.channel.codec import DecodeError


def test_version_is_a_positive_int():
    assert isinstance(PROTOCOL_VERSION, int) and PROTOCOL_VERSION >= 1


def test_union_and_tag_table_agree():
    assert set(MESSAGE_TYPES.values()) == set(Message.__args__)
    for tag, cls in MESSAGE_TYPES.items():
        assert cls.TAG == tag
        assert tag.islower() and " " not in tag


def _all_structs():
    return [
        obj for obj in vars(protocol).values()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == protocol.__name__
    ]


@pytest.mark.parametrize("cls", _all_structs(), ids=lambda c: c.__name__)
def test_every_struct_is_frozen_and_slotted(cls):
    params = cls.__dataclass_params__
    assert params.frozen, f"{cls.__name__} must be frozen: received messages are read-only"
    assert "__slots__" in vars(cls), f"{cls.__name__} must be slotted"


def test_messages_reject_mutation():
    msg = protocol.Release("r1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.request_id = "r2"
    with pytest.raises((AttributeError, TypeError)):
        msg.extra = 1


def test_tensor_fields_do_not_take_part_in_equality():
    a = protocol.EmbeddingsData("h", 0, torch.zeros(2, 3))
    b = protocol.EmbeddingsData("h", 0, torch.ones(2, 3))
    assert a == b  # control fields equal; tensors are compared by the code that needs to


def test_handshake_carries_version_and_kv_layout():
    layout = protocol.KVLayout("m", "bfloat16", 16, 30, 3, 64)
    hello = protocol.Handshake(PROTOCOL_VERSION, protocol.Role.DECODE, "d0", layout)
    assert hello.protocol_version == PROTOCOL_VERSION and hello.kv_layout == layout
    assert {f.name for f in dataclasses.fields(protocol.KVLayout)} == {
        "model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_size",
    }


def _wire_schema() -> str:
    """Everything that decides what a peer accepts: each struct's tag and fields (names and declared
    types, in order) and each enum's values. Defaults do not travel (every field is always sent)."""
    lines = []
    for name, obj in sorted(vars(protocol).items()):
        if not isinstance(obj, type) or obj.__module__ != protocol.__name__:
            continue
        if dataclasses.is_dataclass(obj):
            fields = ", ".join(f"{f.name}: {f.type}" for f in dataclasses.fields(obj))
            lines.append(f"{name} [{getattr(obj, 'TAG', '')}] ({fields})")
        elif issubclass(obj, enum.Enum):
            lines.append(f"{name} {{{', '.join(str(m.value) for m in obj)}}}")
    return "\n".join(lines)


# The schema PROTOCOL_VERSION stands for. The codec accepts one version and exactly the declared
# fields, so a schema change without a new version would make peers of "the same version" refuse
# (or misread) each other's messages.
SCHEMA_FINGERPRINT = (17, "bbadca88feefc1ba")


def test_a_schema_change_comes_with_a_new_protocol_version():
    digest = hashlib.sha256(_wire_schema().encode()).hexdigest()[:16]
    assert (PROTOCOL_VERSION, digest) == SCHEMA_FINGERPRINT, (
        f"the wire schema changed (fingerprint {digest!r}): bump PROTOCOL_VERSION and pin the new pair here")


def test_a_field_with_a_default_is_still_required_on_the_wire():
    # A default serves the constructor only: a peer that lacks the field cannot leave it out.
    body = codec._MESSAGES["status"].to_wire(protocol.Status("e", protocol.Role.DECODE, protocol.Health.READY,
                                                             1, 2, 0, 0), "Status")
    del body["data_addr"]
    frame = msgpack.packb([PROTOCOL_VERSION, "status", body], use_bin_type=True)
    with pytest.raises(DecodeError, match="missing fields \\['data_addr'\\]"):
        codec.decode([frame])
    frame = msgpack.packb([PROTOCOL_VERSION, "status", {**body, "data_addr": "", "priority": 1}], use_bin_type=True)
    with pytest.raises(DecodeError, match="unknown fields \\['priority'\\]"):
        codec.decode([frame])
