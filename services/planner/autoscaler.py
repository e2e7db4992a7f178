"""`epdserve up --planner`: how many encoders, prefills and decodes the next interval needs, from what the proxy
measured in the last one.

Every interval the stack's proxy is scraped (its /metrics: requests finished, failed and in flight, their
prompt and output lengths, TTFT and time per output token, and the time its requests spent in each stage: an
image's encoding, a prompt's prefill) and the difference to the last scrape is one `Observation`. The next
interval's traffic is forecast as a moving average of the observed ones. Then:

  predicted   with a profile (`epdserve plan --save-profile`), the fewest instances within the bounds whose
              predicted TTFT and TPOT (layout_model.py) meet the SLOs under the forecast (encoders by the
              images forecast and the profile's time an image; where it has none, the encoders are held);
  corrected   whatever was predicted, a role whose measured mean breaks its SLO gets one instance more than it
              has (TPOT: decode; TTFT: of the encoder and the prefill, the one its requests spent longer in) -
              the model is a model, the measurement is what users saw; and the prefills get one more while
              the proxy gives prompts to decodes because every prefill is backed up (its burst-sharing rule,
              --max-prefill-queue-tokens: services/proxy/prefill_queue.py), whatever the latencies - the decodes
              are doing the prefills' work, at their streams' expense;
  held        fewer instances only after `patience` intervals in a row that all wanted fewer, one at a time
              (a lull does not take away what the next burst needs; a scale-in drains, which takes a while);
  budgeted    with `max_instances` (the cores, memory or machines the stack may take, counted in instances,
              as Dynamo's planner has a GPU budget), never more instances than that of the roles it scales
              together: the predicted layout is the fewest within it, and more than it has room for goes to
              the roles furthest over their SLOs first (decode by TPOT, the others by TTFT).

Without a profile only the correction acts, and a role whose mean stays under half its SLO for `patience`
intervals gives one instance back (an encoder also when no image came). Only the roles with bounds are scaled
(bounds_for: the others keep the stack's count). Every decision carries its reason, which the stack logs.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from epdserve.services.planner.layout_model import SLO, Layout, Traffic, predict
from epdserve.services.planner.profile import EngineProfile

SCALED_ROLES = ("encoder", "prefill", "decode")
ENCODE_STAGE, PREFILL_STAGE = "proxy.encode", "proxy.prefill"  # the proxy's spans: per image, per prompt
# The proxy's routing reason (epdserve:routing_decisions_total) for a prompt its burst-sharing rule gave a decode
# because every prefill was backed up (services/proxy/prefill_queue.py REASON: they meet only on the wire).
SHARED_REASON = "prefill_queue"
SMOOTHING = 0.5  # weight of the newest interval in the forecast


def parse_bounds(value: str) -> dict[str, tuple[int, int]]:
    """`decode=1:2,prefill=1:2,encoder=1:2` -> {role: (low, high)}; ValueError naming what is wrong."""
    bounds = {}
    for part in filter(None, value.split(",")):
        role, _, span = part.partition("=")
        low, _, high = span.partition(":")
        if role not in SCALED_ROLES:
            raise ValueError(f"--planner-bounds: {role!r}: the planner scales {', '.join(SCALED_ROLES)} "
                             "instances (a unified engine keeps its count)")
        if not (low.isdigit() and high.isdigit()) or not 1 <= int(low) <= int(high):
            raise ValueError(f"--planner-bounds: {part!r}: expected ROLE=LOW:HIGH with 1 <= LOW <= HIGH")
        bounds[role] = (int(low), int(high))
    return bounds


@dataclass(frozen=True)
class PlannerConfig:
    """`epdserve up --planner`'s options."""
    bounds: dict[str, tuple[int, int]]  # encoder, prefill and decode: (low, high)
    slo: SLO
    interval: float = 10.0  # seconds between decisions
    profile: str | None = None  # a profile `epdserve plan --save-profile` wrote (None: measured latencies only)
    max_instances: int | None = None  # of the roles scaled, together (None: the bounds alone)


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
    encode_sum: float = 0.0  # images encoded (the proxy's wait for each), and how many
    encode_count: float = 0.0
    prefill_sum: float = 0.0  # prompts prefilled (the proxy's wait for each), and how many
    prefill_count: float = 0.0
    shared: float = 0.0  # prompts given to decodes because every prefill was backed up

    @classmethod
    def from_metrics(cls, text: str) -> Counters:
        from prometheus_client.parser import text_string_to_metric_families

        sums: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                # The stages' histogram by its stage; every other metric summed over its labels.
                name = sample.name
                if name.startswith("epdserve:request_stage_seconds"):
                    name += "|" + sample.labels.get("stage", "")
                elif name == "epdserve:routing_decisions_total":
                    name += "|" + sample.labels.get("reason", "")
                sums[name] = sums.get(name, 0.0) + sample.value
        stage = "epdserve:request_stage_seconds"
        return cls(sums.get("vllm:request_success_total", 0.0), sums.get("epdserve:request_failure_total", 0.0),
                   sums.get("epdserve:proxy_requests_in_flight", 0.0),
                   sums.get("vllm:request_prompt_tokens_sum", 0.0), sums.get("vllm:request_prompt_tokens_count", 0.0),
                   sums.get("vllm:request_generation_tokens_sum", 0.0),
                   sums.get("vllm:request_generation_tokens_count", 0.0),
                   sums.get("vllm:time_to_first_token_seconds_sum", 0.0),
                   sums.get("vllm:time_to_first_token_seconds_count", 0.0),
                   sums.get("vllm:request_time_per_output_token_seconds_sum", 0.0),
                   sums.get("vllm:request_time_per_output_token_seconds_count", 0.0),
                   sums.get(f"{stage}_sum|{ENCODE_STAGE}", 0.0), sums.get(f"{stage}_count|{ENCODE_STAGE}", 0.0),
                   sums.get(f"{stage}_sum|{PREFILL_STAGE}", 0.0), sums.get(f"{stage}_count|{PREFILL_STAGE}", 0.0),
                   sums.get(f"epdserve:routing_decisions_total|{SHARED_REASON}", 0.0))


