"""1 encoder + 2 prefill + 2 decode: routing spreads requests, prefix affinity finds the cache, and streams
whose decode is lost mid-way (SIGKILL, or a drain past its grace) continue on the other decode, token for token."""
import asyncio
import signal
import time

import httpx
import openai
import pytest

from epdserve.services.cli.main import parse_args, proxy_config
from epdserve.services.proxy.server import build_proxy
from epdserve.transport.channel.common import ChannelError
from epdserve.transport.channel.protocol import DecodeRequest, Role, TokenDeltas

NUM_BLOCKS = 512
LEASE = 4.0
LONG_PREFIX = ("You are a careful assistant. Answer briefly and precisely. " * 12).strip()


@pytest.fixture(scope="module")
def stack(demo_model, stack_factory):
    return stack_factory(demo_model, encoders=1, prefills=2, decodes=2,
                         engine_args=["--num-kv-blocks", str(NUM_BLOCKS), "--lease-seconds", str(LEASE),
                                      "--drain-timeout", "1"],
                         proxy_args=["--rpc-timeout", "5"])


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def counter(stack, name: str, metric: str) -> float:
    return stack.services[name].metrics().get(metric, 0.0)


def test_requests_spread_over_instances(stack, client):
    before = {n: counter(stack, n, "epdserve:local_prefills_total") for n in ("prefill-0", "prefill-1")}
    before |= {n: counter(stack, n, "epdserve:remote_kv_requests_total") for n in ("decode-0", "decode-1")}
    def every_instance_got_some() -> bool:
        return all(counter(stack, n, "epdserve:local_prefills_total") > before[n] for n in ("prefill-0", "prefill-1")) \
            and all(counter(stack, n, "epdserve:remote_kv_requests_total") > before[n] for n in ("decode-0", "decode-1"))

    # Distinct prompts, cached nowhere: spread by the hash of their heads, and by load. On a busy host a status
    # poll may miss and leave an instance out for a moment: more requests, up to a bound, until each got some.
    for i in range(40):
        client.completions.create(model="demo", prompt=f"Topic number {i}: tell me about {i * 7} birds.",
                                  max_tokens=4, temperature=0)
        if i >= 11 and every_instance_got_some():
            break
    for name in ("prefill-0", "prefill-1"):
        assert counter(stack, name, "epdserve:local_prefills_total") > before[name], f"{name} got nothing"
    for name in ("decode-0", "decode-1"):
        assert counter(stack, name, "epdserve:remote_kv_requests_total") > before[name], f"{name} got nothing"


def test_shared_prefix_hits_the_prefix_cache(stack, client):
    # Found on a prefill, or - KV-aware routing - on the decode that holds it, which then prefills the rest.
    hits = lambda: sum(counter(stack, n, "vllm:prefix_cache_hits_total")  # noqa: E731
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


# Streams of every kind the proxy must continue exactly: greedy with logprobs, seeded sampling, a JSON schema's
# matcher, and n = 3 seeded sequences (each continued alone).
STREAMS = {
    "greedy": dict(prompt="Story 1: once upon a time", max_tokens=160, temperature=0, logprobs=1,
                   extra_body={"ignore_eos": True}),
    "seeded": dict(prompt="Story 2: in a land far away", max_tokens=160, temperature=1.0, seed=7,
                   extra_body={"ignore_eos": True}),
    "json": dict(prompt="Thirty fruits, as JSON:", max_tokens=160, temperature=0, extra_body={"structured_outputs": {
        "json": {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"},
                                                             "minItems": 30}}, "required": ["fruits"]}}}),
    "n3": dict(prompt="Story 3: the old lighthouse", max_tokens=160, temperature=1.0, seed=11, n=3,
               extra_body={"ignore_eos": True}),
}


def healthy(stack, role: str) -> int:
    return httpx.get(stack.url + "/ready", timeout=5).json()["healthy_instances"].get(role, 0)


def wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


async def stream_all(stack, requests: dict, ended: set | None = None, stalls: dict | None = None,
                     http_client: httpx.AsyncClient | None = None) -> dict:
    """name -> {choice index: (text, finish_reason)} for each request streamed at once (through the stack's
    proxy, or `http_client`'s); `ended` collects the names whose stream has ended, `stalls[name]` is its longest
    wait between two chunks (seconds)."""
    async def one(c, name, kwargs):
        choices: dict[int, list] = {}
        last = time.monotonic()
        async for event in await c.completions.create(model="demo", stream=True, **kwargs):
            now = time.monotonic()
            if stalls is not None:
                stalls[name] = max(stalls.get(name, 0.0), now - last)
            last = now
            for choice in event.choices:
                text, _ = choices.get(choice.index, ("", None))
                choices[choice.index] = [text + choice.text, choice.finish_reason]
        if ended is not None:
            ended.add(name)
        return {i: tuple(v) for i, v in choices.items()}

    async with openai.AsyncOpenAI(base_url=(str(http_client.base_url) if http_client else stack.url) + "/v1",
                                  api_key="unused", max_retries=0, timeout=300, http_client=http_client) as c:
        names = list(requests)
        results = await asyncio.gather(*(one(c, name, requests[name]) for name in names))
    return dict(zip(names, results))


