"""1 encoder + 1 prefill + 1 decode + proxy, each its own process, driven by the official openai client.

The served model is the LLaVA demo (SmolLM2's language model behind an untrained CLIP tower): text
answers must be SmolLM2's, image answers HF LlavaForConditionalGeneration's, token for token (greedy,
float32; a mismatch only at a checked near-tie of HF's own logits).
"""
import asyncio
import base64
import io
import time

import httpx
import openai
import pytest
import torch
import zmq
from PIL import Image

from tests.e2e.conftest import picture_png

MAX_TOKENS = 16
NUM_BLOCKS = 512
TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a quiet village by the sea,",
    "List three primary colours:",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a fruit."}],
]
GREEDY = dict(temperature=0, max_tokens=MAX_TOKENS)
IDS = dict(extra_body={"return_tokens_as_token_ids": True})


@pytest.fixture(scope="module")
def stack(demo_model, stack_factory):
    return stack_factory(demo_model, encoders=1, prefills=1, decodes=1,
                         engine_args=["--num-kv-blocks", str(NUM_BLOCKS), "--lease-seconds", "5"],
                         # the image URL test serves its picture from 127.0.0.1
                         proxy_args=["--rpc-timeout", "10", "--allow-private-image-urls"])


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def all_blocks_free(stack) -> bool:
    for name in ("prefill-0", "decode-0"):
        m = stack.services[name].metrics()
        if m["epdserve:num_free_kv_blocks"] != NUM_BLOCKS or m["vllm:num_requests_running"] != 0:
            return False
    return True


def test_text_completions_equal_hf(client, smollm2, hf_greedy, near_tie_check, ids_of):
    model, tokenizer = smollm2
    for prompt in TEXT_PROMPTS:
        resp = client.completions.create(model="demo", prompt=prompt, logprobs=0, **GREEDY, **IDS)
        ours = ids_of(resp.choices[0].logprobs.tokens)
        ref, logits = hf_greedy(model, tokenizer.encode(prompt), MAX_TOKENS)
        near_tie_check(prompt, ours, ref, logits)
        assert resp.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert resp.usage.completion_tokens == len(ours)
        assert resp.choices[0].text == tokenizer.decode(ours, skip_special_tokens=True)


def test_chat_equals_hf_streaming_or_not(client, smollm2, hf_greedy, near_tie_check, ids_of):
    model, tokenizer = smollm2
    for messages in CHATS:
        prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(prompt_ids, add_special_tokens=False)
        ref, logits = hf_greedy(model, prompt_ids, MAX_TOKENS)
        full = client.chat.completions.create(model="demo", messages=messages, logprobs=True, **GREEDY, **IDS)
        ours = ids_of([c.token for c in full.choices[0].logprobs.content])
        near_tie_check(str(messages), ours, ref, logits)
        assert full.usage.prompt_tokens == len(prompt_ids) and full.usage.completion_tokens == len(ours)
        assert full.choices[0].finish_reason == ("stop" if len(ours) < MAX_TOKENS else "length")
        text, usage = "", None
        for event in client.chat.completions.create(model="demo", messages=messages, stream=True,
                                                    stream_options={"include_usage": True}, **GREEDY):
            if event.choices:
                text += event.choices[0].delta.content or ""
            usage = event.usage or usage
        assert text == full.choices[0].message.content
        assert usage.completion_tokens == full.usage.completion_tokens


def test_image_chat_equals_hf_llava(client, demo_model, near_tie_check, ids_of, hf_greedy):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(demo_model, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(demo_model)
    png = picture_png(0)
    question = "What is in this picture?"
    hf_messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[Image.open(io.BytesIO(png))], return_tensors="pt")
    with torch.no_grad():
        ref, logits = hf_greedy(model, inputs["input_ids"][0].tolist(), MAX_TOKENS,
                                pixel_values=inputs["pixel_values"])
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png)}},
                                             {"type": "text", "text": question}]}]
    resp = client.chat.completions.create(model="demo", messages=messages, logprobs=True, **GREEDY, **IDS)
    near_tie_check("image chat", ids_of([c.token for c in resp.choices[0].logprobs.content]), ref, logits)
    assert resp.usage.prompt_tokens == inputs["input_ids"].shape[1]


