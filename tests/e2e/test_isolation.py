"""One request must never stall a loop others share or take an engine for itself. Each hostile request
runs beside a canary - a small request sent again and again - that must keep being answered while it runs;
each hostile request gets its own answer (a 400 naming what is wrong, a 503 with Retry-After, or its
tokens). Real stacks, real processes: SmolLM2 on one unified engine, and a tiny model on 1 prefill and 2
decodes for a decode killed mid-traffic. (Bad lines in `run-batch`: test_run_batch.py; the API key's
scheme and duplicate headers: tests/integration/test_proxy_http_edge.py; bodies over the edge's limits:
test_api_fuzz.py.)"""
import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

SEATS = 8
UNIFIED_ENGINE = ["--threads", "1", "--num-kv-blocks", "768", "--max-num-seqs", str(SEATS),
                  "--grammar-compile-timeout", "1", "--max-queue-wait", "2"]
# Raised so that the engine's own defences are what the tests meet, not the proxy's limits.
UNIFIED_PROXY = ["--max-logit-bias", "50000", "--max-structured-output-bytes", str(1 << 20)]


@pytest.fixture(scope="module")
def unified(default_model_path, stack_factory):
    return stack_factory(default_model_path, unified=1, engine_args=UNIFIED_ENGINE, proxy_args=UNIFIED_PROXY)


class Canary:
    """Sends `send(client)` again and again from its own thread; when each answer came and what it was."""

    def __init__(self, url: str, send) -> None:
        self.url, self.send = url, send
        self.answers: list[tuple[float, float, int]] = []  # (sent, answered, status)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "Canary":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)

    def _loop(self) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self._stop.is_set():
                sent = time.monotonic()
                status = self.send(client).status_code
                self.answers.append((sent, time.monotonic(), status))
                time.sleep(0.05)

    def answered_between(self, start: float, end: float) -> list[int]:
        """Statuses of the canaries sent and answered within [start, end]."""
        return [status for sent, answered, status in self.answers if start <= sent and answered <= end]


def small_completion(client: httpx.Client) -> httpx.Response:
    return client.post("/v1/completions", json={"model": "demo", "prompt": "Hello", "max_tokens": 4,
                                                "temperature": 0})


def list_models(client: httpx.Client) -> httpx.Response:
    return client.get("/v1/models")


def beside_a_canary(stack, send_canary, hostile):
    """(hostile()'s result, the canary statuses answered while it ran)."""
    with Canary(stack.url, send_canary) as canary:
        time.sleep(0.5)
        start = time.monotonic()
        result = hostile()
        end = time.monotonic()
    return result, canary.answered_between(start, end)


def huge_schema(num_properties: int) -> dict:
    names = [f"field_{i:05d}" for i in range(num_properties)]
    return {"type": "object", "properties": {n: {"type": "string"} for n in names}, "required": names}


def test_a_grammar_that_compiles_for_seconds_is_a_400_while_the_engine_serves_others(unified):
    def hostile():
        return httpx.post(unified.url + "/v1/chat/completions", timeout=120, json={
            "model": "demo", "messages": [{"role": "user", "content": "Fill the form."}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "form", "schema": huge_schema(9000)}}})

    r, canaries = beside_a_canary(unified, small_completion, hostile)
    assert r.status_code == 400 and "took longer than 1s to compile" in r.json()["error"]["message"], r.text
    assert canaries and set(canaries) == {200}  # answered while the compile ran, off the engine's loop


def test_a_vocabulary_wide_logit_bias_on_every_seat_is_served_beside_the_others(unified):
    def hostile():
        return httpx.post(unified.url + "/v1/completions", timeout=300, json={
            "model": "demo", "prompt": "Once upon a time", "n": SEATS, "max_tokens": 16,
            "logit_bias": {str(i): -100 for i in range(49_000)}})

    r, canaries = beside_a_canary(unified, small_completion, hostile)
    assert r.status_code == 200, r.text
    tokenizer = unified_tokenizer(unified)
    for choice in r.json()["choices"]:  # only the 152 ids left unbiased come out
        assert all(t >= 49_000 for t in tokenizer(choice["text"])), choice
    assert canaries and set(canaries) == {200}


