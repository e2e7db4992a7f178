"""Prefill on one engine, decode on another, through the engine's KV door (kv_connector.py): a connector
copies the blocks prefill holds into decode's cache, on a thread of its own as a transport would. The
tokens equal those of one engine doing both - when the load works, when it fails and decode recomputes,
with seeded sampling, penalties and prefix hits - and every block comes back to both pools. The services'
own connector (PeerKVConnector) pulls over the real transport when what arrives is corrupted."""
import asyncio
import time
from dataclasses import replace

import pytest
import torch

from epdserve import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from epdserve.services.host.engine_worker import kv_layout
from epdserve.services.host.peer_kv_connector import PeerKVConnector, PeerSources
from epdserve.services.host.request_spans import RequestSpans
from epdserve.services.host.service_metrics import ServiceMetrics
from epdserve.shared.engine.llm import build_engine_config
from epdserve.shared.engine.llm_engine import LLMEngine
from epdserve.transport import transports
from epdserve.transport.kv.server import KVTransferServer
from epdserve.transport.channel.protocol import KVHandle

PROMPTS = [list(range(200, 200 + n)) for n in (1, 15, 16, 17, 40, 70)]
MAX_TOKENS = 12


def engines(path, decode_blocks=64, kv_cache_dtype="auto"):
    prefill_engine = LLMEngine(build_engine_config(path, num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype),
                               detokenize=False)
    decode = AsyncLLM.from_config(build_engine_config(path, num_kv_blocks=decode_blocks, kv_cache_dtype=kv_cache_dtype),
                                  detokenize=False)
    return prefill_engine, decode


async def decoded(decode: AsyncLLM, prefill_engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
                  firsts: list[int], held: list[int]) -> list[list[int]]:
    """Each sequence's tokens: prefill's first, then decode's."""
    request = await decode.make_request({"prompt_token_ids": prompt}, replace(params, output_kind=RequestOutputKind.DELTA),
                                        rid, peer_token_ids=[[t] for t in firsts],
                                        kv_transfer_params=(prefill_engine.runner.kv_cache, held, len(prompt)))
    tokens = [[t] for t in firsts]
    async for out in decode.generate(request):
        for completion in out.outputs:
            tokens[completion.index] += completion.token_ids
    return tokens


async def all_blocks_back(decode: AsyncLLM) -> bool:
    for _ in range(200):
        stats = decode.stats()
        if stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0:
            return True
        await asyncio.sleep(0.01)
    return False


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.mark.parametrize("decode_has_prefix, fail, params, kv_cache_dtype", [
    (False, False, GREEDY, "auto"),
    (True, False, GREEDY, "auto"),
    # Seeded sampling continues where prefill's draw left off: the same tokens as one engine.
    (False, False, SamplingParams(temperature=3.0, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True), "auto"),
    # The load fails: decode recomputes the prompt and prefill's first token, and goes on exactly as one
    # engine would (seeded noise, penalties and limits included).
    (False, True, GREEDY, "auto"),
    (False, True, SamplingParams(temperature=1.5, seed=5, presence_penalty=1.5, frequency_penalty=0.5,
                                 max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True), "auto"),
    # An FP8 pool's blocks move as stored: the same tokens as one engine with an FP8 pool; an int8 pool's with
    # their scales, and a recompute stores the rows the prefill stored.
    (True, False, GREEDY, "fp8"),
    (True, False, GREEDY, "int8"),
    (False, True, GREEDY, "int8"),
], ids=["pulled", "pulled-after-prefix-hits", "pulled-seeded", "recomputed", "recomputed-seeded-penalties",
        "pulled-after-prefix-hits-fp8-kv", "pulled-after-prefix-hits-int8-kv", "recomputed-int8-kv"])
