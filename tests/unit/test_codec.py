"""The codec: exact round trips, zero-copy tensors, and strict rejection of everything else."""
import math

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epdserve.transport.channel import protocol as p
from epdserve.transport.channel import codec, tensor_frames
from epdserve.transport.channel.codec import DEFAULT_LIMITS, DecodeError, EncodeError, Limits, VersionMismatchError

LAYOUT = p.KVLayout("SmolLM2-135M", "bfloat16", 16, 30, 3, 64)
SAMPLING = p.WireSamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=1234, max_tokens=None,
                                stop=("\n\n", "</s>"), stop_token_ids=(2,), logprobs=5)
PLACEHOLDER = p.MMPlaceholder(offset=3, length=576, mm_hash="ab" * 32, encoder_addr="tcp://127.0.0.1:5000")
HANDLE = p.KVHandle("prefill-0", "tcp://127.0.0.1:6000", (7, 3, 11), 2**62 + 5, 40, 1.8e9 + 0.25)
LOGPROBS = p.TokenLogprobs(-0.25, (5, 9), (-0.25, -2.5))

MROPE = p.MRopePositions((0, 1, 1), (0, 1, 2), (0, 1, 1))  # an image of 1 x 2 x 1 tokens after one text token
SAMPLES = [
    p.Handshake(p.PROTOCOL_VERSION, p.Role.DECODE, "decode-0", LAYOUT, "ucx", b"\x00ucx\xff"),
    p.Handshake(p.PROTOCOL_VERSION, p.Role.PROXY, "proxy-0"),
    p.HandshakeAck(p.PROTOCOL_VERSION, "prefill-0", LAYOUT, "zmq"),
    p.EncodeRequest("r1", (p.MMItem("ab" * 32, b"\x89PNG\r\n"), p.MMItem("cd" * 32, b""))),
    p.EncodeDone("r1", (p.EncodedItem("ab" * 32, 576),)),
    p.EncodeDone("r1", (), (p.TraceSpan("encode", "encoder-0", 1.8e9, 1.8e9 + 0.5),)),
    p.PrefillRequest("r1", tuple(range(100)), SAMPLING, (PLACEHOLDER,), cache_salt="tenant-a"),
    p.PrefillRequest("r2", (1,), p.WireSamplingParams()),
    p.PrefillRequest("r3", (1, 2, 3), SAMPLING, (PLACEHOLDER,), mrope_positions=MROPE),
    p.PrefillDone("r1", 42, HANDLE, num_cached_tokens=32, first_logprobs=LOGPROBS),
    p.PrefillDone("r3", 2, None, finish_reason=p.FinishReason.STOP),
    p.PrefillDone("r4", 2, HANDLE, trace=(p.TraceSpan("prefill.compute", "prefill-0", 1.8e9, 1.8e9 + 1),)),
    p.DecodeRequest("r1", tuple(range(100)), 42, HANDLE, SAMPLING, (PLACEHOLDER,), "tenant-a", "tcp://10.0.0.1:7000"),
    p.GenerateRequest("r2", (1, 2, 3), SAMPLING, "tcp://10.0.0.1:7000", (PLACEHOLDER,), None),
    p.GenerateRequest("r3", (1, 2, 3), SAMPLING, "tcp://10.0.0.1:7000", (PLACEHOLDER,), None, (4,), MROPE),
    p.DecodeRequest("r3", (1, 2, 3), 42, HANDLE, SAMPLING, (PLACEHOLDER,), mrope_positions=MROPE),
    p.GenerateRequest("r3", (1, 2), SAMPLING, "tcp://10.0.0.1:7000", lora=p.WireLoRA("sql", "/adapters/sql")),
    p.PrefillRequest("r4", (1,), p.WireSamplingParams(), lora=p.WireLoRA("sql", "/adapters/sql")),
    p.TokenDelta("r1", (5, 6, 7), (LOGPROBS,) * 3),
    p.TokenDelta("r1", (), finish_reason=p.FinishReason.STOP, stop_reason="</s>"),
    p.TokenDelta("r1", (2,), finish_reason=p.FinishReason.STOP, stop_reason=2),
    p.TokenDelta("r1", (2,), trace=(p.TraceSpan("kv.transfer", "decode-0", 1.8e9, 1.8e9 + 0.1, 1 << 20, 4),)),
    p.TokenDeltas((p.TokenDelta("r1", (5,), (LOGPROBS,)), p.TokenDelta("r2", (), finish_reason=p.FinishReason.LENGTH))),
    p.TokenDeltas(()),
    p.Release("r1"),
    p.RenewLease("r1"),
    p.LeaseRenewed("r1", 1.8e9),
    p.Abort("r1"),
    p.HoldCheck("r1"),
    p.Ack("r1"),
    p.StatusRequest(),
    p.KVEventsRequest(),
    p.KVEventsRequest(41),
    p.KVEvents("decode-0", 16, 3, 5, bytes(range(32)), bytes(16)),
    p.KVEvents("decode-0", 16, 0, 5, bytes(48), snapshot=True),
    p.KVEvents("decode-0", 16, 6, 7, bytes(16), offloaded_stored=bytes(range(32)), offloaded_removed=bytes(16)),
    p.Status("decode-0", p.Role.DECODE, p.Health.READY, 100, 4096, 3, 1),
    p.Status("prefill-0", p.Role.PREFILL, p.Health.READY, 100, 4096, 3, 1, data_addr="tcp://10.0.0.2:7001"),
    p.Status("unified-0", p.Role.UNIFIED, p.Health.READY, 100, 4096, 3, 1, lora_adapters=("sql", "chat"), max_loras=4),
    p.LoadLoRA("sql", "/adapters/sql"),
    p.UnloadLoRA("sql"),
    p.Error(p.ErrorCode.NOT_FOUND, "no such request", "r1", retryable=False),
    p.FetchBlocks("r1", 9, (7, 3, 11), (1, 1, 1)),
    p.FetchBlocks("r1", 9, (7,), (1,), ucx_tag=2**64 - 1),
    p.BlocksData("r1", (7, 8, 3), (2**64 - 1, 0),
                 (torch.randn(2, 4, 1, 8), torch.randn(1, 4, 1, 8).to(torch.bfloat16))),
    p.BlocksData("r1", (), (), ()),
    p.KVStorePut(LAYOUT, bytes(range(32)), tuple(range(32)), (2**64 - 1, 7), (torch.randn(2, 30, 2, 3, 16, 64),)),
    p.KVStoreGet(LAYOUT, bytes(48), tuple(range(48))),
    p.KVStoreBlocks(bytes(16), (5,), (torch.randn(1, 2, 2, 1, 16, 8),)),
    p.KVStoreBlocks(b"", (), ()),
    p.BlocksSent("r1", 2, (2**64 - 1, 12345)),
    p.FetchEmbeddings("ab" * 32),
    p.EmbeddingsData("ab" * 32, 2**64 - 1, torch.randn(5, 16).to(torch.bfloat16)),
    p.EmbeddingsSent("ab" * 32, p.TensorSpec("bfloat16", (576, 576)), 7),
]


