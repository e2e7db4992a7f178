"""Ordinary traffic and unlucky operations never break a stack: clients that hang up, requests with
out-of-range values, a prefill killed mid-prefill, peers that claim another role, proxies that come and
go. Real stacks (tiny random model, small KV pools), real processes, real sockets."""
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from epdserve.services.cli.launcher import free_port
from epdserve.transport.channel import protocol as p
from epdserve.shared.engine.sampling_params import SamplingParams
from epdserve.services.host.wire import sampling_params_to_wire
from epdserve.transport.channel.common import ErrorReply
from epdserve.transport.channel.request_client import RequestClient
from tests.e2e.conftest import stack_auth

NUM_BLOCKS = 96
LEASE = 3.0
ENGINE_ARGS = ["--num-kv-blocks", str(NUM_BLOCKS), "--lease-seconds", str(LEASE), "--max-model-len", "512"]
PROMPT = "The lighthouse keeper walked up the stairs and"


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")



INBOX_PORT = free_port()


@pytest.fixture(scope="module")
def pd(tiny_model_paths, stack_factory):
    return stack_factory(tiny_model_paths["llama"], prefills=1, decodes=1, engine_args=ENGINE_ARGS,
                         proxy_args=["--rpc-timeout", "5", "--inbox-port", str(INBOX_PORT)])


@pytest.fixture(scope="module")
def pd2(tiny_model_paths, stack_factory):
    return stack_factory(tiny_model_paths["llama"], prefills=2, decodes=2, engine_args=ENGINE_ARGS,
                         proxy_args=["--rpc-timeout", "5"])