def test_prefill_then_decode_equals_unified(tiny_model_paths, copy_connector, prefill_held, decode_has_prefix, fail,
                                           params, kv_cache_dtype):
    path = tiny_model_paths["qwen2"]
    unified = LLM(model=path, num_kv_blocks=128, kv_cache_dtype=kv_cache_dtype).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], params)
    prefill_engine, decode = engines(path, kv_cache_dtype=kv_cache_dtype)
    assert decode.kv_cache.dtype == prefill_engine.runner.kv_cache.dtype == {
        "fp8": torch.float8_e4m3fn, "int8": torch.int8}.get(kv_cache_dtype, torch.float32)
    connector = copy_connector(decode.kv_cache, fail=fail)
    decode.add_connector(connector)
    block_size = prefill_engine.config.cache.block_size

    async def main():
        if decode_has_prefix:  # decode computed the longest prompt before: its full blocks are local hits
            async for _ in decode.generate({"prompt_token_ids": PROMPTS[-1]}, SamplingParams(max_tokens=1)):
                pass
        runs = []
        for i, prompt in enumerate(PROMPTS):
            firsts, held = prefill_held(prefill_engine, f"r{i}", prompt, params)
            runs.append(decoded(decode, prefill_engine, f"r{i}", prompt, params, firsts, held))
        results = await asyncio.gather(*runs)
        assert await all_blocks_back(decode)
        return results

    try:
        results = asyncio.run(main())
        for tokens, ref in zip(results, unified):
            assert tokens[0] == ref.outputs[0].token_ids
        loaded = {load.request_id: load for load in connector.loads}
        for i, prompt in enumerate(PROMPTS):
            assert prefill_engine.release_kv(f"r{i}")
            local = len(prompt) // block_size * block_size if decode_has_prefix else 0
            if local == len(prompt):  # decode's own cache held it all: nothing to load
                assert f"r{i}" not in loaded
                continue
            load = loaded[f"r{i}"]  # only what decode lacked was loaded (the prompts share their heads)
            assert load.first_block * block_size >= local and load.num_tokens == len(prompt)
            assert len(load.block_ids) == -(-len(prompt) // block_size) - load.first_block
        assert sorted(connector.ended) == sorted(f"r{i}" for i in range(len(PROMPTS)))
        stats = prefill_engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks and not prefill_engine.scheduler.held
        # Each prompt was looked up in a prefix cache - and counted - by the engine that prefilled it, once:
        # decode, pulling or recomputing it, counts none of them (only the prompt it prefilled itself).
        assert stats.prefix_cache_queries == sum(map(len, PROMPTS))
        assert decode.stats().prefix_cache_queries == (len(PROMPTS[-1]) if decode_has_prefix else 0)
    finally:
        decode.shutdown()


def test_a_request_waits_for_room_seatless_and_loads_when_blocks_free(tiny_model_paths, copy_connector, prefill_held,
                                                                      keep):
    """8 blocks, 7 held by a finished request kept for a peer: the next request's load waits in the queue
    (asking again as blocks free up, never spinning) and starts once the hog lets go."""
    path = tiny_model_paths["llama"]
    prefill_engine, decode = engines(path, decode_blocks=8)
    connector = copy_connector(decode.kv_cache)
    decode.add_connector(connector)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = list(range(300, 340))

    async def main():
        hog = await decode.make_request({"prompt_token_ids": list(range(100, 200))}, SamplingParams(max_tokens=1),
                                        "hog", kv_transfer_params=keep)
        async for _ in decode.generate(hog):
            pass
        firsts, held = prefill_held(prefill_engine, "b", prompt, params)
        task = asyncio.create_task(decoded(decode, prefill_engine, "b", prompt, params, firsts, held))
        await asyncio.sleep(0.5)
        assert not connector.loads and decode.stats().num_waiting == 1
        decode.release_kv("hog")
        tokens = await asyncio.wait_for(task, 30)
        assert await all_blocks_back(decode)
        return tokens

    try:
        tokens = asyncio.run(main())
        ref = LLM(model=path, num_kv_blocks=32).generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
        assert tokens[0] == ref and len(connector.loads) == 1
    finally:
        decode.shutdown()


def test_aborted_while_its_kv_is_written_frees_the_blocks_only_once_the_load_ends(tiny_model_paths, copy_connector,
                                                                                 prefill_held):
    path = tiny_model_paths["llama"]
    prefill_engine, decode = engines(path, decode_blocks=32)
    connector = copy_connector(decode.kv_cache, delay=0.5)
    decode.add_connector(connector)
    params = SamplingParams(max_tokens=4)
    prompt = list(range(100, 150))

    async def main():
        firsts, held = prefill_held(prefill_engine, "x", prompt, params)
        task = asyncio.create_task(decoded(decode, prefill_engine, "x", prompt, params, firsts, held))
        while not connector.loads:
            await asyncio.sleep(0.01)
        task.cancel()  # the client went away mid-load
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.1)
        stats = decode.stats()
        assert stats.num_free_blocks < stats.num_total_blocks  # still being written: not reused yet
        assert await all_blocks_back(decode)

    try:
        asyncio.run(main())
        assert connector.ended == ["x"]
    finally:
        decode.shutdown()