def sample(message_type):
    return next(m for m in SAMPLES if type(m) is message_type)


def roundtrip(message, limits=codec.DEFAULT_LIMITS):
    frames = codec.encode(message)
    # What a socket delivers: separate, writable buffers.
    return codec.decode([bytearray(f) for f in frames], limits)


def test_samples_cover_every_message_type():
    assert {type(m) for m in SAMPLES} == set(p.MESSAGE_TYPES.values())


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    decoded = roundtrip(message)
    assert type(decoded) is type(message)
    assert decoded == message
    conv = codec._MESSAGES[message.TAG]
    sent_tensors, got_tensors = conv.tensors(message), conv.tensors(decoded)
    assert len(got_tensors) == len(sent_tensors)
    for sent, got in zip(sent_tensors, got_tensors):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)


def test_decoded_sequences_are_tuples_and_enums_are_enums():
    decoded = roundtrip(sample(p.PrefillRequest))
    assert isinstance(decoded.prompt_token_ids, tuple)
    assert isinstance(decoded.sampling_params.stop, tuple)
    status = roundtrip(p.Status("e", p.Role.PREFILL, p.Health.DRAINING, 1, 2, 3, 4))
    assert status.health is p.Health.DRAINING and status.role is p.Role.PREFILL


def test_int_is_accepted_where_a_float_is_declared():
    decoded = roundtrip(p.LeaseRenewed("r", 17))
    assert decoded.lease_deadline == 17.0 and type(decoded.lease_deadline) is float


