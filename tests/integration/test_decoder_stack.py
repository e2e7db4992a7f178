"""The C++ decoder stack (kernels/csrc/cpu_layer_ops.cpp's DecoderStack): a model's layers in one call a step,
calling the kernels the Python layers call in the same order, so every value is the same bit for bit.

Each engine runs a batch - prompts prefilled in chunks beside decodes - once fused and once with the Python
layers (the same engine, its stack taken away): the tokens and every logprob must be equal, not close."""
import pytest
import torch

from epdserve import LLM, SamplingParams
from epdserve.kernels import cpu_linear

PROMPTS = [list(range(5, 5 + n)) for n in (1, 7, 23, 40)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)


def run(llm: LLM) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in outs]


def fused_then_python(llm: LLM) -> tuple[list, list]:
    runner = llm.engine.runner
    assert runner.fused_layers
    fused = run(llm)
    runner.model.model.decoder_stack = None
    return fused, run(llm)


def gate_and_up_joined(llm: LLM) -> bool:
    """Whether the first layer's gate and up projections run as one panel weight (their panels then one tensor,
    the gate's first)."""
    mlp = llm.engine.runner.model.model.layers[0].mlp
    gate, up = (p.quantized.panels if p.quantized is not None else p.panels for p in (mlp.gate_proj, mlp.up_proj))
    return gate.untyped_storage().data_ptr() == up.untyped_storage().data_ptr() and \
        up.data_ptr() == gate.data_ptr() + gate.numel() * gate.element_size()


def window_model(tmp_path, default_model_path) -> str:
    """Tiny Qwen2 (q/k/v biases, MQA) whose second layer slides a window of 8."""
    from epdserve.shared.checkpoints.tiny_models import build_tiny_model

    return str(build_tiny_model("qwen2", tmp_path / "qwen2-window", default_model_path, use_sliding_window=True,
                                sliding_window=8, max_window_layers=1))


def unjoined_model(tmp_path, default_model_path) -> str:
    """Tiny Llama whose MLP is 200 wide: the gate's last panel has padding columns, so gate and up stay apart."""
    from epdserve.shared.checkpoints.tiny_models import build_tiny_model

    return str(build_tiny_model("llama", tmp_path / "llama-200", default_model_path, intermediate_size=200))


@pytest.mark.parametrize("model,kwargs", [
    ("smollm2", {}),  # SmolLM2 from its GGUF file: quantized panels
    ("llama", {}),  # float32 panels
    ("llama", {"kv_cache_dtype": "int8"}),
    ("llama", {"kv_cache_dtype": "fp8"}),
    ("qwen2-window", {}),
    ("qwen3", {}),  # per-head q/k norms
    ("gemma3", {}),  # (1 + weight) sandwich norms, q/k norms, GeGLU, a second RoPE for the sliding layers
    ("llama", {"dtype": "bfloat16"}),
    ("llama-200", {}),  # gate and up in two calls
])
def test_the_fused_layers_give_the_python_layers_values_bit_for_bit(model, kwargs, tiny_model_paths,
                                                                   default_model_path, tmp_path):
    if kwargs.get("dtype") == "bfloat16" and not cpu_linear.supports(torch.bfloat16):
        pytest.skip("no bfloat16 panel kernel on this CPU (AVX-512 BF16)")
    builders = {"qwen2-window": window_model, "llama-200": unjoined_model}
    path = str(default_model_path) if model == "smollm2" else tiny_model_paths.get(model)
    path = path or builders[model](tmp_path, default_model_path)
    llm = LLM(model=path, num_kv_blocks=64, max_num_batched_tokens=32, enable_prefix_caching=False, **kwargs)
    assert gate_and_up_joined(llm) == (model != "llama-200")
    fused, python = fused_then_python(llm)
    assert fused == python
    # The stack times its attention calls for the step timer, as the Python layers' backend calls are timed.
    assert llm.engine.step_timer.breakdown()["attention"] > 0


@pytest.mark.parametrize("model,kwargs", [
    ("mixtral", {}),  # sparse MLPs
    ("qwen3-moe", {}),  # sparse MLPs in some layers
    ("llama", {"attention_backend": "torch"}),
    ("llama", {"enable_lora": True, "max_lora_rank": 8}),
])
def test_layers_the_stack_does_not_run_stay_python(model, kwargs, tiny_model_paths):
    llm = LLM(model=tiny_model_paths[model], num_kv_blocks=64, **kwargs)
    assert not llm.engine.runner.fused_layers
    assert llm.engine.runner.model.model.decoder_stack is None
    assert llm.generate({"prompt_token_ids": PROMPTS[1]}, PARAMS)[0].outputs[0].token_ids