def test_32_concurrent_streams_complete(stack, client):
    prompts = [f"Write a short note about the number {i}." for i in range(8)]
    expected = {p: client.completions.create(model="demo", prompt=p, **GREEDY).choices[0].text for p in prompts}

    async def one(c, prompt):
        text, finish = "", None
        async for event in await c.completions.create(model="demo", prompt=prompt, stream=True, **GREEDY):
            text += event.choices[0].text
            finish = event.choices[0].finish_reason or finish
        return prompt, text, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as c:
            return await asyncio.gather(*(one(c, prompts[i % 8]) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32
    for prompt, text, finish in results:
        assert text == expected[prompt] and finish in ("stop", "length")
    wait_until(lambda: all_blocks_free(stack), 10, "every block back in the pools")


@pytest.mark.parametrize("body, status", [
    ({"model": "demo", "prompt": "x", "max_tokens": 0}, 400),
    ({"model": "demo", "prompt": "x", "max_tokens": "ten"}, 400),
    ({"model": "demo"}, 400),
    ({"model": "other-model", "prompt": "x"}, 404),
    ({"model": "demo", "prompt": "word " * 9000, "max_tokens": 4}, 400),
    ({"model": "demo", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]}]}, 400),
    ({"model": "demo", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}]}, 400),
    ({"model": "demo", "messages": [{"role": "wizard", "content": "hi"}]}, 400),
])
def test_bad_input_gets_4xx_and_the_stack_keeps_serving(stack, client, body, status):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(stack.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    assert client.completions.create(model="demo", prompt="Hello", max_tokens=2).choices[0].text is not None


def test_malformed_json(stack):
    r = httpx.post(stack.url + "/v1/chat/completions", content=b'{"model": "demo", "messages": [',
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"


def test_garbage_on_zmq_ports_is_counted_and_dropped(stack, client):
    ctx = zmq.Context.instance()
    services = [s for s in stack.services.values() if s.role != "proxy"]
    before = {s.name: s.metrics()["epdserve:rejected_frames_total"] for s in services}
    garbage = [[b"\x00" * 8, b"\xc1\xc1\xc1"], [b"\x00" * 8, b"\x93\x01\x02"], [b"not even framed"],
               [b"\x00" * 8, bytes(range(256)) * 64]]
    for s in services:
        for port in (s.port, s.data_port):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            for frames in garbage:
                sock.send_multipart(frames)
            time.sleep(0.2)
            sock.close()
    for s in services:
        wait_until(lambda: s.metrics()["epdserve:rejected_frames_total"] > before[s.name], 10,
                   f"{s.name} to count the garbage")
        assert httpx.get(f"http://127.0.0.1:{s.http_port}/health").status_code == 200
    assert client.completions.create(model="demo", prompt="Hello", max_tokens=2).usage.completion_tokens == 2


def test_client_disconnect_aborts_everywhere(stack):
    async def hang_up():
        async with httpx.AsyncClient(timeout=60) as c:
            async with c.stream("POST", stack.url + "/v1/completions",
                                json={"model": "demo", "prompt": "Tell me a long story.", "max_tokens": 1000,
                                      "ignore_eos": True, "stream": True}) as r:
                events = 0
                async for line in r.aiter_lines():
                    events += line.startswith("data:")
                    if events == 4:
                        return  # hang up once decode is streaming

    def aborted() -> float:
        text = httpx.get(f"http://127.0.0.1:{stack.services['decode-0'].http_port}/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("epdserve:engine_requests_finished_total") and 'finished_reason="abort"' in line)

    before = aborted()
    asyncio.run(hang_up())
    wait_until(lambda: all_blocks_free(stack), 10, "the aborted request's blocks to return")
    assert aborted() == before + 1


def test_image_from_an_http_url_equals_the_data_url(client):
    """image_url may be an http(s) URL: fetched by the proxy (size and time limited), same answer."""
    import http.server
    import threading

    png = picture_png(3)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = png if self.path == "/picture.png" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"

        def ask(image_url):
            return client.chat.completions.create(model="demo", **GREEDY, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "Describe it."}]}])

        assert ask(url + "/picture.png").choices[0].message.content == ask(data_url(png)).choices[0].message.content
        with pytest.raises(openai.BadRequestError, match="HTTP 404"):
            ask(url + "/missing.png")
    finally:
        server.shutdown()


