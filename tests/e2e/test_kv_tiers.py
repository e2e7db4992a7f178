"""KV tiers on a real 1 prefill + 2 decode stack: a conversation evicted from every engine's pool comes
back from their local offload tiers with the very tokens it had, its prompt mostly not recomputed - and its
restored tokens are cached ones, in its usage and in the prefix-cache hit series."""
import openai
import pytest

from tests.e2e.kv_eviction import cached_counts, complete, completion, push_out, token_ids, total

BLOCK_SIZE = 16
ENGINE_ARGS = ["--num-kv-blocks", "40", "--block-size", str(BLOCK_SIZE), "--kv-offloading-size", "0.05"]


def conversation(i: int, num_blocks: int = 18) -> list[int]:
    return [(5 + i * 131 + t * 17) % 1900 + 3 for t in range(num_blocks * BLOCK_SIZE)]


@pytest.fixture(scope="module")
def stack(stack_factory, tiny_model_paths):
    return stack_factory(tiny_model_paths["llama"], prefills=1, decodes=2, engine_args=ENGINE_ARGS)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def test_an_evicted_conversation_comes_back_from_the_local_tiers_token_for_token(stack, client):
    first = complete(client, conversation(0))
    push_out(stack, client, conversation, 1)
    computed = total(stack, "epdserve:prompt_tokens_computed_total")
    hits = total(stack, "epdserve:kv_tier_hit_tokens_total")
    found, counted = cached_counts(stack)
    again = completion(client, conversation(0))
    assert token_ids(again) == first
    restored = total(stack, "epdserve:kv_tier_hit_tokens_total") - hits
    recomputed = total(stack, "epdserve:prompt_tokens_computed_total") - computed
    # The prompt's blocks but the last come back from a tier: a block's worth is computed at most.
    assert restored >= 17 * BLOCK_SIZE, restored
    assert recomputed <= BLOCK_SIZE, recomputed
    assert total(stack, "epdserve:kv_tier_failed_restores_total") == 0
    # Restored tokens are cached ones: in the usage, and - counted once, by the engine that prefilled the
    # request - in the engines' prefix-cache and tier hits and the proxy's cached prompt tokens.
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 17 * BLOCK_SIZE, cached
    assert tuple(now - then for now, then in zip(cached_counts(stack), (found, counted))) == (cached, cached)
