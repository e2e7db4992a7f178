"""Prompt logprobs (SamplingParams.prompt_logprobs) equal HF's log_softmax of the prompt logits in float32,
whatever the engine path: one prefill, chunked prefill, a prefix already cached, a recompute after
preemption. Top-k ids are compared away from near-ties (tests/conftest.py TIE_GAP)."""
import pytest
import torch

from epdserve import LLM, SamplingParams

TIE_GAP = 1e-4
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his "
        "father had taught him. There were one hundred and twelve of them, worn smooth in the middle by a "
        "century of boots. At the top he trimmed the wick and polished the great lens.")


@pytest.fixture(scope="module")
def model_path(tiny_model_paths):
    return tiny_model_paths["llama"]


@pytest.fixture(scope="module")
def prompt(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path).encode(TEXT)[:45]


@pytest.fixture(scope="module")
def hf_logprobs(model_path, hf_causal_lm, prompt):
    model = hf_causal_lm(model_path)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)  # row p predicts token p + 1


def check_against_hf(prompt_logprobs, prompt, hf, k):
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for pos in range(1, len(prompt)):
        entry, ref = prompt_logprobs[pos], hf[pos - 1]
        token = prompt[pos]
        assert entry[token].logprob == pytest.approx(float(ref[token]), abs=1e-4), pos
        assert entry[token].rank == int((ref > ref[token]).sum()) + 1 or \
            abs(float(ref[token]) - float(ref.topk(entry[token].rank).values[-1])) < TIE_GAP
        top = sorted(((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank <= k))
        ref_top = ref.topk(k + 1)
        assert [r for r, _, _ in top] == list(range(1, k + 1))
        for (_, tid, lp), ref_id, ref_lp in zip(top, ref_top.indices.tolist(), ref_top.values.tolist()):
            assert lp == pytest.approx(ref_lp, abs=1e-4)
            assert tid == ref_id or abs(float(ref[tid]) - ref_lp) < TIE_GAP


@pytest.mark.parametrize("chunk", [2048, 7])
def test_prompt_logprobs_equal_hf_in_one_pass_and_in_chunks(model_path, prompt, hf_logprobs, chunk):
    llm = LLM(model_path, max_num_batched_tokens=chunk, num_kv_blocks=64)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5))
    check_against_hf(out[0].prompt_logprobs, prompt, hf_logprobs, 5)
    # No prompt_logprobs asked: none computed.
    assert llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))[0].prompt_logprobs is None


def test_a_cached_prefix_is_still_scored(model_path, prompt, hf_logprobs):
    llm = LLM(model_path, num_kv_blocks=64)
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))  # fills the cache
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    assert out[0].num_cached_tokens == 0  # a request that wants prompt logprobs computes every position
    check_against_hf(out[0].prompt_logprobs, prompt, hf_logprobs, 0)


def test_a_recompute_after_preemption_keeps_one_score_per_position(model_path, prompt, hf_logprobs):
    # 8 blocks of 16 tokens: three 45-token prompts that each grow by 40 tokens cannot all stay.
    llm = LLM(model_path, num_kv_blocks=8, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        check_against_hf(out.prompt_logprobs, prompt, hf_logprobs, 2)
