"""Graceful shutdown of real processes: a SIGTERMed decode finishes its streams while new requests go
elsewhere; a SIGTERMed proxy turns unready, refuses new requests and lets its streams finish - or, at the
end of a short grace, ends them with an error event and `data: [DONE]`; a decode killed outright, with no
other decode to continue its streams on, ends them with an error event and `[DONE]` within seconds, never a
hang; `epdserve up` drains its whole
stack when it is stopped; a service started with SIGINT ignored still stops on it.

Streams are read as raw server-sent events (httpx), so that `[DONE]` and error events are seen as sent;
requests that must be refused go through the official openai client."""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from epdserve.services.cli.launcher import free_port

ENGINE_ARGS = ["--num-kv-blocks", "384", "--drain-timeout", "120"]
STREAM_TIMEOUT = httpx.Timeout(180, connect=10)


class SSEStream:
    """One streamed completion read event by event: its payloads, whether `[DONE]` ended it, and when."""

    def __init__(self, url: str, prompt: str, max_tokens: int, model: str = "demo") -> None:
        self.url, self.prompt, self.max_tokens, self.model = url, prompt, max_tokens, model
        self.events: list[dict] = []
        self.done = False
        self.after_done: list[str] = []  # anything sent after [DONE] (nothing should be)
        self.status: int | None = None
        self.ended_at: float | None = None

    @property
    def num_chunks(self) -> int:
        return sum(1 for e in self.events if e.get("choices"))

    @property
    def errors(self) -> list[dict]:
        return [e["error"] for e in self.events if "error" in e]

    @property
    def text_tokens(self) -> int:
        usage = [e["usage"] for e in self.events if e.get("usage")]
        return usage[-1]["completion_tokens"] if usage else 0

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events for c in e.get("choices", []) if c.get("finish_reason")]

    async def run(self, client: httpx.AsyncClient) -> "SSEStream":
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", self.url + "/v1/completions", json=body) as response:
            self.status = response.status_code
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if self.done:
                    self.after_done.append(data)
                elif data == "[DONE]":
                    self.done = True
                else:
                    self.events.append(json.loads(data))
        self.ended_at = time.monotonic()
        return self


def running(service) -> float:
    return service.metrics().get("vllm:num_requests_running", 0.0)


