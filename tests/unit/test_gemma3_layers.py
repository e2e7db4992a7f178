"""Gemma 3's layer numerics equal HF's bit for bit, in float32 and in bfloat16 (where the cast's place
matters): the (1 + weight) RMSNorm, alone and after the residual add; the scaled embeddings; the
soft-capped logits."""
import json

import pytest
import torch

from epdserve.shared.config import ModelConfig
from epdserve.shared.models.layers.rms_norm import RMSNorm

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_unit_offset_rms_norm_equals_hf(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    g = torch.Generator().manual_seed(0)
    weight = torch.empty(64).uniform_(-0.5, 0.5, generator=g)
    ours, hf = RMSNorm(64, 1e-6, unit_offset=True), Gemma3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(weight)
        hf.weight.copy_(weight)
    ours, hf = ours.to(dtype), hf.to(dtype)
    x = (torch.randn(7, 64, generator=g) * 3).to(dtype)
    delta = torch.randn(7, 64, generator=g).to(dtype)
    # Rounded where HF rounds; only the sum of squares adds up in another order (the C++ op, as Llama's norm).
    tolerance = 4e-6 if dtype == torch.float32 else 1e-2
    with torch.no_grad():
        torch.testing.assert_close(ours(x.clone()), hf(x), rtol=tolerance, atol=tolerance)
        residual = x.clone()
        torch.testing.assert_close(ours(residual, delta), hf(x + delta), rtol=tolerance, atol=tolerance)
        assert torch.equal(residual, x + delta)  # the residual stream, added to in place


@pytest.fixture
def gemma_config(tmp_path):
    def build(dtype: str, **raw) -> ModelConfig:
        (tmp_path / "config.json").write_text(json.dumps(dict(
            architectures=["Gemma3ForCausalLM"], vocab_size=64, hidden_size=24, intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=12, **raw)))
        return ModelConfig.from_pretrained(tmp_path, dtype=dtype)
    return build


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_embeddings_equal_hf(gemma_config, dtype):
    """sqrt(24) rounded to the model dtype (4.90625 in bfloat16), then the product in that dtype."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from epdserve.shared.models.llama import LlamaModel

    config = gemma_config(str(dtype).removeprefix("torch."))
    torch.manual_seed(0)
    ours = LlamaModel(config).to(dtype)
    hf = Gemma3TextScaledWordEmbedding(64, 24, 0, embed_scale=24 ** 0.5)
    with torch.no_grad():
        hf.weight.copy_(ours.embed_tokens.weight.float())
    hf = hf.to(dtype)
    ids = torch.arange(64)
    with torch.no_grad():
        assert torch.equal(ours.embed(ids), hf(ids))


@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_capped_logits_equal_hf(gemma_config, dtype):
    from epdserve.shared.models.llama import LlamaForCausalLM

    config = gemma_config(str(dtype).removeprefix("torch."), final_logit_softcapping=3.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    hidden = (torch.randn(5, 24) * 4).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.normal_()
        raw = model.lm_head(hidden)
        expected = (torch.tanh(raw / 3.0) * 3.0).float()  # HF: logits / cap, tanh, * cap, in the model dtype
        logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.abs().max() <= 3.0
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
