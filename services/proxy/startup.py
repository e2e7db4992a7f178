"""The proxy's start: it listens at once, and serves the API once every role it routes to has a ready instance.

Until then every API route answers 503 with an OpenAI error body naming the roles it waits for, and the
proxy logs no URL: its first line that shows one is its ready line. It listens from the start (rather
than opening its port only once a route exists) because orchestrators and `epdserve up` probe /health
(alive) and /ready (serving) through a start that takes minutes while engines load their model: a closed
port reads as a dead proxy to a probe, and as "connection refused", which says nothing, to a client.

After that first ready, a role that loses every instance makes its requests fail one by one (503, no
healthy instance), as the router decides; the API stays open.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

logger = logging.getLogger(__name__)

# How often the start is checked while it lasts: the ready line follows the router's polls closely.
CHECK_INTERVAL_SECONDS = 0.2


class Startup:
    """Whether the proxy has been ready yet; the first check that finds it so logs the ready line."""

    def __init__(self, readiness: Callable[[], tuple[bool, dict]], model_name: str, url: str) -> None:
        """`readiness()` -> (every configured role has a healthy instance, {"unavailable_roles": [...]})."""
        self.readiness, self.model_name, self.url = readiness, model_name, url
        self.started = False

    def waiting_for(self) -> str | None:
        """Why the API is not served yet (None once it is)."""
        if self.started:
            return None
        ready, details = self.readiness()
        if not ready:
            roles = " and ".join(details["unavailable_roles"])
            return (f"{self.model_name} is starting: no {roles} instance is ready yet (engines load the model "
                    "first); retry once GET /ready answers 200")
        self.started = True
        logger.info("proxy for %s ready: %s/v1", self.model_name, self.url)
        return None

    async def watch(self) -> None:
        """Check until the proxy is ready, so that the ready line comes without waiting for a request."""
        while self.waiting_for() is not None:
            await asyncio.sleep(CHECK_INTERVAL_SECONDS)
