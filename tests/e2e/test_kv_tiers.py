"""KV tiers on a real 1 prefill + 2 decode stack: a conversation evicted from every engine's pool comes
back from their local offload tiers with the very tokens it had, its prompt mostly not recomputed."""
import openai
import pytest

BLOCK_SIZE = 16
ENGINE_ARGS = ["--num-kv-blocks", "40", "--block-size", str(BLOCK_SIZE), "--kv-offloading-size", "0.05"]


def conversation(i: int, num_blocks: int = 18) -> list[int]:
    return [(5 + i * 131 + t * 17) % 1900 + 3 for t in range(num_blocks * BLOCK_SIZE)]


def complete(client, prompt_ids: list[int], max_tokens: int = 8) -> list[int]:
    out = client.completions.create(model="demo", prompt=prompt_ids, max_tokens=max_tokens, temperature=0,
                                    logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def served(service) -> float:
    return service.metrics().get("epdserve:engine_requests_finished_total", 0.0)


def push_out(stack, client, first: int) -> int:
    """Other conversations, from `first` on, until every engine has served 3 of them: 3 x 18 blocks leave
    no block of an earlier conversation in a 40-block pool (the prefill serves them all). The next unused."""
    engines = [s for s in stack.services.values() if s.role in ("prefill", "decode")]
    before = {s.name: served(s) for s in engines}
    i = first
    while any(served(s) - before[s.name] < 3 for s in engines):
        assert i < first + 16, "the router never spread the conversations over both decodes"
        complete(client, conversation(i))
        i += 1
    return i


def total(stack, name: str) -> float:
    """`name` summed over the engines (each runs the one tier, `local`)."""
    return sum(s.metrics().get(name, 0.0) for s in stack.services.values() if s.role in ("prefill", "decode"))


@pytest.fixture(scope="module")
def stack(stack_factory, tiny_model_paths):
    return stack_factory(tiny_model_paths["llama"], prefills=1, decodes=2, engine_args=ENGINE_ARGS)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def test_an_evicted_conversation_comes_back_from_the_local_tiers_token_for_token(stack, client):
    first = complete(client, conversation(0))
    push_out(stack, client, 1)
    computed = total(stack, "epdserve:prompt_tokens_computed_total")
    hits = total(stack, "epdserve:kv_tier_hit_tokens_total")
    assert complete(client, conversation(0)) == first
    restored = total(stack, "epdserve:kv_tier_hit_tokens_total") - hits
    recomputed = total(stack, "epdserve:prompt_tokens_computed_total") - computed
    # The prompt's blocks but the last come back from a tier: a block's worth is computed at most.
    assert restored >= 17 * BLOCK_SIZE, restored
    assert recomputed <= BLOCK_SIZE, recomputed
    assert total(stack, "epdserve:kv_tier_failed_restores_total") == 0