def test_no_healthy_instance_is_a_503(demo_model, tmp_path):
    """A proxy whose decode and prefill instances are all unreachable answers 503, not a hang or a 500."""
    import socket
    import subprocess
    import sys

    ports = []
    for _ in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    proxy_port, dead_prefill, dead_decode = ports
    log = (tmp_path / "proxy.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "epdserve.services.cli", "serve", "proxy", "--model", demo_model,
                             "--port", str(proxy_port), "--served-model-name", "demo",
                             "--prefill", f"127.0.0.1:{dead_prefill}",
                             "--decode", f"127.0.0.1:{dead_decode}", "--poll-interval", "0.2"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{proxy_port}"
        wait_until(lambda: _answers(url + "/health"), 120, "the proxy to start")
        assert httpx.get(url + "/ready").status_code == 503
        r = httpx.post(url + "/v1/completions", json={"model": "demo", "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503 and "decode" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_request_past_its_time_is_a_504_and_is_aborted(demo_model, start_stack):
    """A non-streaming request still running when its time is up answers 504, and the engine drops it."""
    stack = start_stack(demo_model, unified=1, engine_args=["--num-kv-blocks", str(NUM_BLOCKS)],
                          proxy_args=["--token-timeout", "1"])
    try:
        slow = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError, match="took longer than 1s") as caught:
            # Thousands of tokens take far longer than a second on any CPU.
            slow.completions.create(model="demo", prompt="Count to ten thousand:", max_tokens=4000,
                                    temperature=0, extra_body={"ignore_eos": True})
        assert caught.value.status_code == 504
        assert caught.value.body["type"] == "TimeoutError"
        engine = stack.services["unified-0"]
        wait_until(lambda: engine.metrics()["vllm:num_requests_running"] == 0
                   and engine.metrics()["epdserve:num_free_kv_blocks"] == NUM_BLOCKS, 10, "the request to be dropped")
        assert slow.completions.create(model="demo", prompt="Hi", max_tokens=2, temperature=0).usage.completion_tokens == 2
    finally:
        stack.stop()


@pytest.mark.parametrize("where", [
    dict(host="::1"),
    dict(hosts={"prefill": "127.0.0.2", "decode": "127.0.0.3", "proxy": "127.0.0.4"}),
], ids=["ipv6", "separate-hosts"])
def test_a_stack_across_addresses(default_model_path, start_stack, smollm2, hf_greedy, near_tie_check, ids_of, where):
    """Control, KV transfer, token streams and HTTP, exact: all over IPv6 (::1); and as the README's
    separate-hosts recipe, prefill, decode and proxy each on an address of its own (127.0.0.2-4 stand for three
    hosts) with every port fixed, block and inbox ports too."""
    stack = start_stack(default_model_path, prefills=1, decodes=1, engine_args=["--num-kv-blocks", str(NUM_BLOCKS)],
                        **where)
    try:
        model, tokenizer = smollm2
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompt = TEXT_PROMPTS[0]
        resp = client.completions.create(model="demo", prompt=prompt, logprobs=0, **GREEDY, **IDS)
        ref, logits = hf_greedy(model, tokenizer.encode(prompt), MAX_TOKENS)
        near_tie_check(prompt, ids_of(resp.choices[0].logprobs.tokens), ref, logits)
        assert stack.services["decode-0"].metrics()["epdserve:remote_kv_requests_total"] == 1
        for name in ("prefill-0", "decode-0"):  # each listens on its own address
            host = stack.services[name].host
            assert f"ready: control tcp://{f'[{host}]' if ':' in host else host}:" in \
                stack.services[name].log.read_text()
    finally:
        stack.stop()


def test_decode_renews_the_lease_while_a_request_waits_for_room(default_model_path, start_stack, smollm2,
                                                                hf_greedy, near_tie_check, ids_of):
    """A decode with room for one sequence keeps the second request's KV alive on prefill (1 s lease)
    for as long as the first one runs, then pulls it instead of recomputing."""
    stack = start_stack(default_model_path, prefills=1, decodes=1,
                          engine_args=["--num-kv-blocks", str(NUM_BLOCKS), "--max-num-seqs", "1", "--lease-seconds", "1"])
    try:
        decode, prefill = stack.services["decode-0"], stack.services["prefill-0"]
        http = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def main():
            async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0,
                                          timeout=120) as c:
                long = await c.completions.create(model="demo", prompt="Count slowly:", max_tokens=4000,
                                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
                await long.__anext__()  # it runs on decode and takes its only seat
                waiting = asyncio.create_task(asyncio.to_thread(
                    http.completions.create, model="demo", prompt=TEXT_PROMPTS[0], logprobs=0, **GREEDY, **IDS))
                deadline = time.monotonic() + 60
                while decode.metrics().get("epdserve:kv_lease_renewals_total", 0) < 3:  # > 1.5 leases waited
                    assert time.monotonic() < deadline and not waiting.done(), "no lease renewals"
                    await asyncio.sleep(0.2)
                await long.response.aclose()  # the first request leaves; the waiting one gets the seat
                return await waiting

        resp = asyncio.run(main())
        model, tokenizer = smollm2
        ref, logits = hf_greedy(model, tokenizer.encode(TEXT_PROMPTS[0]), MAX_TOKENS)
        near_tie_check(TEXT_PROMPTS[0], ids_of(resp.choices[0].logprobs.tokens), ref, logits)
        assert decode.metrics()["epdserve:local_prefills_total"] == 0  # pulled, not recomputed
        assert decode.metrics()["epdserve:remote_kv_requests_total"] == 2
        assert prefill.metrics()["epdserve:kv_lease_expired_total"] == 0
    finally:
        stack.stop()


def test_a_prefill_killed_during_the_pull_is_recomputed_on_decode(default_model_path, start_stack, smollm2,
                                                                   hf_greedy, near_tie_check, ids_of,
                                                                   prefill_killed_during_pull):
    """Over ZeroMQ: decode's fetch fails as the connection drops, and decode recomputes the prompt, to the
    same tokens. test_ucx_stack.py kills its prefill the same way over UCX."""
    stack = start_stack(default_model_path, prefills=1, decodes=1,
                        engine_args=["--num-kv-blocks", str(NUM_BLOCKS), "--max-num-seqs", "1", "--lease-seconds", "5"],
                        proxy_args=["--routing-policy", "load"])
    try:
        decode = stack.services["decode-0"]
        resp = prefill_killed_during_pull(stack, TEXT_PROMPTS[0], MAX_TOKENS)
        model, tokenizer = smollm2
        ref, logits = hf_greedy(model, tokenizer.encode(TEXT_PROMPTS[0]), MAX_TOKENS)
        near_tie_check(TEXT_PROMPTS[0], ids_of(resp.choices[0].logprobs.tokens), ref, logits)
        m = decode.metrics()
        # The long stream was pulled; the request under test failed its fetch and was recomputed.
        assert (m["epdserve:remote_kv_requests_total"], m["epdserve:local_prefills_total"],
                m["epdserve:kv_transfer_failures_total"]) == (1, 1, 1), m
        assert "recomputing the prompt here" in decode.log.read_text()
    finally:
        stack.stop()
