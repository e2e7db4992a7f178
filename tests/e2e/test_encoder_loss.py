"""2 encoders + 1 prefill + 1 decode (or 1 unified engine): an encoder SIGKILLed after it encoded a request's
image, before the engine fetched the embeddings, costs the request seconds, not its answer. The engine finds
the encoder gone at once (its connection refused), answers `embeddings_unavailable` (the prefill as its reply,
the unified engine on the stream), and the proxy encodes the image again on the live encoder and sends the
request once more: the answer equals the one served without the fault. With no encoder left, the client gets a
prompt 503, never a 500 after the transfer timeout; an encoder back heals the stack.

The window is made with real signals: the engine is frozen (SIGSTOP) while the request is encoded, so that it
cannot fetch the embeddings before the encoder that made them is killed; it is thawed (SIGCONT) well within
the proxy's heartbeats.
"""
import base64
import concurrent.futures
import signal
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import picture_png

NUM_BLOCKS = 256
GREEDY = dict(temperature=0, max_tokens=12)
QUESTION = "What is in this picture?"
# What losing its encoder may add to a request's time at most (the transfer timeout is 60 s), beyond the same
# request's time without the fault (on a busy CPU that is seconds: the image encoded, ~600 prompt tokens).
PROMPT_S = 10.0


@pytest.fixture(scope="module", params=["prefill-0", "unified-0"])
def stack(request, demo_model, stack_factory):
    """A stack whose engine that fetches the embeddings is `stack.fetcher`."""
    roles = dict(prefills=1, decodes=1) if request.param == "prefill-0" else dict(unified=1)
    stack = stack_factory(demo_model, encoders=2, engine_args=["--num-kv-blocks", str(NUM_BLOCKS)], **roles)
    stack.fetcher = request.param
    return stack


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, png: bytes, salt: str):
    """A greedy chat about `png`; `salt` keeps the engines' prefix caches of other asks out of it (the prefill
    then needs the embeddings), while the encoders' caches of the image still serve it."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": QUESTION}]}]
    return client.chat.completions.create(model="demo", messages=messages, extra_body={"cache_salt": salt}, **GREEDY)


def hits(stack, name: str) -> float:
    return stack.services[name].metrics().get("vllm:mm_cache_hits_total", 0.0)


def healthy(stack, role: str) -> int:
    return httpx.get(stack.url + "/ready", timeout=5).json()["healthy_instances"].get(role, 0)


def wait_for(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def encoder_lost_after_encoding(stack, client, png: bytes, salt: str, encoders: list[str]):
    """Ask about `png` (whose embeddings one of `encoders` already holds) with the engine that fetches them
    frozen; once that encoder has answered the encode (its cache hit counted), SIGKILL it and thaw the engine.
    (the encoder killed, the reply or the error, seconds from the ask to its end)."""
    prefill = stack.services[stack.fetcher]
    before = {name: hits(stack, name) for name in encoders}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        prefill.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            asked = pool.submit(ask, client, png, salt)
            deadline = started + 5
            while not (encoded := [name for name in encoders if hits(stack, name) > before[name]]):
                assert time.monotonic() < deadline and not asked.done(), "the image was never encoded"
                time.sleep(0.02)
            time.sleep(0.1)  # the hit is counted just before EncodeDone leaves; the frozen engine fetches nothing
            (killed,) = encoded
            stack.services[killed].proc.send_signal(signal.SIGKILL)
            stack.services[killed].proc.wait(10)
        finally:
            prefill.proc.send_signal(signal.SIGCONT)
        try:
            reply = asked.result(60)
        except openai.APIStatusError as exc:
            reply = exc
        return killed, reply, time.monotonic() - started


def test_an_encoder_killed_after_encoding_is_made_good_by_encoding_again(stack, client):
    proxy, prefill = stack.services["proxy"], stack.services[stack.fetcher]
    png = picture_png(7)
    started = time.monotonic()
    expected = ask(client, png, "reference")  # encoded now: the encoder it went to holds the embeddings
    unfaulted = time.monotonic() - started
    reencodes = proxy.metrics().get("epdserve:request_reencodes_total", 0.0)
    unavailable = prefill.metrics().get("epdserve:embeddings_unavailable_total", 0.0)

    killed, reply, seconds = encoder_lost_after_encoding(stack, client, png, "fault", ["encoder-0", "encoder-1"])
    assert not isinstance(reply, Exception), reply
    assert reply.choices[0].message.content == expected.choices[0].message.content
    assert reply.usage.completion_tokens == expected.usage.completion_tokens
    assert seconds < unfaulted + PROMPT_S
    assert prefill.metrics()["epdserve:embeddings_unavailable_total"] == unavailable + 1
    assert proxy.metrics()["epdserve:request_reencodes_total"] == reencodes + 1
    print(f"\n{stack.fetcher}: encoder SIGKILLed after encoding: answered in {seconds:.2f}s ({unfaulted:.2f}s without the fault), "
          "identical, image encoded again")

    # The last encoder lost the same way: nothing can encode the image again; the client is told at once.
    (live,) = {"encoder-0", "encoder-1"} - {killed}
    wait_for(lambda: healthy(stack, "encoder") == 1, f"{killed} still routed to")
    ask(client, png, "warm")  # the live encoder holds the image now
    _, reply, seconds = encoder_lost_after_encoding(stack, client, png, "fault-2", [live])
    assert isinstance(reply, openai.APIStatusError) and reply.status_code == 503, reply
    assert seconds < PROMPT_S
    print(f"last encoder SIGKILLed after encoding: 503 in {seconds:.2f}s")

    # An encoder back (as a restart policy would bring it): the stack heals.
    stack.services[killed].start()
    wait_for(lambda: healthy(stack, "encoder") == 1, f"{killed} did not come back")
    again = ask(client, png, "healed")
    assert again.choices[0].message.content == expected.choices[0].message.content
    stack.services[live].start()
    wait_for(lambda: healthy(stack, "encoder") == 2, f"{live} did not come back")
