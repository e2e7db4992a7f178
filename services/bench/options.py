"""What one `epdserve bench serve` command runs, built once from its arguments: where requests go, the
workload (dataset, rates, arrivals, sampling), what the report measures and where results are written.

Our own flag names and `vllm bench serve`'s land in the same fields (--input-len or --random-input-len,
...), so a saved vLLM command line and ours that mean the same workload give equal options. Every mistake
and every vLLM flag that cannot be honoured (vllm_flags.py) stops here, on one line, before a request is sent.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from epdserve.services.bench import datasets, metrics, vllm_flags
from epdserve.services.bench.datasets import DatasetConfig

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
TOKENIZER_MODES = ("auto", "hf", "slow")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                   "repetition_penalty")


class ReportOptions(NamedTuple):
    """What the report measures: goodput SLOs (ms by metric), percentiles and the metrics given them."""
    goodput: dict[str, float]
    percentiles: tuple[float, ...]
    metrics: tuple[str, ...]


class ResultOptions(NamedTuple):
    """Where and how each run's JSON is written."""
    label: str  # --label, else the backend: names files and plot lines
    result_dir: str
    result_filename: str | None
    save_result: bool  # vLLM's file name when there is no --result-filename
    append_result: bool  # one JSON object per line, appended
    save_detailed: bool  # also every generated text
    metadata: dict[str, str]
    trace: bool
    plot: bool


@dataclass(frozen=True)
class BenchOptions:
    """Everything one command runs; two command lines that mean the same workload give equal options."""

    backend: str  # openai, vllm or openai-chat, as the results record it
    base_url: str
    endpoint_path: str
    chat: bool
    model: str | None  # named in every request; None: the server's first model
    model_id: str | None  # the results' model_id: --model as given (vLLM's); None: the server's
    tokenizer: str | None  # --tokenizer, else --model (None: the server's model, once known)
    tokenizer_required: bool  # given as --tokenizer or as --model's folder: failing to load it is an error
    load_tokenizer: bool  # False: --skip-tokenizer-init
    tokenizer_mode: str
    trust_remote_code: bool
    dataset: DatasetConfig
    rates: tuple[float, ...]
    burstiness: float
    arrival: str
    max_concurrency: int | None
    num_warmups: int
    ignore_eos: bool
    body: dict  # sampling fields and --extra-body, merged into every request body
    headers: dict
    request_timeout: float
    ready_check_timeout: float
    request_id_prefix: str | None  # None: one made up at the start
    verify_tls: bool
    progress: bool
    report: ReportOptions
    results: ResultOptions

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchOptions:
        """Checks everything before anything is sent; a mistake is a SystemExit with one line."""
        refused = vllm_flags.refusal(args)
        if refused:
            raise SystemExit(refused)
        if args.dataset_name not in datasets.DATASETS:
            raise SystemExit(f"epdserve bench serve: unknown --dataset-name {args.dataset_name!r}; choose one of "
                             f"{', '.join(datasets.DATASETS)}")
        backend, endpoint_path, chat = _backend_and_endpoint(args)
        local_model = args.model is not None and Path(args.model).is_dir()
        return cls(
            backend=backend, base_url=_base_url(args), endpoint_path=endpoint_path, chat=chat,
            # A local folder is not a name an epdserve proxy serves: the server is asked for its name then.
            model=args.served_model_name or (None if local_model else args.model), model_id=args.model,
            tokenizer=args.tokenizer or args.model, tokenizer_required=bool(args.tokenizer) or local_model,
            load_tokenizer=not args.skip_tokenizer_init,
            tokenizer_mode=_tokenizer_mode(args), trust_remote_code=args.trust_remote_code,
            dataset=_dataset(args), rates=_rates(args), burstiness=args.burstiness, arrival=args.arrival,
            max_concurrency=_max_concurrency(args), num_warmups=args.num_warmups, ignore_eos=_ignore_eos(args),
            body=_body(args, chat), headers=_headers(args), request_timeout=args.request_timeout,
            ready_check_timeout=args.ready_check_timeout_sec, request_id_prefix=args.request_id_prefix,
            verify_tls=not args.insecure, progress=not args.disable_tqdm, report=_report(args),
            results=ResultOptions(args.label or backend, args.result_dir, args.result_filename, args.save_result,
                                  args.append_result, args.save_detailed, _pairs(args.metadata, "--metadata"),
                                  args.trace, not args.no_plot))


def _backend_and_endpoint(args: argparse.Namespace) -> tuple[str, str, bool]:
    """(backend, endpoint path, chat). Without --backend it follows --endpoint (or the dataset); without
    --endpoint the backend's API (vLLM's default is /v1/completions whatever the backend)."""
    chat_only = args.dataset_name in datasets.CHAT_ONLY
    if args.backend is None:
        path = args.endpoint or (CHAT_PATH if chat_only else COMPLETIONS_PATH)
        backend = "openai-chat" if path.rstrip("/").endswith("chat/completions") else "openai"
    else:
        backend = args.backend
        path = args.endpoint or (CHAT_PATH if vllm_flags.BACKENDS[backend] == "chat" else COMPLETIONS_PATH)
    chat = backend == "openai-chat"
    expected = "chat/completions" if chat else "completions"
    if not path.rstrip("/").endswith(expected) or (not chat and path.rstrip("/").endswith("chat/completions")):
        raise SystemExit(f"epdserve bench serve: --endpoint {path} does not fit --backend {backend}, which sends "
                         f"{'chat' if chat else 'completion'} requests to a path ending in /{expected}")
    if chat_only and not chat:
        raise SystemExit(f"epdserve bench serve: the {args.dataset_name} dataset needs a chat endpoint "
                         f"({CHAT_PATH}, --backend openai-chat)")
    return backend, path, chat


