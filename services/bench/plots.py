"""PNG plots of bench results: latency CDFs, and throughput / latency against request rate.

Each function takes {label: result dict} (the JSON a run writes) so that runs of different servers,
stacks or rates draw on the same axes. Titles say what was measured (model, server, workload), one
legend below the panels names every line, and "inf" (everything sent at once) stands apart from the
finite rates, unjoined to them. matplotlib is imported lazily (the `bench` extra).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

PANEL_SIZE = (4.0, 3.4)  # inches per panel


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_ms: list[float], label: str, color=None) -> None:
    xs = np.sort(np.asarray(values_ms))
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label, drawstyle="steps-post", color=color)


def latency_samples(result: dict) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT and E2EL and every ITL gap of the successful requests, in ms."""
    ok = [not e for e in result["errors"]]
    pick = lambda key: [v * 1000 for v, good in zip(result[key], ok) if good]  # noqa: E731
    return {
        "TTFT": pick("ttfts"),
        "ITL": [gap * 1000 for gaps, good in zip(result["itls"], ok) if good for gap in gaps],
        "TPOT": [v * 1000 for v, n, good in zip(result["tpots"], result["output_lens"], ok) if good and n > 1],
        "E2EL": pick("latencies"),
    }


def describe(results: list[dict]) -> str:
    """One line on what the runs measured: what they have in common (model, server, workload)."""
    first = results[0]
    def common(key):
        values = {str(r.get(key)) for r in results}
        return first.get(key) if len(values) == 1 else None

    parts = []
    model, url = common("model_id"), common("base_url")
    if model or url:
        where = f"{url}{common('endpoint') or ''}" if url else ""
        parts.append(" at ".join(p for p in (str(model or ""), where) if p))
    workload = []
    if common("dataset_name"):
        workload.append(f"{first['dataset_name']} prompts")
    if common("num_prompts"):
        workload.append(f"{first['num_prompts']} requests per run")
    completed = sum(r.get("completed", 0) for r in results)
    if completed:
        mean_in = sum(r.get("total_input_tokens", 0) for r in results) / completed
        mean_out = sum(r.get("total_output_tokens", 0) for r in results) / completed
        workload.append(f"mean {mean_in:.0f} prompt + {mean_out:.0f} output tokens")
    if common("max_concurrency"):
        workload.append(f"at most {first['max_concurrency']} in flight")
    if workload:
        parts.append(", ".join(workload))
    return "\n".join(parts)


