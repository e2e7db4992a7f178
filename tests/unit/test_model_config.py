"""What ModelConfig reads from an HF config.json for each supported family: the sparse layers of a
mixture-of-experts model as HF chooses them, the weights' size, and a clear refusal of anything else."""
import json
import math

import pytest
from safetensors import safe_open

from epdserve.shared.config import SUPPORTED_ARCHITECTURES, ModelConfig
from epdserve.shared.models.weights import safetensors_files

BASE = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 6,
        "num_attention_heads": 2, "num_key_value_heads": 1}


def config(tmp_path, **raw) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **raw}))
    return ModelConfig.from_pretrained(tmp_path)


def test_an_unsupported_architecture_is_refused_in_one_line_naming_the_supported_ones(tmp_path):
    with pytest.raises(ValueError) as raised:
        config(tmp_path, architectures=["GemmaForCausalLM"])
    message = str(raised.value)
    assert "\n" not in message and "GemmaForCausalLM" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("raw, sparse, renormalize", [
    (dict(num_experts=4), (0, 1, 2, 3, 4, 5), False),
    (dict(num_local_experts=4, norm_topk_prob=True), (0, 1, 2, 3, 4, 5), True),  # transformers' other name
    (dict(num_experts=4, decoder_sparse_step=2), (1, 3, 5), False),
    (dict(num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3]), (1, 5), False),
    (dict(num_experts=4, mlp_only_layers=[0, 1, 2, 3, 4, 5]), None, None),  # all dense: no sparse MLP
    (dict(num_experts=0), None, None),
])
def test_qwen3_moe_sparse_layers_as_hf_chooses_them(tmp_path, raw, sparse, renormalize):
    model = config(tmp_path, architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=8, **raw)
    assert model.qk_norm
    if sparse is None:
        assert model.moe is None
        return
    assert (model.moe.sparse_layers, model.moe.renormalize, model.moe.round_weights) == (sparse, renormalize, True)
    assert (model.moe.num_experts, model.moe.intermediate_size) == (4, 8)


def test_mixtral_is_sparse_everywhere_and_always_renormalises(tmp_path):
    model = config(tmp_path, architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2,
                   norm_topk_prob=False, sliding_window=4096)
    assert model.moe.sparse_layers == tuple(range(6)) and model.moe.renormalize and not model.moe.round_weights
    assert (model.moe.intermediate_size, model.moe.top_k) == (32, 2)
    assert model.sliding_window == 4096 and not model.qk_norm


def test_qwen3_dense_has_qk_norm_and_its_own_head_dim(tmp_path):
    model = config(tmp_path, architectures=["Qwen3ForCausalLM"], head_dim=24)
    assert model.qk_norm and model.moe is None and model.head_size == 24 and not model.qkv_bias


def test_weight_bytes_of_every_tiny_family_equal_its_checkpoint(tiny_model_paths):
    for path in tiny_model_paths.values():
        numel = 0
        for file in safetensors_files(path):
            with safe_open(str(file), framework="pt") as f:
                numel += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
        assert ModelConfig.from_pretrained(path).num_weight_bytes == numel * 4, path