async def wait_for(predicate, timeout: float, what: str, state=lambda: "") -> None:
    """Wait until `predicate()`; `state()` says where things stood if it never came."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}; {state()}"
        await asyncio.sleep(0.05)


def wait_exit(service, timeout: float) -> int:
    try:
        return service.proc.wait(timeout)
    except Exception:
        pytest.fail(f"{service.name} still running {timeout:.0f}s after it was told to stop")


def refused_while_draining(url: str) -> openai.APIStatusError:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="demo", prompt="Hello", max_tokens=3)
    return info.value


def test_a_sigtermed_decode_finishes_its_streams_while_new_requests_go_elsewhere(default_model_path, start_stack):
    stack = start_stack(default_model_path, prefills=1, decodes=2, engine_args=ENGINE_ARGS)
    draining, other = stack.services["decode-0"], stack.services["decode-1"]
    streams = [SSEStream(stack.url, f"Story {i}: once upon a time", 160) for i in range(3)]

    async def main():
        async with httpx.AsyncClient(timeout=STREAM_TIMEOUT) as client:
            tasks = [asyncio.create_task(s.run(client)) for s in streams]
            # Three streams over two decodes: decode-0 holds at least one, each has sent a few tokens.
            await wait_for(lambda: running(draining) >= 1 and min(s.num_chunks for s in streams) >= 3, 120,
                           "decode-0 streams", lambda: f"chunks {[s.num_chunks for s in streams]}, errors "
                           f"{[s.errors for s in streams]}, running {running(draining)} + {running(other)}")
            draining.proc.send_signal(signal.SIGTERM)
            await wait_for(lambda: httpx.get(f"http://127.0.0.1:{draining.http_port}/ready").status_code == 503, 10,
                           "decode-0 reports itself unready")
            assert httpx.get(f"http://127.0.0.1:{draining.http_port}/ready").json()["status"] == "draining"
            assert running(draining) >= 1, "decode-0 finished its streams before the test could look"
            # New work while decode-0 drains: answered by decode-1 once the proxy has seen the DRAINING status.
            before = other.metrics()["epdserve:remote_kv_requests_total"]
            await asyncio.sleep(1.0)  # two of the proxy's polls
            async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0) as c:
                for i in range(2):
                    answer = await c.completions.create(model="demo", prompt=f"Hello {i}", max_tokens=3)
                    assert answer.usage.completion_tokens == 3
            assert other.metrics()["epdserve:remote_kv_requests_total"] == before + 2
            return await asyncio.gather(*tasks)

    asyncio.run(main())
    for s in streams:
        assert s.status == 200 and not s.errors, s.errors
        assert s.done and not s.after_done
        assert s.text_tokens == 160 and s.finish_reasons == ["length"]
    assert wait_exit(draining, 30) == 0
    assert httpx.get(stack.url + "/ready").status_code == 200  # decode-1 still serves


def test_a_sigtermed_proxy_refuses_new_requests_and_finishes_its_streams(default_model_path, start_stack):
    stack = start_stack(default_model_path, unified=1, engine_args=ENGINE_ARGS, proxy_args=["--drain-timeout", "120"])
    proxy = stack.services["proxy"]
    stream = SSEStream(stack.url, "Tell me a long story about a lighthouse.", 200)

    async def main():
        async with httpx.AsyncClient(timeout=STREAM_TIMEOUT) as client:
            task = asyncio.create_task(stream.run(client))
            await wait_for(lambda: stream.num_chunks >= 3, 120, "the stream started")
            proxy.proc.send_signal(signal.SIGTERM)
            await wait_for(lambda: httpx.get(stack.url + "/ready").status_code == 503, 10, "/ready turned 503")
            assert httpx.get(stack.url + "/ready").json()["draining"] is True
            refusal = await asyncio.to_thread(refused_while_draining, stack.url)
            assert refusal.status_code == 503 and refusal.response.headers["connection"] == "close"
            assert refusal.response.json()["error"]["type"] == "ServiceUnavailableError"
            assert httpx.get(stack.url + "/health").status_code == 200  # alive: it is finishing work
            assert not stream.done, "the stream ended before the drain could be observed"
            return await task

    asyncio.run(main())
    assert stream.status == 200 and not stream.errors, stream.errors
    assert stream.done and stream.text_tokens == 200 and stream.finish_reasons == ["length"]
    # Nothing left in flight: the proxy exits at once, not at the end of its 120 s grace.
    assert wait_exit(proxy, 20) == 0


def test_streams_still_running_at_the_end_of_a_short_grace_get_an_error_event_and_done(default_model_path,
                                                                                        start_stack):
    stack = start_stack(default_model_path, unified=1, engine_args=ENGINE_ARGS, proxy_args=["--drain-timeout", "2"])
    proxy, engine = stack.services["proxy"], stack.services["unified-0"]
    stream = SSEStream(stack.url, "Count slowly from one to ten thousand.", 3000)
    whole: dict = {}

    def wait_whole_answer():
        r = httpx.post(stack.url + "/v1/completions", timeout=120, json={
            "model": "demo", "prompt": "Write a very long essay.", "max_tokens": 3000, "ignore_eos": True})
        whole.update(status=r.status_code, body=r.json())

    async def main():
        async with httpx.AsyncClient(timeout=STREAM_TIMEOUT) as client:
            task = asyncio.create_task(stream.run(client))
            unstreamed = asyncio.create_task(asyncio.to_thread(wait_whole_answer))
            await wait_for(lambda: stream.num_chunks >= 3 and running(engine) >= 2, 120, "both requests run")
            proxy.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.gather(task, unstreamed)
            return signalled

    signalled = asyncio.run(main())
    # Cut at the end of the grace (2 s), with the liveness check's and the write's slack - never the
    # 3000 tokens it asked for.
    assert stream.ended_at - signalled < 2 + 8
    assert stream.status == 200 and stream.num_chunks >= 3
    (error,) = stream.errors
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError" and "shutting down" in error["message"]
    assert stream.done and not stream.after_done, "an error event, then [DONE], then nothing"
    assert stream.text_tokens == 0 and not stream.finish_reasons
    assert whole["status"] == 503 and whole["body"]["error"]["type"] == "ServiceUnavailableError"
    assert wait_exit(proxy, 15) == 0
    # The engine was told: both requests were aborted there, not left to run their 3000 tokens.
    deadline = time.monotonic() + 15
    while running(engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running(engine) == 0


def test_a_killed_decode_ends_its_stream_with_an_error_event_and_done(default_model_path, start_stack):
    stack = start_stack(default_model_path, prefills=1, decodes=1, engine_args=ENGINE_ARGS)
    decode = stack.services["decode-0"]
    stream = SSEStream(stack.url, "Story: once upon a time", 400)

    async def main():
        async with httpx.AsyncClient(timeout=STREAM_TIMEOUT) as client:
            task = asyncio.create_task(stream.run(client))
            await wait_for(lambda: stream.num_chunks >= 5, 120, "the stream reached decode")
            decode.stop(signal.SIGKILL)
            killed = time.monotonic()
            await task
            return killed

    killed = asyncio.run(main())
    assert stream.ended_at - killed < 15, "the proxy noticed the dead decode within a few polls"
    (error,) = stream.errors
    assert "decode" in error["message"] and error["code"] == 502
    assert stream.done and not stream.after_done
    assert stream.num_chunks < 400


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    return state != "Z"  # a zombie has exited (its parent has not reaped it yet)


def test_epdserve_up_drains_its_whole_stack_when_stopped(default_model_path, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "up.log"
    up = subprocess.Popen([sys.executable, "-m", "epdserve.services.cli", "--log-level", "info", "up", "--model",
                           str(default_model_path), "--unified", "--port", str(port), "--drain-timeout", "300",
                           "--", "--num-kv-blocks", "384"], stdout=log.open("wb"), stderr=subprocess.STDOUT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    children: list[int] = []
    try:
        deadline = time.monotonic() + 600
        while True:
            children = children_of(up.pid) or children  # known from the start: stopped even if `up` dies
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert len(children) == 2  # the unified engine and the proxy
        stream = SSEStream(url, "Tell me a long story about a lighthouse.", 60, model=default_model_path.name)

        async def main():
            async with httpx.AsyncClient(timeout=STREAM_TIMEOUT) as client:
                task = asyncio.create_task(stream.run(client))
                await wait_for(lambda: stream.num_chunks >= 3, 120, "the stream started",
                               lambda: f"status {stream.status}, events {stream.events}")
                up.send_signal(signal.SIGTERM)
                await wait_for(lambda: httpx.get(url + "/ready").status_code == 503, 10, "the proxy drains")
                return await task

        asyncio.run(main())
        assert not stream.errors and stream.done and stream.text_tokens == 60, stream.errors
        assert up.wait(120) == 0, log.read_text()[-3000:]
        assert not [pid for pid in children if is_running(pid)], "every child stopped with the stack"
    finally:
        for pid in [up.pid, *children]:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
        up.wait()


def listens(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("role", ["decode", "proxy", "planner"])
def test_a_service_started_with_sigint_ignored_stops_on_it_from_the_instant_its_port_opens(role, tiny_model_paths):
    """As a script's background job is started (SIGINT ignored): Ctrl-C's signal must still stop each service - even
    the instant its HTTP port opens (uvicorn's own handlers, had they been installed, would stop that port alone and
    leave the service running)."""
    model, port = tiny_model_paths["llama"], free_port()
    args = {"decode": ["--model", model, "--port", str(free_port()), "--data-port", str(free_port()),
                       "--http-port", str(port), "--threads", "1"],
            "proxy": ["--model", model, "--port", str(port), "--decode", f"127.0.0.1:{free_port()}"],
            "planner": ["--proxy-url", f"http://127.0.0.1:{free_port()}", "--planner-bounds", "decode=1:2",
                        "--ttft-slo", "1", "--tpot-slo", "1", "--http-port", str(port)]}[role]
    proc = subprocess.Popen([sys.executable, "-m", "epdserve.services.cli", "serve", role, *args],
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not listens(port):
            assert proc.poll() is None and time.monotonic() < deadline, f"{role} never listened"
            time.sleep(0.001)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
