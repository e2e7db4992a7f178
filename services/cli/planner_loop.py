"""`epdserve up --planner`'s loop: every interval, the proxy's metrics scraped, the autoscaler asked
(services/planner/autoscaler.py), and the stack's encoders, prefills and decodes added or retired to match; every
decision printed with its reason. The proxy learns of each change from the stack's discovery file, and exports what
the planner wants (epdserve:planner_desired_replicas{role})."""
from __future__ import annotations

import time
import urllib.error
import urllib.request

from epdserve.services.planner.autoscaler import Autoscaler, Counters, PlannerConfig


class PlannerLoop:
    def __init__(self, stack, config: PlannerConfig, url: str) -> None:
        """`stack`: the LocalStack it scales; `url`: its proxy's."""
        self.stack, self.config, self.url = stack, config, url
        self.autoscaler = Autoscaler.from_config(config)
        self._next = time.monotonic()
        stack.write_discovery(desired=self._counts())

    def _counts(self) -> dict[str, int]:
        return {role: self.stack.count(role) for role in self.autoscaler.roles}

    def _scrape(self) -> Counters | None:
        key = self.stack.config.api_key
        request = urllib.request.Request(self.url + "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                return Counters.from_metrics(r.read().decode())
        except (urllib.error.URLError, OSError, ValueError) as exc:
            print(f"epdserve up: planner: cannot read the proxy's metrics ({exc}); no decision this interval",
                  flush=True)
            return None

    def tick(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.config.interval
        counters = self._scrape()
        if counters is None:
            return
        observation = self.autoscaler.observe(counters, now)
        if observation is None:
            return
        current = self._counts()
        decided, reasons = self.autoscaler.decide(observation, current)
        changes = []
        for role in self.autoscaler.roles:
            while self.stack.count(role) < decided[role]:
                changes.append(f"started {self.stack.add_instance(role)}")
            while self.stack.count(role) > decided[role]:
                changes.append(f"retiring {self.stack.retire_instance(role)} (drained, then stopped)")
        self.stack.write_discovery(desired=decided)
        # Printed when it acts or holds back; what it wants every interval is in the proxy's metrics.
        if changes or any("held at" in reason for reason in reasons):
            measured = (f"{observation.rate:.2f} req/s; TTFT " + (f"{observation.ttft:.3f} s" if observation.ttft
                                                                  is not None else "-") + ", TPOT " +
                        (f"{observation.tpot * 1000:.0f} ms" if observation.tpot is not None else "-"))
            counts = ", ".join(f"{role} {current[role]} -> {decided[role]}" for role in self.autoscaler.roles)
            print(f"epdserve up: planner: {counts} ({measured}): {'; '.join(reasons) or 'no change'}"
                  + (f"; {', '.join(changes)}" if changes else ""), flush=True)
