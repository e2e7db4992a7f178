"""`epdserve bench serve`: load-test an OpenAI-compatible server and write `vllm bench serve`-shaped JSON.

    epdserve bench serve --base-url http://127.0.0.1:8000 --dataset-name random --input-len 128 \\
        --output-len 32 --num-prompts 50 --request-rate 1 2 inf --tokenizer "$(epdserve model llava-demo)"

Each request rate is one run: a JSON file `bench_<label>_<rate>qps[_c<N>].json` in --result-dir, and
PNG plots beside it (latency CDFs of every rate; throughput and latency against rate when several).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


class _HelpFormatter(argparse.HelpFormatter):
    """Adds an option's default to its help once: not when the help already says it, nor when there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        none = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if "default" in text or not action.option_strings or none or action.default in ([], {}):
            return text
        return f"{text} (default: %(default)s)"


def add_bench_parser(subparsers) -> None:
    """Adds `bench serve` to the `epdserve` command's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmark a running OpenAI-compatible server")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    p = kinds.add_parser("serve", help="send a synthetic workload, report TTFT/TPOT/ITL/E2EL, throughput, goodput",
                         formatter_class=_HelpFormatter)
    _add_target_options(p.add_argument_group("target"))
    _add_dataset_options(p.add_argument_group("dataset"))
    _add_load_options(p.add_argument_group("load"))
    _add_result_options(p.add_argument_group("results"))
    p.set_defaults(func=_serve_command)


def _add_target_options(target) -> None:
    target.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    target.add_argument("--host", default="127.0.0.1", help="server host, without --base-url")
    target.add_argument("--port", type=int, default=8000, help="server port, without --base-url")
    target.add_argument("--endpoint", help=f"default {COMPLETIONS_PATH}; {CHAT_PATH} for multi-turn and image")
    target.add_argument("--model", help="model name sent in requests (default: the server's first model); a local "
                                        "folder is used as --tokenizer and the name is asked from the server")
    target.add_argument("--tokenizer", help="HF tokenizer folder to build exact-length prompts (default: --model "
                                            "when that is a folder; without one prompts are plain random words)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token ($OPENAI_API_KEY)")
    target.add_argument("--header", nargs="*", default=[], metavar="KEY=VALUE", help="extra HTTP headers")
    target.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    target.add_argument("--ready-check-timeout-sec", type=float, default=0.0,
                        help="wait this long for GET /v1/models to answer before starting (0: no wait)")


def _add_dataset_options(data) -> None:
    from epdserve.services.bench.datasets import DATASETS

    data.add_argument("--dataset-name", default="random", choices=DATASETS,
                      help="random: exact-length random prompts; lognormal: random prompts with log-normal "
                           "lengths; sharegpt: real conversations from --dataset-path; multi-turn: conversations "
                           "that resend their history; image: prompts with generated images")
    data.add_argument("--dataset-path", metavar="FILE",
                      help="the ShareGPT JSON file (sharegpt), e.g. ShareGPT_V3_unfiltered_cleaned_split.json")
    data.add_argument("--num-prompts", type=int, default=100, help="requests per run (multi-turn: all turns)")
    data.add_argument("--input-len", type=int, default=1024,
                      help="prompt tokens (lognormal: the median; multi-turn: each user turn)")
    data.add_argument("--output-len", type=int, default=128, help="max tokens per reply (lognormal: the median)")
    data.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*(1 -+ r)")
    data.add_argument("--random-prefix-len", type=int, default=0, help="a prefix shared by every random prompt")
    data.add_argument("--lognormal-sigma", type=float, default=0.8, help="log-normal spread of the lengths")
    data.add_argument("--lognormal-max-len", type=int, default=2048, help="longest prompt or reply")
    data.add_argument("--sharegpt-output-len", type=int,
                      help="output tokens of every sharegpt request (unset: the conversation's reply length)")
    data.add_argument("--multi-turn-turns", type=int, default=4, help="requests per conversation")
    data.add_argument("--multi-turn-prefix-len", type=int, default=1024, help="opening document of a conversation")
    data.add_argument("--image-width", type=int, default=224, help="pixels of each generated image (image)")
    data.add_argument("--image-height", type=int, default=224, help="pixels of each generated image (image)")
    data.add_argument("--images-per-request", type=int, default=1, help="images in each request (image)")
    data.add_argument("--seed", type=int, default=0,
                      help="seed of prompts, lengths and arrivals; the n-th request rate runs with seed + n")


def _add_load_options(load) -> None:
    load.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                      help="requests per second; several values run one after another; inf sends all at once "
                           "(default: inf)")
    load.add_argument("--arrival", default="poisson", choices=["poisson", "fixed"],
                      help="poisson: gamma gaps (see --burstiness); fixed: exactly 1/rate apart")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson, <1 burstier")
    load.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    load.add_argument("--num-warmups", type=int, default=1, help="untimed requests before each run")
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                      help="generate exactly --output-len tokens (synthetic prompts would stop at random)")
    load.add_argument("--temperature", type=float, help="sent with every request (unset: the server's default)")
    load.add_argument("--top-p", type=float, help="sent with every request (unset: the server's default)")
    load.add_argument("--top-k", type=int, help="sent with every request (unset: the server's default)")
    load.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")


def _add_result_options(out) -> None:
    out.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                     help="comma-separated metrics whose percentiles are reported")
    out.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated percentiles")
    out.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs for goodput: ttft, tpot, e2el in ms")
    out.add_argument("--label", help="name of the run in files and plots (default: openai or openai-chat)")
    out.add_argument("--result-dir", default=".", help="folder of the JSON results and PNG plots")
    out.add_argument("--result-filename", help="JSON file name (several rates: _<rate>qps is inserted)")
    out.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="recorded in the JSON")
    out.add_argument("--save-detailed", action="store_true", help="also keep every generated text")
    out.add_argument("--trace", action="store_true",
                     help="record each request's server-side breakdown (an epdserve proxy started with "
                          "--request-trace sends it) in the JSON's `traces`, and summarize the KV transfer: "
                          "median time, bytes, and share of TTFT")
    out.add_argument("--no-plot", action="store_true", help="write no PNG plots")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{what} {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def result_path(args: argparse.Namespace, label: str, rate: float) -> Path:
    suffix = f"_c{args.max_concurrency}" if args.max_concurrency else ""
    if args.result_filename:
        name = Path(args.result_filename)
        if len(args.request_rate) > 1:
            name = name.with_name(f"{name.stem}_{rate_name(rate)}qps{name.suffix}")
        return Path(args.result_dir) / name
    return Path(args.result_dir) / f"bench_{label}_{rate_name(rate)}qps{suffix}.json"


def _load_tokenizer(args: argparse.Namespace):
    source = args.tokenizer or (args.model if args.model and Path(args.model).is_dir() else None)
    if source is None:
        return None, None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source), source
    except (OSError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SystemExit(f"epdserve bench serve: cannot load the tokenizer {source!r}: {first_line}") from None


def _server_model(base_url: str, headers: dict, timeout: float) -> str:
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(base_url + "/v1/models", headers=headers, timeout=10)
            r.raise_for_status()
            return r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            if time.monotonic() >= deadline:
                raise SystemExit(f"cannot list the models of {base_url}: {exc}") from None
            time.sleep(1.0)


def print_summary(result: dict, percentiles: list[float], metrics: list[str]) -> None:
    from epdserve.services.bench.metrics import percentile_key

    row = lambda name, value, fmt="{:<10}": print(f"{name:<40} " + fmt.format(value))  # noqa: E731
    print("{:=^50}".format(" Serving Benchmark Result "))
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result["max_concurrency"] is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Request rate configured (RPS):", result["request_rate"])
    row("Benchmark duration (s):", result["duration"], "{:<10.2f}")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Total cached prompt tokens:", result["total_cached_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], "{:<10.2f}")
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", result["output_throughput"], "{:<10.2f}")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], "{:<10.2f}")
    row("Peak concurrent requests:", result["max_concurrent_requests"])
    row("Total token throughput (tok/s):", result["total_token_throughput"], "{:<10.2f}")
    titles = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
              "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency"),
              "later_turns_ttft": ("TTFT", "TTFT of turns after the first")}
    for metric in [*metrics, "later_turns_ttft"]:
        if f"mean_{metric}_ms" not in result:
            continue
        short, header = titles[metric]
        print("{:-^50}".format(header))
        row(f"Mean {short} (ms):", result[f"mean_{metric}_ms"], "{:<10.2f}")
        row(f"Median {short} (ms):", result[f"median_{metric}_ms"], "{:<10.2f}")
        for p in percentiles:
            key = percentile_key(p)
            row(f"{key.upper()} {short} (ms):", result[f"{key}_{metric}_ms"], "{:<10.2f}")
    if "traced_requests" in result:
        print("{:-^50}".format("Server-side traces"))
        row("Traced requests:", result["traced_requests"])
        row("Requests that pulled KV:", result["kv_transfer_requests"])
        row("Requests that recomputed the prompt:", result["kv_recompute_requests"])
        row("Median KV transfer (ms):", result["median_kv_transfer_ms"], "{:<10.2f}")
        row("Median KV transfer (bytes):", result["median_kv_transfer_bytes"], "{:<10.0f}")
        row("Median KV transfer / TTFT:", result["median_kv_transfer_ttft_ratio"], "{:<10.3f}")
    print("=" * 50, flush=True)


def _serve_command(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from epdserve.services.bench import datasets, runner

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the report

    report = _ReportOptions.from_args(args)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint_path = args.endpoint or (CHAT_PATH if args.dataset_name in datasets.CHAT_ONLY else COMPLETIONS_PATH)
    chat = endpoint_path.rstrip("/").endswith("chat/completions")
    if args.dataset_name in datasets.CHAT_ONLY and not chat:
        raise SystemExit(f"the {args.dataset_name} dataset needs a chat endpoint ({CHAT_PATH})")
    headers = _pairs(args.header, "--header")
    if args.api_key:
        headers.setdefault("Authorization", f"Bearer {args.api_key}")
    tokenizer, tokenizer_id = _load_tokenizer(args)
    text = datasets.TextSource(tokenizer)
    config, runs = _sample_runs(args, text)
    model = args.model if args.model and not Path(args.model).is_dir() else None
    model = model or _server_model(base_url, headers, args.ready_check_timeout_sec)
    warmups = datasets.warmup_requests(config, text, args.num_warmups)
    sampling = {k: v for k, v in {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}.items()
                if v is not None}
    endpoint = runner.Endpoint(base_url + endpoint_path, model, chat, args.ignore_eos, headers,
                               sampling | args.extra_body, args.request_timeout,
                               f"bench-{datetime.now().strftime('%H%M%S')}-")
    label = args.label or ("openai-chat" if chat else "openai")
    count_tokens = (lambda s: len(tokenizer.encode(s, add_special_tokens=False))) if tokenizer is not None else None
    print(f"{label}: {args.num_prompts} {args.dataset_name} requests to {endpoint.api_url} (model {model}), "
          f"rates {[rate_name(r) for r in args.request_rate]}, max concurrency {args.max_concurrency}", flush=True)

    results: list[dict] = []
    Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    for i, (rate, samples) in enumerate(zip(args.request_rate, runs)):
        shape = runner.LoadShape(rate, args.burstiness, args.arrival, args.max_concurrency, args.seed + i)
        outputs, duration = asyncio.run(runner.run_load(endpoint, samples, shape, warmups, not args.disable_tqdm,
                                                        count_tokens))
        kind = "openai-chat" if chat else "openai"
        header = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": kind, "backend": kind,
                  "label": label, "model_id": model,
                  "tokenizer_id": tokenizer_id, "base_url": base_url, "endpoint": endpoint_path,
                  "dataset_name": args.dataset_name, "seed": args.seed + i, "num_prompts": len(samples)}
        results.append(_record_run(args, report, header, rate, outputs, duration))
    if not args.no_plot:
        _plot(args, label, results)
    return 0 if all(r["completed"] for r in results) else 1


class _ReportOptions(NamedTuple):
    """What the report measures: goodput SLOs (ms by metric), percentiles and the metrics given them."""
    goodput: dict[str, float]
    percentiles: list[float]
    metrics: list[str]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> _ReportOptions:
        from epdserve.services.bench import metrics

        try:
            goodput = metrics.parse_goodput(args.goodput)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        chosen = [m for m in args.percentile_metrics.split(",") if m]
        unknown = set(chosen) - set(metrics.PERCENTILE_METRICS)
        if unknown:
            raise SystemExit(f"--percentile-metrics: unknown {sorted(unknown)}; "
                             f"choose from {metrics.PERCENTILE_METRICS}")
        return cls(goodput, [float(p) for p in args.metric_percentiles.split(",") if p], chosen)


def _sample_runs(args: argparse.Namespace, text) -> tuple:
    """The dataset config and every run's prompts, sampled before the first request: a bad dataset fails
    here, not after a run. Each rate gets its own prompts (seed + n): a prefix cache must not serve one
    run from an earlier one's."""
    from epdserve.services.bench import datasets

    if args.dataset_path and args.dataset_name != "sharegpt":
        raise SystemExit(f"--dataset-path is read by --dataset-name sharegpt, not {args.dataset_name}")
    config = datasets.DatasetConfig(
        args.dataset_name, args.num_prompts, args.seed, args.input_len, args.output_len,
        range_ratio=args.random_range_ratio, prefix_len=args.random_prefix_len,
        lognormal_sigma=args.lognormal_sigma, lognormal_max_len=args.lognormal_max_len,
        dataset_path=args.dataset_path, sharegpt_output_len=args.sharegpt_output_len, turns=args.multi_turn_turns,
        conversation_prefix_len=args.multi_turn_prefix_len, image_width=args.image_width,
        image_height=args.image_height, images_per_request=args.images_per_request)
    try:
        runs = [datasets.sample_requests(replace(config, seed=args.seed + i), text)
                for i in range(len(args.request_rate))]
    except ValueError as exc:
        raise SystemExit(f"epdserve bench serve: {exc}") from None
    return config, runs


