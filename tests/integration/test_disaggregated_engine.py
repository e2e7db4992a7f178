"""Prefill on one engine, decode on another, KV blocks copied between their caches: the tokens equal
those of one engine doing both, and every block comes back to both pools."""
import asyncio
from dataclasses import replace

import pytest

from epdserve import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from epdserve.shared.engine.llm_engine import LLMEngine
from epdserve.shared.engine.llm import build_engine_config

PROMPTS = [list(range(200, 200 + n)) for n in (1, 15, 16, 17, 40, 70)]
MAX_TOKENS = 12


def prefill(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams):
    """Run the prompt to its first token and keep the blocks (what a prefill service does)."""
    request = engine.make_request(rid, {"prompt_token_ids": prompt}, params, hold_kv=True)
    request.max_output_tokens = 1  # as the prefill service does: min_tokens etc. still apply to the token
    engine.add_request(rid, request)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    return final.outputs[0].token_ids[0], final.kv_block_ids


@pytest.mark.parametrize("decode_has_prefix, params", [
    (False, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)),
    (True, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)),
    # Seeded sampling continues where prefill's draw left off: the same tokens as one engine.
    (False, SamplingParams(temperature=3.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)),
])
def test_prefill_then_decode_equals_unified(tiny_model_paths, decode_has_prefix, params):
    path = tiny_model_paths["qwen2"]
    unified = LLM(model=path, num_kv_blocks=128).generate([{"prompt_token_ids": p} for p in PROMPTS], params)

    prefill_engine = LLMEngine(build_engine_config(path, num_kv_blocks=64), detokenize=False)
    decode = AsyncLLM(LLMEngine(build_engine_config(path, num_kv_blocks=64), detokenize=False))
    block_size = prefill_engine.config.cache.block_size
    if decode_has_prefix:  # decode computed the longest prompt before: its full blocks are local hits
        decode.engine.add_request("warm", {"prompt_token_ids": PROMPTS[-1]}, SamplingParams(max_tokens=1))
        while decode.engine.has_unfinished_requests():
            decode.engine.step()

    async def run_one(i, prompt):
        rid = f"r{i}"
        first, held = prefill(prefill_engine, rid, prompt, params)
        fetched = []

        async def fill_kv(reservation):
            src = held[reservation.first_remote_block:reservation.first_remote_block + len(reservation.block_ids)]
            fetched.append((reservation.num_local_tokens, len(src)))
            decode.engine.runner.kv_cache[:, :, reservation.block_ids] = prefill_engine.runner.kv_cache[:, :, src]

        request = await decode.make_request({"prompt_token_ids": prompt},
                                      replace(params, output_kind=RequestOutputKind.DELTA), rid)
        tokens = [first]
        async for out in decode.generate_prefilled(request, first, fill_kv):
            tokens += out.outputs[0].token_ids
        assert prefill_engine.release_kv(rid)
        return tokens, fetched[0]

    async def main():
        return await asyncio.gather(*(run_one(i, p) for i, p in enumerate(PROMPTS)))

    try:
        results = asyncio.run(main())
        for (tokens, (num_local, num_fetched)), ref, prompt in zip(results, unified, PROMPTS):
            assert tokens == ref.outputs[0].token_ids
            num_blocks = -(-len(prompt) // block_size)
            if decode_has_prefix:  # only what decode lacked was fetched
                assert num_local == len(prompt) // block_size * block_size
            assert num_fetched == num_blocks - num_local // block_size
        for engine in (prefill_engine, decode.engine):
            stats = engine.stats()
            assert stats.num_free_blocks == stats.num_total_blocks and not engine.scheduler.held
    finally:
        decode.shutdown()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=3.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=1.5, seed=5, presence_penalty=1.5, frequency_penalty=0.5, max_tokens=MAX_TOKENS,
                   min_tokens=MAX_TOKENS, ignore_eos=True),
])
def test_recomputed_continuation_equals_unified(tiny_model_paths, params):
    """Decode's fallback when prefill's KV cannot be pulled: it recomputes the prompt and prefill's first
    token and goes on with the same tokens (seeded noise, penalties and limits as in one engine)."""
    path = tiny_model_paths["qwen2"]
    unified = LLM(model=path, num_kv_blocks=128).generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    prefill_engine = LLMEngine(build_engine_config(path, num_kv_blocks=64), detokenize=False)
    decode = AsyncLLM(LLMEngine(build_engine_config(path, num_kv_blocks=64), detokenize=False))

    async def run_one(i, prompt):
        first, _ = prefill(prefill_engine, f"r{i}", prompt, params)
        assert prefill_engine.release_kv(f"r{i}")
        request = await decode.make_request({"prompt_token_ids": prompt},
                                      replace(params, output_kind=RequestOutputKind.DELTA), f"r{i}")
        tokens = [first]
        async for out in decode.generate_recomputed(request, first):
            tokens += out.outputs[0].token_ids
        return tokens

    async def main():
        return await asyncio.gather(*(run_one(i, p) for i, p in enumerate(PROMPTS)))

    try:
        for tokens, ref in zip(asyncio.run(main()), unified):
            assert tokens == ref.outputs[0].token_ids
        stats = decode.engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        decode.shutdown()


