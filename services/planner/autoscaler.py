"""`epdserve up --planner`: how many prefills and decodes the next interval needs, from what the proxy measured in
the last one.

Every interval the stack's proxy is scraped (its /metrics: requests finished, failed and in flight, their
prompt and output lengths, TTFT and time per output token) and the difference to the last scrape is one
`Observation`. The next interval's traffic is forecast as a moving average of the observed ones. Then:

  predicted   with a profile (`epdserve plan --save-profile`), the fewest prefills and decodes within the bounds
              whose predicted TTFT and TPOT (layout_model.py) meet the SLOs under the forecast;
  corrected   whatever was predicted, a role whose measured mean breaks its SLO gets one instance more than it
              has (TTFT: prefill, TPOT: decode) - the model is a model, the measurement is what users saw;
  held        fewer instances only after `patience` intervals in a row that all wanted fewer, one at a time
              (a lull does not take away what the next burst needs; a scale-in drains, which takes a while).

Without a profile only the correction acts, and a role whose mean stays under half its SLO for `patience`
intervals gives one instance back. Every decision carries its reason, which the stack logs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.services.planner.layout_model import SLO, Layout, Traffic, predict
from epdserve.services.planner.profile import EngineProfile

SCALED_ROLES = ("prefill", "decode")
SMOOTHING = 0.5  # weight of the newest interval in the forecast


def parse_bounds(value: str) -> dict[str, tuple[int, int]]:
    """`decode=1:2,prefill=1:2` -> {role: (low, high)}; ValueError naming what is wrong."""
    bounds = {}
    for part in filter(None, value.split(",")):
        role, _, span = part.partition("=")
        low, _, high = span.partition(":")
        if role not in SCALED_ROLES:
            raise ValueError(f"--planner-bounds: {role!r}: the planner scales {' and '.join(SCALED_ROLES)} "
                             "instances (encoders and unified engines keep their counts)")
        if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
            raise ValueError(f"--planner-bounds: {part!r}: expected ROLE=LOW:HIGH with 1 <= LOW <= HIGH")
        bounds[role] = (int(low), int(high))
    return bounds


@dataclass(frozen=True)
class PlannerConfig:
    """`epdserve up --planner`'s options."""
    bounds: dict[str, tuple[int, int]]  # prefill and decode: (low, high)
    slo: SLO
    interval: float = 10.0  # seconds between decisions
    profile: str | None = None  # a profile `epdserve plan --save-profile` wrote (None: measured latencies only)


@dataclass(frozen=True)
class Counters:
    """What the proxy's /metrics counts (summed over labels), at one scrape."""
    finished: float = 0.0
    failed: float = 0.0
    in_flight: float = 0.0
    prompt_tokens: float = 0.0  # of finished requests, and how many
    prompt_count: float = 0.0
    output_tokens: float = 0.0
    output_count: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    tpot_sum: float = 0.0
    tpot_count: float = 0.0

    @classmethod
    def from_metrics(cls, text: str) -> Counters:
        from prometheus_client.parser import text_string_to_metric_families

        sums: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
        return cls(sums.get("vllm:request_success_total", 0.0), sums.get("epdserve:request_failure_total", 0.0),
                   sums.get("epdserve:proxy_requests_in_flight", 0.0),
                   sums.get("vllm:request_prompt_tokens_sum", 0.0), sums.get("vllm:request_prompt_tokens_count", 0.0),
                   sums.get("vllm:request_generation_tokens_sum", 0.0),
                   sums.get("vllm:request_generation_tokens_count", 0.0),
                   sums.get("vllm:time_to_first_token_seconds_sum", 0.0),
                   sums.get("vllm:time_to_first_token_seconds_count", 0.0),
                   sums.get("vllm:request_time_per_output_token_seconds_sum", 0.0),
                   sums.get("vllm:request_time_per_output_token_seconds_count", 0.0))


@dataclass(frozen=True)
class Observation:
    """One interval: arrivals per second, the finished requests' mean lengths, the mean TTFT and TPOT (None:
    nothing finished to measure)."""
    rate: float
    input_len: float | None
    output_len: float | None
    ttft: float | None
    tpot: float | None

    @classmethod
    def between(cls, before: Counters, after: Counters, seconds: float) -> Observation:
        arrived = (after.finished - before.finished) + (after.failed - before.failed) + (after.in_flight -
                                                                                          before.in_flight)

        def mean(total: str, count: str) -> float | None:
            n = getattr(after, count) - getattr(before, count)
            return (getattr(after, total) - getattr(before, total)) / n if n > 0 else None

        return cls(max(arrived, 0.0) / seconds, mean("prompt_tokens", "prompt_count"),
                   mean("output_tokens", "output_count"), mean("ttft_sum", "ttft_count"),
                   mean("tpot_sum", "tpot_count"))


