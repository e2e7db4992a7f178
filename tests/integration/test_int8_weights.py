"""`--quantization int8`: a float checkpoint's dense linear layers quantized at load, one scale per output
channel. The engine then computes with exactly the dequantized values: its answers are a float32 engine's on a
checkpoint holding them, logprobs included - on a CPU with the quantized kernel by construction (it unpacks
the same floats and accumulates in the float32 kernel's order), elsewhere by dequantizing at load."""
import shutil

import pytest
import torch
from safetensors.torch import save_file

from epdserve import LLM, SamplingParams
from epdserve.shared.models.layers.linear import Linear
from epdserve.shared.models.quantized_weight import QuantizedWeight
from epdserve.shared.models.weights import checkpoint_weights_int8, safetensors_files

KERNEL = Linear.runs_quantized(torch.empty(0))  # float32 on this CPU: the quantized kernel runs
PROMPTS = [[1, 5, 9, 13, 2, 7], [3, 3, 3, 8], [11, 4, 6, 10, 12, 14, 15, 16]]


def test_each_row_is_rounded_to_its_own_scale():
    torch.manual_seed(0)
    weight = torch.randn(6, 96) * torch.tensor([1e-3, 0.1, 1.0, 10.0, 0.0, 3.0])[:, None]
    quantized = QuantizedWeight.int8_per_channel(weight)
    assert quantized.q.dtype == torch.int8 and quantized.scale.shape == (6, 1) and quantized.group == 96
    values = quantized.dequantize()
    error = (values - weight).abs().amax(dim=1)
    assert torch.all(error <= quantized.scale[:, 0] / 2 * (1 + 1e-6))
    assert quantized.q.abs().amax(dim=1).tolist() == [127, 127, 127, 127, 0, 127]
    assert torch.equal(values[4], torch.zeros(96)) and quantized.scale[4, 0] == 0


@pytest.fixture(scope="module")
def dequantized_folder(tiny_model_paths, tmp_path_factory):
    """tiny-llama with its linear layers replaced by their int8 values, dequantized: what int8 serving computes."""
    source = tiny_model_paths["llama"]
    folder = tmp_path_factory.mktemp("int8") / "llama"
    shutil.copytree(source, folder, ignore=lambda d, names: [n for n in names if n.endswith(".safetensors")
                                                              or n.endswith(".index.json")])
    tensors = {name: (t.dequantize() if isinstance(t, QuantizedWeight) else t).contiguous()
               for name, t in checkpoint_weights_int8(source)}
    save_file(tensors, str(folder / "model.safetensors"))
    assert safetensors_files(folder) == [folder / "model.safetensors"]
    return folder


MAX_TOKENS = 16


def answers(llm: LLM, max_tokens: int = MAX_TOKENS) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs])
            for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def quantized_layers(llm: LLM) -> list[Linear]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear) and m.quantized is not None]


@pytest.fixture(scope="module")
def float32_answers(dequantized_folder):
    llm = LLM(model=str(dequantized_folder), num_kv_blocks=64)
    assert not quantized_layers(llm)
    return answers(llm)


def test_an_int8_engine_answers_as_float32_on_its_dequantized_weights(tiny_model_paths, float32_answers):
    llm = LLM(model=tiny_model_paths["llama"], num_kv_blocks=64, quantization="int8")
    # every layer's qkv (fused), o, gate, up and down projections run on int8; the embedding and lm_head not
    assert len(quantized_layers(llm)) == (5 * len(llm.engine.runner.model.model.layers) if KERNEL else 0)
    assert answers(llm) == float32_answers


def test_the_triton_kernel_runs_int8_as_shipped_and_answers_as_float32(tiny_model_paths, float32_answers):
    """Where the engine runs Triton's kernels (a GPU; here the interpreter), the int8 weights run Triton's
    quantized kernel: the same weights, only the matmul's order of sums differs - the same tokens (the tiny
    model's logits are spread wide), logprobs equal to float32 rounding."""
    from epdserve.kernels.quantized_linear import QuantizedTiles

    llm = LLM(model=tiny_model_paths["llama"], num_kv_blocks=64, quantization="int8", attention_backend="triton")
    layers = quantized_layers(llm)
    assert len(layers) == 5 * len(llm.engine.runner.model.model.layers)
    assert all(isinstance(m.quantized, QuantizedTiles) and m.quantized.q.dtype == torch.int8 for m in layers)
    got = answers(llm, MAX_TOKENS // 2)  # the interpreter is slow: half of the answers
    assert [tokens for tokens, _ in got] == [tokens[:MAX_TOKENS // 2] for tokens, _ in float32_answers]
    for (_, steps), (_, expected) in zip(got, float32_answers):
        for step, want in zip(steps, expected):
            assert step.keys() == want.keys()
            assert all(abs(step[t] - want[t]) < 1e-4 for t in step), (step, want)
