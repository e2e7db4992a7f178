"""`epdserve bench serve`: load-test an OpenAI-compatible server and write `vllm bench serve`'s result JSON.

    epdserve bench serve --base-url http://127.0.0.1:8000 --dataset-name random --input-len 128 \\
        --output-len 32 --num-prompts 50 --request-rate 1 2 inf --tokenizer "$(epdserve model llava-demo)"

It takes `vllm bench serve`'s flags with their meaning (--backend, --random-input-len, --save-result, ...)
beside its own names; a vLLM flag it cannot honour stops it with the reason. Each request rate is one run:
a JSON file in --result-dir (named as result.py says), and PNG plots beside it (latency CDFs of every rate;
throughput and latency against rate when several).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from datetime import datetime
from pathlib import Path

from epdserve.services.bench.options import CHAT_PATH, COMPLETIONS_PATH, TOKENIZER_MODES, BenchOptions


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
    from epdserve.services.bench.vllm_flags import add_refused_flags

    bench = subparsers.add_parser("bench", help="benchmark a running OpenAI-compatible server")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    p = kinds.add_parser("serve", help="send a synthetic workload, report TTFT/TPOT/ITL/E2EL, throughput, goodput",
                         formatter_class=_HelpFormatter,
                         epilog="`vllm bench serve` flags are taken with vLLM's meaning; the ones this command "
                                "cannot honour (--profile, --ramp-up-strategy, other datasets' flags, ...) are "
                                "refused with the reason.")
    _add_target_options(p.add_argument_group("target"))
    _add_dataset_options(p.add_argument_group("dataset"))
    _add_load_options(p.add_argument_group("load"))
    _add_result_options(p.add_argument_group("results"))
    add_refused_flags(p)
    p.set_defaults(func=_serve_command)


def _add_target_options(target) -> None:
    target.add_argument("--backend", metavar="{openai,vllm,openai-chat}",
                        help=f"openai and vllm (its alias) send completion requests, to {COMPLETIONS_PATH} unless "
                             f"--endpoint says otherwise; openai-chat sends chat requests, to {CHAT_PATH} (default: "
                             f"what --endpoint is, else openai; openai-chat for multi-turn and image)")
    target.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    target.add_argument("--host", default="127.0.0.1", help="server host, without --base-url")
    target.add_argument("--port", type=int, default=8000, help="server port, without --base-url")
    target.add_argument("--endpoint", help="API path (default: the backend's)")
    target.add_argument("--model", help="the model: results' model_id, named in requests (default: the server's "
                                        "first model); a local folder is also the tokenizer, and the name "
                                        "requests use is then asked from the server")
    target.add_argument("--served-model-name", help="the name requests use, when it is not --model")
    target.add_argument("--tokenizer", help="HF tokenizer (a folder, or a hub name in the local HF cache) that "
                                            "builds exact-length prompts (default: the model's when there is one "
                                            "here; without one prompts are plain random words)")
    target.add_argument("--tokenizer-mode", default="auto", metavar="{" + ",".join(TOKENIZER_MODES) + "}",
                        help="auto and hf: the HF tokenizer, fast when it has one; slow: its Python version")
    target.add_argument("--trust-remote-code", action="store_true", help="let the tokenizer run its own code")
    target.add_argument("--skip-tokenizer-init", action="store_true",
                        help="load no tokenizer: prompts are plain random words")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token ($OPENAI_API_KEY)")
    target.add_argument("--header", nargs="*", default=[], metavar="KEY=VALUE", help="extra HTTP headers")
    target.add_argument("--insecure", action="store_true", help="do not verify the server's TLS certificate")
    target.add_argument("--request-id-prefix", help="X-Request-Id of request i is PREFIX<i> (default: bench-<time>-)")
    target.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    target.add_argument("--ready-check-timeout-sec", type=float, default=0.0,
                        help="wait this long for GET /v1/models to answer before starting (0: no wait)")


def _add_dataset_options(data) -> None:
    from epdserve.services.bench.datasets import DATASETS

    data.add_argument("--dataset-name", default="random", metavar="{" + ",".join(DATASETS) + "}",
                      help="random: exact-length random prompts; lognormal: random prompts with log-normal "
                           "lengths; sharegpt: real conversations from --dataset-path; multi-turn: conversations "
                           "that resend their history; image: prompts with generated images")
    data.add_argument("--dataset-path", metavar="FILE",
                      help="the ShareGPT JSON file (sharegpt), e.g. ShareGPT_V3_unfiltered_cleaned_split.json")
    data.add_argument("--num-prompts", type=int, default=1000, help="requests per run (multi-turn: all turns)")
    data.add_argument("--random-input-len", type=int, default=1024,
                      help="prompt tokens (lognormal: the median; multi-turn: each user turn)")
    data.add_argument("--random-output-len", type=int, default=128,
                      help="max tokens per reply (lognormal: the median)")
    data.add_argument("--input-len", type=int, help="overrides --random-input-len, as vLLM's general length")
    data.add_argument("--output-len", type=int,
                      help="overrides --random-output-len and --sharegpt-output-len, as vLLM's general length")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in len*(1 -+ r), r in [0, 1)")
    data.add_argument("--random-prefix-len", type=int, default=0,
                      help="a prefix shared by every random prompt, before its --random-input-len tokens")
    data.add_argument("--lognormal-sigma", type=float, default=0.8, help="log-normal spread of the lengths")
    data.add_argument("--lognormal-max-len", type=int, default=2048, help="longest prompt or reply")
    data.add_argument("--sharegpt-output-len", type=int,
                      help="output tokens of every sharegpt request (unset: the conversation's reply length)")
    data.add_argument("--disable-shuffle", action="store_true", help="sharegpt: conversations in file order")
    data.add_argument("--no-oversample", action="store_true",
                      help="sharegpt: fewer requests when the file has too few usable conversations, rather "
                           "than drawing some again")
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
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction,
                      help="generate every reply to its full length (default: on, except for sharegpt, whose "
                           "replies end where the model ends them, as vLLM)")
    for name, kind in (("temperature", float), ("top-p", float), ("top-k", int), ("min-p", float),
                       ("frequency-penalty", float), ("presence-penalty", float), ("repetition-penalty", float)):
        load.add_argument(f"--{name}", type=kind, help="sent with every request (unset: the server's default)")
    load.add_argument("--logprobs", type=int, help="log probabilities per token asked of completion requests")
    load.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request body")


def _add_result_options(out) -> None:
    from epdserve.services.bench.metrics import PERCENTILE_METRICS

    out.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                     help=f"comma-separated metrics whose percentiles are reported, of {','.join(PERCENTILE_METRICS)} "
                          "(the client queue's under --max-concurrency only)")
    out.add_argument("--metric-percentiles", default="50,90,99", help="comma-separated percentiles")
    out.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="SLOs for goodput: ttft, tpot, e2el in ms")
    out.add_argument("--label", help="name of the run in files and plots (default: the backend)")
    out.add_argument("--result-dir", default=".", help="folder of the JSON results and PNG plots")
    out.add_argument("--result-filename", help="JSON file name (several rates: _<rate>qps is inserted)")
    out.add_argument("--save-result", action="store_true",
                     help="name the JSON as vLLM does: <label>-<rate>qps[-concurrency<N>]-<model>-<date>.json "
                          "(without it: bench_<label>_<rate>qps[_c<N>].json; either way it is written)")
    out.add_argument("--append-result", action="store_true",
                     help="append the JSON to the file as one line, after what it holds")
    out.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE", help="recorded in the JSON")
    out.add_argument("--save-detailed", action="store_true", help="also keep every generated text")
    out.add_argument("--trace", action="store_true",
                     help="record each request's server-side breakdown (an epdserve proxy started with "
                          "--request-trace sends it) in the JSON's `traces`, and summarize the KV transfer: "
                          "median time, bytes, and share of TTFT")
    out.add_argument("--no-plot", action="store_true", help="write no PNG plots")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _load_tokenizer(options: BenchOptions, source: str | None):
    """(tokenizer, where it came from), or (None, None) without one. One given as --tokenizer or as --model's
    folder must load; the model's otherwise is taken only from here (its folder or the local HF cache)."""
    if source is None:
        return None, None
    from transformers import AutoTokenizer

    kwargs = {"trust_remote_code": options.trust_remote_code, "use_fast": options.tokenizer_mode != "slow"}
    try:
        if options.tokenizer_required or Path(source).is_dir():
            return AutoTokenizer.from_pretrained(source, **kwargs), source
        return AutoTokenizer.from_pretrained(source, local_files_only=True, **kwargs), source
    except (OSError, ValueError) as exc:
        if options.tokenizer_required or Path(source).is_dir():
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SystemExit(f"epdserve bench serve: cannot load the tokenizer {source!r}: {first_line}") from None
        print(f"no tokenizer of {source!r} here: prompts are plain random words (give --tokenizer for "
              f"exact lengths)", file=sys.stderr)
        return None, None