@dataclass
class Autoscaler:
    bounds: dict[str, tuple[int, int]]  # role -> (low, high), for prefill and decode
    slo: SLO
    profile: EngineProfile | None = None
    patience: int = 2
    forecast: Traffic | None = None
    _fewer: dict[str, int] = field(default_factory=dict)  # role -> intervals in a row that wanted fewer

    def decide(self, observation: Observation, current: dict[str, int]) -> tuple[dict[str, int], list[str]]:
        """The counts for the next interval, and why each role's changes (or would, held back)."""
        self._update_forecast(observation)
        wanted = dict(current)
        reasons = []
        if self.profile is not None and self.forecast is not None and self.forecast.rate > 0:
            layout = self._predicted()
            if layout is None:
                wanted = {role: self.bounds[role][1] for role in SCALED_ROLES}
                reasons.append(f"no layout within the bounds meets the SLOs at the forecast {self._describe()}: "
                               "the most of each role")
            else:
                wanted = {"prefill": layout.prefills, "decode": layout.decodes}
                reasons.append(f"predicted for the forecast {self._describe()}: {layout}")
        elif self.profile is None:
            for role, measured, limit in (("prefill", observation.ttft, self.slo.ttft),
                                          ("decode", observation.tpot, self.slo.tpot)):
                if observation.rate == 0 or (measured is not None and measured < limit / 2):
                    wanted[role] = current[role] - 1
                    reasons.append(f"{role}: " + ("no requests" if observation.rate == 0 else
                                                  f"measured {measured:.3f} s under half the SLO {limit:g} s"))
        for role, measured, limit in (("prefill", observation.ttft, self.slo.ttft),
                                      ("decode", observation.tpot, self.slo.tpot)):
            if measured is not None and measured > limit and wanted[role] <= current[role]:
                wanted[role] = current[role] + 1
                reasons.append(f"{role}: measured mean {measured:.3f} s above the SLO {limit:g} s: one more")
        decided = {}
        for role in SCALED_ROLES:
            low, high = self.bounds[role]
            target = min(max(wanted[role], low), high)
            if target < current[role]:
                self._fewer[role] = self._fewer.get(role, 0) + 1
                if self._fewer[role] < self.patience:
                    reasons.append(f"{role}: fewer wanted {self._fewer[role]} interval(s) in a row of "
                                   f"{self.patience}: held at {current[role]}")
                    target = current[role]
                else:
                    target, self._fewer[role] = current[role] - 1, 0
            else:
                self._fewer[role] = 0
            decided[role] = target
        return decided, reasons

    def _update_forecast(self, o: Observation) -> None:
        f = self.forecast
        if f is None:
            if o.input_len is not None and o.output_len is not None:
                self.forecast = Traffic(o.rate, round(o.input_len), round(o.output_len))
            return
        input_len = f.input_len if o.input_len is None else SMOOTHING * o.input_len + (1 - SMOOTHING) * f.input_len
        output_len = f.output_len if o.output_len is None else SMOOTHING * o.output_len + (1 - SMOOTHING) * f.output_len
        self.forecast = Traffic(SMOOTHING * o.rate + (1 - SMOOTHING) * f.rate, round(input_len), round(output_len))

    def _predicted(self) -> Layout | None:
        """The fewest instances within the bounds that meet the SLOs under the forecast (None: none do)."""
        (p_low, p_high), (d_low, d_high) = self.bounds["prefill"], self.bounds["decode"]
        layouts = sorted((Layout(prefills=p, decodes=d) for p in range(p_low, p_high + 1)
                          for d in range(d_low, d_high + 1)), key=lambda layout: layout.instances)
        for layout in layouts:
            prediction = predict(self.profile, self.forecast, layout)
            if prediction.meets(self.slo):
                return layout
        return None

    def _describe(self) -> str:
        f = self.forecast
        return f"({f.rate:.2f} req/s, {f.input_len} in / {f.output_len} out tokens)"


def bounds_for(bounds: dict[str, tuple[int, int]], prefills: int, decodes: int) -> dict[str, tuple[int, int]]:
    """Every scaled role's bounds: those given, else the role held at the stack's own count."""
    return {"prefill": bounds.get("prefill", (prefills, prefills)), "decode": bounds.get("decode", (decodes, decodes))}