# ---------------------------------------------------------------------------------------------
# Tensors


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes, so that NaN payloads and -0.0 compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _random_tensor(dtype: torch.dtype, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype is torch.bool:
        raw &= 1
    return raw.view(dtype).view(shape)


@pytest.mark.parametrize("dtype", list(tensor_frames.DTYPES.values()), ids=str)
@pytest.mark.parametrize("shape", [(3, 5, 7), (0, 4), (), (1,)], ids=str)
def test_every_dtype_is_bit_exact(dtype, shape):
    tensor = _random_tensor(dtype, shape)  # random bits: includes NaNs, infs, subnormals
    decoded = roundtrip(p.EmbeddingsData("h", 0, tensor)).data
    assert decoded.dtype == dtype and decoded.shape == tensor.shape
    assert torch.equal(_bits(decoded), _bits(tensor))


def test_bfloat16_special_values_survive():
    values = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 3.0e38], dtype=torch.bfloat16)
    assert torch.equal(_bits(roundtrip(p.EmbeddingsData("h", 0, values)).data), _bits(values))


def test_non_contiguous_input_is_sent_contiguous():
    base = torch.randn(8, 6, dtype=torch.bfloat16)
    for view in (base.t(), base[:, ::2], base[1:7:3]):
        assert not view.is_contiguous()
        decoded = roundtrip(p.EmbeddingsData("h", 0, view)).data
        assert decoded.is_contiguous() and torch.equal(decoded, view)


def test_tensor_decode_aliases_the_frame_without_copying():
    tensor = torch.randn(64, 32)
    head, raw = codec.encode(p.EmbeddingsData("h", 0, tensor))
    assert memoryview(raw).obj is not None and raw.nbytes == tensor.nbytes
    frame = bytearray(raw)
    decoded = codec.decode([head, frame]).data
    frame[:4] = b"\x00\x00\x80\x7f"  # the decoded tensor must see writes to the frame: same memory
    assert math.isinf(decoded.reshape(-1)[0].item())


def test_encode_sends_the_tensor_storage_itself():
    tensor = torch.randn(16, 16)
    frame = codec.encode(p.EmbeddingsData("h", 0, tensor))[1]
    tensor[0, 0] = 123.0
    assert torch.frombuffer(bytearray(frame), dtype=torch.float32)[0].item() == 123.0


def test_a_tuple_of_tensors_travels_as_one_frame_each_from_their_own_storage():
    cache = torch.randn(4, 2, 8, 3)
    message = p.BlocksData("r", (2, 3, 6), (0, 0), (cache[0, 0, 2:4], cache[1, 1, 6:7]))
    head, *frames = codec.encode(message)
    assert len(frames) == 2
    cache[0, 0, 2, 0] = 7.0  # a frame is the cache's own memory: no gather copy
    assert torch.frombuffer(bytearray(frames[0]), dtype=torch.float32)[0].item() == 7.0
    with pytest.raises(DecodeError, match="expected 3 frames"):
        codec.decode([head, frames[0]])
    with pytest.raises(DecodeError, match="needs"):
        codec.decode([head, frames[1], frames[0]])


def test_tensor_frame_size_must_match_its_header():
    head, raw = codec.encode(p.EmbeddingsData("h", 0, torch.randn(4, 4)))
    with pytest.raises(DecodeError, match="needs 64 bytes"):
        codec.decode([head, bytearray(raw)[:-4]])
    with pytest.raises(DecodeError):
        codec.decode([head, bytearray(raw) + b"\0\0\0\0"])


def test_bool_tensor_with_invalid_bytes_is_rejected():
    head, _ = codec.encode(p.EmbeddingsData("h", 0, torch.zeros(3, dtype=torch.bool)))
    with pytest.raises(DecodeError, match="bool"):
        codec.decode([head, bytearray(b"\x00\x01\x02")])


def _envelope(tag, body, version=p.PROTOCOL_VERSION):
    return msgpack.packb([version, tag, body], use_bin_type=True)


@pytest.mark.parametrize("spec", [
    {"dtype": "complex64", "shape": [2]},
    {"dtype": "object", "shape": [2]},
    {"dtype": "float32", "shape": [-1, 2]},
    {"dtype": "float32", "shape": [1] * 9},
    {"dtype": "float32", "shape": [2**40, 2**40]},  # would be a huge allocation: refused by size
    {"dtype": "float32", "shape": "2,2"},
    {"dtype": "float32"},
])
def test_bad_tensor_headers_are_rejected(spec):
    with pytest.raises(DecodeError):
        codec.decode([_envelope("embeddings_data", {"mm_hash": "h", "data": spec}), bytearray(16)])


