"""Scoring and report of benchmarks/goodput.py: which requests met the SLOs, goodput per (server, rate), latency
percentiles of chats and long prompts apart, the same requests under tighter and looser SLOs, the markdown and
the plot. It reads only a report's recorded requests, so `goodput.py --rescore` can score a past run anew.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

SERVERS = ("vllm", "unified", "pd")
KINDS = ("chat", "long")
TPOT_SWEEP_MS = (50.0, 100.0, 150.0, 200.0)
TTFT_SCALES = (0.5, 1.0, 2.0, 4.0)
ATTAINMENT_TARGET = 0.9
# Within this share of the best goodput at a rate, a server ties for the win.
TIE = 0.02


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as the client saw it; a failed one has `error` and meets no SLO."""

    prompt_tokens: int
    output_tokens: int
    long: bool
    ttft_ms: float | None = None
    tpot_ms: float | None = None  # (last token's time - first's) / (output tokens - 1)
    latency_ms: float | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Slo:
    """A request meets the TTFT SLO when its TTFT <= max(ttft_ms, ttft_ms_per_token x prompt tokens): a flat
    bound for chats, one that grows with the prompt for long ones; the TPOT SLO when its TPOT <= tpot_ms."""

    ttft_ms: float
    ttft_ms_per_token: float
    tpot_ms: float

    def ttft_limit_ms(self, prompt_tokens: int) -> float:
        return max(self.ttft_ms, self.ttft_ms_per_token * prompt_tokens)

    def meets_ttft(self, o: Outcome) -> bool:
        return o.error is None and o.ttft_ms <= self.ttft_limit_ms(o.prompt_tokens)

    def meets_tpot(self, o: Outcome) -> bool:
        return o.error is None and o.tpot_ms <= self.tpot_ms

    def scaled_ttft(self, factor: float) -> Slo:
        return replace(self, ttft_ms=self.ttft_ms * factor, ttft_ms_per_token=self.ttft_ms_per_token * factor)

    def describe(self) -> str:
        return (f"TTFT <= max({self.ttft_ms / 1000:g} s, {self.ttft_ms_per_token:g} ms x prompt tokens), "
                f"TPOT <= {self.tpot_ms:g} ms")


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linearly interpolated between ranks (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def outcomes_of(run: dict) -> list[Outcome]:
    return [Outcome(**o) for o in run["outcomes"]]


def score_run(run: dict, rate: float, slo: Slo) -> dict[str, float]:
    """One run: the share of requests meeting both SLOs (and each alone), goodput = rate x that share."""
    outcomes = outcomes_of(run)
    n = len(outcomes)
    ttft = [slo.meets_ttft(o) for o in outcomes]
    tpot = [slo.meets_tpot(o) for o in outcomes]
    both = sum(a and b for a, b in zip(ttft, tpot)) / n
    return {"goodput": rate * both, "attainment": both, "ttft_attainment": sum(ttft) / n,
            "tpot_attainment": sum(tpot) / n, "failed": sum(o.error is not None for o in outcomes),
            "output_throughput": sum(o.output_tokens for o in outcomes if o.error is None) / run["duration_s"]}


def latency_stats(outcomes: list[Outcome]) -> dict[str, float | None]:
    ttft = [o.ttft_ms for o in outcomes if o.error is None]
    tpot = [o.tpot_ms for o in outcomes if o.error is None]
    return {"requests": len(ttft), "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "tpot_p50_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99)}


def cell(runs: list[dict], rate: float, slo: Slo) -> dict:
    """A (server, rate): the median over runs of each score; latency percentiles over every run's requests
    pooled (a run holds only a few long prompts)."""
    scores = [score_run(run, rate, slo) for run in runs]
    out: dict = {k: statistics.median(s[k] for s in scores) for k in scores[0] if k != "failed"}
    out["failed"] = sum(s["failed"] for s in scores)
    out["runs"] = [round(s["goodput"], 4) for s in scores]
    pooled = [o for run in runs for o in outcomes_of(run)]
    out["latency"] = {kind: latency_stats([o for o in pooled if o.long == (kind == "long")]) for kind in KINDS}
    return out


