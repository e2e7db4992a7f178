"""One run's result: `vllm bench serve`'s JSON (its keys, its units: seconds per request, milliseconds in
every statistic) plus ours, and the file it is written to.

Files are named as vLLM names them under --save-result (`<label>-<rate>qps[-concurrency<N>]-<model>-<date>.json`),
`bench_<label>_<rate>qps[_c<N>].json` otherwise, or --result-filename; --append-result adds one JSON object
per line to the file, as vLLM does.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from epdserve.services.bench import metrics
from epdserve.services.bench.metrics import RequestOutput
from epdserve.services.bench.options import BenchOptions

# Measured only where vLLM measures them: the client queue under a concurrency cap, and E2EL including it
# at a finite rate (at rate inf every request is due at once, so its wait is the run's backlog).
QUEUE_METRICS = ("client_queue_time", "e2el_including_client_queue")


def rate_name(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def result_path(options: BenchOptions, model_id: str, date: str, rate: float | None) -> Path:
    """The JSON file of the run at `rate`; rate None: the name without a rate, for what covers every run."""
    res, concurrency = options.results, options.max_concurrency
    if res.result_filename:
        name = Path(res.result_filename)
        if rate is not None and len(options.rates) > 1:
            name = name.with_name(f"{name.stem}_{rate_name(rate)}qps{name.suffix}")
        return Path(res.result_dir) / name
    if res.save_result or res.append_result:
        # vLLM's name: the rate as Python prints a float (4.0, inf), the model's last path part.
        parts = [res.label, *([f"{float(rate)}qps"] if rate is not None else []),
                 *([f"concurrency{concurrency}"] if concurrency is not None else []),
                 model_id.rstrip("/").split("/")[-1], date]
        return Path(res.result_dir) / ("-".join(parts) + ".json")
    parts = ["bench", res.label, *([f"{rate_name(rate)}qps"] if rate is not None else []),
             *([f"c{concurrency}"] if concurrency else [])]
    return Path(res.result_dir) / ("_".join(parts) + ".json")


def reported_metrics(options: BenchOptions, rate: float) -> list[str]:
    out = []
    for name in options.report.metrics:
        if name in QUEUE_METRICS and (options.max_concurrency is None
                                      or (name == "e2el_including_client_queue" and math.isinf(rate))):
            print(f"--percentile-metrics {name}: not reported at rate {rate_name(rate)} "
                  f"{'without' if options.max_concurrency is None else 'even with'} --max-concurrency "
                  "(measured as vLLM measures it: under a concurrency cap, and for E2EL at a finite rate)",
                  file=sys.stderr)
            continue
        out.append(name)
    return out


def record(options: BenchOptions, header: dict, rate: float, outputs: list[RequestOutput],
           duration: float) -> dict:
    """The run's JSON object: `header` (date, backend, model_id, ...), the load, then the metrics."""
    report = options.report
    result = {
        **header,
        **options.results.metadata,
        "request_rate": rate_name(rate) if math.isinf(rate) else rate,
        "burstiness": options.burstiness,
        "arrival": options.arrival,
        "max_concurrency": options.max_concurrency,
        "goodput_slo_ms": report.goodput or None,
        **metrics.summarize(outputs, duration, list(report.percentiles), reported_metrics(options, rate),
                            report.goodput),
        **metrics.per_request(outputs, options.results.save_detailed),
    }
    if options.results.trace:
        result |= metrics.trace_summary(outputs)
        result.setdefault("traces", [None] * len(outputs))
    else:
        result.pop("traces", None)
    return result


def write(options: BenchOptions, result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not options.results.append_result:
        path.write_text(json.dumps(result, indent=1))
        return
    with path.open("a", encoding="utf-8") as f:
        if f.tell():
            f.write("\n")
        f.write(json.dumps(result))
