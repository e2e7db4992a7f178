"""A layout's latencies under a traffic, predicted from an engine's profile.

Each role is a set of identical instances sharing the requests evenly, each a queue in front of its work:

  encoder   every image of a request, one after another: S_e = images x encode seconds
  prefill   one prompt at a time: S_p = prefill_seconds(input_len)
  decode    every request it holds, one step for all: a request stays output_len steps, so by Little's law an
            instance holds B = (rate / decodes) x output_len x step_seconds(B) requests - the fixed point of
            that is its batch, and step_seconds(B) its time per output token
  unified   prefills and decodes in the same steps: every prompt computed while a request decodes makes one of
            its steps a whole prefill long. Those are the prompts queued behind it when its first token comes
            (those that arrived during its wait and its prefill) and those arriving while it decodes, and the
            prompts arriving during each of those prefills, and so on: Poisson(arrivals x (W + S_p +
            (output_len - 1) x step)) prompts to begin with, each bringing Poisson(rho) more, rho = (rate /
            unified) x S_p. Its mean is that first mean / (1 - rho), so TPOT is the step / (1 - rho) plus
            rho (W + S_p) / ((1 - rho) (output_len - 1))

A queue with work S and load rho = arrivals x S (below 1) is M/D/1 (Poisson arrivals, fixed work): it waits
rho x S / (2 (1 - rho)) on average, and not at all with probability 1 - rho, so at loads up to 1/2 its median
wait is 0; Erlang's formula gives the whole distribution, and with it the median. TTFT is the encoder's and the
prefill's waits and work (the prefill samples the first token); TPOT is the decode's step.

Every latency is predicted twice, as a mean and as a median (p50): the means rank the layouts and decide the
SLOs (a mean is what a tail moves); the medians are what the plan is checked against. They part most on a
unified engine, whose TPOT median counts the median number of prompts a request's decoding meets (the
branching process's total is Borel-Tanner given its first count), with the median wait W.
A role loaded to 1 or more has no steady state: the prediction says so (infinite).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from epdserve.services.planner.profile import EngineProfile


@dataclass(frozen=True)
class Traffic:
    rate: float  # requests per second
    input_len: int
    output_len: int
    images: float = 0  # per request (a mean)


@dataclass(frozen=True)
class SLO:
    ttft: float  # seconds
    tpot: float  # seconds


@dataclass(frozen=True)
class Layout:
    encoders: int = 0
    prefills: int = 0
    decodes: int = 0
    unified: int = 0

    def __post_init__(self):
        if min(self.encoders, self.prefills, self.decodes, self.unified) < 0:
            raise ValueError(f"a layout counts instances: {self}")
        if bool(self.unified) == bool(self.prefills or self.decodes):
            raise ValueError("a layout has unified instances, or prefills and decodes")
        if not self.unified and not (self.prefills and self.decodes):
            raise ValueError("a disaggregated layout needs a prefill and a decode")

    @property
    def instances(self) -> int:
        return self.encoders + self.prefills + self.decodes + self.unified

    def __str__(self) -> str:
        if self.unified:
            return f"{self.encoders}E+{self.unified}U" if self.encoders else f"{self.unified}U"
        return f"{self.encoders}E{self.prefills}P{self.decodes}D"

    def up_args(self) -> list[str]:
        """The `epdserve up` options that start it (which runs one unified engine at most)."""
        args = ["--encoders", str(self.encoders)] if self.encoders else []
        if self.unified:
            if self.unified > 1:
                raise ValueError(f"{self}: epdserve up runs one unified engine")
            return args + ["--unified"]
        return args + ["--prefills", str(self.prefills), "--decodes", str(self.decodes)]


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    ttft: float  # seconds (mean); inf: a role is overloaded
    tpot: float
    batch: float  # requests each decoding instance holds
    load: dict[str, float]  # each role's load (work per second per instance; 1 and above: overloaded)
    ttft_p50: float  # seconds (median)
    tpot_p50: float

    def meets(self, slo: SLO) -> bool:
        return self.ttft <= slo.ttft and self.tpot <= slo.tpot


def _wait(load: float, work: float) -> float:
    """M/D/1's mean wait."""
    return math.inf if load >= 1 else load * work / (2 * (1 - load))


