"""`epdserve bench serve` writes `vllm bench serve`'s result JSON: vLLM's keys and units, the file named as vLLM
names it under --save-result, one line per run under --append-result; and the client queue measured as vLLM's."""
import json
import shlex

import numpy as np
import pytest

from epdserve.services.bench import result
from epdserve.services.bench.metrics import RequestOutput
from epdserve.services.bench.options import BenchOptions
from epdserve.services.cli.main import build_parser

# The keys of vLLM's result JSON, from vllm-project/vllm vllm/benchmarks/serve.py at commit
# 009e6d4a1cd6ba3fb2a9fc00f4ec06f5297232a1: `main_async` (result_json: the setup and traffic keys) and
# `benchmark` (result: the metrics, the per-request lists, and `process_one_metric`'s statistics). Left out:
# `rtfx`, the audio seconds per second of vLLM's speech-to-text benchmarks, which have no audio here.
VLLM_SETUP_KEYS = ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                   "request_rate", "burstiness", "max_concurrency"]
VLLM_METRIC_KEYS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                    "max_output_tokens_per_s", "max_concurrent_requests"]
VLLM_PER_REQUEST_KEYS = ["input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
                         "generated_texts", "errors"]
VLLM_STATS = ("mean", "median", "std")  # then one p<N> per --metric-percentiles value


def options(line: str) -> BenchOptions:
    return BenchOptions.from_args(build_parser().parse_args(["bench", "serve", *shlex.split(line)]))


def request(start: float, ttft: float, gaps: list[float], queue: float = 0.0, prompt_len: int = 10) -> RequestOutput:
    return RequestOutput(success=True, prompt_len=prompt_len, output_len=len(gaps) + 1, ttft=ttft, itl=list(gaps),
                         latency=ttft + sum(gaps), start_time=start, queue_time=queue, generated_text="x" * len(gaps))


OUTPUTS = [request(0.0, 0.1, [0.02, 0.03], queue=0.0), request(0.1, 0.3, [0.05], queue=0.2),
           RequestOutput(prompt_len=7, start_time=0.2, error="HTTP 503: no healthy decode instance")]


def run(opts: BenchOptions, rate: float = 4.0) -> dict:
    header = {"date": "20250102-030405", "endpoint_type": opts.backend, "backend": opts.backend,
              "label": opts.results.label, "model_id": "org/demo", "tokenizer_id": None, "num_prompts": len(OUTPUTS)}
    return result.record(opts, header, rate, OUTPUTS, 2.0)


def test_the_json_has_vllms_keys_in_vllms_units():
    opts = options("--backend vllm --max-concurrency 2 --save-detailed --metric-percentiles 50,99.9 "
                   "--percentile-metrics ttft,tpot,itl,e2el,client_queue_time,e2el_including_client_queue "
                   "--goodput ttft:200 --metadata run=a")
    r = run(opts)
    metrics = ["ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue"]
    stats = [f"{stat}_{m}_ms" for m in metrics for stat in (*VLLM_STATS, "p50", "p99.9")]
    missing = [k for k in VLLM_SETUP_KEYS + VLLM_METRIC_KEYS + VLLM_PER_REQUEST_KEYS + stats if k not in r]
    assert missing == []
    assert (r["backend"], r["endpoint_type"], r["label"], r["run"]) == ("vllm", "vllm", "vllm", "a")
    assert (r["request_rate"], r["burstiness"], r["max_concurrency"]) == (4.0, 1.0, 2)
    assert run(opts, float("inf"))["request_rate"] == "inf"  # as vLLM writes an unbounded rate
    # Counts and rates: failed requests count in `failed` only, throughputs per second of `duration`.
    assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (2, 1, 20, 5)
    assert r["request_throughput"] == pytest.approx(1.0) and r["output_throughput"] == pytest.approx(2.5)
    assert r["request_goodput"] == pytest.approx(0.5)  # TTFT 100 ms within 200, 300 ms not
    # Per request: seconds, in dataset order; a failed request reports 0 output tokens and its error.
    assert r["ttfts"][:2] == [0.1, 0.3] and r["itls"][:2] == [[0.02, 0.03], [0.05]]
    assert r["output_lens"] == [3, 2, 0] and r["input_lens"] == [10, 10, 7]
    assert r["queue_times"] == [0.0, 0.2, 0.0] and r["generated_texts"] == ["xx", "x", ""]
    assert r["errors"][:2] == ["", ""] and r["errors"][2].startswith("HTTP 503")
    # Statistics: milliseconds over the completed requests.
    assert r["mean_ttft_ms"] == pytest.approx(200.0) and r["median_e2el_ms"] == pytest.approx((150 + 350) / 2)
    assert r["p99.9_itl_ms"] == pytest.approx(np.percentile([20, 30, 50], 99.9))
    assert r["mean_client_queue_time_ms"] == pytest.approx(100.0)
    assert r["mean_e2el_including_client_queue_ms"] == pytest.approx((150 + 550) / 2)
    json.dumps(r)  # every value is plain JSON


def test_without_a_concurrency_cap_the_client_queue_is_not_reported_as_vllm():
    line = "--percentile-metrics ttft,client_queue_time,e2el_including_client_queue"
    r = run(options(line))
    assert "mean_ttft_ms" in r and "mean_client_queue_time_ms" not in r
    assert "mean_e2el_including_client_queue_ms" not in r
    r = run(options(line + " --max-concurrency 4"), float("inf"))  # everything due at once: no E2EL + queue
    assert "mean_client_queue_time_ms" in r and "mean_e2el_including_client_queue_ms" not in r
    assert "generated_texts" not in r  # vLLM keeps the texts under --save-detailed only


@pytest.mark.parametrize("line, rate, name", [
    # vLLM's compute_result_filename: <label>-<rate>qps[-concurrency<N>]-<model's last part>-<date>.json
    ("--save-result", 4.0, "openai-4.0qps-demo-20250102-030405.json"),
    ("--save-result --backend vllm --max-concurrency 8", float("inf"),
     "vllm-infqps-concurrency8-demo-20250102-030405.json"),
    ("--save-result --label mine --request-rate 0.5 2", 0.5, "mine-0.5qps-demo-20250102-030405.json"),
    ("--save-result --result-filename r.json", 4.0, "r.json"),
    ("--result-filename r.json --request-rate 1 2", 2.0, "r_2qps.json"),
    ("--max-concurrency 8", float("inf"), "bench_openai_infqps_c8.json"),
    ("--dataset-name image", 1.5, "bench_openai-chat_1.5qps.json"),
])
def test_result_file_names(line, rate, name):
    assert result.result_path(options(f"--result-dir out {line}"), "org/demo", "20250102-030405", rate).as_posix() \
        == f"out/{name}"


def test_append_result_adds_one_json_line_per_run(tmp_path):
    opts = options(f"--append-result --result-dir {tmp_path}")
    path = result.result_path(opts, "demo", "20250102-030405", 4.0)
    for rate in (4.0, 8.0):
        result.write(opts, run(opts, rate), path)
    lines = path.read_text().splitlines()
    assert [json.loads(line)["request_rate"] for line in lines] == [4.0, 8.0]
    result.write(options(f"--result-dir {tmp_path}"), run(opts), path)  # without it the file is replaced
    assert json.loads(path.read_text())["request_rate"] == 4.0
