"""Greedy float32 output equals HF transformers `generate`, token for token, on every engine path.

Each prompt is compared with HF run on that prompt alone. A mismatch is accepted only at a genuine
near-tie: HF's own top-2 logits at the first differing step must be within a tiny gap (tests/conftest.py
TIE_GAP; float32 rounding of a
differently batched computation can flip those, and only those). After such a step the two continuations
legitimately differ, so the comparison of that sequence ends there.
"""
import pytest
import torch

from epdserve import LLM, SamplingParams

pytestmark = pytest.mark.slow  # more than ten seconds: left out of `make test-fast`

MAX_NEW_TOKENS = 24

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his "
    "father had taught him. There were one hundred and twelve of them, worn smooth in the middle by a "
    "century of boots. At the top he trimmed the wick, polished the great lens until it shone like a "
    "second moon, and wrote the weather in the logbook: wind from the north-west, sea moderate, "
    "visibility good. Ships passed far out on the horizon, their lights no bigger than sparks. Some nights "
    "a fishing boat came close enough that he could hear the crew singing, and he would raise a hand "
    "although they could not see him. In winter the storms arrived without warning. Waves broke over the "
    "rocks and threw spray against the windows so hard that the whole tower hummed. He kept the lamp "
    "burning through all of it, because somewhere out there a captain was steering by it, trusting that "
    "it would be where the chart said it was. When spring came he painted the railings, mended the "
    "shutters, and planted beans in the little garden behind the cottage, where the wall kept off the "
    "wind. His daughter wrote to him from the city about trains and theatres and a job in an office with "
    "a view of the river. He read her letters twice, once quickly for the news and once slowly for her "
    "voice, and then he put them in the tin box on the shelf beside the barometer and went back up the "
    "stairs to light the lamp. Years later, when the light was automated and the keepers were sent home, "
    "she asked him whether he missed it, and he said that he still woke at dusk."
)
PROMPT_LENGTHS = [1, 2, 3, 5, 8, 13, 16, 17, 31, 33, 64, 100, 129, 200, 257, 320]


@pytest.fixture(scope="module")
def prompts(default_model_path):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_path).encode(TEXT)
    assert len(ids) >= max(PROMPT_LENGTHS)
    # Interleave lengths so that long and short prompts share batches and blocks.
    return [ids[:n] for n in PROMPT_LENGTHS[::2] + PROMPT_LENGTHS[1::2]]


_hf_cache: dict = {}


def hf_greedy(model_path: str, prompts: list[list[int]]):
    """HF `generate` on each prompt alone: (tokens, per-step logits) per prompt; cached per model."""
    if model_path not in _hf_cache:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        results = []
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=MAX_NEW_TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=model.config.eos_token_id)
            tokens = out.sequences[0, len(p):].tolist()
            results.append((tokens, [step[0] for step in out.logits]))
        _hf_cache[model_path] = results
    return _hf_cache[model_path]


def matches_hf(check, outputs, reference) -> int:
    """Near-ties accepted (and counted); any other difference fails."""
    return sum(check(f"prompt {i}", out.outputs[0].token_ids, *ref) for i, (out, ref) in enumerate(zip(outputs, reference)))


def run(model_path, prompts, **kwargs):
    llm = LLM(model=model_path, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return llm, outputs


def check_engine_is_clean(llm):
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


PATHS = {
    "batched": dict(enable_prefix_caching=False),
    "prefix-cache": dict(enable_prefix_caching=True),
    "chunked-prefill": dict(enable_prefix_caching=False, max_num_batched_tokens=48),
    # vLLM's step budget: decodes and chunks share it (the default packs prompts, decodes on top).
    "chunked-prefill-shared-budget": dict(enable_prefix_caching=False, max_num_batched_tokens=48,
                                          budget_policy="shared"),
    "preemption": dict(enable_prefix_caching=True, num_kv_blocks=48, max_num_batched_tokens=512),
    # Prompt lookup drafts, verified in the step (drafts cut by the budget, and preempted, too).
    "speculative": dict(enable_prefix_caching=True, num_kv_blocks=64, max_num_batched_tokens=96,
                        speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                            "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                                            "adaptive": False}),
}


@pytest.fixture(params=["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral", "tiny-gemma3",
                        "smollm2"])
def model(request, tiny_model_paths, default_model_path):
    if request.param == "smollm2":
        return str(default_model_path), True
    # The tiny models' logits are spread wide (scaled lm_head): on them any mismatch is a bug.
    return tiny_model_paths[request.param.removeprefix("tiny-")], False


@pytest.mark.parametrize("path", PATHS)
def test_greedy_equals_hf(model, prompts, path, near_tie_check):
    model_path, ties_possible = model
    reference = hf_greedy(model_path, prompts)
    llm, outputs = run(model_path, prompts, **PATHS[path])
    near_ties = matches_hf(near_tie_check, outputs, reference)
    assert ties_possible or near_ties == 0
    stats = llm.engine.stats()
    if path == "prefix-cache":
        # Every prompt is a prefix of the same text, and all were computed once: a second run reuses
        # their blocks (all but each prompt's last partial block and last token).
        again = llm.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS))
        hits = llm.engine.stats().prefix_cache_hits - stats.prefix_cache_hits
        assert hits == sum((len(p) - 1) // 16 * 16 for p in prompts)
        assert matches_hf(near_tie_check, again, reference) == 0 or ties_possible
    if path == "preemption":
        assert stats.num_preemptions > 0, "the pool was meant to be too small for the batch"
    if path == "speculative":
        assert stats.spec_decode.num_accepted_tokens > 0
    check_engine_is_clean(llm)