def median_goodput(runs: list[dict], rate: float, slo: Slo) -> float:
    return statistics.median(score_run(run, rate, slo)["goodput"] for run in runs)


def analyse(report: dict, slo: Slo) -> dict:
    """Every table of the report from its recorded requests, under `slo` (and the sweeps around it)."""
    rates = report["config"]["rates"]
    servers = [s for s in SERVERS if s in report["servers"]]
    cells, tpot_sweep, ttft_sweep, sustained = {}, {}, {}, {}
    for s in servers:
        by_rate = report["servers"][s]["rates"]
        cells[s] = {r: cell(by_rate[r], float(r), slo) for r in rates}
        tpot_sweep[s] = {r: {f"{ms:g}": median_goodput(by_rate[r], float(r), replace(slo, tpot_ms=ms))
                             for ms in TPOT_SWEEP_MS} for r in rates}
        ttft_sweep[s] = {r: {f"{x:g}": median_goodput(by_rate[r], float(r), slo.scaled_ttft(x))
                             for x in TTFT_SCALES} for r in rates}
        kept = [float(r) for r in rates if cells[s][r]["attainment"] >= ATTAINMENT_TARGET]
        sustained[s] = max(kept) if kept else None
    return {"slo": asdict(slo), "cells": cells, "tpot_sweep": tpot_sweep, "ttft_sweep": ttft_sweep,
            "sustained_rate": sustained}


def verdicts(summary: dict, rates: list[str]) -> list[str]:
    """Per rate: the server(s) with the most goodput, and for each what share met each SLO (which one binds)."""
    lines = []
    cells = summary["cells"]
    for r in rates:
        best = max(cells[s][r]["goodput"] for s in cells)
        ranked = sorted(cells, key=lambda s: -cells[s][r]["goodput"])
        winners = [s for s in ranked if cells[s][r]["goodput"] >= best * (1 - TIE)] if best > 0 else []
        parts = [f"{s} {cells[s][r]['goodput']:.2f} req/s ({_pct(cells[s][r]['attainment'])} met both; TTFT "
                 f"{_pct(cells[s][r]['ttft_attainment'])}, TPOT {_pct(cells[s][r]['tpot_attainment'])})"
                 for s in ranked]
        head = f"best: {', '.join(winners)}" if winners else "no server met the SLOs"
        lines.append(f"- **{r} req/s** - {head}. " + "; ".join(parts) + ".")
    return lines


# -- markdown -----------------------------------------------------------------------------------------------------
def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _sweep_table(sweep: dict, rates, servers, values, header: str) -> list[str]:
    """Goodput per (rate, server) under each of `values` of one SLO (a column each)."""
    lines = ["| rate | server | " + " | ".join(header.format(v) for v in values) + " |",
             "|---|---|" + "---|" * len(values)]
    for r in rates:
        for s in servers:
            lines.append(f"| {r} | {s} | " + " | ".join(f"{sweep[s][r][f'{v:g}']:.2f}" for v in values) + " |")
    return lines