async def lose_decode_mid_stream(stack, lose: str, keep: str, requests: dict, how,
                                 stalls: dict) -> tuple[dict, int]:
    """Stream `requests` on decode `lose` only (`keep` frozen while they are accepted), let them get going, then
    `how(service)` takes `lose` away; what each stream received (and in `stalls`, its longest silence), and how
    many were still running when it went."""
    ended: set[str] = set()
    stack.services[keep].proc.send_signal(signal.SIGSTOP)
    try:
        await asyncio.to_thread(wait_for, lambda: healthy(stack, "decode") == 1, f"{keep} still routed to")
        task = asyncio.create_task(stream_all(stack, requests, ended, stalls))
        # Every sequence decoding on `lose` (a stream's first token comes from prefill, before decode has it).
        sequences = sum(kwargs.get("n", 1) for kwargs in requests.values())
        while counter(stack, lose, "vllm:num_requests_running") < sequences:
            assert not task.done(), task.result()
            await asyncio.sleep(0.05)
    finally:
        stack.services[keep].proc.send_signal(signal.SIGCONT)
    await asyncio.to_thread(wait_for, lambda: healthy(stack, "decode") == 2, f"{keep} not routed to again")
    running = len(requests) - len(ended)
    assert running, "the streams ended before their decode was lost"
    how(stack.services[lose])
    return await task, running


@pytest.fixture(scope="module")
def expected(stack) -> dict:
    """What STREAMS answer without a fault."""
    return asyncio.run(stream_all(stack, STREAMS))


class LosingInbox:
    """Loses one message of token deltas on its way into a proxy's inbox, as a dropped connection loses the
    pushes in flight: of those that come from a decode, the `nth` that ends no sequence, or (`last`) the `nth`
    that ends one."""

    def __init__(self, inbox, nth: int, last: bool) -> None:
        self.nth, self.last, self.seen, self.lost = nth, last, 0, None
        self._enqueue = inbox._enqueue
        inbox._enqueue = self.enqueue  # before the inbox starts reading

    async def enqueue(self, message, peer) -> None:
        if isinstance(message, TokenDeltas) and all(d.offset for d in message.deltas) and \
                any(d.finish_reason is not None for d in message.deltas) == self.last:
            self.seen += 1
            if self.seen == self.nth:
                self.lost = message
                return
        await self._enqueue(message, peer)


async def through_a_second_proxy(stack, requests: dict, extra_args: list[str], tamper) -> tuple[dict, str]:
    """`requests` streamed through a second proxy, in this process, on the stack's services (`extra_args` added to
    the stack proxy's command line; `tamper(router, backend)` before it starts): what each received, and the
    proxy's metrics after."""
    argv = stack.services["proxy"].argv[3:]  # after `python -m epdserve.services.cli`
    config = proxy_config(parse_args([*argv, *extra_args]), stack.model)
    app, router, backend, _, tracer, _ = await build_proxy(config)
    tamper(router, backend)
    await backend.start()
    await router.start()
    try:
        deadline = time.monotonic() + 60
        while not router.readiness()[0]:
            assert time.monotonic() < deadline, "the second proxy never saw the stack's services ready"
            await asyncio.sleep(0.1)

        def http() -> httpx.AsyncClient:
            return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy")

        streams = await stream_all(stack, requests, http_client=http())  # closes its client
        async with http() as metrics:
            return streams, (await metrics.get("/metrics")).text
    finally:
        await router.close()
        await backend.close()
        tracer.shutdown()


@pytest.mark.parametrize("last", [False, True], ids=["a-middle-delta", "a-last-delta"])
def test_a_lost_delta_is_noticed_and_its_stream_continues(stack, expected, last):
    """Pushes are at most once: deltas that never reach the proxy leave a gap, which the next delta's offset
    shows - or, when a sequence's last delta is lost, a silence, after which the proxy asks the decode whether it
    still runs the request (HoldCheck) and hears it does not. Either way the proxy continues the stream from what
    it had delivered, and every stream ends exactly as without the loss. The second proxy loses them; its token
    timeout (60 s) would end a stream that waited for a lost end."""
    losing = []

    def lose(router, backend):
        losing.append(LosingInbox(backend.inbox, nth=1 if last else 40, last=last))

    streams, metrics = asyncio.run(through_a_second_proxy(stack, STREAMS, ["--token-timeout", "60"], lose))
    assert losing[0].lost is not None and any(d.token_ids for d in losing[0].lost.deltas)
    assert streams == expected
    assert 'epdserve:request_migrations_total{model_name="demo",reason="tokens_lost"}' in metrics


