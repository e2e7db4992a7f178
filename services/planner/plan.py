"""The layouts a traffic could run on, ranked: the fewest instances that meet the SLOs, then the most goodput.

Candidates: one unified engine (what `epdserve up --unified` starts), and every xEyPzD with y, z >= 1 and, for a
traffic with images, x >= 1, of at most `max_instances` instances in all.
"""
from __future__ import annotations

from dataclasses import dataclass

from epdserve.services.planner.layout_model import SLO, Layout, Prediction, Traffic, goodput, predict
from epdserve.services.planner.profile import EngineProfile


@dataclass(frozen=True)
class Candidate:
    prediction: Prediction
    goodput: float  # requests per second at which the layout still meets the SLOs
    meets: bool

    @property
    def layout(self) -> Layout:
        return self.prediction.layout


def candidates(traffic: Traffic, max_instances: int) -> list[Layout]:
    encoders = range(1, max_instances - 1) if traffic.images else [0]
    out = [Layout(encoders=1 if traffic.images else 0, unified=1)]
    for e in encoders:
        for p in range(1, max_instances - e):
            for d in range(1, max_instances - e - p + 1):
                out.append(Layout(encoders=e, prefills=p, decodes=d))
    return [layout for layout in out if layout.instances <= max_instances]


def plan(profile: EngineProfile, traffic: Traffic, slo: SLO, max_instances: int) -> list[Candidate]:
    """Every candidate, best first: those meeting the SLOs (fewest instances, then most goodput), then the rest
    (most goodput)."""
    if max_instances < 1:
        raise ValueError(f"--max-instances must be at least 1, got {max_instances}")
    ranked = []
    for layout in candidates(traffic, max_instances):
        prediction = predict(profile, traffic, layout)
        ranked.append(Candidate(prediction, goodput(profile, traffic, layout, slo), prediction.meets(slo)))
    return sorted(ranked, key=lambda c: (not c.meets, c.layout.instances if c.meets else 0, -c.goodput,
                                          c.layout.instances))
