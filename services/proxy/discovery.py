"""A discovery file: the instances of each role, rewritten by whoever scales them (`epdserve up --planner`).

    {"prefill": ["127.0.0.1:7000", ...], "decode": [...], "encoder": [...], "unified": [...],
     "planner": {"desired": {"decode": 2, ...}}}

A role the file names has exactly the instances it lists (the command line's are the first list, until the
file is written); a role it does not name keeps the command line's. An instance dropped from a list is
routed no new request and watched until its requests end, as one gone from DNS. The file is read again
whenever it changes (checked every poll); one that cannot be read or parsed changes nothing and is warned
about once. `planner.desired`: the replicas the planner wants of each role, which the proxy exports.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from epdserve.services.runtime.network import split_target
from epdserve.transport.channel.protocol import Role

logger = logging.getLogger(__name__)

ROLES = {role.value: role for role in (Role.ENCODER, Role.PREFILL, Role.DECODE, Role.UNIFIED)}


class Discovery:
    """What the file says, read again when its modification time changes."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) of the last version read
        self.targets: dict[Role, list[str]] = {}
        self.desired: dict[str, int] = {}
        self._warned = False

    def changed(self) -> bool:
        """Re-read the file if it changed since the last read; True if what it says changed."""
        try:
            stat = self.path.stat()
        except OSError as exc:
            self._warn(f"cannot read it: {exc}")
            return False
        if (stat.st_mtime_ns, stat.st_size) == self._seen:
            return False
        self._seen = (stat.st_mtime_ns, stat.st_size)
        try:
            targets, desired = parse(self.path.read_text())
        except (OSError, ValueError) as exc:
            self._warn(str(exc))
            return False
        self._warned = False
        if (targets, desired) == (self.targets, self.desired):
            return False
        self.targets, self.desired = targets, desired
        return True

    def _warn(self, why: str) -> None:
        if not self._warned:
            logger.warning("discovery file %s: %s; keeping the instances known before", self.path, why)
            self._warned = True


def parse(text: str) -> tuple[dict[Role, list[str]], dict[str, int]]:
    """(targets by role, the planner's desired replicas by role name); ValueError naming what is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    unknown = set(data) - set(ROLES) - {"planner"}
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)}: expected {sorted(ROLES)} and planner")
    targets = {}
    for name, role in ROLES.items():
        if name in data:
            listed = data[name]
            if not isinstance(listed, list) or not all(isinstance(t, str) for t in listed):
                raise ValueError(f"{name}: expected a list of HOST:PORT strings")
            for target in listed:
                split_target(target)  # raises ValueError naming the bad one
            targets[role] = listed
    planner = data.get("planner", {})
    desired = planner.get("desired", {}) if isinstance(planner, dict) else None
    if not isinstance(desired, dict) or not all(k in ROLES and isinstance(v, int) and v >= 0
                                                 for k, v in desired.items()):
        raise ValueError("planner.desired: expected {role: replicas}")
    return targets, desired
