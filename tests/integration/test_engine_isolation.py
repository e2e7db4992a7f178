"""One request's failure stays that request's: the engine loop goes on, the others' tokens do not change,
every block comes back. A loop that does die says so at once, to every waiter."""
import asyncio

import pytest

from epdserve import LLM, AsyncLLM, SamplingParams
from epdserve.shared.engine.async_llm import EngineDeadError, RequestFailedError
from epdserve.shared.engine.request import Request

GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=8)
PROMPTS = ["The lighthouse keeper", "Once upon a time", "In a hole in the ground", "It was a cold day"]


@pytest.fixture(scope="module")
def llm(tiny_model_paths):
    return LLM(model=tiny_model_paths["llama"], num_kv_blocks=256)


def assert_clean(engine):
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


def run(engine, requests: dict[str, Request]) -> dict[str, list[int]]:
    for rid, request in requests.items():
        engine.add_request(rid, request)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def good_requests(engine, tag: str) -> dict[str, Request]:
    params = [SamplingParams(**GREEDY), SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)]
    return {f"{tag}-{i}": engine.make_request(f"{tag}-{i}", p, params[i % 2]) for i, p in enumerate(PROMPTS)}


def test_a_request_that_breaks_sampling_fails_alone(llm):
    engine = llm.engine
    alone = {rid: out.outputs[0].token_ids for rid, out in run(engine, good_requests(engine, "a")).items()}
    requests = good_requests(engine, "b")
    poison = engine.make_request("poison", "Hello there", SamplingParams(temperature=1.0, max_tokens=8))
    # A value that slipped past validation and breaks the sampler: it must cost this request only.
    poison.sampling_params.temperature = "hot"
    finished = run(engine, {**requests, "poison": poison})
    assert finished["poison"].outputs[0].finish_reason == "error"
    assert "sampling failed" in finished["poison"].error
    for i in range(len(PROMPTS)):
        assert finished[f"b-{i}"].outputs[0].token_ids == alone[f"a-{i}"], f"request {i} changed"
    assert engine.stats().num_finished["error"] >= 1
    assert_clean(engine)


def test_a_request_that_breaks_the_model_fails_alone(llm):
    engine = llm.engine
    alone = {rid: out.outputs[0].token_ids for rid, out in run(engine, good_requests(engine, "c")).items()}
    requests = good_requests(engine, "d")
    # A token id past the embedding table (the engine's own checks refuse it; built here without them).
    poison = Request("bad-token", [5, engine.model_config.vocab_size + 5, 6], SamplingParams(**GREEDY),
                     engine.model_config.max_model_len)
    poison.sampling_params.eos_token_ids = engine.model_config.eos_token_ids
    finished = run(engine, {**requests, "bad-token": poison})
    assert finished["bad-token"].outputs[0].finish_reason == "error"
    for i in range(len(PROMPTS)):
        assert finished[f"d-{i}"].outputs[0].token_ids == alone[f"c-{i}"], f"request {i} changed"
    assert_clean(engine)


@pytest.mark.parametrize("params, message", [
    (dict(top_k=(1 << 63)), "top_k"),
    (dict(stop_token_ids=[10 ** 9], min_tokens=2), "stop_token_ids"),
    (dict(seed=1 << 64), "seed"),
    (dict(seed=-(1 << 63) - 1), "seed"),
    (dict(min_tokens=100_000, max_tokens=None), "min_tokens"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
])
def test_parameters_past_the_models_limits_are_refused(llm, params, message):
    with pytest.raises(ValueError, match=message):
        llm.engine.make_request("x", "Hello", SamplingParams(**params))


def test_async_failures_reach_their_stream_only(tiny_model_paths):
    llm = AsyncLLM.from_model(tiny_model_paths["llama"], num_kv_blocks=128)

    async def collect(request):
        return [out async for out in llm.generate(request)]

    async def main():
        poison = await llm.make_request("Hello", SamplingParams(temperature=1.0, max_tokens=4), "poison")
        poison.sampling_params.top_p = "wide"
        good = await llm.make_request("Hello", SamplingParams(**GREEDY), "good")
        bad, ok = await asyncio.gather(collect(poison), collect(good), return_exceptions=True)
        assert isinstance(bad, RequestFailedError) and "sampling failed" in str(bad)
        assert ok[-1].finished and len(ok[-1].outputs[0].token_ids) == 8
        assert llm.dead is None

    try:
        asyncio.run(main())
        stats = llm.stats()
        assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
    finally:
        llm.shutdown()


def test_cancelled_engine_calls_do_not_stop_the_loop(tiny_model_paths):
    """A caller cancelled while its call waits for the engine thread (a client gone mid-handoff)."""
    llm = AsyncLLM.from_model(tiny_model_paths["llama"], num_kv_blocks=128)

    async def main():
        busy = asyncio.create_task(collect_all(llm.generate("Hello " * 200, SamplingParams(**GREEDY))))
        for _ in range(30):
            call = asyncio.create_task(llm.kv_events(None))
            await asyncio.sleep(0)  # queued behind the running step
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
        await busy
        assert llm.dead is None
        await llm.kv_events(None)
        assert llm.stats().num_running == 0

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()


async def collect_all(stream):
    return [out async for out in stream]


def test_a_dead_loop_fails_every_waiter_and_reports(tiny_model_paths):
    llm = AsyncLLM.from_model(tiny_model_paths["llama"], num_kv_blocks=128)
    causes = []
    llm.on_dead(causes.append)

    def broken_schedule():
        raise RuntimeError("scheduler bug")

    async def main():
        stream = collect_all(llm.generate("Hello", SamplingParams(**GREEDY)))
        llm._engine.scheduler.schedule = broken_schedule  # a bug outside any one request (injected: the engine's own)
        with pytest.raises(EngineDeadError):
            await stream
        assert isinstance(llm.dead, RuntimeError) and causes == [llm.dead]
        with pytest.raises(EngineDeadError):
            await llm.kv_events(None)
        with pytest.raises(EngineDeadError):
            await collect_all(llm.generate("Hello", SamplingParams(**GREEDY)))

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()
