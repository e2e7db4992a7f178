"""`epdserve up --planner`: a stack that adds a decode when the forecast load needs one, routes to it once it is
ready, and retires it when the load is gone - while streams run on it, every one of them completing with the
tokens the stack gives alone; and one that does the same with an encoder for the images its requests bring.

The profile given (--planner-profile) is written here: a decode step of 150 ms plus 50 ms a request, far slower
than the tiny model's, so that what the planner decides depends on the request rate the test sends, not on this
machine's speed. At 2 req/s of 40-token answers one decode would hold B = 80 x (0.15 + 0.05 B) requests, which
never settles: two are predicted; once nothing arrives the forecast halves every interval and one decode meets
the TPOT SLO again.
"""
import asyncio
import base64
import json
import re
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epdserve.services.cli.launcher import free_port
from tests.e2e.conftest import picture_png
from tests.e2e.test_first_start import Up

pytestmark = pytest.mark.slow
READY = "epdserve is ready: "
PROFILE = {"model": "tiny-llama", "threads": 1, "context_len": 16, "max_num_seqs": 64,
           "prefill": [[1, 0.001], [2048, 0.5]], "decode": [[1, 0.2], [64, 3.35]], "encode": None}
OUTPUT_LEN = 40
LONG = 1500  # the streams that run through the scale-in


@pytest.fixture(scope="module")
def up(tiny_model_paths, tmp_path_factory):
    profile = tmp_path_factory.mktemp("planner") / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    port = free_port()
    stack = Up([str(Path(sys.executable).with_name("epdserve")), "up", tiny_model_paths["llama"], "--port", str(port),
                "--planner", "--planner-bounds", "decode=1:2", "--planner-interval", "0.5", "--planner-profile",
                str(profile), "--ttft-slo", "60", "--tpot-slo", "0.35", "--", "--num-kv-blocks", "1024"])
    stack.url = f"http://127.0.0.1:{port}"
    stack.model = Path(tiny_model_paths["llama"]).name
    stack.profile = profile
    try:
        stack.wait_for(READY, 300)
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def planner_service(up):
    """`epdserve serve planner` on the same stack, with the same options as its own planner: it only says what it
    wants, on its /metrics."""
    port = free_port()
    service = Up([str(Path(sys.executable).with_name("epdserve")), "serve", "planner", "--proxy-url", up.url,
                  "--planner-bounds", "decode=1:2", "--planner-interval", "0.5", "--planner-profile", str(up.profile),
                  "--ttft-slo", "60", "--tpot-slo", "0.35", "--http-port", str(port)])
    service.url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: answers(service.url + "/ready"), 60, "the planner service to read the proxy",
                   service.report)
        yield service
    finally:
        service.stop()


