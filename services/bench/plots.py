"""PNG plots of bench results: latency CDFs, and throughput / latency against request rate.

Each function takes {label: result dict} (the JSON a run writes) so that runs of different servers,
stacks or rates draw on the same axes. matplotlib is imported lazily (the `bench` extra).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_ms: list[float], label: str) -> None:
    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms))
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label, drawstyle="steps-post")


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


def plot_latency_cdfs(results: dict[str, dict], path: Path, title: str = "") -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for label, result in results.items():
        for ax, (name, values) in zip(axes, latency_samples(result).items()):
            _cdf(ax, values, label)
    for ax, name in zip(axes, ("TTFT", "ITL", "TPOT", "E2EL")):
        ax.set_xlabel(f"{name} (ms)" + (", log scale" if name == "ITL" else ""))
        if name == "ITL" and ax.lines:  # steady decode steps and the rare long stalls, on one axis
            ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    axes[-1].legend(fontsize=8, loc="lower right")
    return _save(plt, fig, path, title)


def _save(plt, fig, path: Path, title: str) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rate_axis(results: list[dict]) -> tuple[list[float], list[str]]:
    """x positions for request rates, inf drawn one step beyond the largest finite rate."""
    finite = [r["request_rate"] for r in results if r["request_rate"] != "inf"]
    top = max(finite, default=1.0)
    xs = [top * 1.5 if r["request_rate"] == "inf" else float(r["request_rate"]) for r in results]
    return xs, [r["request_rate"] if r["request_rate"] == "inf" else f"{r['request_rate']:g}" for r in results]


def plot_rate_sweep(series: dict[str, list[dict]], path: Path, title: str = "") -> Path:
    """{label: [result per rate]} -> output throughput, TTFT and ITL (p50 solid, p99 dashed) against rate."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for label, results in series.items():
        results = sorted(results, key=lambda r: math.inf if r["request_rate"] == "inf" else r["request_rate"])
        xs, names = rate_axis(results)
        line, = axes[0].plot(xs, [r["output_throughput"] for r in results], marker="o", label=label)
        for ax, metric in zip(axes[1:], ("ttft", "itl")):
            ax.plot(xs, [r.get(f"median_{metric}_ms", 0) for r in results], marker="o", color=line.get_color(),
                    label=f"{label} p50")
            if all(f"p99_{metric}_ms" in r for r in results):
                ax.plot(xs, [r[f"p99_{metric}_ms"] for r in results], marker="x", linestyle="--",
                        color=line.get_color(), label=f"{label} p99")
        for ax in axes:
            ax.set_xticks(xs, names)
    axes[0].set_ylabel("output tokens / s")
    axes[1].set_ylabel("TTFT (ms)")
    axes[2].set_ylabel("ITL (ms)")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=7)
    return _save(plt, fig, path, title)
