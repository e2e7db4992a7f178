"""Speculative decoding (ngram prompt lookup, suffix decoding) through the offline engine: the output is exactly that of
one token per step - greedy and seeded, with every logits processor, stops, structured outputs, n > 1,
preemption, prefix caching and chunked prefill - and greedy equals HF transformers.

Each test checks that drafts were accepted too: a speculating engine that never accepted a draft would
pass the equality trivially.
"""
import json
import math
from collections import Counter

import jsonschema
import pytest

from epdserve import LLM, SamplingParams
from epdserve.shared.engine.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow  # more than ten seconds: left out of `make test-fast`

# Every draft proposed is verified ("adaptive": false): which drafts the draft policy keeps depends on how long
# steps take, and these tests need drafts verified whatever the machine. The policy's own tests come last.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": False}
CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "Rewrite the code above with mul instead of sub:\n\ndef add(a, b):\n    return a + b\n\n\ndef")
PROMPTS = [CODE, "The lighthouse keeper climbed the stairs. The lighthouse keeper", "a b c a b c a b c a",
           "Once upon a time"]


@pytest.fixture(scope="module")
def tiny(tiny_model_paths):
    return tiny_model_paths["llama"]


@pytest.fixture(scope="module")
def base(tiny):
    return LLM(model=tiny, num_kv_blocks=256)


@pytest.fixture(scope="module")
def spec(tiny):
    return LLM(model=tiny, num_kv_blocks=256, speculative_config=SPEC)


def accepted(llm) -> int:
    return llm.engine.scheduler.spec_stats.num_accepted_tokens


def assert_clean(llm):
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


def assert_same(base_outs, spec_outs):
    for b, s in zip(base_outs, spec_outs, strict=True):
        assert len(b.outputs) == len(s.outputs)
        for x, y in zip(b.outputs, s.outputs):
            assert y.token_ids == x.token_ids
            assert (y.text, y.finish_reason, y.stop_reason) == (x.text, x.finish_reason, x.stop_reason)
            if x.logprobs is not None:
                assert [{t: (round(lp.logprob, 4), lp.rank) for t, lp in e.items()} for e in y.logprobs] == \
                       [{t: (round(lp.logprob, 4), lp.rank) for t, lp in e.items()} for e in x.logprobs]


@pytest.mark.parametrize("params", [
    dict(temperature=0.0, max_tokens=40, ignore_eos=True),
    dict(temperature=0.0, max_tokens=33, logprobs=3),
    dict(temperature=0.0, max_tokens=30, repetition_penalty=1.3, ignore_eos=True),
    dict(temperature=5.0, seed=7, max_tokens=40, ignore_eos=True),
    dict(temperature=5.0, top_p=0.8, seed=3, max_tokens=40, logprobs=2),
    dict(temperature=3.0, top_k=5, min_p=0.01, seed=11, max_tokens=40, frequency_penalty=0.5,
         presence_penalty=0.3, ignore_eos=True),
    dict(temperature=4.0, seed=5, max_tokens=30, min_tokens=20, logit_bias={11: 3.0, 12: -50.0}),
], ids=["greedy", "greedy-logprobs", "greedy-repetition", "seeded", "seeded-top-p-logprobs",
        "seeded-top-k-penalties", "seeded-min-tokens-bias"])
def test_output_is_that_of_one_token_per_step(base, spec, params):
    before = accepted(spec)
    sp = SamplingParams(**params)
    assert_same(base.generate(PROMPTS, sp), spec.generate(PROMPTS, sp))
    assert accepted(spec) > before
    assert_clean(spec)


def test_stops_cut_the_accepted_run_where_one_token_per_step_stops(base, spec):
    greedy = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    reference = base.generate(PROMPTS, SamplingParams(**greedy))
    for ref in reference:
        tokens, text = ref.outputs[0].token_ids, ref.outputs[0].text
        cases = [SamplingParams(**{**greedy, "max_tokens": m}) for m in (1, 2, 7, 13)]
        cases.append(SamplingParams(**greedy, stop_token_ids=[tokens[9]]))
        if len(text) > 12:
            cases.append(SamplingParams(**greedy, stop=[text[len(text) // 2:len(text) // 2 + 2]]))
            cases.append(SamplingParams(**greedy, stop=[text[-5:-3]], include_stop_str_in_output=True))
        prompt = {"prompt_token_ids": ref.prompt_token_ids}
        assert_same(base.generate([prompt] * len(cases), cases), spec.generate([prompt] * len(cases), cases))
    assert_clean(spec)


def test_structured_output_is_that_of_one_token_per_step(default_model_path):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"type": "string"},
                                                        "maxItems": 4}},
              "required": ["name", "tags"], "additionalProperties": False}
    constraint = StructuredOutputsParams.json_schema(schema)
    prompts = ["A JSON record of a pirate with tags pirate, pirate, pirate: ",
               'Repeat: {"name": "ann", "tags": ["x", "x", "x"]} and again: ']
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=constraint),
              SamplingParams(temperature=1.0, seed=4, max_tokens=60, structured_outputs=constraint)]
    base = LLM(default_model_path, num_kv_blocks=64)
    spec = LLM(default_model_path, num_kv_blocks=64, speculative_config=SPEC)
    for sp in params:
        want, got = base.generate(prompts, sp), spec.generate(prompts, sp)
        assert_same(want, got)
        for out in got:
            assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert accepted(spec) > 0
    assert_clean(spec)


