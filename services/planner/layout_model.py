"""A layout's latencies under a traffic, predicted from an engine's profile.

Each role is a set of identical instances sharing the requests evenly, each a queue in front of its work:

  encoder   every image of a request, one after another: S_e = images x encode seconds
  prefill   one prompt at a time: S_p = prefill_seconds(input_len)
  decode    every request it holds, one step for all: a request stays output_len steps, so by Little's law an
            instance holds B = (rate / decodes) x output_len x step_seconds(B) requests - the fixed point of
            that is its batch, and step_seconds(B) its time per output token
  unified   prefills and decodes in the same steps: the share of its time spent on prompts,
            rho = (rate / unified) x S_p, stretches every decode step by 1 / (1 - rho)

A queue with work S and load rho = arrivals x S (below 1) waits rho x S / (2 (1 - rho)) on average (M/D/1:
Poisson arrivals, fixed work). TTFT is the encoder's and the prefill's waits and work (the prefill samples the
first token); TPOT is the decode's step. These are means: the plan compares them with measured medians.
A role loaded to 1 or more has no steady state: the prediction says so (infinite).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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

    def meets(self, slo: SLO) -> bool:
        return self.ttft <= slo.ttft and self.tpot <= slo.tpot


def _wait(load: float, work: float) -> float:
    """M/D/1's mean wait."""
    return math.inf if load >= 1 else load * work / (2 * (1 - load))


def _decode_batch(profile: EngineProfile, arrivals: float, output_len: int, stretch: float = 1.0) -> float:
    """The batch B with B = arrivals x output_len x stretch x step_seconds(B): the least fixed point, by
    iteration from an empty instance (inf: none below the engine's largest batch - requests would queue
    without end)."""
    batch = 0.0
    for _ in range(200):
        following = arrivals * output_len * stretch * profile.step_seconds(batch)
        if following > profile.max_num_seqs:
            return math.inf
        if abs(following - batch) < 1e-6:
            break
        batch = following
    return batch


def predict(profile: EngineProfile, traffic: Traffic, layout: Layout) -> Prediction:
    load: dict[str, float] = {}
    ttft = 0.0
    if traffic.images:
        if profile.encode is None:
            raise ValueError("the traffic has images and the profiled model has no vision tower")
        if not layout.encoders:
            raise ValueError(f"{layout}: images need an encoder")
        work = traffic.images * profile.encode
        load["encoder"] = traffic.rate / layout.encoders * work
        ttft += work + _wait(load["encoder"], work)
    prefill = profile.prefill_seconds(traffic.input_len)
    if layout.unified:
        per_instance = traffic.rate / layout.unified
        rho = per_instance * prefill
        load["unified"] = rho
        stretch = math.inf if rho >= 1 else 1 / (1 - rho)
        batch = _decode_batch(profile, per_instance, traffic.output_len, stretch)
        tpot = profile.step_seconds(batch) * stretch
        # A prompt waits for those ahead of it, and for the step under way to end.
        ttft += prefill + _wait(rho, prefill) + (profile.step_seconds(batch) / 2 if math.isfinite(batch) else 0)
    else:
        load["prefill"] = traffic.rate / layout.prefills * prefill
        ttft += prefill + _wait(load["prefill"], prefill)
        batch = _decode_batch(profile, traffic.rate / layout.decodes, traffic.output_len)
        tpot = profile.step_seconds(batch)
        load["decode"] = batch / profile.max_num_seqs
    if not math.isfinite(batch):
        tpot = math.inf
    return Prediction(layout, ttft, tpot, batch, load)


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