def markdown(report: dict, summary: dict) -> str:
    cfg, slo = report["config"], Slo(**summary["slo"])
    rates, cells = cfg["rates"], summary["cells"]
    servers = list(cells)
    lines = [
        "# Goodput under latency SLOs: a mixed chat and long-prompt workload", "",
        f"`{report['command']}` on {report['date']}: {report['machine']}. Model `{cfg['model']}`, float32, every "
        f"server on CPUs {cfg['cpus']} (pd: prefill on the first, decode on the last), one at a time"
        + (f"; vLLM {report['vllm_version']}." if report.get("vllm_version") else "."), "",
        f"Workload: {cfg['num_requests']} streamed `/v1/completions` requests per run, random token-id prompts, "
        f"EOS ignored, {cfg['sampling']}; exactly {cfg['num_long']} are long prompts of "
        f"{cfg['long_prompt'][0]}-{cfg['long_prompt'][1]} tokens, the rest chats of "
        f"{cfg['short_prompt'][0]}-{cfg['short_prompt'][1]}; each writes {cfg['output_len'][0]}-"
        f"{cfg['output_len'][1]} tokens. Poisson arrivals at each rate (seed {cfg['seed']}).", "",
        f"**SLOs: {slo.describe()}** (chats: {slo.ttft_limit_ms(cfg['short_prompt'][1]) / 1000:g} s; long prompts: "
        f"{slo.ttft_limit_ms(cfg['long_prompt'][0]) / 1000:g}-{slo.ttft_limit_ms(cfg['long_prompt'][1]) / 1000:g} s). "
        f"Goodput = rate x the share of requests meeting both SLOs (a failed request meets neither), the median of "
        f"{cfg['repeats']} runs; latency percentiles pool every run's requests.", "",
        "## Goodput (req/s meeting both SLOs)", "",
        "| rate req/s | " + " | ".join(servers) + " |", "|---|" + "---|" * len(servers),
    ]
    for r in rates:
        lines.append(f"| {r} | " + " | ".join(f"{cells[s][r]['goodput']:.2f}" for s in servers) + " |")
    sustained = summary["sustained_rate"]
    lines += ["", f"Highest swept rate with >= {_pct(ATTAINMENT_TARGET)} of requests meeting both SLOs: "
              + ", ".join(f"{s} {sustained[s]:g} req/s" if sustained[s] else f"{s} none" for s in servers) + ".",
              "", "## Where each wins", "", *verdicts(summary, rates), "",
              "## SLO attainment and throughput", "",
              "| rate | server | both SLOs | TTFT met | TPOT met | failed | out tok/s |",
              "|---|---|---|---|---|---|---|"]
    for r in rates:
        for s in servers:
            c = cells[s][r]
            lines.append(f"| {r} | {s} | {_pct(c['attainment'])} | {_pct(c['ttft_attainment'])} | "
                         f"{_pct(c['tpot_attainment'])} | {c['failed']} | {c['output_throughput']:.0f} |")
    lines += ["", "## Latency by request kind (ms, every run pooled)", "",
              "| rate | server | chat TTFT p50 / p99 | chat TPOT p50 / p99 | long TTFT p50 / p99 "
              "| long TPOT p50 / p99 |",
              "|---|---|---|---|---|---|"]
    for r in rates:
        for s in servers:
            lat = cells[s][r]["latency"]
            lines.append(f"| {r} | {s} | " + " | ".join(
                f"{_ms(lat[k][m + '_p50_ms'])} / {_ms(lat[k][m + '_p99_ms'])}" for k in KINDS for m in ("ttft", "tpot"))
                + " |")
    lines += ["", "## Goodput under other SLOs (the same requests, req/s)", "",
              "TPOT SLO varied, TTFT SLO as above:", ""]
    lines += _sweep_table(summary["tpot_sweep"], rates, servers, TPOT_SWEEP_MS, "TPOT <= {:g} ms")
    lines += ["", "TTFT SLO scaled (both its terms), TPOT SLO as above:", ""]
    lines += _sweep_table(summary["ttft_sweep"], rates, servers, TTFT_SCALES, "TTFT x{:g}")
    lines += ["", "CPU pinning:", ""] + [f"- {s}: {report['servers'][s]['pinning']}" for s in servers]
    return "\n".join(lines) + "\n"


def plot(report: dict, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = report["config"]["rates"]
    xs = [float(r) for r in rates]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.plot(xs, xs, "k:", label="every request meets the SLOs")
    for s, by_rate in summary["cells"].items():
        left.plot(xs, [by_rate[r]["goodput"] for r in rates], "o-", label=s)
        right.plot(xs, [100 * by_rate[r]["attainment"] for r in rates], "o-", label=s)
    right.axhline(100 * ATTAINMENT_TARGET, color="k", linestyle=":", linewidth=1)
    left.set(xlabel="request rate (req/s)", ylabel="goodput (req/s meeting both SLOs)", title="goodput")
    right.set(xlabel="request rate (req/s)", ylabel="% of requests meeting both SLOs", title="SLO attainment",
              ylim=(0, 105))
    left.legend()
    cfg = report["config"]
    fig.suptitle(f"{cfg['model']}, {cfg['num_long']}/{cfg['num_requests']} long prompts; "
                 f"{Slo(**summary['slo']).describe()}; median of {cfg['repeats']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
