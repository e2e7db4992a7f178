"""`docker compose up` of the real image: answers equal to local ones, scaling, a killed decode, a
drained proxy and decode, Prometheus. One stack for the whole file; the tests run in this order, and
the kill and the last stop take decodes away."""
from __future__ import annotations

import base64
import collections
import threading
from dataclasses import dataclass, field

import openai

DRAIN_TOKENS = 200


def greedy(references) -> dict:
    return dict(temperature=0, max_tokens=references.max_tokens, extra_body={"return_tokens_as_token_ids": True})


def ids_of(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def finished_requests(stack, container: str) -> collections.Counter:
    """Requests the engine in `container` finished, by finish reason, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = stack.http_get(container, "/metrics")
    assert status == 200, container
    counts = collections.Counter()
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == "epdserve:engine_requests_finished_total":
                counts[s.labels["finished_reason"]] += int(s.value)
    return counts


def running_requests(stack, container: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    status, body = stack.http_get(container, "/metrics")
    assert status == 200, container
    return sum(s.value for family in text_string_to_metric_families(body) for s in family.samples
               if s.name == "vllm:num_requests_running")


@dataclass
class Stream:
    """A streamed chat read on its own thread: the chunks' text, how it ended."""

    client: openai.OpenAI
    max_tokens: int
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: Exception | None = None
    started: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for event in self.client.chat.completions.create(
                    model="llava-demo", messages=[{"role": "user", "content": "Tell me a long story."}],
                    stream=True, temperature=0, max_tokens=self.max_tokens, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}):
                if event.choices:
                    self.text.append(event.choices[0].delta.content or "")
                    self.finish_reason = event.choices[0].finish_reason or self.finish_reason
                    if len(self.text) >= 10:
                        self.started.set()
                if event.usage:
                    self.completion_tokens = event.usage.completion_tokens
        except Exception as exc:  # noqa: BLE001 - kept and judged by the test
            self.error = exc
        finally:
            self.started.set()

    def join(self) -> None:
        # The client's read timeout (120 s) ends a hung stream with APITimeoutError.
        self.thread.join(300)
        assert not self.thread.is_alive(), "a stream neither finished nor failed"

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_reason == "length" and self.completion_tokens == self.max_tokens


def test_engines_run_the_cpp_kernels(stack):
    # The image has no compiler: each engine loads the C++ CPU kernels its build stage compiled.
    for container in stack.containers("prefill") + stack.containers("decode"):
        logs = stack.logs(container)
        assert "attention backend cpu" in logs, f"{container} is not on the C++ path:\n{logs[-3000:]}"
        assert logs.count("C++ CPU kernels: prebuilt for ") == 1, logs[-3000:]


def test_text_chat_equals_the_local_engine(client, references):
    reply = client.chat.completions.create(model="llava-demo", messages=references.text_messages, logprobs=True,
                                           **greedy(references))
    assert ids_of([c.token for c in reply.choices[0].logprobs.content]) == references.text_ids


