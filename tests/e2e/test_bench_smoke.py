"""`epdserve bench serve` against a running encoder + prefill + decode + proxy stack: a few requests of each
kind, and the JSON it writes has every `vllm bench serve` field with consistent values (no timing limits); a
saved `vllm bench serve` command line runs as it is, and its JSON reads as a vLLM script reads it."""
import json
import math
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest

OUTPUT_LEN = 6
SUMMARY_FIELDS = [
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "max_output_tokens_per_s", "max_concurrent_requests", "total_cached_tokens",
]
PER_REQUEST_FIELDS = ["input_lens", "output_lens", "ttfts", "tpots", "itls", "latencies", "start_times",
                      "cached_tokens", "errors"]
STAT_FIELDS = [f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
               for stat in ("mean", "median", "std", "p50", "p90", "p99")]


@pytest.fixture(scope="module")
def stack(demo_model, stack_factory):
    return stack_factory(demo_model, encoders=1, prefills=1, decodes=1, engine_args=["--num-kv-blocks", "512"])


def bench(stack, demo_model, out_dir, *args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "epdserve.services.cli", "bench", "serve", "--base-url", stack.url,
           "--tokenizer", demo_model, "--output-len", str(OUTPUT_LEN), "--temperature", "0", "--seed", "1",
           "--result-dir", str(out_dir), "--disable-tqdm", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + stack.logs()
    return proc


def check_result(result: dict, num_prompts: int) -> None:
    missing = [f for f in SUMMARY_FIELDS + PER_REQUEST_FIELDS + STAT_FIELDS if f not in result]
    assert not missing, f"missing fields: {missing}"
    assert result["model_id"] == "demo"  # asked from the server's /v1/models
    assert (result["num_prompts"], result["completed"], result["failed"]) == (num_prompts, num_prompts, 0)
    assert result["errors"] == [""] * num_prompts
    for field in PER_REQUEST_FIELDS:
        assert len(result[field]) == num_prompts, field
    assert result["output_lens"] == [OUTPUT_LEN] * num_prompts  # ignore_eos: exactly max tokens
    assert result["total_output_tokens"] == OUTPUT_LEN * num_prompts
    assert result["total_input_tokens"] == sum(result["input_lens"]) and min(result["input_lens"]) > 0
    for ttft, itl, latency, n in zip(result["ttfts"], result["itls"], result["latencies"], result["output_lens"]):
        assert 0 < ttft <= latency
        assert 1 + len(itl) <= n  # a chunk may carry several tokens, never fewer than one
        assert all(gap >= 0 for gap in itl)
        assert ttft + sum(itl) <= latency + 1e-6
    assert result["duration"] > 0
    assert result["request_throughput"] == pytest.approx(num_prompts / result["duration"])
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / result["duration"])
    assert result["total_token_throughput"] == pytest.approx(
        (result["total_input_tokens"] + result["total_output_tokens"]) / result["duration"])
    for metric in ("ttft", "tpot", "itl", "e2el"):
        p50, p90, p99 = (result[f"p{p}_{metric}_ms"] for p in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99, metric
        assert result[f"median_{metric}_ms"] == pytest.approx(p50)
    assert min(result["ttfts"]) * 1000 <= result["mean_ttft_ms"] <= max(result["ttfts"]) * 1000 + 1e-6
    assert 1 <= result["max_concurrent_requests"] <= num_prompts


def test_random_prompts_at_two_rates(stack, demo_model, tmp_path):
    bench(stack, demo_model, tmp_path, "--num-prompts", "6", "--input-len", "24", "--request-rate", "8", "inf",
          "--goodput", "ttft:600000", "tpot:600000", "--label", "smoke")
    for name, rate in (("bench_smoke_8qps.json", 8.0), ("bench_smoke_infqps.json", "inf")):
        result = json.loads((tmp_path / name).read_text())
        check_result(result, 6)
        assert result["request_rate"] == rate
        assert result["endpoint_type"] == "openai" and result["dataset_name"] == "random"
        assert result["input_lens"] == [24] * 6  # exact-length prompts (SmolLM2 adds no BOS)
        assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # SLOs of 10 minutes
    assert (tmp_path / "bench_smoke_cdf.png").stat().st_size > 0
    assert (tmp_path / "bench_smoke_rates.png").stat().st_size > 0


def test_multi_turn_conversations_hit_the_prefix_cache(stack, demo_model, tmp_path):
    bench(stack, demo_model, tmp_path, "--dataset-name", "multi-turn", "--num-prompts", "6", "--multi-turn-turns",
          "3", "--multi-turn-prefix-len", "80", "--input-len", "12", "--max-concurrency", "2", "--label", "mt")
    result = json.loads((tmp_path / "bench_mt_infqps_c2.json").read_text())
    check_result(result, 6)
    assert result["endpoint_type"] == "openai-chat" and result["max_concurrency"] == 2
    assert result["turns"] == [0, 0, 1, 1, 2, 2]  # two conversations, sent turn by turn
    # Every turn resends the whole conversation: prompts grow, and later turns reuse cached blocks.
    assert result["input_lens"][0] < result["input_lens"][2] < result["input_lens"][4]
    assert all(result["cached_tokens"][i] >= 80 for i in range(2, 6))
    assert not math.isnan(result["mean_later_turns_ttft_ms"])


def test_image_prompts(stack, demo_model, tmp_path):
    proc = bench(stack, demo_model, tmp_path, "--dataset-name", "image", "--num-prompts", "2", "--input-len", "8",
                 "--image-width", "64", "--image-height", "48", "--no-plot")
    result = json.loads((tmp_path / "bench_openai-chat_infqps.json").read_text())
    check_result(result, 2)
    assert min(result["input_lens"]) > 8 + 100  # the image's placeholder tokens count as prompt tokens
    assert "Serving Benchmark Result" in proc.stdout
    assert not list(tmp_path.glob("*.png"))


# A `vllm bench serve` command line as a script saves it, word for word but the port and folders.
SAVED_VLLM_COMMAND = (
    "vllm bench serve --backend vllm --host 127.0.0.1 --port {port} --endpoint /v1/completions --model demo "
    "--tokenizer {tokenizer} --dataset-name random --random-input-len 24 --random-output-len 6 --num-prompts 4 "
    "--request-rate 8 --max-concurrency 2 --seed 1 --ignore-eos --temperature 0 "
    "--percentile-metrics ttft,tpot,itl,e2el,client_queue_time,e2el_including_client_queue "
    "--metric-percentiles 50,90,99 --goodput ttft:600000 e2el:600000 --save-result --save-detailed "
    "--result-dir {result_dir} --metadata tag=saved --disable-tqdm")


def test_a_saved_vllm_bench_serve_command_line(stack, demo_model, tmp_path):
    argv = shlex.split(SAVED_VLLM_COMMAND.format(port=stack.port, tokenizer=demo_model, result_dir=tmp_path))
    assert argv[:3] == ["vllm", "bench", "serve"]
    proc = subprocess.run([sys.executable, "-m", "epdserve.services.cli", *argv[1:]], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + stack.logs()
    # Found and read as a vLLM script does: vLLM's file name in --result-dir, one JSON object.
    [path] = tmp_path.glob("*.json")
    assert re.fullmatch(r"vllm-8\.0qps-concurrency2-demo-\d{8}-\d{6}\.json", path.name), path.name
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    check_result(result, 4)
    assert path.name == f"vllm-8.0qps-concurrency2-demo-{result['date']}.json"
    assert (result["backend"], result["endpoint_type"], result["model_id"], result["tokenizer_id"]) == (
        "vllm", "vllm", "demo", demo_model)
    assert (result["num_prompts"], result["request_rate"], result["burstiness"], result["max_concurrency"]) == (
        4, 8.0, 1.0, 2)
    assert result["tag"] == "saved" and result["input_lens"] == [24] * 4
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # SLOs of 10 minutes
    assert len(result["generated_texts"]) == 4 and all(isinstance(t, str) for t in result["generated_texts"])
    # vLLM's units: per-request seconds, statistics in milliseconds over them.
    assert result["p99_ttft_ms"] == pytest.approx(np.percentile(result["ttfts"], 99) * 1000)
    assert result["mean_itl_ms"] == pytest.approx(np.mean(sum(result["itls"], [])) * 1000)
    queue = np.asarray(result["queue_times"])
    assert len(queue) == 4 and (queue >= 0).all()
    assert result["mean_client_queue_time_ms"] == pytest.approx(queue.mean() * 1000)
    assert result["median_e2el_including_client_queue_ms"] == pytest.approx(
        np.median(np.asarray(result["latencies"]) + queue) * 1000)
    assert "Serving Benchmark Result" in proc.stdout
