"""The GGUF reader and the block formats against the `gguf` package (llama.cpp's own Python reader and
dequantizer, which transformers converts GGUF files with): the same metadata, the same tensors, and every
dequantized value bit for bit."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from epdserve.shared.models.gguf_file import GGUFFile  # noqa: E402
from epdserve.shared.models.gguf_quants import FORMATS, GGMLType, split_blocks, to_float32  # noqa: E402

QUANTIZED = [kind for kind, fmt in FORMATS.items() if fmt.split is not None]

# Where each format keeps its float16 scale (and minimum), byte offsets into a block: random bytes there
# could be a NaN or an infinity, which a real file never holds.
F16_FIELDS = {GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2),
              GGMLType.Q8_0: (0,), GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,)}


def random_blocks(kind: GGMLType, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """[rows, bytes per row] of valid blocks: random bits, finite float16 scales of both signs."""
    rng = np.random.default_rng(seed)
    fmt = FORMATS[kind]
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, fmt.type_size), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        raw[:, at:at + 2] = rng.normal(0, 0.05, size=len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks_per_row * fmt.type_size)


@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda k: k.name)
def test_every_format_dequantizes_as_the_reference_bit_for_bit(kind):
    fmt = FORMATS[kind]
    raw = random_blocks(kind, rows=6, blocks_per_row=2, seed=int(kind))
    shape = (6, 2 * fmt.block_size)
    ours = to_float32(kind, raw, shape)
    reference = gguf.dequantize(raw, gguf.GGMLQuantizationType(int(kind)))
    assert ours.shape == reference.shape == shape
    assert np.array_equal(ours.view(np.uint32), reference.view(np.uint32))
    groups = split_blocks(kind, raw, shape)
    assert groups.q.shape == (12, fmt.block_size)
    assert int(groups.q.min()) >= -128 and int(groups.q.max()) <= 127  # every format's q fits in int8


def test_a_written_file_reads_back_whole(tmp_path):
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_string("tokenizer.chat_template", "{{ messages }}")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "é", "a b"])
    writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, 2.25])
    float32 = np.arange(12, dtype=np.float32).reshape(3, 4)
    writer.add_tensor("output_norm.weight", float32)
    quantized = {kind: random_blocks(kind, rows=4, blocks_per_row=1, seed=100 + int(kind)) for kind in QUANTIZED}
    for kind, raw in quantized.items():
        writer.add_tensor(f"{kind.name}.weight", raw, raw_dtype=gguf.GGMLQuantizationType(int(kind)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    f = GGUFFile(path)
    assert f.metadata["general.architecture"] == "llama"
    assert f.metadata["llama.block_count"] == 2
    assert f.metadata["llama.attention.layer_norm_rms_epsilon"] == np.float32(1e-5)
    assert f.metadata["tokenizer.ggml.add_bos_token"] is True
    assert f.metadata["tokenizer.chat_template"] == "{{ messages }}"
    assert f.metadata["tokenizer.ggml.tokens"] == ["<s>", "é", "a b"]
    assert f.metadata["tokenizer.ggml.scores"].tolist() == [0.0, -1.5, 2.25]
    norm = f.tensors["output_norm.weight"]
    assert norm.type == GGMLType.F32 and norm.shape == (3, 4)
    assert np.array_equal(to_float32(norm.type, norm.data, norm.shape), float32)
    for kind, raw in quantized.items():
        t = f.tensors[f"{kind.name}.weight"]
        assert t.type == kind and t.shape == (4, FORMATS[kind].block_size)
        assert np.array_equal(t.data, raw.reshape(-1))


def test_not_a_gguf_file_is_one_clear_error(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(path)


def test_a_truncated_file_names_the_tensor(tmp_path):
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.ones((64, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.write_bytes(path.read_bytes()[:-1024])
    with pytest.raises(ValueError, match="token_embd.weight.*past the end"):
        GGUFFile(path)


def test_parts_stacked_in_a_common_group_dequantize_as_they_did_alone():
    """q, k and v fused from formats of different groups (Q5_0's 32, Q6_K's 16) and with and without offsets:
    the stack's values are each part's, bit for bit (the added offsets are -0.0: x + -0.0 == x)."""
    import torch

    from epdserve.shared.models.quantized_weight import QuantizedWeight

    gen = torch.Generator().manual_seed(0)

    def part(rows, group, offset):
        q = torch.randint(-32, 32, (rows, 64), generator=gen, dtype=torch.int8)
        scale = torch.randn(rows, 64 // group, generator=gen)
        scale[0, 0] = -1.0  # with q = 0 below: a -0.0 weight, which must stay -0.0
        q[0, 0] = 0
        return QuantizedWeight(q, scale, torch.randn(rows, 64 // group, generator=gen) if offset else None)

    parts = [part(3, 32, False), part(2, 16, True), part(4, 64, False)]
    stacked = QuantizedWeight.stack_rows(parts)
    assert stacked.group == 16 and stacked.offset is not None
    alone = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(stacked.dequantize().view(torch.int32), alone.view(torch.int32))