def test_greedy_equals_hf(default_model_path, hf_causal_lm, hf_greedy, near_tie_check):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    llm = LLM(default_model_path, num_kv_blocks=64, speculative_config=SPEC)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=24,
                                                                                  ignore_eos=True))
    model = hf_causal_lm(default_model_path)
    ties = sum(near_tie_check(f"prompt {i}", out.outputs[0].token_ids, *hf_greedy(model, p, 24))
               for i, (p, out) in enumerate(zip(prompts, outs)))
    assert ties <= 1
    assert accepted(llm) > 0


def test_parallel_sampling_is_that_of_one_token_per_step(base, spec):
    # Hot enough that the sequences differ, not so hot that no draft is ever accepted (at 5.0, 0 or 1 of ~180).
    params = SamplingParams(n=3, temperature=2.0, seed=21, max_tokens=30, ignore_eos=True)
    before = accepted(spec)
    assert_same(base.generate(PROMPTS[:2], params), spec.generate(PROMPTS[:2], params))
    assert accepted(spec) > before
    assert_clean(spec)


def test_preemption_prefix_caching_and_chunked_prefill(tiny, base):
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=5.0, seed=9, max_tokens=60, ignore_eos=True)]
    prompts = PROMPTS * 2
    want = [base.generate(prompts, sp) for sp in params]
    # 16 blocks of 16 tokens for 8 requests of up to ~40 + 60 tokens: they preempt each other; the prefix
    # cache serves their shared prompts and their recomputes; 24-token steps chunk prompts and cut drafts.
    small = LLM(model=tiny, num_kv_blocks=16, max_num_batched_tokens=24, speculative_config=SPEC)
    for sp, ref in zip(params, want):
        assert_same(ref, small.generate(prompts, sp))
    stats = small.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert accepted(small) > 0
    assert_clean(small)


# Critical values of the chi-square distribution at p = 0.001 (Wilson-Hilferty), by degrees of freedom.
def chi2_critical(df: int, z: float = 3.0902) -> float:
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampling_keeps_the_distribution(base, spec):
    """Unseeded draws (the engine's own random stream, which speculation consumes differently) at temperature 3,
    where drafts (a repeat of the text so far) are accepted about a third of the time: the four-token
    outputs, classed by whether they begin with the most common first token and by how many times they
    repeat their first token, are classed alike with and without speculation - a chi-square test of
    homogeneity over the classes holding at least 10 outputs of the two runs together (the rest pooled),
    rejected at p < 0.001. Drafts accepted beyond the target's odds would lengthen the repeats."""
    prompt = "a b c a b c a b c a"
    params = SamplingParams(temperature=3.0, max_tokens=4, ignore_eos=True)
    draws = 600
    before = spec.engine.stats().spec_decode
    outputs = [[o.outputs[0].token_ids for o in llm.generate([prompt] * draws, params)] for llm in (base, spec)]
    after = spec.engine.stats().spec_decode
    assert after.num_accepted_tokens - before.num_accepted_tokens > draws // 4
    mode = Counter(tokens[0] for tokens in outputs[0]).most_common(1)[0][0]

    def kind(tokens):
        repeats = next((i for i, t in enumerate(tokens) if t != tokens[0]), len(tokens))
        return tokens[0] == mode, repeats

    counts = [Counter(map(kind, run)) for run in outputs]
    kinds = sorted(set(counts[0]) | set(counts[1]))
    frequent = [k for k in kinds if counts[0][k] + counts[1][k] >= 10]
    table = [[c[k] for k in frequent] + [sum(c[k] for k in kinds if k not in frequent)] for c in counts]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    assert len(table[0]) >= 3, f"too few classes for a test: {counts}"
    totals = [a + b for a, b in zip(*table)]
    stat = sum((row[j] - totals[j] / 2) ** 2 / (totals[j] / 2) for row in table for j in range(len(totals)))
    assert stat < chi2_critical(len(totals) - 1), (stat, table)