def answers(url: str) -> bool:
    """Whether `url` answers 200 (a service's /health once it listens, /ready once it is ready)."""
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def desired(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.labels["role"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "epdserve:planner_desired_replicas"}


def healthy(url: str, role: str) -> int:
    return httpx.get(url + "/ready", timeout=10).json()["healthy_instances"].get(role, 0)


def wait_until(predicate, timeout: float, what: str, report) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{report()}"
        time.sleep(0.2)


async def complete(client: httpx.AsyncClient, up, prompt: list[int], max_tokens: int, stream: bool):
    url = up.url
    body = {"model": up.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, "stream": stream}
    if not stream:
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"], time.monotonic()
    tokens = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                tokens += chunk["choices"][0]["logprobs"]["tokens"]
    return tokens, time.monotonic()


def test_a_decode_is_added_under_load_and_retired_under_running_streams(up, planner_service):
    prompts = [[5 + (17 * i + 3 * t) % 1500 for t in range(12)] for i in range(8)]
    wait_until(lambda: desired(up.url) == {"prefill": 1, "decode": 1}, 30, "the planner's first word", up.report)

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            # 2 req/s until the planner has a second decode serving.
            sent = []
            deadline = time.monotonic() + 60
            while healthy(up.url, "decode") < 2:
                assert time.monotonic() < deadline, "no second decode came:\n" + up.report()
                sent.append(asyncio.create_task(complete(client, up, prompts[len(sent) % 8], OUTPUT_LEN, False)))
                await asyncio.sleep(0.5)
                wanted.append(desired(planner_service.url))
            await asyncio.gather(*sent)
            # Long streams over both decodes; then nothing more arrives, and the planner retires one under them.
            streams = [asyncio.create_task(complete(client, up, p, LONG, True)) for p in prompts]
            retired_at = await asyncio.to_thread(retirement, up)
            results = await asyncio.gather(*streams)
            alone = await asyncio.gather(*(complete(client, up, p, LONG, False) for p in prompts))
            return results, retired_at, alone

    wanted = []  # what the planner service, reading the same proxy, wanted meanwhile
    results, retired_at, alone = asyncio.run(main())
    assert {"decode": 2} in wanted, (wanted, planner_service.report())
    assert re.search(r"planner: prefill 1 -> 1, decode 1 -> 2 .*started decode-1", "\n".join(up.text())), up.report()
    # Some of the streams were still running when decode-1 was taken out of routing: the scale-in met them.
    assert any(ended > retired_at for _, ended in results), up.report()
    assert [tokens for tokens, _ in results] == [tokens for tokens, _ in alone]
    assert all(len(tokens) == LONG for tokens, _ in results)
    wait_until(lambda: any("planner: decode-1 stopped" in line for line in up.text()), 120, "decode-1 to stop",
               up.report)
    assert healthy(up.url, "decode") == 1 and desired(up.url)["decode"] == 1
    wait_until(lambda: desired(planner_service.url) == {"decode": 1}, 30, "the planner service to want one decode",
               planner_service.report)
    assert any("planner: decode 1 -> 2 (" in line for line in planner_service.text()), planner_service.report()
    # Once it wanted one decode it kept to it, though the stack's own planner took a while to retire the second.
    decisions = [line.split("planner: decode ")[1][:6] for line in planner_service.text() if "planner: decode " in line]
    assert ("2 -> 1", "2 -> 2") not in set(zip(decisions, decisions[1:])), planner_service.report()


def retirement(up) -> float:
    """When the planner took decode-1 out of routing (by the clock of this process)."""
    up.wait_for(r"planner: .*retiring decode-1", 60)
    return time.monotonic()


# An image takes 0.6 s to encode by this profile (the tiny model's tower is far faster): at 4 req/s of one image
# each an encoder would have 2.4 s of work a second (overloaded), and two, the most there may be, are wanted; once
# nothing arrives the forecast halves every interval and one is enough again. Prompts and steps cost next to
# nothing by it. The SLOs are loose: the profile decides, not the latencies measured under the suite's load.
IMAGE_PROFILE = {"model": "tiny-qwen2.5-vl", "threads": 1, "context_len": 16, "max_num_seqs": 64,
                 "prefill": [[1, 0.001], [2048, 0.01]], "decode": [[1, 0.001], [64, 0.01]], "encode": 0.6}


@pytest.fixture(scope="module")
def up_images(qwen2_5_vl_path, tmp_path_factory):
    profile = tmp_path_factory.mktemp("planner") / "profile.json"
    profile.write_text(json.dumps(IMAGE_PROFILE))
    port = free_port()
    stack = Up([str(Path(sys.executable).with_name("epdserve")), "up", str(qwen2_5_vl_path), "--port", str(port),
                "--planner", "--planner-bounds", "encoder=1:2", "--planner-interval", "0.5", "--planner-profile",
                str(profile), "--ttft-slo", "30", "--tpot-slo", "30"])
    stack.url = f"http://127.0.0.1:{port}"
    stack.model = Path(qwen2_5_vl_path).name
    try:
        stack.wait_for(READY, 300)
        yield stack
    finally:
        stack.stop()


def test_an_encoder_is_added_for_images_and_retired_once_none_come(up_images):
    up = up_images
    wait_until(lambda: desired(up.url) == {"encoder": 1, "prefill": 1, "decode": 1}, 30, "the planner's first word",
               up.report)

    def body(seed: int) -> dict:
        image = "data:image/png;base64," + base64.b64encode(picture_png(seed)).decode()
        return {"model": up.model, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": "What is in the picture?"}]}]}

    async def main():
        # Idle connections dropped before the proxy's 5 s keep-alive ends them: reusing one the server is closing
        # at that moment would be a ReadError (httpx's own expiry is 5 s too).
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(keepalive_expiry=2)) as client:
            async def ask(seed: int) -> tuple[int, str]:
                r = await client.post(up.url + "/v1/chat/completions", json=body(seed))
                assert r.status_code == 200, r.text
                return seed, r.json()["choices"][0]["message"]["content"]

            answers = []
            deadline = time.monotonic() + 90
            # 4 req/s until a second encoder serves: whatever the noise of half-second intervals, the forecast stays
            # above the 1.7 req/s one encoder can take.
            while healthy(up.url, "encoder") < 2:
                assert time.monotonic() < deadline, "no second encoder came:\n" + up.report()
                answers.append(asyncio.create_task(ask(len(answers) % 4)))
                await asyncio.sleep(0.25)
            # Four pictures again, spread over both encoders by their hashes.
            answers += [asyncio.create_task(ask(seed)) for seed in range(4)]
            return await asyncio.gather(*answers)

    answers = asyncio.run(main())
    assert re.search(r"planner: encoder 1 -> 2, .*started encoder-1", "\n".join(up.text())), up.report()
    # A picture's answer is the same whichever encoder made its embeddings, before the second came and after.
    assert all(len({a for s, a in answers if s == seed}) == 1 for seed in range(4)), answers
    # Nothing arrives any more: the encoder is taken out of routing and, idle by its metrics, stopped.
    wait_until(lambda: any("planner: encoder-1 stopped" in line for line in up.text()), 60, "encoder-1 to stop",
               up.report)
    assert healthy(up.url, "encoder") == 1 and desired(up.url)["encoder"] == 1, up.report()

