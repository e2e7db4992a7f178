"""A request continued on another engine from every token a lost stream had delivered (handoff.py, what the
proxy's migration sends): the engine recomputes the prompt and those tokens, and goes on with exactly the tokens
the first engine would have sampled next - greedy, seeded sampling with penalties, a JSON schema's matcher
replayed, each of n = 3 sequences continued alone with its seed - and delivers only what follows them."""
import json
from dataclasses import replace

import pytest

from epdserve import LLM, RequestOutputKind, SamplingParams
from epdserve.shared.engine import sequence_seed
from epdserve.shared.engine.sampling_params import StructuredOutputsParams

PROMPT = list(range(300, 340))
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {
    "type": "array", "items": {"type": "string"}, "minItems": 3}}, "required": ["name", "tags"]}
CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    "seeded-penalties": SamplingParams(temperature=1.2, top_p=0.9, seed=17, presence_penalty=0.8,
                                       frequency_penalty=0.3, repetition_penalty=1.2, max_tokens=24, min_tokens=24,
                                       ignore_eos=True),
    "json-schema-seeded": SamplingParams(temperature=1.0, seed=3, max_tokens=40,
                                         structured_outputs=StructuredOutputsParams.json_schema(json.dumps(SCHEMA))),
    "logprobs": SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True),
}


@pytest.fixture(scope="module")
def llm(tiny_model_paths):
    return LLM(model=tiny_model_paths["qwen2"], num_kv_blocks=128)


def resumed(llm: LLM, params: SamplingParams, delivered: list[int]):
    """The output of a request that continues from `delivered`, on the engine's own loop."""
    engine = llm.engine
    request = engine.make_request("resumed", {"prompt_token_ids": PROMPT}, params, peer_token_ids=[delivered])
    engine.add_request("resumed", request)
    outputs = []
    while engine.has_work():
        outputs += [out for out in engine.step() if out.request_id == "resumed"]
    return outputs


@pytest.mark.parametrize("name", CASES)
def test_a_continued_request_samples_what_the_first_engine_would_have(llm, name):
    params = CASES[name]
    reference = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]
    assert len(reference.token_ids) > 4
    for cut in (1, len(reference.token_ids) // 2, len(reference.token_ids) - 1):
        outputs = resumed(llm, replace(params, output_kind=RequestOutputKind.DELTA), reference.token_ids[:cut])
        following = [t for out in outputs for t in out.outputs[0].token_ids]
        assert following == reference.token_ids[cut:], f"cut at {cut}"
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == reference.finish_reason
        if params.logprobs is not None:  # new tokens only, each with its own entry
            logprobs = [lp for out in outputs for lp in out.outputs[0].logprobs]
            assert logprobs == reference.logprobs[cut:]
    if name == "json-schema-seeded" and reference.finish_reason == "stop":
        json.loads(llm.get_tokenizer().decode(reference.token_ids))


def test_each_of_n_sequences_continues_alone_with_its_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=41, max_tokens=20, ignore_eos=True)
    reference = sorted(llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs, key=lambda c: c.index)
    assert len({tuple(c.token_ids) for c in reference}) == 3
    for completion, cut in zip(reference, (1, 7, 19)):
        alone = replace(params, n=1, seed=sequence_seed(params.seed, completion.index),
                        output_kind=RequestOutputKind.DELTA)
        outputs = resumed(llm, alone, completion.token_ids[:cut])
        assert [t for out in outputs for t in out.outputs[0].token_ids] == completion.token_ids[cut:]


def test_delivered_tokens_that_end_the_request_finish_it_at_once(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reference = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]
    outputs = resumed(llm, replace(params, output_kind=RequestOutputKind.DELTA), reference.token_ids)
    assert len(outputs) == 1 and outputs[0].finished and outputs[0].outputs[0].token_ids == []
    assert outputs[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("params, delivered, message", [
    (SamplingParams(max_tokens=4), [5, 6, 7, 8, 9], "exceed the request's 4 output tokens"),
    (SamplingParams(max_tokens=4), [10 ** 9], "outside the vocabulary"),
    (SamplingParams(n=2, max_tokens=4), [[1, 2], [3, 4]], "exactly one token of each"),
    (SamplingParams(max_tokens=4), [], "at least one token"),
])
def test_continuations_that_cannot_be_are_refused(llm, params, delivered, message):
    peer = delivered if params.n > 1 else [delivered]
    with pytest.raises(ValueError, match=message):
        llm.engine.make_request("bad", {"prompt_token_ids": PROMPT}, params, peer_token_ids=peer)
