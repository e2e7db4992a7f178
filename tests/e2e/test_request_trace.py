"""Per-request traces on a real stack: 2 prefills + 1 decode of the tiny model behind a proxy started with
--request-trace and load routing (prefill chosen by a hash of the prompt's head; every request takes the
prefill -> decode handoff). prefill-1's lease is shorter than any handoff, so decode's pull of the KV it
computed always fails and decode recomputes the prompt; prefill-0's KV is pulled. Each request's
`epdserve_trace`, read through the official `openai` client, must show where its time went, and
`epdserve bench serve --trace` summarizes the same."""
import json
import math
import subprocess
import sys

import openai
import pytest

from epdserve.shared.config import ModelConfig
from tests.e2e.conftest import Stack  # the module pytest loaded: its ports are handed out once

BLOCK_SIZE = 16  # the engines' default
TRANSFERS = "epdserve:request_kv_transfer_seconds_count"
SLACK = 0.002  # seconds: each span is converted from its process's monotonic clock on its own


@pytest.fixture(scope="module")
def stack(stack_factory, tiny_model_paths):
    stack = Stack(tiny_model_paths["llama"], stack_factory.log_root.mktemp("trace-stack"), prefills=2, decodes=1,
                  engine_args=["--max-model-len", "512", "--num-kv-blocks", "128"],
                  proxy_args=["--routing-policy", "load", "--request-trace"])
    stack.services["prefill-1"].argv += ["--lease-seconds", "0.001"]
    stack_factory.started.append(stack)  # stopped with the module's other stacks
    return stack.start()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def traced_on(stack, client, prefill: str, seen: set[str]) -> tuple[dict, dict, float]:
    """(trace, usage, decode's KV-transfer count before it) of a request whose prompt prefill `prefill`
    computed: distinct prompts (distinct first tokens: nothing cached anywhere) until one lands there."""
    words = ["lighthouse", "river", "mountain", "harbour", "forest", "desert", "glacier", "meadow", "canyon",
             "island", "valley", "volcano", "prairie", "lagoon", "tundra", "orchard"]
    for word in words:
        if word in seen:
            continue
        seen.add(word)
        before = stack.services["decode-0"].metrics().get(TRANSFERS, 0.0)
        response = client.completions.create(model="demo", prompt=f"{word.capitalize()} keepers walked up the "
                                              "stairs, counting every step aloud until", max_tokens=6,
                                              temperature=0, extra_body={"ignore_eos": True})
        (trace,) = response.model_extra["epdserve_trace"]
        if spans_named(trace, "prefill.compute")[0]["engine_id"] == prefill:
            return trace, response.usage, before
    raise AssertionError(f"no prompt was routed to {prefill}")


def spans_named(trace: dict, name: str) -> list[dict]:
    return [s for s in trace["spans"] if s["name"].split(":")[0] == name]


def one(trace: dict, name: str) -> dict:
    (span,) = spans_named(trace, name)
    return span


def in_order(*spans: dict) -> bool:
    return all(a["end"] <= b["start"] + SLACK for a, b in zip(spans, spans[1:]))


@pytest.fixture(scope="module")
def prompts_used() -> set[str]:
    return set()


def test_a_pulled_request_shows_its_kv_transfer(stack, client, prompts_used, tiny_model_paths):
    trace, usage, before = traced_on(stack, client, "prefill-0", prompts_used)
    names = [s["name"] for s in trace["spans"]]
    assert names[0] == "proxy.request" and not spans_named(trace, "kv.recompute"), names
    root = trace["spans"][0]
    assert all(root["start"] - SLACK <= s["start"] <= s["end"] <= root["end"] + SLACK for s in trace["spans"])
    transfer = one(trace, "kv.transfer")
    model = ModelConfig.from_pretrained(tiny_model_paths["llama"])
    block_bytes = 2 * model.num_layers * model.num_kv_heads * model.head_size * BLOCK_SIZE * 4  # float32
    assert transfer["engine_id"] == "decode-0"
    assert transfer["num_blocks"] == math.ceil(usage.prompt_tokens / BLOCK_SIZE)  # nothing cached on decode
    assert transfer["num_bytes"] == transfer["num_blocks"] * block_bytes > 0
    prefill, queue, compute = one(trace, "proxy.prefill"), one(trace, "prefill.queue"), one(trace, "prefill.compute")
    assert queue["engine_id"] == compute["engine_id"] == "prefill-0"
    assert in_order(queue, compute) and prefill["start"] <= queue["start"] and compute["end"] <= prefill["end"]
    # Decode hears of the request once prefill answered; the first token reached the client before.
    assert in_order(prefill, one(trace, "decode.queue"), transfer, one(trace, "decode.first_step"))
    assert prefill["end"] <= one(trace, "proxy.first_token")["end"] + SLACK
    assert stack.services["decode-0"].metrics()[TRANSFERS] == before + 1


def test_a_failed_pull_shows_the_recompute(stack, client, prompts_used):
    decode = stack.services["decode-0"]
    recomputes = decode.metrics().get("epdserve:local_prefills_total", 0.0)
    trace, _, before = traced_on(stack, client, "prefill-1", prompts_used)
    recompute = one(trace, "kv.recompute")
    assert recompute["engine_id"] == "decode-0" and recompute["name"] == "kv.recompute:blocks_not_found"
    failed = one(trace, "kv.transfer")  # the attempt, which moved nothing
    assert (failed["name"], failed["num_bytes"]) == ("kv.transfer:failed", 0) and failed["num_blocks"] > 0
    assert not spans_named(trace, "decode.first_step")
    assert in_order(one(trace, "proxy.prefill"), one(trace, "decode.queue"), failed, recompute)
    metrics = decode.metrics()
    assert metrics[TRANSFERS] == before and metrics["epdserve:local_prefills_total"] == recomputes + 1


def test_bench_serve_summarizes_the_traces(stack, tiny_model_paths, tmp_path):
    cmd = [sys.executable, "-m", "epdserve.services.cli", "bench", "serve", "--base-url", stack.url,
           "--tokenizer", tiny_model_paths["llama"], "--num-prompts", "4", "--input-len", "40", "--output-len", "4",
           "--seed", "7", "--temperature", "0", "--trace", "--result-dir", str(tmp_path), "--result-filename",
           "bench.json", "--disable-tqdm", "--no-plot"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Median KV transfer / TTFT:" in proc.stdout
    result = json.loads((tmp_path / "bench.json").read_text())
    assert len(result["traces"]) == 4 and all(len(traces) == 1 for traces in result["traces"])
    assert result["traced_requests"] == 4
    # Each request was pulled from prefill-0 or recomputed after prefill-1's lease ran out.
    assert result["kv_transfer_requests"] + result["kv_recompute_requests"] == 4
    if result["kv_transfer_requests"]:
        assert result["median_kv_transfer_bytes"] > 0 and result["median_kv_transfer_ms"] > 0
        assert 0 < result["median_kv_transfer_ttft_ratio"]
