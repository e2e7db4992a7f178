"""`epdserve serve planner`: the planner as a service of its own, for a deployment whose instances an orchestrator
starts and stops (compose, Kubernetes) rather than `epdserve up`.

Every interval it reads the stack as its proxy sees it - /metrics for the traffic, /ready for the instances of
each role that are healthy - and asks the autoscaler (autoscaler.py: the same decisions as `up --planner`) how
many each role should have. It starts and stops nothing: it says what it wants, as
`epdserve:planner_desired_replicas{role}` on its own /metrics, for KEDA's Prometheus scaler (or an HPA through
prometheus-adapter) to set each Deployment's replicas by, and logs each decision with its reason. /ready answers
200 once it has read the proxy. SIGTERM or SIGINT stops it at once: it holds nothing.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time

import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from epdserve.services.planner.autoscaler import Autoscaler, Counters, PlannerConfig
from epdserve.services.runtime.management import ManagementServer, build_management_app
from epdserve.transport.channel.protocol import Health

logger = logging.getLogger(__name__)


class PlannerService:
    def __init__(self, config: PlannerConfig, proxy_url: str, api_key: str | None, model_name: str | None) -> None:
        """`model_name`: its metric's label (None: the one the proxy's metrics carry)."""
        self.config, self.proxy_url, self.model_name = config, proxy_url.rstrip("/"), model_name
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.autoscaler = Autoscaler.from_config(config)
        self.desired: dict[str, int] = {}
        self._unreachable = False
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self):
        family = GaugeMetricFamily("epdserve:planner_desired_replicas", "Instances the planner wants of each role.",
                                   labels=["model_name", "role"])
        for role, replicas in sorted(self.desired.items()):
            family.add_metric([self.model_name or "", role], replicas)
        yield family

    def health(self) -> tuple[Health, dict]:
        return (Health.READY if self.desired else Health.STARTING), {"desired": self.desired}

    async def tick(self, client: httpx.AsyncClient) -> None:
        """One interval: the proxy read, a decision made (none from the first reading: it starts the interval)."""
        try:
            metrics = await client.get(self.proxy_url + "/metrics", headers=self.headers)
            metrics.raise_for_status()
            ready = await client.get(self.proxy_url + "/ready", headers=self.headers)  # 503 while a role has none
            healthy = ready.json().get("healthy_instances", {})
            counters = Counters.from_metrics(metrics.text)
            if self.model_name is None:
                self.model_name = next((s.labels["model_name"] for f in text_string_to_metric_families(metrics.text)
                                        for s in f.samples if "model_name" in s.labels), "")
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            if not self._unreachable:  # once until it answers again, not every interval
                logger.warning("planner: cannot read the proxy at %s (%s); no decisions until it answers",
                               self.proxy_url, exc)
            self._unreachable = True
            return
        self._unreachable = False
        observation = self.autoscaler.observe(counters, time.monotonic())
        if observation is None:  # it starts from the instances the proxy has
            self.desired = {role: int(healthy.get(role, 0)) for role in self.autoscaler.roles}
            return
        # Then from what it asked for, as an HPA from its replicas' spec: the instances it wanted may take a while
        # to come or go (a pod's start, a drain), and counting those still there would undo a scale-in it has
        # already decided.
        current = dict(self.desired)
        decided, reasons = self.autoscaler.decide(observation, current)
        if decided != self.desired or any("held at" in reason for reason in reasons):
            counts = ", ".join(f"{role} {current[role]} -> {decided[role]}" for role in self.autoscaler.roles)
            logger.info("planner: %s (%.2f req/s): %s", counts, observation.rate, "; ".join(reasons) or "no change")
        self.desired = decided

    async def run(self, host: str, http_port: int) -> None:
        # Its own handlers, before its port answers: SIGTERM or SIGINT stops it even where it was started with
        # SIGINT ignored (a script's background job).
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        server = ManagementServer(build_management_app(self.health, lambda: self.registry), host, http_port)
        port = await server.start()
        logger.info("planner: reading %s every %g s; desired replicas on http://%s:%d/metrics", self.proxy_url,
                    self.config.interval, host, port)
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                while not stop.is_set():
                    await self.tick(client)
                    try:
                        await asyncio.wait_for(stop.wait(), self.config.interval)
                    except asyncio.TimeoutError:
                        pass
        finally:
            await server.close()