def _log_ticks(ax, values: list[float]) -> None:
    """A log axis labelled in plain numbers that never collide (1, 2, 5, ..., 10k): 1-2-5 steps over a
    narrow range, 1-3 over a wider one, decades beyond, and no minor-tick labels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    low, high = min(values), max(values)
    decades = math.log10(high / low) if low > 0 else 99
    subs = (1.0, 2.0, 5.0) if decades <= 1.5 else (1.0, 3.0) if decades <= 3 else (1.0,)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v / 1000:g}k" if v >= 1000 else f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _figure_legend(fig, axes) -> None:
    handles, labels = [], []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 6), fontsize=9, frameon=False)


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_latency_cdfs(results: dict[str, dict], path: Path, title: str | None = None) -> Path:
    return _save(latency_cdf_figure(results, title), path)


def plot_rate_sweep(series: dict[str, list[dict]], path: Path, title: str | None = None) -> Path:
    return _save(rate_sweep_figure(series, title), path)


def latency_cdf_figure(results: dict[str, dict], title: str | None = None):
    """{line label: result} -> one CDF panel per latency (TTFT, ITL, TPOT, E2EL); ITL on a log axis.
    The title defaults to `describe` of the results."""
    plt = _pyplot()
    names = ("TTFT", "ITL", "TPOT", "E2EL")
    fig, axes = plt.subplots(1, 4, figsize=(PANEL_SIZE[0] * 4, PANEL_SIZE[1] + 0.6), layout="constrained")
    drawn: dict[str, list[float]] = {name: [] for name in names}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, result) in enumerate(results.items()):
        for ax, (name, values) in zip(axes, latency_samples(result).items()):
            if values:
                _cdf(ax, values, label, colors[i % len(colors)])
                drawn[name] += values
    for ax, name in zip(axes, names):
        ax.set_xlabel(f"{name} (ms)" + (", log scale" if name == "ITL" else ""))
        if name == "ITL" and drawn[name] and min(drawn[name]) > 0:  # steady steps and rare stalls on one axis
            ax.set_xscale("log")
            _log_ticks(ax, drawn[name])
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    _figure_legend(fig, axes)
    fig.suptitle(describe(list(results.values())) if title is None else title, fontsize=10)
    return fig


def rate_value(result: dict) -> float:
    rate = result["request_rate"]
    return math.inf if rate == "inf" else float(rate)


def rate_axis(results: list[dict]) -> tuple[list[float], list[str]]:
    """x positions and tick labels of request rates: finite rates where they are, inf one step past them."""
    finite = [rate_value(r) for r in results if not math.isinf(rate_value(r))]
    top = max(finite, default=1.0)
    xs = [top * 1.4 if math.isinf(rate_value(r)) else rate_value(r) for r in results]
    return xs, ["inf\n(all at once)" if math.isinf(rate_value(r)) else f"{rate_value(r):g}" for r in results]


def rate_sweep_figure(series: dict[str, list[dict]], title: str | None = None):
    """{label: [result per rate]} -> output throughput, TTFT and ITL (p50 solid, p99 dashed) against rate.

    Finite rates are joined by lines; inf is a marker on its own, past a dotted separator: a line to it
    would invent a slope between "n per second" and "all at once".
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(PANEL_SIZE[0] * 3 + 1, PANEL_SIZE[1] + 0.8), layout="constrained")
    ticks: dict[float, str] = {}
    separator = None
    for label, results in series.items():
        results = sorted(results, key=rate_value)
        xs, names = rate_axis(results)
        ticks.update(zip(xs, names))
        finite = [i for i, r in enumerate(results) if not math.isinf(rate_value(r))]
        infinite = [i for i, r in enumerate(results) if math.isinf(rate_value(r))]
        if finite and infinite:
            separator = max(separator or 0.0, (xs[finite[-1]] + xs[infinite[0]]) / 2)
        color = None
        # One series: the legend tells p50 from p99; several: which series, too.
        name = f"{label} " if len(series) > 1 else ""
        panels = [(axes[0], "output_throughput", label if name else None, "-", "o"),
                  (axes[1], "median_ttft_ms", f"{name}p50 (median)", "-", "o"),
                  (axes[1], "p99_ttft_ms", f"{name}p99", "--", "x"),
                  (axes[2], "median_itl_ms", f"{name}p50 (median)", "-", "o"),
                  (axes[2], "p99_itl_ms", f"{name}p99", "--", "x")]
        for ax, key, legend, style, marker in panels:
            if not all(key in r for r in results):
                continue
            ys = [r[key] for r in results]
            line, = ax.plot([xs[i] for i in finite], [ys[i] for i in finite], linestyle=style, marker=marker,
                            color=color, label=legend)
            color = line.get_color()
            if infinite:
                ax.plot([xs[i] for i in infinite], [ys[i] for i in infinite], linestyle="none", marker=marker,
                        color=color, label=None if finite else legend)
    for ax, ylabel in zip(axes, ("output tokens / s", "TTFT (ms)", "ITL (ms)")):
        ax.set_xticks(list(ticks), list(ticks.values()))
        if separator is not None:
            ax.axvline(separator, color="0.6", linestyle=":", linewidth=1)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    _figure_legend(fig, axes)
    runs = [r for results in series.values() for r in results]
    fig.suptitle(describe(runs) if title is None else title, fontsize=10)
    return fig