def test_a_first_token_that_stops_ends_the_request_at_once(tiny_model_paths):
    decode = AsyncLLM.from_config(build_engine_config(tiny_model_paths["llama"], num_kv_blocks=32), detokenize=False)

    async def main():
        request = await decode.make_request({"prompt_token_ids": [300, 301, 302]},
                                            SamplingParams(max_tokens=8, stop_token_ids=[9], output_kind=RequestOutputKind.DELTA),
                                            "s", peer_token_ids=[[9]])
        return [out async for out in decode.generate(request)]

    try:
        outs = asyncio.run(main())
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "stop"
        assert outs[-1].outputs[0].token_ids == []  # the token itself went out with prefill's answer
        assert decode.stats().num_free_blocks == 32
    finally:
        decode.shutdown()


@pytest.mark.parametrize("faults, stale, failure", [(1, False, None), (2, False, "integrity"), (0, True, "stale_handle")],
                         ids=["fetched-again", "recomputed", "stale-handle-recomputed"])
def test_kv_that_lands_corrupted_is_fetched_again_then_recomputed(tiny_model_paths, prefill_held, corrupting_frames,
                                                                  faults, stale, failure):
    """Decode pulls prefill's blocks with the services' connector and the real KV transfer client, from a server
    whose first `faults` replies have a bit flipped after it took their checksums: one corruption is caught
    and the pull made again; a second makes decode recompute the prompt. A handle whose blocks prefill
    exposed anew since (`stale`) is refused, and decode recomputes too. Each mismatch is counted, and every
    way decode's tokens equal one engine's."""
    path = tiny_model_paths["qwen2"]
    params = SamplingParams(temperature=1.5, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = PROMPTS[4]
    want = LLM(model=path, num_kv_blocks=128).generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    prefill_engine, decode = engines(path)
    layout = kv_layout(prefill_engine.config)
    metrics = ServiceMetrics("decode", "decode-0", "tiny")

    async def main():
        firsts, held = prefill_held(prefill_engine, "r", prompt, params)
        server = KVTransferServer("prefill-0", [corrupting_frames(faults)], kv_cache=prefill_engine.runner.kv_cache,
                                  layout=layout)
        client = transports.create_client("zmq", "decode-0", kv_cache=decode.kv_cache, layout=layout)
        connector = PeerKVConnector(client, metrics, asyncio.get_running_loop(), 30.0,
                                    prefill_engine.config.model.dtype, {"timeout": 5.0})
        decode.add_connector(connector)
        try:
            await server.start()
            generation = server.expose("r", held)
            if stale:  # released, and exposed again under a new generation
                server.withdraw("r")
                assert server.expose("r", held) != generation
            handle = KVHandle("prefill-0", server.address, tuple(held), generation, len(prompt), time.time() + 60)
            sources = PeerSources(RequestSpans("decode-0"), kv_handle=handle)
            request = await decode.make_request({"prompt_token_ids": prompt},
                                                replace(params, output_kind=RequestOutputKind.DELTA), "r",
                                                peer_token_ids=[[t] for t in firsts], kv_transfer_params=sources)
            tokens = list(firsts)
            async for out in decode.generate(request):
                tokens += out.outputs[0].token_ids
            assert await all_blocks_back(decode)
            return tokens, sources
        finally:
            await connector.close()
            await client.close()
            await server.close()

    try:
        tokens, sources = asyncio.run(main())
        assert tokens == want
        spans = [span.name for span in sources.spans.take()]
        if failure is None:
            assert sources.kv_ready is not None and sources.failed is None and "kv.transfer" in spans
        else:
            assert sources.kv_ready is None and sources.failed[1] == failure and "kv.transfer:failed" in spans
        count = metrics.registry.get_sample_value
        assert count("epdserve:transfer_integrity_failures_total", {**metrics.labels, "kind": "kv"}) == faults
        assert count("epdserve:transfer_integrity_failures_total", {**metrics.labels, "kind": "embeddings"}) == 0
        assert count("epdserve:kv_transfer_failures_total", metrics.labels) == (failure is not None)
        assert prefill_engine.release_kv("r")
    finally:
        decode.shutdown()


@pytest.mark.parametrize("kv_cache_dtype, stored", [("auto", "float32"), ("bfloat16", "bfloat16"),
                                                    ("fp8", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2"),
                                                    ("int8", "int8")])
def test_the_kv_layout_peers_compare_names_what_the_pool_stores(tiny_model_paths, kv_cache_dtype, stored):
    """A prefill and a decode whose pools store different dtypes refuse each other before any block moves
    (test_kv_transfer.py): what they compare is the pool's dtype, not the model's."""
    config = build_engine_config(tiny_model_paths["qwen2"], kv_cache_dtype=kv_cache_dtype)
    assert kv_layout(config).dtype == config.kv_dtype_name == stored
    # The rows peers move: an int8 pool's carry their scale.
    assert kv_layout(config).head_size == config.model.head_size + (2 if stored == "int8" else 0)
