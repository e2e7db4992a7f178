"""The goodput benchmark's client against a real 1 prefill + 1 decode stack of the tiny llama: every request of
a mixed workload sent at its time, streamed to its end and timed; a request the server refuses is a failure
of that request, not of the run."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("goodput", BENCHMARKS / "goodput.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["goodput"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, default_model_path) -> str:
    from epdserve.shared.checkpoints.tiny_models import build_tiny_model

    return str(build_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "tiny-llama", default_model_path))


@pytest.fixture(scope="module")
def stack(stack_factory, tiny_llama):
    return stack_factory(tiny_llama, prefills=1, decodes=1, engine_args=["--num-kv-blocks", "512"])


def test_a_mixed_workload_is_timed_request_by_request(bench, stack, tiny_llama):
    args = bench.parse_args(["--quick"])  # 12 requests, 2 of them long prompts of 768-1024 tokens
    vocab = json.loads((Path(tiny_llama) / "config.json").read_text())["vocab_size"]
    items = bench.workload(args, vocab, repeat=0, rate_index=0, rate=20.0)
    run = asyncio.run(bench.run_workload(stack.url, items, temperature=0.0))
    outcomes = [bench.Outcome(**o) for o in run["outcomes"]]
    assert [o.error for o in outcomes] == [None] * len(items), stack.logs()
    assert [(o.prompt_tokens, o.output_tokens, o.long) for o in outcomes] == [
        (len(i.prompt), i.max_tokens, i.long) for i in items]  # EOS ignored: every request writes all it asks
    assert sum(o.long for o in outcomes) == 2
    for o in outcomes:
        assert 0 < o.ttft_ms <= o.latency_ms and o.tpot_ms > 0
        assert o.ttft_ms + o.tpot_ms * (o.output_tokens - 1) == pytest.approx(o.latency_ms)
    # Sent at their arrival times: the run lasts at least until the last one is sent, plus its answer.
    assert run["duration_s"] * 1e3 >= items[-1].arrival_s * 1e3 + outcomes[-1].latency_ms


def test_a_refused_request_fails_alone(bench, stack):
    too_long = bench.Item(0.0, [300] * 3000, 8, True)  # the tiny llama takes 2048 positions
    fine = bench.Item(0.05, [301] * 40, 8, False)
    run = asyncio.run(bench.run_workload(stack.url, [too_long, fine], temperature=None))
    refused, served = (bench.Outcome(**o) for o in run["outcomes"])
    assert refused.error.startswith("HTTP 400") and refused.ttft_ms is None
    assert served.error is None and served.output_tokens == 8