@pytest.mark.parametrize("config, message", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "speculative method"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}', "unsupported keys"),
    ("{not json", "not valid JSON"),
])
def test_bad_speculative_config_is_refused(tiny, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny, num_kv_blocks=16, speculative_config=config)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_attention_backend_verifies_drafts(tiny_model_paths, backend):
    """The PyTorch path (its decode mirror rebuilt around the steps that verify drafts) and the Triton
    kernels (interpreted on CPU) give the tokens of one token per step too."""
    steps = 24 if backend == "torch" else 6
    prompts = [{"prompt_token_ids": [100 + i % 5 for i in range(n)]} for n in (3, 11, 19)]
    kwargs = dict(model=tiny_model_paths["llama"], num_kv_blocks=32, attention_backend=backend)
    for params in (SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=2, max_tokens=steps, ignore_eos=True)):
        want = LLM(**kwargs).generate(prompts, params) if backend == "torch" else \
            LLM(**{**kwargs, "attention_backend": "torch"}).generate(prompts, params)
        llm = LLM(**kwargs, speculative_config=SPEC)
        assert_same(want, llm.generate(prompts, params))
        assert accepted(llm) > 0


@pytest.mark.parametrize("draft", ["qwen3", "llama"], ids=["draft-is-the-model", "other-draft"])
def test_draft_model_output_is_that_of_one_token_per_step(tiny_model_paths, draft):
    """A draft model (here the tiny qwen3 itself, then the tiny llama, which shares its vocabulary) proposes;
    the output is the target's own, and a draft that is the target itself has its greedy drafts accepted."""
    target = tiny_model_paths["qwen3"]
    base = LLM(model=target, num_kv_blocks=64)
    spec = LLM(model=target, num_kv_blocks=64, speculative_config={
        "method": "draft_model", "num_speculative_tokens": 3, "model": tiny_model_paths[draft], "adaptive": False})
    for params in (SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
                   SamplingParams(temperature=1.0, seed=8, max_tokens=24, ignore_eos=True),
                   SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=16, ignore_eos=True)):
        before = spec.engine.stats().spec_decode
        assert_same(base.generate(PROMPTS, params), spec.generate(PROMPTS, params))
        after = spec.engine.stats().spec_decode
        if draft == "qwen3" and params.temperature == 0.0:
            assert after.num_accepted_tokens - before.num_accepted_tokens == \
                after.num_draft_tokens - before.num_draft_tokens > 0
    assert spec.engine.stats().step_seconds["draft"] > 0
    assert_clean(spec)


def test_draft_model_under_preemption_and_prefix_caching(tiny_model_paths):
    target = tiny_model_paths["qwen3"]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    want = LLM(model=target, num_kv_blocks=256).generate(PROMPTS * 2, params)
    small = LLM(model=target, num_kv_blocks=16, max_num_batched_tokens=24, speculative_config={
        "method": "draft_model", "num_speculative_tokens": 3, "model": target, "adaptive": False})
    assert_same(want, small.generate(PROMPTS * 2, params))
    stats = small.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_decode.num_accepted_tokens > 0
    assert_clean(small)


@pytest.mark.parametrize("config, message", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent"}, "no model at"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "model": "x", "prompt_lookup_max": 2}, "unsupported keys"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "unsupported keys"),
])
def test_bad_draft_model_config_is_refused(tiny, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=tiny, num_kv_blocks=16, speculative_config=config)


