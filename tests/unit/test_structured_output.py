"""Structured outputs in the engine: the grammar cache, matchers fed token by token or replayed, the
bitmask in the sampler, and logit_bias. Uses the real SmolLM2 tokenizer (xgrammar needs a vocabulary)."""
import json

import pytest
import torch

from epdserve.shared.engine.request import Request, RequestStatus, dense_logit_bias
from epdserve.shared.engine.sampler import Sampler
from epdserve.shared.engine.sampling_params import SamplingParams, StructuredOutputsParams
from epdserve.shared.engine.structured_output import GrammarCompiler, apply_bitmask
from epdserve.shared.processing.tokenizer import load_tokenizer

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    return load_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer.hf, 49152, (EOS,), max_cached=2)


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return len(tokenizer.hf)


def request(compiler, so: StructuredOutputsParams | None, **params) -> Request:
    params = SamplingParams(structured_outputs=so, eos_token_ids=(EOS,), **params)
    return Request("r", [1, 2, 3], params, max_model_len=1000, grammar=compiler.new_state(so) if so else None,
                   logit_bias=dense_logit_bias(params.logit_bias, compiler.vocab_size))


def allowed(compiler, state, vocab) -> set[int]:
    logits = torch.zeros(1, vocab)
    apply_bitmask(logits, [state], [0], torch.empty(1, (vocab + 31) // 32, dtype=torch.int32))
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_grammars_are_compiled_once_per_spec_and_evicted_least_recent_first(tokenizer):
    compiler = GrammarCompiler(tokenizer.hf, 49152, (EOS,), max_cached=2)
    a, b, c = (StructuredOutputsParams("regex", r) for r in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    assert compiler.compile(StructuredOutputsParams("regex", "a+")) is first
    assert (compiler.num_compiled, compiler.num_hits) == (1, 1)
    compiler.compile(b)
    compiler.compile(a)  # a is now the most recent: c evicts b
    compiler.compile(c)
    assert len(compiler) == 2 and compiler.compile(a) is first and compiler.num_compiled == 3
    compiler.compile(b)
    assert compiler.num_compiled == 4  # b was evicted, so compiled again
    # The same text under another kind is another grammar.
    assert compiler.compile(StructuredOutputsParams("grammar", 'root ::= "a"')) is not first


@pytest.mark.parametrize("so, message", [
    (StructuredOutputsParams("json", '{"type": "nonsense"}'), "invalid JSON schema"),
    (StructuredOutputsParams("json", "not json"), "invalid JSON schema"),
    (StructuredOutputsParams("regex", "[a-"), "invalid regex"),
    (StructuredOutputsParams("grammar", "root ::= undefined_rule"), "invalid grammar"),
])
def test_a_spec_that_does_not_compile_is_a_value_error(compiler, so, message):
    with pytest.raises(ValueError, match=message):
        compiler.new_state(so)


def test_the_bitmask_allows_exactly_the_grammar_s_next_tokens(compiler, tokenizer, vocab):
    state = compiler.new_state(StructuredOutputsParams.choices(["yes", "no"]))
    first = allowed(compiler, state, vocab)
    assert first and all(tokenizer.decode([t]) and ("yes".startswith(tokenizer.decode([t])) or
                                                    "no".startswith(tokenizer.decode([t]))) for t in first)
    assert EOS not in first
    for token in tokenizer.encode("yes", add_special_tokens=False):
        state.accept(token)
    assert allowed(compiler, state, vocab) == {EOS}  # complete: only the stop token
    state.accept(EOS)
    assert state.is_terminated and state.rejected_token is None


def test_apply_bitmask_touches_only_the_constrained_rows(compiler, vocab):
    logits = torch.randn(3, vocab)
    before = logits.clone()
    state = compiler.new_state(StructuredOutputsParams("regex", "[0-9]+"))
    apply_bitmask(logits, [state], [1], torch.zeros(3, (vocab + 31) // 32, dtype=torch.int32))
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    kept = logits[1] > float("-inf")
    assert 0 < int(kept.sum()) < 1000
    assert torch.equal(logits[1][kept], before[1][kept])


def test_replaying_the_tokens_into_a_fresh_matcher_gives_the_same_state(compiler, tokenizer, vocab):
    so = StructuredOutputsParams.json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                               "required": ["n"]})
    tokens = tokenizer.encode('{"n": 12', add_special_tokens=False)
    live = request(compiler, so)
    masks = []
    for t in tokens:
        masks.append(allowed(compiler, live.grammar, vocab))
        live.append_output_token(t)
    # A peer engine taking the request over: a new request, the same tokens appended.
    replayed = request(compiler, so)
    for t in tokens:
        replayed.append_output_token(t)
    assert allowed(compiler, replayed.grammar, vocab) == allowed(compiler, live.grammar, vocab)
    assert replayed.grammar.num_accepted == len(tokens) and not replayed.check_stop()
    assert all(t in m for t, m in zip(tokens, masks))


def test_the_request_finishes_when_its_grammar_ends_and_fails_on_a_token_outside_it(compiler, tokenizer):
    done = request(compiler, StructuredOutputsParams("regex", "ok"), ignore_eos=True, max_tokens=50)
    for t in tokenizer.encode("ok", add_special_tokens=False) + [EOS]:
        done.append_output_token(t)
    assert done.check_stop() and done.status == RequestStatus.FINISHED_STOPPED and done.stop_reason is None

    bad = request(compiler, StructuredOutputsParams("regex", "ok"))
    bad.append_output_token(tokenizer.encode("no", add_special_tokens=False)[0])
    assert bad.check_stop() and bad.status == RequestStatus.FINISHED_ERROR
    assert "structured output" in bad.failure.message and bad.failure.bad_input


def test_the_sampler_picks_only_allowed_tokens_greedy_or_random(compiler, tokenizer, vocab):
    so = StructuredOutputsParams.choices(["yes", "no"])
    greedy = request(compiler, so, temperature=0.0)
    random = request(compiler, so, temperature=1.0, seed=3)
    free = request(compiler, None, temperature=0.0)
    logits = torch.randn(3, vocab)
    favourite = int(logits[2].argmax())
    out = Sampler()(logits, [greedy, random, free])
    first_tokens = allowed(compiler, compiler.new_state(so), vocab)
    assert out.token_ids[0] in first_tokens and out.token_ids[1] in first_tokens
    assert out.token_ids[0] == max(first_tokens, key=lambda t: float(logits[0, t]))
    assert out.token_ids[2] == favourite  # the unconstrained row is untouched


def test_a_huge_penalty_on_every_allowed_token_still_leaves_them_allowed(compiler, tokenizer, vocab):
    """repetition_penalty 1e307 overflows negative logits to -inf; a choice whose every first token the
    request has seen would then allow nothing, and a forbidden token came out."""
    so = StructuredOutputsParams.choices(["yes", "no"])
    first_tokens = allowed(compiler, compiler.new_state(so), vocab)
    rows = [request(compiler, so, temperature=t, seed=5, repetition_penalty=1.9988932900897771e307) for t in (0.0, 1.0)]
    for r in rows:
        r.all_token_ids += sorted(first_tokens)  # every allowed token seen before
    logits = torch.full((2, vocab), 3.0)
    logits[:, sorted(first_tokens)] = -1.0
    out = Sampler()(logits, rows)
    assert set(out.token_ids) <= first_tokens


def test_a_grammar_that_can_only_end_ends_the_request_despite_min_tokens(compiler, tokenizer, vocab):
    """min_tokens masks EOS, the finished regex allows only EOS: the grammar wins, no row is left empty."""
    done = request(compiler, StructuredOutputsParams("regex", "ok"), min_tokens=10, temperature=1.0, seed=1)
    for t in tokenizer.encode("ok", add_special_tokens=False):
        done.append_output_token(t)
    other = request(compiler, None, min_tokens=10, temperature=0.0)
    logits = torch.randn(2, vocab)
    out = Sampler()(logits, [done, other])
    assert out.token_ids[0] == EOS
    assert out.token_ids[1] != EOS  # an unconstrained row keeps min_tokens
    done.append_output_token(out.token_ids[0])
    assert done.check_stop() and done.status == RequestStatus.FINISHED_STOPPED


def test_nothing_is_copied_when_no_request_uses_a_processor(compiler, vocab):
    logits = torch.randn(2, vocab)
    assert Sampler()._apply_logits_processors(logits, [request(compiler, None), request(compiler, None)])[0] is logits


def test_logit_bias_forces_and_bans_tokens_greedy_and_random(compiler, vocab):
    logits = torch.randn(4, vocab)
    best = logits.argmax(-1).tolist()
    forced = request(compiler, None, temperature=0.0, logit_bias={7: 100.0})
    banned = request(compiler, None, temperature=0.0, logit_bias={best[1]: -100.0})
    forced_random = request(compiler, None, temperature=1.0, seed=1, logit_bias={9: 100.0})
    free = request(compiler, None, temperature=0.0)
    raw = logits.clone()
    out = Sampler()(logits, [forced, banned, forced_random, free])
    assert out.token_ids[0] == 7 and out.token_ids[2] == 9 and out.token_ids[3] == best[3]
    runner_up = int(raw[1].topk(2).indices[1])
    assert out.token_ids[1] == runner_up
    assert torch.equal(logits, raw)  # the model's logits are left as they were


def test_logit_bias_is_validated():
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias={-1: 1.0})


def test_choice_specs_are_json_lists_and_kinds_are_checked():
    assert json.loads(StructuredOutputsParams.choices(["a|b", "c"]).spec) == ["a|b", "c"]
    with pytest.raises(ValueError, match="kind"):
        StructuredOutputsParams("xml", "x")
    with pytest.raises(ValueError, match="non-empty spec"):
        StructuredOutputsParams("regex", "")


def test_a_vocabulary_wide_bias_shared_by_many_sequences_is_added_to_each_row(compiler):
    """n sequences share one dense bias row; the sampler adds it to every row of theirs at once."""
    vocab = compiler.vocab_size
    bias = {t: -100.0 for t in range(0, vocab - 7)}  # every token but the last 7 banned
    shared = dense_logit_bias(bias, vocab)
    params = SamplingParams(temperature=0.0, logit_bias=bias, eos_token_ids=(EOS,))
    biased = [Request(f"r{i}", [1, 2, 3], params, max_model_len=1000, logit_bias=shared) for i in range(128)]
    free = request(compiler, None, temperature=0.0)
    logits = torch.randn(129, vocab, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, [*biased[:64], free, *biased[64:]])
    expected = (logits[:, vocab - 7:].argmax(-1) + vocab - 7).tolist()
    assert out.token_ids[:64] == expected[:64] and out.token_ids[65:] == expected[65:]
    assert out.token_ids[64] == int(logits[64].argmax())


def test_a_grammar_no_token_can_begin_is_refused_when_compiled(compiler):
    with pytest.raises(ValueError, match="no token of this model's vocabulary can begin"):
        compiler.compile(StructuredOutputsParams("grammar", r"root ::= [^\x00-\U0010FFFF]"))


def test_a_grammar_that_allows_no_token_mid_way_fails_its_request_as_bad_input(compiler, tokenizer):
    """After "a" the grammar wants a character outside every code point: the row has no token left. Its
    request fails as the request's own doing; the other rows of the batch are sampled as usual."""
    stuck = request(compiler, StructuredOutputsParams("grammar", r'root ::= "a" [^\x00-\U0010FFFF]'),
                    temperature=0.0)
    stuck.append_output_token(tokenizer.encode("a", add_special_tokens=False)[0])
    free = request(compiler, None, temperature=0.0)
    logits = torch.randn(2, compiler.vocab_size, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, [stuck, free])
    assert set(out.failed) == {0} and "can continue the request's structured output" in out.failed[0]
    assert out.token_ids[1] == int(logits[1].argmax())