def _record_run(args: argparse.Namespace, report: _ReportOptions, header: dict, rate: float, outputs,
                duration: float) -> dict:
    """One rate's result: summarized, printed, and written as `vllm bench serve`-shaped JSON."""
    from epdserve.services.bench import metrics

    result = {
        **header,
        **_pairs(args.metadata, "--metadata"),
        "request_rate": rate_name(rate) if math.isinf(rate) else rate,
        "burstiness": args.burstiness,
        "arrival": args.arrival,
        "max_concurrency": args.max_concurrency,
        "goodput_slo_ms": report.goodput or None,
        **metrics.summarize(outputs, duration, report.percentiles, report.metrics, report.goodput),
        **metrics.per_request(outputs, args.save_detailed),
    }
    if args.trace:
        result |= metrics.trace_summary(outputs)
        result.setdefault("traces", [None] * len(outputs))
        if not result["traced_requests"]:
            print("--trace: no response carried epdserve_trace (start the proxy, or `epdserve up`, with "
                  "--request-trace)", file=sys.stderr)
    else:
        result.pop("traces", None)
    print_summary(result, report.percentiles, report.metrics)
    for e in [e for e in result["errors"] if e][:5]:
        print(f"error: {e}", file=sys.stderr)
    path = result_path(args, header["label"], rate)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return result


def _plot(args: argparse.Namespace, label: str, results: list[dict]) -> None:
    try:
        from epdserve.services.bench import plots
    except ImportError as exc:
        print(f"no plots ({exc}); install matplotlib", file=sys.stderr)
        return
    stem = result_path(args, label, args.request_rate[0]).stem
    if len(results) > 1:
        stem = re.sub(r"_[^_]*qps", "", stem, count=1)
    by_rate = {("all at once" if r["request_rate"] == "inf" else f"{r['request_rate']:g} req/s"): r for r in results}
    title = plots.describe(results)
    if args.label:
        title = f"{args.label}: {title}"
    try:
        paths = [plots.plot_latency_cdfs(by_rate, Path(args.result_dir) / f"{stem}_cdf.png", title)]
        if len(results) > 1:
            paths.append(plots.plot_rate_sweep({label: results}, Path(args.result_dir) / f"{stem}_rates.png", title))
    except ImportError as exc:
        print(f"no plots ({exc}); install matplotlib", file=sys.stderr)
        return
    print("wrote " + ", ".join(str(p) for p in paths))