def drop_after_first_decode_request(router) -> list[str]:
    """Each decode's connection, as the second proxy sees it, drops right after the first DecodeRequest it
    delivers (accepted there, its answer lost), as a stall past the heartbeats drops every connection at once;
    the addresses it happened to, in order. Before the router starts: its decodes' clients are made then."""
    dropped: list[str] = []
    pool = router.pool(Role.DECODE)
    make_client = pool.make_client

    def dropping_client(address, role):
        client = make_client(address, role)
        send = client.request

        async def request(message, **kwargs):
            answer = await send(message, **kwargs)
            if isinstance(message, DecodeRequest) and address not in dropped:
                dropped.append(address)
                raise ChannelError(f"connection to {address} lost")
            return answer

        client.request = request
        return client

    pool.make_client = dropping_client
    return dropped


def test_a_call_on_connections_that_all_dropped_is_sent_again_once_they_are_back(stack, expected):
    """Every decode's connection drops while it accepts the stream (no decode is left to try): the proxy waits
    for one to answer its polls again, aborts the earlier attempt there and sends the request again - the stream
    ends exactly as without the drops, where it used to end with a 503."""
    dropped: list[list[str]] = []

    def drop(router, backend):
        dropped.append(drop_after_first_decode_request(router))

    streams, _ = asyncio.run(through_a_second_proxy(stack, {"greedy": STREAMS["greedy"]}, [], drop))
    assert len(dropped[0]) == 2, dropped  # both decodes dropped: the request was sent again to one of them
    assert streams == {"greedy": expected["greedy"]}


def test_streams_continue_on_another_decode_when_theirs_is_lost(stack, client, expected):
    """A decode SIGKILLed mid-stream, and one stopped whose drain grace runs out: every stream continues on the
    other decode from the tokens it had sent, and ends exactly as without the fault; nothing is left held."""
    proxy = stack.services["proxy"]
    migrations = proxy.metrics().get("epdserve:request_migrations_total", 0.0)

    stalls: dict[str, float] = {}
    killed, running = asyncio.run(lose_decode_mid_stream(stack, "decode-0", "decode-1", STREAMS,
                                                         lambda s: s.stop(signal.SIGKILL), stalls))
    assert killed == expected
    assert max(stalls.values()) < 30, stalls
    print(f"\ndecode SIGKILL: {len(killed)}/{len(STREAMS)} streams completed, identical; longest stall "
          f"{max(stalls.values()):.2f}s")
    assert proxy.metrics()["epdserve:request_migrations_total"] >= migrations + running
    stack.services["decode-0"].start()  # as a restart policy would: the stack heals
    wait_for(lambda: healthy(stack, "decode") == 2, "decode-0 did not come back", 120)

    # SIGTERM: decode-1 drains for its grace (--drain-timeout 1), then cuts its streams; they continue on decode-0.
    drained = {name: STREAMS[name] for name in ("greedy", "n3")}
    stalls.clear()
    cut, _ = asyncio.run(lose_decode_mid_stream(stack, "decode-1", "decode-0", drained,
                                                lambda s: s.proc.send_signal(signal.SIGTERM), stalls))
    assert cut == {name: expected[name] for name in drained}
    assert max(stalls.values()) < 30, stalls
    print(f"decode drained past its grace: {len(cut)}/{len(drained)} streams completed, identical; longest stall "
          f"{max(stalls.values()):.2f}s")
    stack.services["decode-1"].proc.wait(30)
    assert 'epdserve:request_migrations_total{model_name="demo",reason="drained"}' in \
        httpx.get(stack.url + "/metrics", timeout=5).text
    stack.services["decode-1"].start()
    wait_for(lambda: healthy(stack, "decode") == 2, "decode-1 did not come back", 120)

    # Every block comes back: prefill's leases released, the decodes' requests ended.
    def all_free() -> bool:
        return all(counter(stack, n, "epdserve:num_free_kv_blocks") == NUM_BLOCKS
                   for n in ("prefill-0", "prefill-1", "decode-0", "decode-1"))
    wait_for(all_free, "KV blocks still held", LEASE + 10)
    for _ in range(3):
        assert client.completions.create(model="demo", prompt="Hello", max_tokens=3).usage.completion_tokens == 3
