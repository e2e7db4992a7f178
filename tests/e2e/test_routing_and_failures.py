"""1 encoder + 2 prefill + 2 decode: routing spreads requests, prefix affinity finds the cache, and a
decode killed with SIGKILL mid-stream fails only its own requests."""
import asyncio
import signal
import time

import httpx
import openai
import pytest

NUM_BLOCKS = 512
LEASE = 4.0
LONG_PREFIX = ("You are a careful assistant. Answer briefly and precisely. " * 12).strip()


@pytest.fixture(scope="module")
def stack(demo_model, stack_factory):
    return stack_factory(demo_model, encoders=1, prefills=2, decodes=2,
                         engine_args=["--num-kv-blocks", str(NUM_BLOCKS), "--lease-seconds", str(LEASE)],
                         proxy_args=["--rpc-timeout", "5"])


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def counter(stack, name: str, metric: str) -> float:
    return stack.services[name].metrics().get(metric, 0.0)


def test_requests_spread_over_instances(stack, client):
    before = {n: counter(stack, n, "epdserve:local_prefills_total") for n in ("prefill-0", "prefill-1")}
    before |= {n: counter(stack, n, "epdserve:remote_kv_requests_total") for n in ("decode-0", "decode-1")}
    for i in range(12):  # distinct prompts, cached nowhere: spread by the hash of their heads, and by load
        client.completions.create(model="demo", prompt=f"Topic number {i}: tell me about {i * 7} birds.",
                                  max_tokens=4, temperature=0)
    for name in ("prefill-0", "prefill-1"):
        assert counter(stack, name, "epdserve:local_prefills_total") > before[name], f"{name} got nothing"
    for name in ("decode-0", "decode-1"):
        assert counter(stack, name, "epdserve:remote_kv_requests_total") > before[name], f"{name} got nothing"


def test_shared_prefix_hits_the_prefix_cache(stack, client):
    # Found on a prefill, or - KV-aware routing - on the decode that holds it, which then prefills the rest.
    hits = lambda: sum(counter(stack, n, "epdserve:prefix_cache_hits_total")  # noqa: E731
                       for n in ("prefill-0", "prefill-1", "decode-0", "decode-1"))
    first = client.completions.create(model="demo", prompt=LONG_PREFIX + " What is 2+2?", max_tokens=4, temperature=0)
    before = hits()
    second = client.completions.create(model="demo", prompt=LONG_PREFIX + " What is 3+3?", max_tokens=4,
                                       temperature=0)
    assert hits() > before
    assert second.usage.prompt_tokens_details.cached_tokens >= 96  # most of the long prefix
    assert first.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens_details.cached_tokens


def test_image_urls_on_private_hosts_are_refused_by_default(stack, client):
    """Without --allow-private-image-urls the proxy fetches nothing from loopback or cloud metadata
    addresses on a client's behalf (the refusal comes before any connection is made)."""
    for url in (f"http://127.0.0.1:{stack.port}/health", "http://169.254.169.254/latest/meta-data/"):
        with pytest.raises(openai.BadRequestError, match="non-public address"):
            client.chat.completions.create(model="demo", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]}])


def test_decode_killed_mid_stream(stack, client):
    async def stream(c, i):
        text, error = "", None
        try:
            async for event in await c.completions.create(
                    model="demo", prompt=f"Story {i}: once upon a time", max_tokens=300, temperature=0,
                    stream=True, extra_body={"ignore_eos": True}):
                if event.choices:
                    text += event.choices[0].text
        except openai.APIError as exc:
            error = exc
        return text, error

    async def main():
        async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as c:
            tasks = [asyncio.create_task(stream(c, i)) for i in range(6)]
            # Both decodes busy (six streams arriving together are spread over them), then one dies.
            deadline = time.monotonic() + 60
            while min(counter(stack, n, "epdserve:num_requests_running") for n in ("decode-0", "decode-1")) < 1:
                assert time.monotonic() < deadline, "the streams did not reach both decodes"
                await asyncio.sleep(0.1)
            stack.services["decode-0"].stop(signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    failed = [err for _, err in results if err is not None]
    finished = [text for text, err in results if err is None]
    assert failed and finished, f"expected both outcomes, got {len(failed)} failures"
    for err in failed:
        assert "decode" in str(err) and "stopped answering" in str(err)
    # New requests go to the survivor.
    for _ in range(3):
        assert client.completions.create(model="demo", prompt="Hello", max_tokens=3).usage.completion_tokens == 3
    # Blocks prefill held for the dead decode's requests come back within the lease.
    deadline = time.monotonic() + LEASE + 10
    while time.monotonic() < deadline:
        free = [counter(stack, n, "epdserve:num_free_kv_blocks") for n in ("prefill-0", "prefill-1")]
        if free == [NUM_BLOCKS, NUM_BLOCKS]:
            break
        time.sleep(0.5)
    assert free == [NUM_BLOCKS, NUM_BLOCKS]
    assert httpx.get(stack.url + "/ready").status_code == 200
