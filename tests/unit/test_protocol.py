"""The protocol's shape: one tagged union of frozen, slotted structs with a version."""
import dataclasses

import pytest
import torch

from epdserve.shared import protocol
from epdserve.shared.protocol import MESSAGE_TYPES, PROTOCOL_VERSION, Message


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
    a = protocol.EmbeddingsData("h", torch.zeros(2, 3))
    b = protocol.EmbeddingsData("h", torch.ones(2, 3))
    assert a == b  # control fields equal; tensors are compared by the code that needs to


def test_handshake_carries_version_and_kv_layout():
    layout = protocol.KVLayout("m", "bfloat16", 16, 30, 3, 64)
    hello = protocol.Handshake(PROTOCOL_VERSION, protocol.Role.DECODE, "d0", layout)
    assert hello.protocol_version == PROTOCOL_VERSION and hello.kv_layout == layout
    assert {f.name for f in dataclasses.fields(protocol.KVLayout)} == {
        "model_id", "dtype", "block_size", "num_layers", "num_kv_heads", "head_size",
    }


def test_wire_sampling_params_cover_the_engine_fields():
    names = {f.name for f in dataclasses.fields(protocol.WireSamplingParams)}
    assert {
        "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs",
        "skip_special_tokens",
    } <= names
