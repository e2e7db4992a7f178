"""Structured outputs through the engine with SmolLM2: answers that validate, under preemption, across a
prefill -> decode handoff (KV pulled or recomputed), and a bad constraint failing only its own request."""
import asyncio
import json
import time
from dataclasses import replace

import jsonschema
import pytest

from epdserve import AsyncLLM, RequestOutputKind, SamplingParams
from epdserve.shared.engine.llm import LLM, build_engine_config
from epdserve.shared.engine.llm_engine import LLMEngine
from epdserve.shared.engine.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow  # more than ten seconds: left out of `make test-fast`

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
PEOPLE = ["Describe a pirate as JSON.", "Give me a person as JSON.", "A JSON record for a baker, please.",
          "JSON for an astronaut."]


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def constrained(**kwargs) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams.json_schema(SCHEMA), **kwargs)


@pytest.fixture(scope="module")
def llm(default_model_path):
    return LLM(default_model_path, num_kv_blocks=128)


def test_json_schema_answers_validate_greedy_and_sampled(llm):
    prompts = [{"prompt_token_ids": chat_ids(llm.engine, p)} for p in PEOPLE]
    params = [constrained(temperature=0.0, max_tokens=60), constrained(temperature=1.0, seed=1, max_tokens=60),
              constrained(temperature=1.0, max_tokens=60), constrained(temperature=0.7, top_p=0.9, max_tokens=60)]
    for out in llm.generate(prompts, params):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert llm.engine.grammar_compiler.num_compiled >= 1


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(llm):
    prompt = {"prompt_token_ids": chat_ids(llm.engine, PEOPLE[0])}
    free = SamplingParams(temperature=0.0, max_tokens=20)
    alone = llm.generate(prompt, free)[0].outputs[0].token_ids
    mixed = llm.generate([prompt, prompt], [constrained(temperature=0.0, max_tokens=20), free])
    assert mixed[1].outputs[0].token_ids == alone


def test_preempted_constrained_requests_still_validate(default_model_path):
    # 14 blocks of 16 tokens for 4 requests of ~40 prompt + 60 new tokens: they preempt each other.
    small = LLM(default_model_path, num_kv_blocks=14, max_num_seqs=4)
    prompts = [{"prompt_token_ids": chat_ids(small.engine, p)} for p in PEOPLE]
    params = [constrained(temperature=1.0, seed=i, max_tokens=60) for i in range(len(PEOPLE))]
    outs = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


@pytest.mark.parametrize("pull", [True, False], ids=["kv-pulled", "recomputed"])
def test_prefill_samples_the_first_token_and_decode_the_rest(default_model_path, llm, copy_connector, prefill_held,
                                                              pull):
    """Prefill's first token is sampled under the grammar; decode replays it into a fresh matcher and goes
    on, on the loaded KV or on the recomputed prompt, with the same tokens as one engine."""
    params = constrained(temperature=1.0, seed=7, max_tokens=60)
    prompt = chat_ids(llm.engine, PEOPLE[1])
    unified = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    prefill = LLMEngine(build_engine_config(default_model_path, num_kv_blocks=32), detokenize=False)
    decode = AsyncLLM.from_config(build_engine_config(default_model_path, num_kv_blocks=32))
    decode.add_connector(copy_connector(decode.kv_cache, fail=not pull))

    async def run():
        firsts, held = prefill_held(prefill, "r", prompt, params)
        request = await decode.make_request({"prompt_token_ids": prompt},
                                            replace(params, output_kind=RequestOutputKind.DELTA), "r",
                                            peer_token_ids=[[t] for t in firsts],
                                            kv_transfer_params=(prefill.runner.kv_cache, held, len(prompt)))
        tokens = list(firsts)
        async for out in decode.generate(request):
            tokens += out.outputs[0].token_ids
            reason = out.outputs[0].finish_reason
        prefill.release_kv("r")
        return tokens, reason

    try:
        tokens, reason = asyncio.run(run())
    finally:
        decode.shutdown()
    assert tokens == unified.token_ids and reason == "stop"
    jsonschema.validate(json.loads(llm.engine.tokenizer.decode(tokens)), SCHEMA)


def test_a_constraint_that_does_not_compile_fails_alone(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="invalid grammar"):
        engine.make_request("bad", [1, 2, 3], SamplingParams(
            structured_outputs=StructuredOutputsParams("grammar", "root ::= nowhere")))
    # The engine goes on serving.
    out = llm.generate({"prompt_token_ids": chat_ids(engine, "Yes or no?")}, SamplingParams(
        temperature=0.0, max_tokens=5, structured_outputs=StructuredOutputsParams.choices(["yes", "no"])))
    assert out[0].outputs[0].text in ("yes", "no")


def huge_schema(num_properties: int) -> dict:
    names = [f"field_{i:05d}" for i in range(num_properties)]
    return {"type": "object", "properties": {n: {"type": "string"} for n in names}, "required": names}


def test_a_slow_compile_is_refused_while_the_engine_loop_goes_on(default_model_path):
    """The compile runs off the event loop, which keeps ticking; past the time bound the request is
    refused (bad input), and the grammar, compiled anyway, is cached for the next such request."""
    config = replace(build_engine_config(default_model_path, num_kv_blocks=32), grammar_compile_timeout=0.05)
    llm = AsyncLLM.from_config(config)
    so = StructuredOutputsParams.json_schema(huge_schema(3000))

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        with pytest.raises(ValueError, match="took longer than 0.05s to compile"):
            await llm.make_request([1, 2, 3], SamplingParams(structured_outputs=so), "slow")
        ticker.cancel()
        return ticks

    async def cached_soon():  # the same schema again: taken at once once the first compile has ended
        deadline = time.monotonic() + 60
        while True:
            try:
                return await llm.make_request([1, 2, 3], SamplingParams(structured_outputs=so), "again")
            except ValueError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)

    try:
        assert asyncio.run(main()) >= 1  # the loop ran while the compile did
        assert asyncio.run(cached_soon()).grammar is not None
    finally:
        llm.shutdown()


def test_a_request_whose_grammar_dead_ends_fails_as_bad_input_and_the_others_go_on(default_model_path):
    llm = AsyncLLM.from_config(build_engine_config(default_model_path, num_kv_blocks=32))
    dead_end = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        "grammar", r'root ::= "a" [^\x00-\U0010FFFF]'))

    async def main():
        async def collect(params, rid):
            request = await llm.make_request([1, 9906, 28], params, rid)
            return [out async for out in llm.generate(request)][-1]

        stuck = asyncio.create_task(collect(dead_end, "stuck"))
        fine = asyncio.create_task(collect(SamplingParams(temperature=0.0, max_tokens=8), "fine"))
        with pytest.raises(ValueError, match="can continue the request's structured output"):
            await stuck
        return await fine

    try:
        assert asyncio.run(main()).outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()