def test_draft_prompt_work_is_chunked_within_the_step_budget(tiny_model_paths, hf_causal_lm, hf_greedy,
                                                             near_tie_check):
    """A long prompt arriving while others decode: the draft computes its prompt chunk by chunk, in the steps
    that compute the target's, never more prompt tokens in a step than the step budget - so every request
    decoding meanwhile gets a token every step - and greedy output still equals HF transformers."""
    target, budget, k = tiny_model_paths["qwen3"], 32, 3
    llm = LLM(model=target, num_kv_blocks=128, max_num_batched_tokens=budget, speculative_config={
        "method": "draft_model", "num_speculative_tokens": k, "model": target, "adaptive": False})
    engine, proposer = llm.engine, llm.engine.proposer
    # The short requests decode (about k + 1 tokens a step, the draft being the target) all through the long
    # prompt's chunks.
    lengths = {"short-0": 120, "short-1": 120, "long": 24}
    short = [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24]]
    long = [(i * 37) % 900 + 5 for i in range(400)]
    prompts = {"short-0": short[0], "short-1": short[1], "long": long}
    for rid in ("short-0", "short-1"):
        engine.add_request(rid, {"prompt_token_ids": prompts[rid]},
                           SamplingParams(temperature=0.0, max_tokens=lengths[rid], ignore_eos=True))
    while any(engine.scheduler.requests[r].num_output_tokens < 2 for r in ("short-0", "short-1")):
        engine.step()
    engine.add_request("long", {"prompt_token_ids": long},
                       SamplingParams(temperature=0.0, max_tokens=lengths["long"], ignore_eos=True))
    requests = dict(engine.scheduler.requests)
    outputs, chunked_steps = {}, 0
    while engine.has_unfinished_requests():
        decoding = [r for r in requests.values() if not r.is_finished and r.num_computed_tokens >= r.num_prompt_tokens]
        before = {r.request_id: r.num_output_tokens for r in decoding}
        prompt_left = requests["long"].num_prompt_tokens - requests["long"].num_computed_tokens
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        # Every request decoding in this step got at least one token.
        assert all(r.num_output_tokens > before[r.request_id] for r in decoding)
        # Decoding requests each compute at most their last token, the previous step's drafts and their own k
        # drafts; the rest of the draft's tokens are prompt work, within the budget.
        assert proposer.num_tokens_last_step <= budget + len(decoding) * 2 * (k + 1)
        chunked_steps += 0 < prompt_left and len(decoding) > 0
    assert chunked_steps >= len(long) // budget
    # The draft is the target: every greedy draft is accepted only if the KV it drafted from, computed chunk by
    # chunk, is right.
    spec = engine.stats().spec_decode
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
    model = hf_causal_lm(target)
    ties = sum(near_tie_check(rid, list(outputs[rid].outputs[0].token_ids),
                              *hf_greedy(model, prompts[rid], lengths[rid])) for rid in prompts)
    assert ties <= 1
    # The long prompt again: the target takes its blocks from the prefix cache, the draft has none of it and
    # catches up a budget a step, drafting once it is there.
    engine.add_request("again", {"prompt_token_ids": long},
                       SamplingParams(temperature=0.0, max_tokens=lengths["long"], ignore_eos=True))
    again, steps = [], 0
    while engine.has_unfinished_requests():
        again += [out for out in engine.step() if out.finished]
        steps += 1
        assert proposer.num_tokens_last_step <= budget + 2 * (k + 1)
    assert again[0].num_cached_tokens > 0
    assert again[0].outputs[0].token_ids == outputs["long"].outputs[0].token_ids
    assert steps < lengths["long"]  # it drafted
    assert_clean(llm)


def test_suffix_decoding_output_is_that_of_one_token_per_step(tiny, base):
    """Drafts from the request's own suffix tree and from the outputs of the requests that finished before it
    (the second round of the same prompts finds the first's there)."""
    suffix = LLM(model=tiny, num_kv_blocks=256,
                 speculative_config={"method": "suffix", "num_speculative_tokens": 6, "adaptive": False})
    for params in (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True, logprobs=2),
                   SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)):
        assert_same(base.generate(PROMPTS, params), suffix.generate(PROMPTS, params))
    assert accepted(suffix) > 0
    # Each round's outputs joined the cache once the next round's first step swept the finished requests.
    assert len(suffix.engine.proposer.cached) == 2 * len(PROMPTS)
    assert_clean(suffix)


# -- the draft policy (adaptive, the default) ------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_the_default_adaptive_engine_answers_as_one_token_per_step(tiny_model_paths, tiny, base, method):
    """Whatever drafts the policy keeps (it decides from measured step times), the output is the same; with a
    draft model (another tiny model of the same vocabulary: few of its drafts accepted) too, whose requests
    rest and are probed alike."""
    config = SPEC if method == "ngram" else {"method": "draft_model", "num_speculative_tokens": 3,
                                             "model": tiny_model_paths["qwen3"]}
    adaptive = LLM(model=tiny, num_kv_blocks=256, speculative_config={**config, "adaptive": True})
    for params in (SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True, logprobs=2)):
        assert_same(base.generate(PROMPTS, params), adaptive.generate(PROMPTS, params))
    # Rows priced far beyond what a draft can bring (a second a row, the moving averages made that): no draft
    # is verified but each request's first proposal (its record starts there) and, each time a rest ends, its
    # first draft (a probe), and nothing else changes. (The steps then measured make only the row counts they
    # have cheap.)
    policy = adaptive.engine.scheduler.draft_policy
    for _ in range(100):
        for rows in range(1, 65):
            policy.observe_step(rows, float(rows))
    drafted = adaptive.engine.scheduler.spec_stats.num_draft_tokens
    proposer, asked = adaptive.engine.proposer, []
    propose = proposer.propose
    proposer.propose = lambda request: asked.append(request.request_id) or propose(request)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert_same(base.generate(PROMPTS, params), adaptive.generate(PROMPTS, params))
    first = adaptive.engine.scheduler.spec_stats.num_draft_tokens - drafted
    assert 0 < first <= (config["num_speculative_tokens"] + 3) * len(PROMPTS)
    # Requests whose drafts are then all cut rest from proposing (1, 2, 4, 8 steps): at most 5 of their 15
    # decode steps ask (the first, the cut, and the probes after the first three rests).
    assert len(asked) <= 5 * len(PROMPTS), len(asked)
    assert_clean(adaptive)