def test_abort_while_kv_in_flight_frees_reserved_blocks(tiny_model_paths):
    path = tiny_model_paths["llama"]
    decode = AsyncLLM(LLMEngine(build_engine_config(path, num_kv_blocks=32), detokenize=False))

    async def failing_fill(reservation):
        assert reservation.block_ids
        raise ConnectionError("peer went away")

    async def main():
        request = await decode.make_request({"prompt_token_ids": list(range(100, 150))}, SamplingParams(max_tokens=4), "x")
        with pytest.raises(ConnectionError):
            async for _ in decode.generate_prefilled(request, 7, failing_fill):
                pass
        for _ in range(50):
            stats = await decode.call(lambda e: e.stats())
            if stats.num_free_blocks == stats.num_total_blocks:
                return stats
            await asyncio.sleep(0.01)
        return stats

    try:
        stats = asyncio.run(main())
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        decode.shutdown()


def test_first_token_that_stops_ends_the_request_at_once(tiny_model_paths):
    path = tiny_model_paths["llama"]
    decode = AsyncLLM(LLMEngine(build_engine_config(path, num_kv_blocks=32), detokenize=False))

    async def fill(reservation):
        pass

    async def main():
        request = await decode.make_request({"prompt_token_ids": [300, 301, 302]},
                                      SamplingParams(max_tokens=8, stop_token_ids=[9]), "s")
        return [out async for out in decode.generate_prefilled(request, 9, fill)]

    try:
        outs = asyncio.run(main())
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
        assert decode.engine.stats().num_free_blocks == 32
    finally:
        decode.shutdown()


def hogged_decode(path):
    """A decode engine of 8 blocks, 7 of them held by a finished request kept for a peer ("hog")."""
    decode = AsyncLLM(LLMEngine(build_engine_config(path, num_kv_blocks=8), detokenize=False))
    attempts = []
    reserve = decode.engine.reserve_remote_kv
    decode.engine.reserve_remote_kv = lambda request: attempts.append(request.request_id) or reserve(request)

    async def hog():
        request = await decode.make_request({"prompt_token_ids": list(range(100, 200))}, SamplingParams(max_tokens=1),
                                      "hog", hold_kv=True)
        async for _ in decode.generate(request):
            pass
        assert (await decode.call(lambda e: e.stats())).num_free_blocks == 1

    return decode, attempts, hog


def test_a_reservation_waits_for_room_and_takes_it_when_blocks_free(tiny_model_paths):
    """The engine says when blocks free up: the reservation is tried when asked and again then, not polled."""
    decode, attempts, hog = hogged_decode(tiny_model_paths["llama"])
    filled = asyncio.Event()

    async def fill(reservation):
        assert len(reservation.block_ids) == 3
        filled.set()

    async def main():
        await hog()
        request = await decode.make_request({"prompt_token_ids": list(range(300, 340))}, SamplingParams(max_tokens=3), "b")
        task = asyncio.create_task(collect(decode.generate_prefilled(request, 7, fill, wait_timeout=30)))
        await asyncio.sleep(0.5)
        assert not filled.is_set() and attempts == ["b"]
        assert await decode.call(lambda e: e.release_kv("hog"))
        outs = await asyncio.wait_for(task, 30)
        assert outs[-1].finished
        return await decode.call(lambda e: e.stats())

    try:
        stats = asyncio.run(main())
        assert attempts == ["b", "b"] and stats.num_free_blocks == stats.num_total_blocks
    finally:
        decode.shutdown()


async def collect(outputs):
    return [out async for out in outputs]


def test_a_reservation_that_times_out_takes_no_blocks_later(tiny_model_paths):
    decode, attempts, hog = hogged_decode(tiny_model_paths["llama"])

    async def fill(reservation):
        raise AssertionError("no room was expected")

    async def main():
        await hog()
        request = await decode.make_request({"prompt_token_ids": list(range(300, 340))}, SamplingParams(max_tokens=3), "b")
        with pytest.raises(TimeoutError, match="no KV blocks free"):
            async for _ in decode.generate_prefilled(request, 7, fill, wait_timeout=0.3):
                pass
        assert await decode.call(lambda e: e.release_kv("hog"))
        return await decode.call(lambda e: (e.stats(), dict(e.scheduler.requests)))

    try:
        stats, requests = asyncio.run(main())
        assert stats.num_free_blocks == stats.num_total_blocks and not requests and attempts == ["b"]
    finally:
        decode.shutdown()