def greedy(stack, prompt: str = PROMPT, max_tokens: int = 12) -> list[str]:
    r = httpx.post(stack.url + "/v1/completions", timeout=60, json={
        "model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def engines(stack):
    return [s for s in stack.services.values() if s.role != "proxy"]


def every_block_back(stack) -> bool:
    for service in engines(stack):
        m = service.metrics()
        if m["epdserve:num_free_kv_blocks"] != NUM_BLOCKS or m["vllm:num_requests_running"] != 0:
            return False
    return True


def assert_healthy(stack):
    for service in stack.services.values():
        assert service.alive, f"{service.name} exited: " + stack.logs()
    for service in engines(stack):
        assert httpx.get(f"http://127.0.0.1:{service.http_port}/ready").json()["status"] == "ready"
    assert httpx.get(stack.url + "/ready").status_code == 200


async def hang_up_after_first_event(url: str, i: int) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", url + "/v1/chat/completions", json={
                "model": "demo", "messages": [{"role": "user", "content": f"Story {i}: once upon a time"}],
                "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    return


def proxy_metric(stack, name: str) -> float:
    return stack.services["proxy"].metrics().get(name, 0.0)


@pytest.mark.parametrize("name", ["pd", "pd2"])
def test_disconnect_storms_leave_the_stack_serving(request, name):
    stack = request.getfixturevalue(name)
    expected = greedy(stack)
    aborts = proxy_metric(stack, "epdserve:request_aborts_total")

    async def storm():
        await asyncio.gather(*(hang_up_after_first_event(stack.url, i) for i in range(40)))

    for _ in range(3):
        asyncio.run(storm())
    wait_until(lambda: every_block_back(stack), 30, "every block to return")
    assert_healthy(stack)
    assert greedy(stack) == expected
    # Each hang-up is counted (a few requests may finish before theirs is noticed).
    assert proxy_metric(stack, "epdserve:request_aborts_total") - aborts >= 100


POISON = [
    {"top_k": 9223372036854775808, "temperature": 1.0},
    {"stop_token_ids": [1000000000], "min_tokens": 2},
    {"seed": 1 << 64},
    {"top_k": 1 << 64},
    {"stop_token_ids": [1 << 64]},
    {"min_tokens": 100_000, "max_tokens": 10},
]


@pytest.mark.parametrize("poison", POISON)
def test_poison_parameters_are_a_400_and_the_stack_keeps_serving(pd, poison):
    expected = greedy(pd)
    r = httpx.post(pd.url + "/v1/completions", timeout=60,
                   json={"model": "demo", "prompt": PROMPT, "max_tokens": 4, **poison})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "BadRequestError"
    assert_healthy(pd)
    assert greedy(pd) == expected


def service_client(service, role=p.Role.PROXY) -> RequestClient:
    return RequestClient(f"tcp://127.0.0.1:{service.port}", engine_id="tester", role=role, timeout=10,
                         auth=stack_auth())


@pytest.mark.parametrize("params", [
    dict(top_k=1 << 63, temperature=1.0),
    dict(stop_token_ids=[10 ** 9], min_tokens=2, temperature=1.0),
])
def test_engines_refuse_poison_on_the_wire_too(pd, params):
    """The wire is an API as well: a request that skipped the proxy's checks is refused by the engine."""
    wire = p.WireSamplingParams(max_tokens=4, **{k: tuple(v) if isinstance(v, list) else v for k, v in params.items()})

    async def main():
        for name, message in (("prefill-0", p.PrefillRequest("poison-p", (1, 2, 3), wire)),
                              ("decode-0", p.GenerateRequest("poison-d", (1, 2, 3), wire, "tcp://127.0.0.1:9"))):
            async with service_client(pd.services[name]) as client:
                with pytest.raises(ErrorReply) as refused:
                    await client.request(message)
                assert refused.value.error.code == p.ErrorCode.BAD_REQUEST

    asyncio.run(main())
    assert_healthy(pd)
    greedy(pd)


def test_a_role_spoof_is_refused(pd):
    async def main():
        for name, message in (("decode-0", p.GenerateRequest("spoof", (1, 2), p.WireSamplingParams(),
                                                              "tcp://127.0.0.1:9")),
                              ("decode-0", p.Abort("spoof")),
                              ("prefill-0", p.PrefillRequest("spoof", (1, 2), p.WireSamplingParams())),
                              ("prefill-0", p.Abort("spoof"))):
            async with service_client(pd.services[name], p.Role.ENCODER) as client:
                with pytest.raises(ErrorReply, match="encoder peers may not send"):
                    await client.request(message)

    before = {n: pd.services[n].metrics()["epdserve:rejected_frames_total"] for n in ("decode-0", "prefill-0")}
    asyncio.run(main())
    for name, count in before.items():
        assert pd.services[name].metrics()["epdserve:rejected_frames_total"] == count + 2
    assert_healthy(pd)


def test_the_proxy_inbox_takes_tokens_from_engines_only(pd):
    """Anyone can dial the inbox; only an engine's role may push tokens into it (counted otherwise)."""
    from epdserve.transport.channel.request_client import PushChannel

    before = proxy_metric(pd, "epdserve:inbox_rejected_frames_total")

    async def main():
        async with PushChannel(f"tcp://127.0.0.1:{INBOX_PORT}", engine_id="x", role=p.Role.PROXY,
                               auth=stack_auth()) as push:
            for i in range(3):
                await push.send(p.TokenDelta(f"nobody-{i}", (1,)), timeout=5)

    asyncio.run(main())
    wait_until(lambda: proxy_metric(pd, "epdserve:inbox_rejected_frames_total") == before + 3, 10,
               "the inbox to count the frames")
    assert_healthy(pd)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_reply_addresses_from_the_wire_keep_fds_bounded(tiny_model_paths, start_stack):
    """300 requests, each asking for its tokens at a different (unreachable) address."""
    stack = start_stack(tiny_model_paths["llama"], prefills=1, decodes=1,
                          engine_args=[*ENGINE_ARGS, "--rpc-timeout", "2"])
    decode = stack.services["decode-0"]
    before = open_fds(decode.proc.pid)
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
    wire = sampling_params_to_wire(SamplingParams(temperature=0.0, max_tokens=1))
    peak = before

    async def main():
        nonlocal peak
        async with service_client(decode) as client:
            async def one(i):
                try:
                    await client.request(p.GenerateRequest(f"fd-{i}", (1, 2, 3), wire,
                                                           f"tcp://127.0.0.1:{(base + i) % 65535 + 1}"))
                except ErrorReply as exc:  # past the bound: refused, retryable
                    assert exc.error.code == p.ErrorCode.OVERLOADED and exc.error.retryable

            for batch in range(0, 300, 50):
                await asyncio.gather(*(one(i) for i in range(batch, batch + 50)))
                peak = max(peak, open_fds(decode.proc.pid))

    asyncio.run(main())
    # At most 64 channels (a few fds each) whatever the number of addresses; before, ~3 fds per address.
    assert peak - before < 64 * 4, (before, peak)
    wait_until(lambda: every_block_back(stack), 30, "every block to return")

    def served() -> bool:  # once the bogus streams gave up (2 s), the proxy's own channel has room again
        return httpx.post(stack.url + "/v1/completions", timeout=60,
                          json={"model": "demo", "prompt": PROMPT, "max_tokens": 2}).status_code == 200

    wait_until(served, 30, "the stack to serve again")


def test_a_killed_prefill_fails_its_waiting_streams_within_seconds(default_model_path, start_stack):
    """With the only prefill killed mid-prefill, every stream waiting on it ends (an error before any byte,
    since nothing reached it yet) within 10 s instead of hanging. (Every prompt waits on the prefill: none is
    shared with the decode, which would serve it - slowly - after the kill.)"""
    stack = start_stack(default_model_path, prefills=1, decodes=1,
                        engine_args=["--num-kv-blocks", "1024", "--max-num-batched-tokens", "128"],
                        proxy_args=["--max-prefill-queue-tokens", "0"])
    prompt = "Describe the sea. " * 120  # ~600 tokens, prefilled 128 at a time, 16 of them queued
    ended: list[float] = []

    async def one(client, i):
        try:
            async with client.stream("POST", stack.url + "/v1/completions", json={
                    "model": "demo", "prompt": f"{i} {prompt}", "max_tokens": 8, "stream": True}) as r:
                async for _ in r.aiter_lines():
                    pass
        except httpx.HTTPError:
            pass
        ended.append(time.monotonic())

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            streams = [asyncio.create_task(one(client, i)) for i in range(16)]
            prefill = stack.services["prefill-0"]
            await asyncio.to_thread(wait_until, lambda: prefill.metrics()["vllm:num_requests_running"] > 0, 60,
                                    "prefill to be busy")
            await asyncio.sleep(1.0)
            prefill.proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*streams), 60)
            return killed

    killed = asyncio.run(main())
    waiting = [t - killed for t in ended if t > killed]
    assert waiting, "no stream was still waiting when prefill died"
    assert max(waiting) < 10, f"streams ended {sorted(waiting)} s after the kill"
    assert stack.services["decode-0"].alive and stack.services["proxy"].alive


