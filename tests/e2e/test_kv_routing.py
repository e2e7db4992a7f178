"""KV-aware routing on a real 1 prefill + 2 decode stack: a chat's next turn goes where its KV is.

The engines report what their prefix caches hold (KV events); the proxy's router indexes it. A follow-up
turn then goes to the decode that served the turn before, which pulls only the blocks it lacks; a
follow-up it holds all but a few tokens of is prefilled there, with no prefill and no transfer; a
burst that backs up the prefill is shared with the decodes; a decode that dies leaves the index.
"""
import concurrent.futures
import time

import httpx
import openai
import pytest
import torch
import transformers

BLOCK_SIZE = 16
PREFILL_QUEUE_TOKENS = 64
ENGINE_ARGS = ["--num-kv-blocks", "512", "--block-size", str(BLOCK_SIZE)]


def proxy_metrics(stack) -> dict[str, float]:
    """The proxy's samples by full name with labels (the router's series are per instance)."""
    out = {}
    for line in httpx.get(stack.url + "/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def routed(stack, path: str, reason: str) -> float:
    return sum(v for k, v in proxy_metrics(stack).items()
               if k.startswith("epdserve:routing_decisions_total") and f'path="{path}"' in k
               and f'reason="{reason}"' in k)


def indexed_blocks(stack) -> dict[str, float]:
    return {k.split('instance="')[1].split('"')[0]: v for k, v in proxy_metrics(stack).items()
            if k.startswith("epdserve:kv_index_blocks")}


def index_key(stack, service) -> str:
    """The router's name for a service: its control address."""
    return f"tcp://127.0.0.1:{service.port}"


def decodes(stack):
    return [s for s in stack.services.values() if s.role == "decode"]


def served(service) -> float:
    return service.metrics().get("epdserve:engine_requests_finished_total", 0.0)


def wait_for_index(stack, predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        blocks = indexed_blocks(stack)
        if predicate(blocks):
            return blocks
        time.sleep(0.3)
    raise AssertionError(f"the router's index never got there: {indexed_blocks(stack)}")


@pytest.fixture(scope="module")
def stack(stack_factory, tiny_model_paths):
    # Local prefill only for follow-ups missing at most 2 blocks, so the second turn below still
    # goes through prefill and shows what decode pulls.
    # A prefill queue of 64 prompt tokens sends prompts of at most 64 to decodes, which the burst below fills.
    return stack_factory(tiny_model_paths["llama"], prefills=1, decodes=2, engine_args=ENGINE_ARGS,
                         proxy_args=["--kv-local-prefill-tokens", str(2 * BLOCK_SIZE),
                                     "--max-prefill-queue-tokens", str(PREFILL_QUEUE_TOKENS)])


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def complete(client, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The reply's token ids (greedy, exactly max_tokens of them)."""
    out = client.completions.create(model="demo", prompt=prompt_ids, max_tokens=max_tokens, temperature=0,
                                    logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def test_a_follow_up_turn_goes_to_the_decode_holding_it_and_pulls_only_what_is_new(stack, client):
    turn1 = [(7 * i) % 300 + 5 for i in range(12 * BLOCK_SIZE)]
    before = {s.name: (served(s), s.metrics().get("epdserve:remote_kv_blocks_total", 0.0)) for s in decodes(stack)}
    reply = complete(client, turn1, 3 * BLOCK_SIZE)
    holder = next(s for s in decodes(stack) if served(s) > before[s.name][0])
    other = next(s for s in decodes(stack) if s is not holder)
    # The holder's events reach the index within a poll or two: the prompt and the reply's full blocks.
    wait_for_index(stack, lambda b: b.get(index_key(stack, holder), 0) >= 14)

    turn2 = turn1 + reply + [(11 * i) % 300 + 5 for i in range(5 * BLOCK_SIZE)]
    pulled_before = holder.metrics().get("epdserve:remote_kv_blocks_total", 0.0)
    complete(client, turn2, 8)
    assert served(holder) == before[holder.name][0] + 2 and served(other) == before[other.name][0]
    pulled = holder.metrics().get("epdserve:remote_kv_blocks_total", 0.0) - pulled_before
    # 15 of turn 2's 20 full blocks were on the decode already (12 of the prompt, 3 of the reply).
    assert pulled <= len(turn2) // BLOCK_SIZE - 15 + 1, pulled
    # Turn 2's blocks reach the index too (turn 1 held at most 15), so that the next test counts from a
    # settled index and not from one that these events still arrive at.
    wait_for_index(stack, lambda b: b.get(index_key(stack, holder), 0) >= len(turn2) // BLOCK_SIZE)


def test_a_follow_up_held_but_for_a_few_tokens_is_prefilled_by_that_decode(stack, client):
    turn1 = [(13 * i) % 300 + 5 for i in range(10 * BLOCK_SIZE)]
    served_before = {s.name: served(s) for s in decodes(stack)}
    indexed_before = indexed_blocks(stack)
    reply = complete(client, turn1, 2 * BLOCK_SIZE)
    holder = next(s for s in decodes(stack) if served(s) > served_before[s.name])
    key = index_key(stack, holder)
    # The index has the turn's 12 full blocks on that decode (prompt and reply) once its events arrive.
    wait_for_index(stack, lambda b: b.get(key, 0) >= indexed_before.get(key, 0) + 11)
    prefill = stack.services["prefill-0"]
    prefilled = served(prefill)
    local = routed(stack, "decode_only", "decode_holds_prefix")
    complete(client, turn1 + reply + [9, 8, 7, 6, 5], 4)
    assert routed(stack, "decode_only", "decode_holds_prefix") == local + 1
    assert served(prefill) == prefilled  # no prefill, no transfer


def test_a_burst_the_prefill_cannot_keep_up_with_is_shared_with_the_decodes_token_exact(
        stack, client, tiny_model_paths, hf_greedy, near_tie_check):
    prompts = [[(17 * i + 3 * j) % 300 + 5 for j in range(40)] for i in range(32)]
    local = routed(stack, "decode_only", "prefill_queue")
    disaggregated = routed(stack, "prefill_decode", "no_cached_prefix")

    def greedy(prompt):
        out = client.completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                        extra_body={"return_tokens_as_token_ids": True})
        return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(greedy, prompts))
    # Both paths served the burst: the first prompts queued at the prefill, later ones went to decodes once
    # it held PREFILL_QUEUE_TOKENS (the proxy decides as each arrives, from what it has sent).
    on_decodes = routed(stack, "decode_only", "prefill_queue") - local
    assert on_decodes >= 1 and routed(stack, "prefill_decode", "no_cached_prefix") - disaggregated >= 2
    # Every prompt's tokens left its instance's queue with its first token.
    queued = {k: v for k, v in proxy_metrics(stack).items() if k.startswith("epdserve:queued_prompt_tokens")}
    assert len(queued) == 3 and not any(queued.values()), queued
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_paths["llama"], torch_dtype=torch.float32)
    for i, (prompt, reply) in enumerate(zip(prompts, replies)):
        reference, logits = hf_greedy(model, prompt, 8)
        near_tie_check(f"burst prompt {i}", reply, reference, logits)


def test_a_dead_decode_leaves_the_index_and_a_restarted_one_is_indexed_afresh(stack, client):
    blocks = wait_for_index(stack, lambda b: len(b) == 3)  # the prefill and both decodes report
    victim = max(decodes(stack), key=lambda s: blocks.get(index_key(stack, s), 0))  # the earlier turns' holder
    victim_key = index_key(stack, victim)
    assert blocks[victim_key] > 0
    victim.stop(sig=9)
    wait_for_index(stack, lambda b: victim_key not in b)
    assert complete(client, [5, 6, 7, 8] * 8, 4)  # the other decode serves
    # Restarted on the same address, its events count from 1 again over an empty cache: the index takes
    # its snapshot, holding nothing of what the dead process had.
    victim.start()
    blocks = wait_for_index(stack, lambda b: victim_key in b, timeout=120)
    assert blocks[victim_key] == 0