def test_encoding_rejects_cuda_free_unsupported_dtypes():
    with pytest.raises(EncodeError):
        codec.encode(p.EmbeddingsData("h", 0, torch.zeros(2, dtype=torch.complex64)))


# ---------------------------------------------------------------------------------------------
# Strict decoding of control frames

GOOD = {"request_id": "r1", "generation": 9, "block_ids": [1, 2], "run_lengths": [2], "ucx_tag": None}


@pytest.mark.parametrize("body, match", [
    ({**GOOD, "block_ids": [1, "2"]}, "expected int"),
    ({**GOOD, "block_ids": [1, True]}, "expected int"),  # bool is not an int on the wire
    ({**GOOD, "block_ids": [1, 2.0]}, "expected int"),
    ({**GOOD, "block_ids": 3}, "expected an array"),
    ({**GOOD, "request_id": 5}, "expected str"),
    ({**GOOD, "request_id": None}, "expected str"),
    ({**GOOD, "ucx_tag": "x"}, "ucx_tag: expected int"),
    ({"request_id": "r1", "generation": 9, "block_ids": [1], "run_lengths": [1]}, "missing fields \\['ucx_tag'\\]"),
    ({**GOOD, "generation": None}, "generation: expected int"),
    ({**GOOD, "priority": 1}, "unknown fields \\['priority'\\]"),
    ([1, 2, 3], "map"),
])
def test_wrong_types_missing_and_unknown_fields_are_rejected(body, match):
    with pytest.raises(DecodeError, match=match):
        codec.decode([_envelope("fetch_blocks", body)])


def test_nested_structs_and_enums_are_checked():
    body = codec._MESSAGES["status"].to_wire(sample(p.Status), "Status")
    with pytest.raises(DecodeError, match="not a Health"):
        codec.decode([_envelope("status", {**body, "health": "great"})])
    body = codec._MESSAGES["prefill_done"].to_wire(sample(p.PrefillDone), "PrefillDone")
    handle = dict(body["kv_handle"], block_ids=[1, -0.5])
    with pytest.raises(DecodeError, match="kv_handle.block_ids"):
        codec.decode([_envelope("prefill_done", {**body, "kv_handle": handle})])
    with pytest.raises(DecodeError, match="unknown fields"):
        codec.decode([_envelope("prefill_done", {**body, "kv_handle": dict(body["kv_handle"], x=1)})])


def test_unknown_tag_and_bad_envelopes_are_rejected():
    for frame in (_envelope("launch_missiles", {}), _envelope(7, {}), msgpack.packb({"tag": "ack"}),
                  msgpack.packb([1, "ack"]), msgpack.packb("ack"), b"", b"\xc1", b"\x93\x01"):
        with pytest.raises(DecodeError):
            codec.decode([frame])
    with pytest.raises(DecodeError):
        codec.decode([])


def test_other_protocol_version_is_rejected_with_the_peer_version():
    with pytest.raises(VersionMismatchError) as info:
        codec.decode([_envelope("ack", {"request_id": "r"}, version=p.PROTOCOL_VERSION + 1)])
    assert info.value.peer_version == p.PROTOCOL_VERSION + 1
    with pytest.raises(DecodeError, match="not an integer"):
        codec.decode([_envelope("ack", {"request_id": "r"}, version="1")])


def test_trailing_bytes_and_ext_types_are_rejected():
    frame = codec.encode(p.Ack("r"))[0]
    with pytest.raises(DecodeError):
        codec.decode([frame + b"\x00"])
    ext = msgpack.packb([p.PROTOCOL_VERSION, "ack", {"request_id": msgpack.ExtType(1, b"x")}])
    with pytest.raises(DecodeError):
        codec.decode([ext])


def test_wrong_number_of_frames_is_rejected():
    frames = codec.encode(p.Ack("r"))
    with pytest.raises(DecodeError, match="frames"):
        codec.decode([*frames, b"extra"])


SMALL = Limits(max_message_bytes=4096, max_tensor_bytes=1024, max_str_len=100, max_bin_len=200, max_list_len=50)


@pytest.mark.parametrize("message, match", [
    (p.Release("x" * 101), "max_str_len"),
    (p.FetchBlocks("r", 1, tuple(range(51)), (51,)), "max_array_len"),
    (p.EncodeRequest("r", (p.MMItem("h", b"\0" * 201),)), "max_bin_len"),
    (p.PrefillRequest("r", tuple(range(45)), p.WireSamplingParams(stop=("s" * 95,) * 49)), "exceeds the limit"),
    (p.EmbeddingsData("h", 0, torch.zeros(257)), "exceeds the limit"),
])
def test_over_long_strings_lists_binaries_and_frames_are_rejected(message, match):
    with pytest.raises(DecodeError, match=match):
        roundtrip(message, SMALL)