def _base_url(args: argparse.Namespace) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    host = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
    return f"http://{host}:{args.port}"


def _tokenizer_mode(args: argparse.Namespace) -> str:
    if args.tokenizer_mode not in TOKENIZER_MODES:
        raise SystemExit(f"epdserve bench serve: --tokenizer-mode {args.tokenizer_mode} is not supported: prompts are "
                         f"built with Hugging Face tokenizers only ({', '.join(TOKENIZER_MODES)})")
    return args.tokenizer_mode


def _dataset(args: argparse.Namespace) -> DatasetConfig:
    """vLLM's precedence: --input-len and --output-len, when given, override the dataset-specific lengths."""
    name = args.dataset_name
    if args.dataset_path and name != "sharegpt":
        raise SystemExit(f"epdserve bench serve: --dataset-path is read by --dataset-name sharegpt, not {name}")
    for flag, given in (("--disable-shuffle", args.disable_shuffle), ("--no-oversample", args.no_oversample)):
        if given and name != "sharegpt":
            raise SystemExit(f"epdserve bench serve: {flag} is read by --dataset-name sharegpt, not {name}")
    config = DatasetConfig(
        name, args.num_prompts, args.seed,
        input_len=args.random_input_len if args.input_len is None else args.input_len,
        output_len=args.random_output_len if args.output_len is None else args.output_len,
        range_ratio=args.random_range_ratio, prefix_len=args.random_prefix_len,
        lognormal_sigma=args.lognormal_sigma, lognormal_max_len=args.lognormal_max_len,
        dataset_path=args.dataset_path,
        sharegpt_output_len=args.output_len if args.output_len is not None and name == "sharegpt"
        else args.sharegpt_output_len,
        shuffle=not args.disable_shuffle, oversample=not args.no_oversample, turns=args.multi_turn_turns,
        conversation_prefix_len=args.multi_turn_prefix_len, image_width=args.image_width,
        image_height=args.image_height, images_per_request=args.images_per_request)
    try:
        datasets.check(config)
    except ValueError as exc:
        raise SystemExit(f"epdserve bench serve: {exc}") from None
    return config


def _rates(args: argparse.Namespace) -> tuple[float, ...]:
    if not all(rate > 0 for rate in args.request_rate):
        raise SystemExit("epdserve bench serve: --request-rate: every rate must be positive (inf: all at once)")
    if not args.burstiness > 0:
        raise SystemExit("epdserve bench serve: --burstiness must be positive (1: a Poisson process)")
    return tuple(args.request_rate)


def _max_concurrency(args: argparse.Namespace) -> int | None:
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise SystemExit("epdserve bench serve: --max-concurrency must be at least 1 (leave it out for no cap)")
    return args.max_concurrency


def _ignore_eos(args: argparse.Namespace) -> bool:
    """As vLLM: on for synthetic prompts (random ones would stop at random), as given otherwise."""
    if args.ignore_eos is not None:
        return args.ignore_eos
    return args.dataset_name != "sharegpt"


def _body(args: argparse.Namespace, chat: bool) -> dict:
    body = {name: getattr(args, name) for name in SAMPLING_FIELDS if getattr(args, name) is not None}
    if args.logprobs is not None:
        if chat:
            raise SystemExit("epdserve bench serve: --logprobs is sent with completion requests only (as vLLM's "
                             "openai-chat backend, which leaves it out); for chat use --extra-body "
                             "'{\"logprobs\": true, \"top_logprobs\": N}'")
        body["logprobs"] = args.logprobs
    return body | args.extra_body


def _headers(args: argparse.Namespace) -> dict:
    headers = _pairs(args.header, "--header")
    if args.api_key:
        headers.setdefault("Authorization", f"Bearer {args.api_key}")
    return headers


def _report(args: argparse.Namespace) -> ReportOptions:
    try:
        goodput = metrics.parse_goodput(args.goodput)
    except ValueError as exc:
        raise SystemExit(f"epdserve bench serve: {exc}") from None
    chosen = tuple(m for m in args.percentile_metrics.split(",") if m)
    unknown = set(chosen) - set(metrics.PERCENTILE_METRICS)
    if unknown:
        raise SystemExit(f"epdserve bench serve: --percentile-metrics: unknown {sorted(unknown)}; choose from "
                         f"{', '.join(metrics.PERCENTILE_METRICS)}")
    try:
        percentiles = tuple(float(p) for p in args.metric_percentiles.split(",") if p)
    except ValueError:
        raise SystemExit(f"epdserve bench serve: --metric-percentiles {args.metric_percentiles!r}: expected "
                         f"comma-separated numbers, e.g. 50,90,99") from None
    if not all(0 <= p <= 100 for p in percentiles):
        raise SystemExit("epdserve bench serve: --metric-percentiles: each must be between 0 and 100")
    return ReportOptions(goodput, percentiles, chosen)


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"epdserve bench serve: {what} {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out