def unified_tokenizer(stack):
    def ids(text: str) -> list[int]:
        return httpx.post(stack.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    return ids


def test_a_request_on_every_seat_makes_room_for_the_next_at_once(unified):
    """n = 8 long sequences on an 8-seat engine: a 4-token request sent meanwhile is answered while they
    still run (the group parks some sequences until it is done). Were it to wait for them instead, it would be
    refused after --max-queue-wait (2 s): the group's 200 steps of 8 sequences take longer than that on any CPU."""
    with httpx.stream("POST", unified.url + "/v1/completions", timeout=300, json={
            "model": "demo", "prompt": "Once upon a time", "n": SEATS, "max_tokens": 200, "ignore_eos": True,
            "stream": True}) as hog:
        events = hog.iter_lines()
        for _ in range(2 * SEATS):  # every sequence is decoding
            next(events)
        r = small_completion(httpx.Client(base_url=unified.url, timeout=120))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        finished = [json.loads(line[6:]) for line in events if line.startswith("data: {")]
    # ... and the group still gets all its tokens.
    assert sum(1 for e in finished if e["choices"][0]["finish_reason"] == "length") == SEATS


def test_a_grammar_that_leaves_no_token_mid_way_ends_as_the_requests_own_error(unified):
    body = {"model": "demo", "prompt": "Say a", "max_tokens": 8, "temperature": 0,
            "structured_outputs": {"grammar": r'root ::= "a" [^\x00-\U0010FFFF]'}}
    r = httpx.post(unified.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and "can continue the request's structured output" in r.json()["error"]["message"]
    streamed = httpx.post(unified.url + "/v1/completions", json=body | {"stream": True}, timeout=60)
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 400, streamed.text


def test_tokenizing_megabytes_does_not_hold_up_other_requests(unified):
    def hostile():
        return httpx.post(unified.url + "/tokenize", timeout=120,
                          json={"prompt": "the quick brown fox jumps over the lazy dog " * 120_000})

    r, canaries = beside_a_canary(unified, list_models, hostile)
    assert r.status_code == 200 and r.json()["count"] > 1_000_000
    assert canaries and set(canaries) == {200}  # /v1/models answered while the tokenizer ran


def test_a_request_that_would_wait_in_silence_gets_a_503_with_retry_after(unified):
    """12 prompts of ~1,000 tokens queue several seconds of prefill on one core: once the engine has
    measured how fast it computes them, a request behind them, which would wait past --max-queue-wait
    (2 s), is refused at once, saying when to come back. Their clients then hang up: the proxy aborts what
    they asked, the queue drains, and the small request is served again."""
    engine = unified.services["unified-0"]
    steps = engine.metrics()["epdserve:engine_steps_total"]
    hung_up = client_disconnects(unified)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=unified.url, timeout=300) as client:
            # Prompts of their own: no prefix-cache hit shortens the queue.
            burst = [asyncio.create_task(client.post("/v1/completions", json={
                "model": "demo", "prompt": f"Story {i}: " + "once upon a time " * 250, "max_tokens": 1}))
                for i in range(12)]
            deadline = time.monotonic() + 120
            # A step is counted as it starts: at the second, the first is over, and its rate measured.
            while engine.metrics()["epdserve:engine_steps_total"] < steps + 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            r = await client.post("/v1/completions", json={"model": "demo", "prompt": "Hello", "max_tokens": 4,
                                                            "temperature": 0})
            assert r.status_code == 503 and "--max-queue-wait" in r.json()["error"]["message"], r.text
            assert int(r.headers["Retry-After"]) >= 2
            assert not all(t.done() for t in burst)  # refused while the burst still waited
            for task in burst:
                task.cancel()
            await asyncio.gather(*burst, return_exceptions=True)

    asyncio.run(main())
    client = httpx.Client(base_url=unified.url, timeout=300)
    deadline = time.monotonic() + 60
    while (r := small_completion(client)).status_code != 200:
        assert r.status_code == 503 and time.monotonic() < deadline, r.text
        time.sleep(0.5)
    assert engine.metrics()["epdserve:requests_refused_overloaded_total"] >= 1
    assert client_disconnects(unified) > hung_up  # the proxy aborted what the burst's clients left


def client_disconnects(stack) -> float:
    """The proxy's count of requests aborted because their client hung up."""
    text = httpx.get(stack.url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("epdserve:request_aborts_total{") and 'reason="client_disconnect"' in line)


@pytest.fixture(scope="module")
def pd2(tiny_model_paths, stack_factory):
    return stack_factory(tiny_model_paths["llama"], prefills=1, decodes=2, engine_args=["--num-kv-blocks", "128"],
                         proxy_args=["--rpc-timeout", "30"])


def test_a_killed_decode_is_routed_around_in_seconds_not_at_the_rpc_timeout(pd2):
    client = httpx.Client(base_url=pd2.url, timeout=120)
    assert small_completion(client).status_code == 200
    victim = pd2.services["decode-1"]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    for _ in range(6):  # some would have been routed to the dead one, and waited out the 30 s rpc timeout
        sent = time.monotonic()
        r = small_completion(client)
        assert r.status_code == 200, r.text
        assert time.monotonic() - sent < 10, "a request waited for the dead decode"
    assert httpx.get(pd2.url + "/ready").json()["healthy_instances"]["decode"] == 1