def test_encoding_checks_field_types():
    with pytest.raises(EncodeError, match="request_id"):
        codec.encode(p.Release(7))
    with pytest.raises(EncodeError, match="block_ids"):
        codec.encode(p.FetchBlocks("r", 1, (1, "2"), (2,)))
    with pytest.raises(EncodeError, match="Health"):
        codec.encode(p.Status("e", p.Role.DECODE, "ready", 1, 1, 1, 1))
    with pytest.raises(EncodeError):
        codec.encode(p.FetchBlocks("r", 1, (2**70,), (1,)))  # beyond msgpack's 64-bit integers
    with pytest.raises(EncodeError, match="not a protocol message"):
        codec.encode({"tag": "ack"})


# ---------------------------------------------------------------------------------------------
# Fuzzing: bytes from the wire either decode to a valid message or raise DecodeError, nothing else


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes_only_ever_raise_decode_error(data):
    try:
        codec.decode([data])
    except DecodeError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_mutated_valid_frames_only_ever_raise_decode_error(message, data):
    frames = [bytearray(f) for f in codec.encode(message)]
    head = frames[0]
    cut = data.draw(st.integers(0, len(head) - 1))
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(head) - 1), st.integers(0, 255)), max_size=4))
    mutated = bytearray(head[:cut]) if data.draw(st.booleans()) else bytearray(head)
    for index, value in flips:
        if index < len(mutated):
            mutated[index] = value
    try:
        decoded = codec.decode([mutated, *frames[1:]])
    except DecodeError:
        return
    assert type(decoded) in p.MESSAGE_TYPES.values()  # still a fully typed message


def test_a_message_its_receiver_would_drop_for_its_size_is_refused_when_encoded():
    """What a receiver decoding with the default limits would drop is refused on the sending side, naming
    the field: nothing too large leaves only to vanish on the wire."""
    from epdserve.shared.engine.sampling_params import SamplingParams, StructuredOutputsParams
    from epdserve.services.host.wire import sampling_params_to_wire

    def request(params):
        return p.GenerateRequest("r", (1, 2, 3), sampling_params_to_wire(params), "tcp://127.0.0.1:1")

    big_spec = SamplingParams(structured_outputs=StructuredOutputsParams(
        "regex", "é" * (DEFAULT_LIMITS.max_str_len // 2 + 1)))  # two bytes each
    with pytest.raises(codec.LimitExceeded, match=r"structured_outputs\.spec: a string of \d+ bytes"):
        codec.encode(request(big_spec))
    with pytest.raises(codec.LimitExceeded, match=r"stop_token_ids: \d+ items"):
        codec.encode(request(SamplingParams(stop_token_ids=list(range(DEFAULT_LIMITS.max_list_len + 1)))))
    at_limit = SamplingParams(structured_outputs=StructuredOutputsParams("regex", "a" * DEFAULT_LIMITS.max_str_len))
    assert codec.decode(codec.encode(request(at_limit))).sampling_params.structured_outputs.spec == "a" * (1 << 20)


def test_a_process_that_moves_no_tensors_refuses_them_without_loading_torch():
    """The proxy's case: the codec alone carries no tensors; a message with one is an error both ways, and torch
    stays unloaded. Importing the KV-transfer core is what lets a process carry them."""
    import base64
    import subprocess
    import sys

    frames = codec.encode(p.EmbeddingsData("h", 0, torch.randn(2, 4)))
    code = f"""
import base64, sys
from epdserve.transport.channel import codec, protocol as p
frames = [base64.b64decode(f) for f in {[base64.b64encode(bytes(f)).decode() for f in frames]!r}]
try:
    codec.decode(frames)
    print("decoded")
except codec.DecodeError as exc:
    print("refused:", exc)
try:
    codec.encode(p.EmbeddingsData("h", 0, object()))
    print("encoded")
except codec.EncodeError as exc:
    print("refused:", exc)
print("torch" in sys.modules)
import epdserve.transport.kv
print(type(codec.decode(frames)).__name__)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("refused:") and lines[1].startswith("refused:"), lines
    assert lines[2:] == ["False", "EmbeddingsData"], lines
