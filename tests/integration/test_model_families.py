"""Qwen3, Qwen3-MoE, Mixtral and Gemma 3 through the engine paths test_hf_exactness.py does not walk: n > 1,
a prefill -> decode handoff of KV blocks, structured outputs, and the Triton kernels (interpreted on CPU);
Gemma 3's sliding and global layers on the PyTorch attention backend too, its soft-capped logits, and
Qwen2's window on only the layers HF slides.
Greedy tokens are compared with HF transformers `generate`, or with one engine doing it all."""
import asyncio
import json
from dataclasses import replace

import pytest
import torch

from epdserve import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from epdserve.shared.engine.llm import build_engine_config
from epdserve.shared.engine.llm_engine import LLMEngine
from epdserve.shared.engine.sampling_params import StructuredOutputsParams

FAMILIES = ["qwen3", "qwen3-moe", "mixtral", "gemma3"]
PROMPTS = [list(range(200, 200 + n)) for n in (1, 17, 40)]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(params=FAMILIES)
def path(request, tiny_model_paths):
    return tiny_model_paths[request.param]


def test_n_greedy_sequences_each_equal_hf(path, hf_causal_lm, hf_greedy, near_tie_check):
    llm = LLM(model=path, num_kv_blocks=64, block_size=16)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], replace(GREEDY, n=2))
    for i, (prompt, out) in enumerate(zip(PROMPTS, outputs)):
        tokens, logits = hf_greedy(hf_causal_lm(path), prompt, MAX_TOKENS)
        assert [c.index for c in out.outputs] == [0, 1]
        for completion in out.outputs:
            assert near_tie_check(f"prompt {i}, sequence {completion.index}", completion.token_ids, tokens, logits) == 0
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_prefill_then_decode_equals_one_engine(path, copy_connector, prefill_held):
    """Prefill keeps the prompt's KV, decode copies it in (as a transport would) and goes on."""
    unified = LLM(model=path, num_kv_blocks=64).generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    prefill_engine = LLMEngine(build_engine_config(path, num_kv_blocks=64), detokenize=False)
    decode = AsyncLLM.from_config(build_engine_config(path, num_kv_blocks=64), detokenize=False)
    connector = copy_connector(decode.kv_cache)
    decode.add_connector(connector)

    async def decoded(rid: str, prompt: list[int]) -> list[int]:
        firsts, held = prefill_held(prefill_engine, rid, prompt, GREEDY)
        request = await decode.make_request({"prompt_token_ids": prompt},
                                            replace(GREEDY, output_kind=RequestOutputKind.DELTA), rid,
                                            peer_token_ids=[[t] for t in firsts],
                                            kv_transfer_params=(prefill_engine.runner.kv_cache, held, len(prompt)))
        tokens = list(firsts)
        async for out in decode.generate(request):
            tokens += out.outputs[0].token_ids
        return tokens

    async def main():
        return await asyncio.gather(*(decoded(f"r{i}", p) for i, p in enumerate(PROMPTS)))

    try:
        results = asyncio.run(main())
    finally:
        decode.shutdown()
    assert results == [out.outputs[0].token_ids for out in unified]
    assert sorted(load.request_id for load in connector.loads) == [f"r{i}" for i in range(len(PROMPTS))]


def test_structured_choice_is_obeyed(path):
    llm = LLM(model=path, num_kv_blocks=64)
    choices = ["alpha", "beta", "gamma"]
    params = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams.choices(choices))
    for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params):
        assert out.outputs[0].text in choices and out.outputs[0].finish_reason == "stop"


def test_triton_kernels_equal_the_cpu_kernels(path):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    params = replace(GREEDY, max_tokens=3)
    kwargs = dict(num_kv_blocks=16, block_size=16, max_num_batched_tokens=16)  # chunked prefill too
    cpu = LLM(model=path, attention_backend="cpu", **kwargs).generate(prompts, params)
    triton_llm = LLM(model=path, attention_backend="triton", **kwargs)
    assert triton_llm.engine.runner.attention_backend == "triton"
    triton = triton_llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in triton] == [o.outputs[0].token_ids for o in cpu]


def test_gemma3_on_the_torch_backend_equals_hf(tiny_model_paths, hf_causal_lm, hf_greedy, near_tie_check):
    """The PyTorch backend plans each step once per window (sliding layers, global ones) and keeps the decode
    batch's K/V across steps for all of them."""
    path = tiny_model_paths["gemma3"]
    llm = LLM(model=path, attention_backend="torch", num_kv_blocks=64, max_num_batched_tokens=32)
    assert llm.engine.runner.attention_windows == (12, None)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], replace(GREEDY, max_tokens=16))
    for i, (prompt, out) in enumerate(zip(PROMPTS, outputs)):
        tokens, logits = hf_greedy(hf_causal_lm(path), prompt, 16)
        assert near_tie_check(f"prompt {i}", out.outputs[0].token_ids, tokens, logits) == 0
    assert llm.engine.runner.decode_mirror.num_rebuilds < 16  # appended to, step after step


def test_gemma3_prompt_logprobs_are_hf_soft_capped_ones(tiny_model_paths, hf_causal_lm):
    path = tiny_model_paths["gemma3"]
    prompt = PROMPTS[2]
    with torch.no_grad():
        hf = torch.log_softmax(hf_causal_lm(path)(torch.tensor([prompt])).logits[0].float(), dim=-1)
    out = LLM(model=path, num_kv_blocks=64).generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    scores = out[0].prompt_logprobs
    for pos in range(1, len(prompt)):  # HF's row pos - 1 predicts token pos
        assert scores[pos][prompt[pos]].logprob == pytest.approx(float(hf[pos - 1, prompt[pos]]), abs=1e-4), pos


@pytest.mark.parametrize("layer_types", [True, False])
def test_qwen2_slides_only_the_layers_hf_slides(tmp_path, default_model_path, hf_greedy, near_tie_check, layer_types):
    """use_sliding_window with max_window_layers = 1: layer 0 sees everything, layer 1 a window of 8; said by
    `layer_types` (as transformers 5 writes configs) or by max_window_layers alone (as older ones did)."""
    from transformers import AutoModelForCausalLM

    from epdserve.shared.checkpoints.tiny_models import build_tiny_model

    path = str(build_tiny_model("qwen2", tmp_path / "qwen2-window", default_model_path, use_sliding_window=True,
                                sliding_window=8, max_window_layers=1))
    if not layer_types:
        raw = json.loads((tmp_path / "qwen2-window" / "config.json").read_text())
        del raw["layer_types"]
        (tmp_path / "qwen2-window" / "config.json").write_text(json.dumps(raw))
    llm = LLM(model=path, num_kv_blocks=64)
    assert [a.sliding_window for a in llm.engine.runner.model.attention_layers()] == [None, 8]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.layer_types == ["full_attention", "sliding_attention"]
    for i, (prompt, out) in enumerate(zip(PROMPTS, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY))):
        tokens, logits = hf_greedy(hf, prompt, MAX_TOKENS)
        assert near_tie_check(f"prompt {i}", out.outputs[0].token_ids, tokens, logits) == 0