@dataclass(frozen=True)
class Observation:
    """One interval: arrivals per second, the finished requests' mean lengths, the mean TTFT and TPOT, images per
    request, and the mean time of an image's encoding and of a prompt's prefill as the proxy waited for them (None:
    nothing finished, encoded or prefilled to measure); and how many prompts went to decodes because every
    prefill was backed up."""
    rate: float
    input_len: float | None
    output_len: float | None
    ttft: float | None
    tpot: float | None
    images: float | None = None
    encode: float | None = None
    prefill: float | None = None
    shared: float = 0.0

    @classmethod
    def between(cls, before: Counters, after: Counters, seconds: float) -> Observation:
        arrived = (after.finished - before.finished) + (after.failed - before.failed) + (after.in_flight -
                                                                                          before.in_flight)

        def mean(total: str, count: str) -> float | None:
            n = getattr(after, count) - getattr(before, count)
            return (getattr(after, total) - getattr(before, total)) / n if n > 0 else None

        prompts = after.prompt_count - before.prompt_count
        images = (after.encode_count - before.encode_count) / prompts if prompts > 0 else None
        return cls(max(arrived, 0.0) / seconds, mean("prompt_tokens", "prompt_count"),
                   mean("output_tokens", "output_count"), mean("ttft_sum", "ttft_count"),
                   mean("tpot_sum", "tpot_count"), images, mean("encode_sum", "encode_count"),
                   mean("prefill_sum", "prefill_count"), max(after.shared - before.shared, 0.0))

    def first_token_role(self) -> str:
        """Of the encoder and the prefill, the one the requests spent longer in before their first token: images
        per request times an image's time, against a prompt's (the TTFT less the images' when not measured)."""
        if not self.images or self.encode is None:
            return "prefill"
        images = self.images * self.encode
        prefill = self.prefill if self.prefill is not None else (self.ttft or 0.0) - images
        return "encoder" if images > prefill else "prefill"


