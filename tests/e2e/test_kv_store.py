"""A shared KV store on a real 1 prefill + 2 decode stack: a conversation evicted from every engine's pool
comes back from the store with the very tokens it had (its restored tokens cached ones, in its usage and in
the prefix-cache hit series); a killed store costs recomputation, not requests."""
import sys
import time

import httpx
import openai
import pytest

from epdserve.services.cli.launcher import free_port
from tests.e2e.conftest import Service
from tests.e2e.kv_eviction import cached_counts, complete, completion, push_out, token_ids, total

BLOCK_SIZE = 16


def conversation(i: int, num_blocks: int = 18) -> list[int]:
    return [(11 + i * 173 + t * 19) % 1900 + 3 for t in range(num_blocks * BLOCK_SIZE)]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    port, http_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    argv = [sys.executable, "-m", "epdserve.services.cli", "--log-level", "INFO", "serve", "kvstore",
            "--port", str(port), "--http-port", str(http_port), "--engine-id", "kvstore-0", "--kv-store-size", "0.05"]
    service = Service("kvstore-0", "kvstore", argv, port, None, http_port,
                      tmp_path_factory.mktemp("kvstore") / "kvstore.log", "127.0.0.1")
    service.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{http_port}/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert service.alive, service.log.read_text()
        time.sleep(0.3)
    yield service
    service.stop()


@pytest.fixture(scope="module")
def stack(stack_factory, tiny_model_paths, store):
    engine_args = ["--num-kv-blocks", "40", "--block-size", str(BLOCK_SIZE), "--kv-store", f"127.0.0.1:{store.port}",
                   "--kv-store-timeout", "1.0"]
    # The proxy follows the store too: its blocks count for every instance when routing.
    return stack_factory(tiny_model_paths["llama"], prefills=1, decodes=2, engine_args=engine_args,
                         proxy_args=["--kv-store", f"127.0.0.1:{store.port}"])


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def test_an_evicted_conversation_comes_back_from_the_store_token_for_token(stack, client, store):
    first = complete(client, conversation(0))
    push_out(stack, client, conversation, 1)
    assert store.metrics()["epdserve:kv_store_blocks"] >= 18
    time.sleep(1.5)  # the engines follow the store's events every half second
    computed = total(stack, "epdserve:prompt_tokens_computed_total")
    hits = total(stack, "epdserve:kv_tier_hit_tokens_total")
    found, counted = cached_counts(stack)
    again = completion(client, conversation(0))
    assert token_ids(again) == first
    restored = total(stack, "epdserve:kv_tier_hit_tokens_total") - hits
    recomputed = total(stack, "epdserve:prompt_tokens_computed_total") - computed
    assert restored >= 17 * BLOCK_SIZE, restored
    assert recomputed <= BLOCK_SIZE, recomputed
    assert total(stack, "epdserve:kv_tier_failed_restores_total") == 0
    # What the store brought is cached: in the usage, in the engines' hit series and the proxy's, once.
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 17 * BLOCK_SIZE, cached
    assert tuple(now - then for now, then in zip(cached_counts(stack), (found, counted))) == (cached, cached)


def test_a_killed_store_costs_recomputation_not_requests(stack, client, store):
    again = complete(client, conversation(1))
    push_out(stack, client, conversation, 20)
    store.stop(sig=9)
    started = time.monotonic()
    hits = total(stack, "epdserve:kv_tier_hit_tokens_total")
    assert complete(client, conversation(1)) == again
    # Nothing came from a store that is gone: what no pool held was computed again.
    assert total(stack, "epdserve:kv_tier_hit_tokens_total") == hits
    assert complete(client, conversation(40))
    assert time.monotonic() - started < 30  # at most a store timeout or two, never a stall
    assert all(s.alive for s in stack.services.values())