def _server_model(options: BenchOptions) -> tuple[str, str]:
    """(name, root) of the server's first model, as /v1/models lists it."""
    import time

    import httpx

    deadline = time.monotonic() + options.ready_check_timeout
    while True:
        try:
            r = httpx.get(options.base_url + "/v1/models", headers=options.headers, timeout=10,
                          verify=options.verify_tls)
            r.raise_for_status()
            first = r.json()["data"][0]
            return first["id"], first.get("root") or first["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            if time.monotonic() >= deadline:
                raise SystemExit(f"cannot list the models of {options.base_url}: {exc}") from None
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
              "client_queue_time": ("client queue", "Waiting for a slot under the concurrency cap"),
              "e2el_including_client_queue": ("E2EL + queue", "End-to-end Latency including that wait"),
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

    from epdserve.services.bench import datasets, result, runner

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the report

    options = BenchOptions.from_args(args)
    model, root = options.model, options.model_id
    if model is None or root is None:
        served, served_root = _server_model(options)
        model, root = model or served, root or served_root
    tokenizer, tokenizer_id = _load_tokenizer(options, (options.tokenizer or root) if options.load_tokenizer else None)
    text = datasets.TextSource(tokenizer)
    runs = _sample_runs(options, text)
    warmups = datasets.warmup_requests(options.dataset, text, options.num_warmups)
    endpoint = runner.Endpoint(options.base_url + options.endpoint_path, model, options.chat, options.ignore_eos,
                               options.headers, options.body, options.request_timeout,
                               options.request_id_prefix or f"bench-{datetime.now().strftime('%H%M%S')}-",
                               options.verify_tls)
    count_tokens = (lambda s: len(tokenizer.encode(s, add_special_tokens=False))) if tokenizer is not None else None
    print(f"{options.results.label}: {options.dataset.num_prompts} {options.dataset.name} requests to "
          f"{endpoint.api_url} (model {model}), rates {[result.rate_name(r) for r in options.rates]}, "
          f"max concurrency {options.max_concurrency}", flush=True)

    results: list[dict] = []
    for i, (rate, samples) in enumerate(zip(options.rates, runs)):
        shape = runner.LoadShape(rate, options.burstiness, options.arrival, options.max_concurrency,
                                 options.dataset.seed + i)
        outputs, duration = asyncio.run(runner.run_load(endpoint, samples, shape, warmups, options.progress,
                                                        count_tokens))
        date = datetime.now().strftime("%Y%m%d-%H%M%S")
        header = {"date": date, "endpoint_type": options.backend, "backend": options.backend,
                  "label": options.results.label, "model_id": root, "tokenizer_id": tokenizer_id,
                  "base_url": options.base_url, "endpoint": options.endpoint_path,
                  "dataset_name": options.dataset.name, "seed": options.dataset.seed + i, "num_prompts": len(samples)}
        run = result.record(options, header, rate, outputs, duration)
        _report_run(options, run)
        path = result.result_path(options, root, date, rate)
        result.write(options, run, path)
        print(f"wrote {path}")
        results.append(run)
    if options.results.plot:
        _plot(options, results, result.result_path(options, root, results[0]["date"],
                                                   options.rates[0] if len(results) == 1 else None))
    return 0 if all(r["completed"] for r in results) else 1


def _sample_runs(options: BenchOptions, text) -> list:
    """Every run's prompts, sampled before the first request: a bad dataset fails here, not after a run.
    Each rate gets its own prompts (seed + n): a prefix cache must not serve one run from an earlier one's."""
    from dataclasses import replace

    from epdserve.services.bench import datasets

    try:
        return [datasets.sample_requests(replace(options.dataset, seed=options.dataset.seed + i), text)
                for i in range(len(options.rates))]
    except ValueError as exc:
        raise SystemExit(f"epdserve bench serve: {exc}") from None


def _report_run(options: BenchOptions, run: dict) -> None:
    print_summary(run, list(options.report.percentiles), list(options.report.metrics))
    if options.results.trace and not run["traced_requests"]:
        print("--trace: no response carried epdserve_trace (start the proxy, or `epdserve up`, with "
              "--request-trace)", file=sys.stderr)
    for e in [e for e in run["errors"] if e][:5]:
        print(f"error: {e}", file=sys.stderr)


def _plot(options: BenchOptions, results: list[dict], json_path: Path) -> None:
    """Latency CDFs of every run, and the rate sweep when there are several, named after the JSON."""
    try:
        from epdserve.services.bench import plots
    except ImportError as exc:
        print(f"no plots ({exc}); install matplotlib", file=sys.stderr)
        return
    label = options.results.label
    by_rate = {("all at once" if r["request_rate"] == "inf" else f"{r['request_rate']:g} req/s"): r for r in results}
    title = plots.describe(results)
    if label != options.backend:  # a name of the user's own
        title = f"{label}: {title}"
    stem = json_path.parent / json_path.stem
    try:
        paths = [plots.plot_latency_cdfs(by_rate, Path(f"{stem}_cdf.png"), title)]
        if len(results) > 1:
            paths.append(plots.plot_rate_sweep({label: results}, Path(f"{stem}_rates.png"), title))
    except ImportError as exc:
        print(f"no plots ({exc}); install matplotlib", file=sys.stderr)
        return
    print("wrote " + ", ".join(str(p) for p in paths))