@dataclass
class Autoscaler:
    bounds: dict[str, tuple[int, int]]  # role -> (low, high), for each role scaled (of SCALED_ROLES)
    slo: SLO
    profile: EngineProfile | None = None
    patience: int = 2
    max_instances: int | None = None
    forecast: Traffic | None = None
    _fewer: dict[str, int] = field(default_factory=dict)  # role -> intervals in a row that wanted fewer
    _last: tuple[float, Counters] | None = None  # the last scrape: (when, by time.monotonic(), what)

    @classmethod
    def from_config(cls, config: PlannerConfig) -> Autoscaler:
        profile = EngineProfile.load(config.profile) if config.profile else None
        return cls(config.bounds, config.slo, profile, max_instances=config.max_instances)

    @property
    def roles(self) -> list[str]:
        return [role for role in SCALED_ROLES if role in self.bounds]

    def observe(self, counters: Counters, now: float) -> Observation | None:
        """The interval since the last scrape, `counters` read at `now` (None for the first: it starts one)."""
        last, self._last = self._last, (now, counters)
        return None if last is None else Observation.between(last[1], counters, now - last[0])

    def decide(self, observation: Observation, current: dict[str, int]) -> tuple[dict[str, int], list[str]]:
        """The counts for the next interval of each role with bounds, and why each changes (or would, held
        back)."""
        self._update_forecast(observation)
        wanted = {role: current[role] for role in self.roles}
        reasons = []
        if self.profile is not None and self.forecast is not None and self.forecast.rate > 0:
            layout = self._predicted(current)
            if layout is None:
                wanted = {role: self.bounds[role][1] for role in self.roles}
                reasons.append(f"no layout within the bounds meets the SLOs at the forecast {self._describe()}: "
                               "the most of each role")
            else:
                wanted = {role: n for role, n in (("encoder", layout.encoders), ("prefill", layout.prefills),
                                                  ("decode", layout.decodes)) if role in wanted}
                reasons.append(f"predicted for the forecast {self._describe()}: {layout}")
        elif self.profile is None:
            for role, measured, limit in (("encoder", observation.ttft, self.slo.ttft),
                                          ("prefill", observation.ttft, self.slo.ttft),
                                          ("decode", observation.tpot, self.slo.tpot)):
                if role not in wanted:
                    continue
                if observation.rate == 0 or (measured is not None and measured < limit / 2):
                    wanted[role] = current[role] - 1
                    reasons.append(f"{role}: " + ("no requests" if observation.rate == 0 else
                                                  f"measured {measured:.3f} s under half the SLO {limit:g} s"))
                elif role == "encoder" and observation.images == 0:
                    wanted[role] = current[role] - 1
                    reasons.append("encoder: no images")
        first_token = observation.first_token_role() if "encoder" in wanted else "prefill"
        for role, measured, limit in ((first_token, observation.ttft, self.slo.ttft),
                                      ("decode", observation.tpot, self.slo.tpot)):
            if role in wanted and measured is not None and measured > limit and wanted[role] <= current[role]:
                wanted[role] = current[role] + 1
                reasons.append(f"{role}: measured mean {measured:.3f} s above the SLO {limit:g} s: one more")
        if "prefill" in wanted and observation.shared > 0 and wanted["prefill"] <= current["prefill"]:
            wanted["prefill"] = current["prefill"] + 1
            reasons.append(f"prefill: {observation.shared:.0f} prompt(s) went to decodes, every prefill backed up: "
                           "one more")
        decided = {}
        for role in self.roles:
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
        if self.max_instances is not None:
            decided = self._within_budget(decided, current, observation, reasons)
        return decided, reasons

    def _within_budget(self, decided: dict[str, int], current: dict[str, int], observation: Observation,
                       reasons: list[str]) -> dict[str, int]:
        """`decided` with no more instances than max_instances: what is retired frees room, and the roles that grow
        get what is left, the one furthest over its SLO first."""
        kept = {role: min(n, current[role]) for role, n in decided.items()}
        room = self.max_instances - sum(kept.values())
        grown = {role: n - kept[role] for role, n in decided.items() if n > kept[role]}

        def over(role: str) -> float:
            measured, limit = ((observation.tpot, self.slo.tpot) if role == "decode" else
                               (observation.ttft, self.slo.ttft))
            return (measured or 0.0) / limit

        for role in sorted(grown, key=over, reverse=True):
            granted = min(grown[role], max(room, 0))
            kept[role] += granted
            room -= granted
            if granted < grown[role]:
                reasons.append(f"{role}: {decided[role]} wanted, held at {kept[role]}: the budget is "
                               f"{self.max_instances} instances")
        return kept

    def _update_forecast(self, o: Observation) -> None:
        f = self.forecast
        if f is None:
            if o.input_len is not None and o.output_len is not None:
                self.forecast = Traffic(o.rate, round(o.input_len), round(o.output_len), o.images or 0.0)
            return

        def smoothed(new: float | None, old: float) -> float:
            return old if new is None else SMOOTHING * new + (1 - SMOOTHING) * old

        self.forecast = Traffic(smoothed(o.rate, f.rate), round(smoothed(o.input_len, f.input_len)),
                                round(smoothed(o.output_len, f.output_len)), smoothed(o.images, f.images))

    def _predicted(self, current: dict[str, int]) -> Layout | None:
        """The fewest instances within the bounds that meet the SLOs under the forecast (None: none do)."""
        def counts(role: str, least: int = 0) -> range:
            """Within the role's bounds; a role without them as many as it has (a prefill and a decode at least)."""
            low, high = self.bounds.get(role, (current.get(role, 0),) * 2)
            return range(max(low, least), max(high, least) + 1)

        traffic, encoders = self.forecast, counts("encoder")
        if traffic.images and (self.profile.encode is None or max(encoders) == 0):
            # What the images take cannot be predicted (the profile has no image's time, or there is no encoder):
            # left out, and the encoders held.
            held = current.get("encoder", 0)
            traffic, encoders = replace(traffic, images=0.0), range(held, held + 1)
        layouts = sorted((Layout(encoders=e, prefills=p, decodes=d) for e in encoders for p in counts("prefill", 1)
                          for d in counts("decode", 1)), key=lambda layout: layout.instances)
        if self.max_instances is not None:
            layouts = [layout for layout in layouts if self._counted(layout) <= self.max_instances]
        for layout in layouts:
            prediction = predict(self.profile, traffic, layout)
            if prediction.meets(self.slo):
                return layout
        return None

    def _counted(self, layout: Layout) -> int:
        """The instances of `layout` the budget counts: those of the roles scaled."""
        return sum(n for role, n in (("encoder", layout.encoders), ("prefill", layout.prefills),
                                     ("decode", layout.decodes)) if role in self.bounds)

    def _describe(self) -> str:
        f = self.forecast
        images = f", {f.images:.2f} images" if f.images else ""
        return f"({f.rate:.2f} req/s, {f.input_len} in / {f.output_len} out tokens{images})"


def bounds_for(bounds: dict[str, tuple[int, int]], encoders: int, prefills: int,
               decodes: int) -> dict[str, tuple[int, int]]:
    """Every role's bounds: those given, else the role held at the stack's own count (encoders only where the
    stack has some)."""
    held = {"prefill": prefills, "decode": decodes, **({"encoder": encoders} if encoders or "encoder" in bounds else {})}
    return {role: bounds.get(role, (n, n)) for role, n in held.items()}