def test_image_chat_equals_hf_transformers(client, references, near_tie_check):
    url = "data:image/png;base64," + base64.b64encode(references.picture_png()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": references.image_question}]}]
    reply = client.chat.completions.create(model="llava-demo", messages=messages, logprobs=True,
                                           **greedy(references))
    ours = ids_of([c.token for c in reply.choices[0].logprobs.content])
    near_tie_check("image chat", ours, references.image_ids, references.image_logits)
    assert reply.usage.prompt_tokens == references.image_prompt_tokens


def test_scaled_decodes_both_take_requests(stack, client):
    decodes = stack.containers("decode")
    assert len(decodes) == 2, decodes
    # A round where the proxy gave a decode up (it missed its polls or an answer's deadline on an overloaded
    # machine: the stream was aborted there and served by the other) says nothing of how requests are spread,
    # and is run again; a stream served to its end twice fails at once.
    for _ in range(3):
        before = {c: finished_requests(stack, c) for c in decodes}
        streams = [Stream(client, 24) for _ in range(4)]
        for stream in streams:
            stream.join()
            assert stream.completed, stream.error
        served = {c: finished_requests(stack, c) - before[c] for c in decodes}
        assert sum(counts["length"] for counts in served.values()) == len(streams), served
        if not any(counts["abort"] for counts in served.values()):
            break
    assert all(set(counts) == {"length"} for counts in served.values()), served


def test_prometheus_scrapes_every_service(stack):
    import time

    expected = {f"{stack.ip(c)}:9000" for c in stack.engine_containers()}
    expected |= {f"{stack.ip(c)}:8000" for c in stack.containers("proxy")}
    assert len(expected) == 5, expected  # encoder, prefill, 2 decodes, proxy
    deadline = time.monotonic() + 120  # DNS discovery refreshes and scrapes every 15 s
    while True:
        health = {t["labels"]["instance"]: t["health"] for t in stack.prometheus_targets()}
        if all(health.get(address) == "up" for address in expected):
            break
        assert time.monotonic() < deadline, f"targets {health}, expected all of {sorted(expected)} up"
        time.sleep(2)


def test_killing_a_decode_mid_stream_loses_no_stream(stack, client, docker_cli, references):
    decodes = stack.containers("decode")
    # Long enough to be mid-stream on both decodes when the kill lands.
    streams = [Stream(client, 300) for _ in range(4)]
    for stream in streams:
        assert stream.started.wait(120) and stream.error is None, stream.error
    running = {c: running_requests(stack, c) for c in decodes}
    victim = max(decodes, key=running.get)
    docker_cli("kill", victim)
    for stream in streams:
        stream.join()
    # Those on the killed decode continue on the other one from the tokens they had: every stream ends whole,
    # and all four (one greedy request) alike.
    assert running[victim] and all(s.completed for s in streams), \
        (running, [(s.error, s.finish_reason, s.completion_tokens) for s in streams])
    assert len({"".join(s.text) for s in streams}) == 1
    for _ in range(3):  # new requests go to the decode that is left
        reply = client.chat.completions.create(model="llava-demo", messages=references.text_messages,
                                               **greedy(references))
        assert reply.choices[0].finish_reason in ("stop", "length")


def test_compose_stop_drains_the_proxy_mid_stream(stack, client, docker_cli):
    (proxy,) = stack.containers("proxy")
    stream = Stream(client, DRAIN_TOKENS)
    assert stream.started.wait(120) and stream.error is None, stream.error
    chunks_before_stop = len(stream.text)
    stopped = stack.compose("stop", "proxy", check=False)  # returns once the proxy has exited
    stream.join()
    assert stopped.returncode == 0, stopped.stderr
    assert chunks_before_stop < DRAIN_TOKENS // 2, "the stop came too late to test a drain"
    assert stream.completed, (stream.error, stream.finish_reason, stream.completion_tokens, len(stream.text))
    state = docker_cli("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", proxy).stdout.split()
    assert state == ["exited", "0"], (state, stack.logs(proxy)[-2000:])
    stack.compose("start", "proxy")
    stack.wait_proxy_ready()


def test_compose_stop_drains_a_decode_mid_stream(stack, client, docker_cli):
    decodes = stack.containers("decode")
    stream = Stream(client, DRAIN_TOKENS)
    assert stream.started.wait(120) and stream.error is None, stream.error
    stopped = {}
    stopper = threading.Thread(target=lambda: stopped.update(done=stack.compose("stop", "decode", check=False)))
    chunks_before_stop = len(stream.text)
    stopper.start()
    stream.join()
    stopper.join(120)
    assert stopped["done"].returncode == 0, stopped["done"].stderr
    assert stream.completed, (stream.error, stream.finish_reason, stream.completion_tokens, len(stream.text))
    assert chunks_before_stop < DRAIN_TOKENS // 2, "the stop came too late to test a drain"
    for container in decodes:
        # Exited by itself once its stream was done, not killed at the end of compose's grace (137).
        state = docker_cli("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", container).stdout.split()
        assert state == ["exited", "0"], (container, state, stack.logs(container)[-2000:])
