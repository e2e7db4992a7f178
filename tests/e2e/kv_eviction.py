"""Evicting a conversation from every engine's pool of a 1 prefill + 2 decode stack (40-block pools of
16-token blocks), for the KV tier and KV store tests."""
from typing import Callable


def completion(client, prompt_ids: list[int], max_tokens: int = 8):
    """The greedy completion of `prompt_ids`, its tokens as token ids."""
    return client.completions.create(model="demo", prompt=prompt_ids, max_tokens=max_tokens, temperature=0,
                                     logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})


def complete(client, prompt_ids: list[int], max_tokens: int = 8) -> list[int]:
    return token_ids(completion(client, prompt_ids, max_tokens))


def token_ids(out) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def served(service) -> float:
    return service.metrics().get("epdserve:engine_requests_finished_total", 0.0)


def push_out(stack, client, conversation: Callable[[int], list[int]], first: int) -> int:
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
    """`name` summed over the engines."""
    return sum(s.metrics().get(name, 0.0) for s in stack.services.values() if s.role in ("prefill", "decode"))


CACHED_SERIES = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")


def cached_counts(stack) -> tuple[float, float]:
    """(prompt tokens the engines found in their prefix caches or tiers, cached prompt tokens the proxy
    counted): a request's are the cached tokens of its usage, on both sides."""
    return sum(total(stack, name) for name in CACHED_SERIES), \
        stack.services["proxy"].metrics().get("vllm:prompt_tokens_cached_total", 0.0)
