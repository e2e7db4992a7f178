"""The bench plots read as a reader expects: tick labels apart, inf apart from the finite rates, every line
named in a legend, and a title that says what was measured."""
import math

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from epdserve.services.bench import plots  # noqa: E402


def result(rate, itl_range_ms=(40, 300), n=12, seed=0):
    rng = np.random.default_rng(seed)
    low, high = itl_range_ms
    itls = [list(np.exp(rng.uniform(math.log(low), math.log(high), 15)) / 1000) for _ in range(n)]
    ttfts = list(rng.uniform(0.1, 2.5, n))
    return {
        "request_rate": rate, "model_id": "llava-demo", "base_url": "http://127.0.0.1:8000",
        "endpoint": "/v1/completions", "dataset_name": "random", "num_prompts": n, "max_concurrency": None,
        "completed": n, "total_input_tokens": 64 * n, "total_output_tokens": 16 * n,
        "errors": [""] * n, "ttfts": ttfts, "itls": itls, "output_lens": [16] * n,
        "tpots": [sum(g) / len(g) for g in itls], "latencies": [t + sum(g) for t, g in zip(ttfts, itls)],
        "output_throughput": 10.0 * (1 + seed), "median_ttft_ms": 100.0 + seed, "p99_ttft_ms": 200.0 + seed,
        "median_itl_ms": 50.0, "p99_itl_ms": 90.0,
    }


def overlaps(fig, ax) -> list[tuple[str, str]]:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    low, high = sorted(ax.get_xlim())
    labels = [t for t in ax.get_xticklabels() + ax.get_xticklabels(minor=True)
              if t.get_text() and t.get_visible() and low <= t.get_position()[0] <= high]
    boxes = [(t.get_text(), t.get_window_extent(renderer).expanded(1.0, 1.0).padded(3)) for t in labels]
    return [(a, b) for i, (a, box_a) in enumerate(boxes) for b, box_b in boxes[i + 1:] if box_a.overlaps(box_b)]


# (20, 200), (15, 95) and (8, 60) overlapped with matplotlib's default log labels (3x10^1 over 4x10^1).
@pytest.mark.parametrize("itl_range_ms", [(40, 300), (30, 70), (20, 200), (15, 95), (8, 60), (1, 300), (30, 10000),
                                          (0.5, 20000), (1, 100000)])
def test_log_axis_tick_labels_never_overlap(itl_range_ms):
    fig = plots.latency_cdf_figure({f"{r} req/s": result(r, itl_range_ms, seed=i)
                                    for i, r in enumerate([1, 2, "inf"])})
    itl = fig.axes[1]
    assert itl.get_xscale() == "log"
    assert overlaps(fig, itl) == []
    low, high = itl.get_xlim()
    shown = [t.get_text() for t in itl.get_xticklabels() if t.get_text() and low <= t.get_position()[0] <= high]
    assert shown and all("$" not in s for s in shown), shown  # plain numbers, not 4x10^1
    assert all(len(s) <= 4 for s in shown), shown  # 10k, not 10000


def test_cdf_legend_names_every_run_and_title_says_what_was_measured():
    fig = plots.latency_cdf_figure({"1 req/s": result(1), "all at once": result("inf", seed=1)})
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["1 req/s", "all at once"]
    title = fig._suptitle.get_text()
    assert "llava-demo at http://127.0.0.1:8000/v1/completions" in title and "random prompts" in title


def test_rate_sweep_sets_inf_apart_and_names_p50_and_p99():
    runs = [result(r, seed=i) for i, r in enumerate([1, 2, 4, "inf"])]
    fig = plots.rate_sweep_figure({"openai": runs})
    xs, names = plots.rate_axis(runs)
    assert xs[:3] == [1.0, 2.0, 4.0] and xs[3] > 4.0 and names[3].startswith("inf")
    for ax in fig.axes:
        for line in ax.get_lines():
            x = list(line.get_xdata())
            if line.get_linestyle() not in ("None", "none", ""):  # a drawn line joins finite rates only
                assert xs[3] not in x, (ax.get_ylabel(), x)
        assert [t.get_text() for t in ax.get_xticklabels()] == names
        assert any(list(line.get_xdata()) == [xs[3]] for line in ax.get_lines()), "inf is drawn, on its own"
        assert overlaps(fig, ax) == []
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["p50 (median)", "p99"]


def test_rate_sweep_of_two_servers_names_each():
    fig = plots.rate_sweep_figure({"epdserve": [result(1), result(2)], "vllm": [result(1, seed=1), result(2, seed=1)]})
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"epdserve", "vllm", "epdserve p50 (median)", "vllm p99"} <= set(labels)


def test_rate_sweep_of_inf_alone():
    fig = plots.rate_sweep_figure({"openai": [result("inf")]})
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["inf\n(all at once)"]