def test_up_refuses_a_port_in_use(tiny_model_paths):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "epdserve.services.cli", "up", "--model", tiny_model_paths["llama"],
                               "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"127.0.0.1:{port}" in done.stderr and "another server" in done.stderr


def test_proxy_ready_needs_every_configured_role(pd, tiny_model_paths, tmp_path):
    """A proxy whose encoder is unreachable is not ready (image requests would fail) and says which role: on
    /ready, and to API requests, which it does not serve until then; its log shows no URL meanwhile."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_encoder = s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "epdserve.services.cli", "serve", "proxy", "--model", tiny_model_paths["llama"],
            "--port", str(port), "--poll-interval", "0.2", "--encoder", f"127.0.0.1:{dead_encoder}",
            "--prefill", f"127.0.0.1:{pd.services['prefill-0'].port}",
            "--decode", f"127.0.0.1:{pd.services['decode-0'].port}"]
    proc = subprocess.Popen(args, stdout=(tmp_path / "proxy.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        def answer():
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2)
                return r if r.json()["healthy_instances"].get("decode") else None
            except httpx.HTTPError:
                return None

        r = wait_until(answer, 120, "the proxy to see its decode")
        assert r.status_code == 503 and r.json()["unavailable_roles"] == ["encoder"]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=Path(tiny_model_paths["llama"]).name, prompt="Hi", max_tokens=2)
        assert refused.value.status_code == 503
        assert "no encoder instance is ready yet" in refused.value.body["message"]
    finally:
        proc.terminate()
        proc.wait(15)
    log = (tmp_path / "proxy.log").read_text()
    assert "starting: the API answers 503" in log and "http://" not in log