def _waited_at_most(arrivals: float, work: float, t: float) -> float:
    """M/D/1's P(wait <= t), by Erlang's formula: (1 - rho) x the sum over k <= t / work of
    e^(arrivals (t - k work)) (arrivals (k work - t))^k / k!. Its terms alternate and grow like e^(arrivals t),
    so past arrivals x t = 25 (near a load of 1) they cancel below float64's precision; there the heavy-traffic
    form stands in: no wait with probability 1 - rho, else an exponential wait of mean E[W] / rho."""
    load = arrivals * work
    if arrivals * t > 25:
        return 1 - load * math.exp(-t * load / _wait(load, work))
    return (1 - load) * math.fsum(
        (-1) ** k * math.exp(arrivals * (t - k * work) + k * math.log(arrivals * (t - k * work)) - math.lgamma(k + 1))
        if t > k * work else float(k == 0) for k in range(int(t // work) + 1))


def _quantile_wait(arrivals: float, work: float, q: float) -> float:
    """The least wait at most which a share q of requests waits, at one M/D/1 queue (by bisection)."""
    if 1 - arrivals * work >= q:
        return 0.0
    low, high = 0.0, work
    while _waited_at_most(arrivals, work, high) < q:
        low, high = high, 2 * high
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if _waited_at_most(arrivals, work, middle) < q else (low, middle)
    return high


def _median_wait(queues: list[tuple[float, float]]) -> float:
    """The median of the summed waits of M/D/1 queues (arrivals, work) one after another, as if independent: of
    one queue by bisection; of several on a grid, each queue's distribution convolved with the others' up to
    the sum of their 0.5^(1/n) quantiles (all n at most those with probability 1/2: the median lies within)."""
    queues = [(a, w) for a, w in queues if a * w > 0]
    if any(a * w >= 1 for a, w in queues):
        return math.inf
    if math.prod(1 - a * w for a, w in queues) >= 0.5:
        return 0.0  # half the requests or more wait nowhere
    if len(queues) == 1:
        return _quantile_wait(*queues[0], 0.5)
    horizon = sum(_quantile_wait(a, w, 0.5 ** (1 / len(queues))) for a, w in queues)
    grid = np.linspace(0.0, horizon, 513)
    total = np.ones(1)
    for arrivals, work in queues:
        cdf = np.array([_waited_at_most(arrivals, work, t) for t in grid])
        total = np.convolve(total, np.diff(cdf, prepend=0.0))[:len(grid)]
    return float(grid[min(np.searchsorted(np.cumsum(total), 0.5), len(grid) - 1)])


def _median_interruptions(expected: float, load: float) -> int:
    """The median count of prompts a unified engine computes while a request decodes: Poisson(`expected`) arrive
    in its own decoding time, and each prompt's prefill lets Poisson(`load`) more arrive. The total of that
    branching process, given the first k, is Borel-Tanner: P(n | k) = k/n Poisson(n - k; load x n)."""
    def poisson(j: int, mean: float) -> float:
        return float(j == 0) if mean <= 0 else math.exp(j * math.log(mean) - mean - math.lgamma(j + 1))

    n, cumulative = 0, poisson(0, expected)
    while cumulative < 0.5:
        n += 1
        cumulative += math.fsum(poisson(k, expected) * k / n * poisson(n - k, load * n) for k in range(1, n + 1))
    return n


def _decode_batch(profile: EngineProfile, arrivals: float, output_len: int, stretch: float = 1.0,
                  extra: float = 0.0) -> float:
    """The batch B with B = arrivals x output_len x (stretch x step_seconds(B) + extra), a request's time per
    token: the least fixed point, by iteration from an empty instance (inf: none below the engine's largest
    batch - requests would queue without end)."""
    batch = 0.0
    for _ in range(200):
        following = arrivals * output_len * (stretch * profile.step_seconds(batch) + extra)
        if following > profile.max_num_seqs:
            return math.inf
        if abs(following - batch) < 1e-6:
            break
        batch = following
    return batch


def predict(profile: EngineProfile, traffic: Traffic, layout: Layout) -> Prediction:
    load: dict[str, float] = {}
    encode, queues = 0.0, []  # (arrivals, work) of each queue a prompt waits in before its first token
    if traffic.images:
        if profile.encode is None:
            raise ValueError("the traffic has images and the profiled model has no vision tower")
        if not layout.encoders:
            raise ValueError(f"{layout}: images need an encoder")
        encode = traffic.images * profile.encode
        load["encoder"] = traffic.rate / layout.encoders * encode
        queues.append((traffic.rate / layout.encoders, encode))
    prefill = profile.prefill_seconds(traffic.input_len)
    arrivals = traffic.rate / (layout.unified or layout.prefills)  # at each prefilling instance
    rho = load["unified" if layout.unified else "prefill"] = arrivals * prefill
    queues.append((arrivals, prefill))
    ttft = encode + prefill + sum(_wait(a * w, w) for a, w in queues)
    ttft_p50 = encode + prefill + _median_wait(queues)
    if layout.unified:
        wait, wait_p50 = _wait(rho, prefill), _median_wait([(arrivals, prefill)])
        gaps = max(traffic.output_len - 1, 1)
        stretch, queued = (math.inf, math.inf) if rho >= 1 else (1 / (1 - rho), rho * (wait + prefill) / gaps)
        batch = _decode_batch(profile, arrivals, traffic.output_len, stretch, queued * stretch)
        step = profile.step_seconds(batch)
        tpot = (step + queued) * stretch
        met = arrivals * (wait_p50 + prefill + gaps * step)
        tpot_p50 = step + prefill * _median_interruptions(met, rho) / gaps if math.isfinite(met) else math.inf
        # A prompt also waits for the decode step under way to end.
        if math.isfinite(batch):
            ttft, ttft_p50 = ttft + step / 2, ttft_p50 + step / 2
    else:
        batch = _decode_batch(profile, traffic.rate / layout.decodes, traffic.output_len)
        tpot = tpot_p50 = profile.step_seconds(batch)
        load["decode"] = batch / profile.max_num_seqs
    if not math.isfinite(batch):
        tpot = tpot_p50 = math.inf
    return Prediction(layout, ttft, tpot, batch, load, ttft_p50, tpot_p50)


def goodput(profile: EngineProfile, traffic: Traffic, layout: Layout, slo: SLO) -> float:
    """The highest request rate at which `layout` still meets `slo` (requests per second; 0: not even one
    request alone)."""
    def meets(rate: float) -> bool:
        return predict(profile, Traffic(rate, traffic.input_len, traffic.output_len, traffic.images),
                       layout).meets(slo)

    low, high = 0.0, 1.0
    if not meets(1e-9):
        return 0.0
    while meets(high):
        low, high = high, high * 2
        if high > 1e6:
            return math.inf
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if meets(middle) else (low, middle)
    return low
