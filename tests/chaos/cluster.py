"""The chaos suite's hands on the running compose project: its containers, their network namespaces, their
metrics, the KV taps in front of the prefills' block ports, and healing the stack between faults.

Engines publish no port, but the host reaches every container's address on the compose network: their
/metrics (port 9000) are read from there. Network faults are iptables rules run in a container's own network
namespace (`nsenter -t PID -n`, PID its main process as the host sees it): the container and its image are
never changed.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx

ENGINE_SERVICES = ("encoder", "prefill", "decode")
HEALTHY = {"encoder": 1, "prefill": 2, "decode": 2}  # what the proxy must route to once healed
METRICS_PORT = 9000
BLOCK_PORT = 7101  # compose.yaml's --block-port of every prefill
TAP_PORT = 17101  # where a prefill's KV tap listens, in the prefill's network namespace
HEAL_TIMEOUT_S = 240  # a restarted engine loads its model beside four others on a shared CPU


def sh(*argv: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return sh("docker", *args, timeout=timeout, check=check)


def wait_for(condition: Callable[[], bool], what: str, timeout: float, interval: float = 0.5) -> float:
    """Seconds until `condition()` held; AssertionError naming `what` after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} (after {timeout:.0f}s)")
        time.sleep(interval)
    return time.monotonic() - start


# The labels every sample of a service carries (which service it is), left out of the keys parse_metrics makes.
IDENTITY_LABELS = ("model_name", "role", "engine_id", "engine")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name with its labels: value}, and {bare name: sum over its samples}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in IDENTITY_LABELS)
            out[s.name] = out.get(s.name, 0.0) + s.value
            if labels:
                out[f"{s.name}{{{labels}}}"] = out.get(f"{s.name}{{{labels}}}", 0.0) + s.value
    return out


class KVTap:
    """tests/chaos/kv_tap.py in one prefill container's network namespace, every connection to its block port
    redirected through it. Runs on the host's Python (it reads requests with the project's codec)."""

    def __init__(self, container: str, pid: int, workdir: Path) -> None:
        self.container, self.pid = container, pid
        self.control, self.stats = workdir / f"{container}.control.json", workdir / f"{container}.stats.json"
        self.log = workdir / f"{container}.log"
        self.set_mode()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                ["nsenter", "-t", str(pid), "-n", sys.executable, str(Path(__file__).with_name("kv_tap.py")),
                 "--listen", str(TAP_PORT), "--upstream", f"127.0.0.1:{BLOCK_PORT}", "--control", str(self.control),
                 "--stats", str(self.stats), "--seed", str(pid)], stdout=log, stderr=subprocess.STDOUT)
        wait_for(lambda: self.stats.exists() or self.proc.poll() is not None, "the KV tap to start", 30, 0.1)
        assert self.proc.poll() is None, f"the KV tap of {container} exited: {self.log.read_text()[-2000:]}"
        # Only new connections are redirected (conntrack): the tap goes in before the first KV fetch.
        nsenter_iptables(pid, "-t", "nat", "-A", "PREROUTING", "-p", "tcp", "--dport", str(BLOCK_PORT),
                         "-j", "REDIRECT", "--to-ports", str(TAP_PORT))

    def set_mode(self, delay: float = 0.0, flip: bool = False) -> None:
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps({"delay": delay, "flip": flip}))
        os.replace(tmp, self.control)

    def read_stats(self) -> dict:
        try:
            return json.loads(self.stats.read_text())
        except (OSError, ValueError):
            return {}

    def wait_mode(self, delay: float, flip: bool) -> None:
        wait_for(lambda: (self.read_stats().get("delay"), self.read_stats().get("flip")) == (delay, flip),
                 f"the KV tap of {self.container} to take its mode", 10, 0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def nsenter_iptables(pid: int, *rule: str) -> None:
    sh("nsenter", "-t", str(pid), "-n", "iptables", "-w", *rule)


# What marks a line of a service's log worth showing beside a broken invariant.
_ALARMS = (" WARNING ", " ERROR ", " CRITICAL ", "Traceback", "Assertion failed", "Segmentation fault", "Aborted")


class Cluster:
    """The compose project under test (a tests/compose Stack), seen container by container."""

    def __init__(self, stack, api_key: str, workdir: Path) -> None:
        self.stack, self.api_key, self.workdir = stack, api_key, workdir
        self.taps: dict[str, KVTap] = {}
        self.frozen: dict[str, list[int] | None] = {}  # container -> pids stopped by signal (None: docker pause)
        self.notes: list[str] = []  # what a fault's run should record, taken by `take_notes`

    def take_notes(self) -> list[str]:
        notes, self.notes = self.notes, []
        return notes

    # -- containers ----------------------------------------------------------------------------------
    def containers(self, service: str) -> list[str]:
        return self.stack.containers(service, all_states=True)

    def engines(self) -> list[str]:
        return [c for s in ENGINE_SERVICES for c in self.containers(s)]

    def state(self, container: str) -> dict:
        return json.loads(docker("inspect", "--format", "{{json .State}}", container).stdout)

    def restart_count(self, container: str) -> int:
        return int(docker("inspect", "--format", "{{.RestartCount}}", container).stdout)

    def pid(self, container: str) -> int:
        pid = self.state(container)["Pid"]
        assert pid, f"{container} is not running"
        return pid

    def ip(self, container: str) -> str:
        return self.stack.ip(container)

    def iptables(self, container: str, *rule: str) -> None:
        nsenter_iptables(self.pid(container), *rule)

    def freeze(self, container: str) -> None:
        """`docker pause`; where the cgroup freezer fails ("unable to freeze", seen on this project's CI
        machines), SIGSTOP to every process of the container, which freezes it as far as any peer can tell."""
        paused = docker("pause", container, check=False)
        if paused.returncode == 0:
            self.frozen[container] = None
            return
        pids = [int(pid) for pid in docker("top", container, "-eo", "pid").stdout.split()[1:]]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        self.frozen[container] = pids
        self.notes.append(f"docker pause failed ({paused.stderr.strip()[-120:]}): froze its {len(pids)} "
                          "process(es) with SIGSTOP instead, SIGCONT to thaw")

    def thaw(self, container: str) -> None:
        if container not in self.frozen:
            return
        pids = self.frozen.pop(container)
        if pids is None:
            docker("unpause", container)
        for pid in pids or ():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    # -- metrics -------------------------------------------------------------------------------------
    def metrics(self, container: str) -> dict[str, float]:
        body = httpx.get(f"http://{self.ip(container)}:{METRICS_PORT}/metrics", timeout=5).text
        return parse_metrics(body)

    def proxy_metrics(self) -> dict[str, float]:
        body = httpx.get(self.stack.url + "/metrics", headers={"Authorization": f"Bearer {self.api_key}"},
                         timeout=10).text
        return parse_metrics(body)

    def healthy_instances(self) -> dict[str, int]:
        try:
            return httpx.get(self.stack.url + "/ready", headers={"Authorization": f"Bearer {self.api_key}"},
                             timeout=5).json().get("healthy_instances", {})
        except (httpx.HTTPError, ValueError):
            return {}

    def held_blocks(self) -> dict[str, int]:
        """KV blocks each engine holds (its pool's total less its free blocks); None where unreadable."""
        held = {}
        for container in self.containers("prefill") + self.containers("decode"):
            try:
                m = self.metrics(container)
                held[container] = int(m["epdserve:num_kv_blocks"] - m["epdserve:num_free_kv_blocks"])
            except (httpx.HTTPError, KeyError, AssertionError):
                held[container] = None
        return held

    def wait_idle(self, timeout: float) -> dict[str, int]:
        """Blocks still held when every engine went idle, or when `timeout` ran out: {container: blocks}."""
        deadline = time.monotonic() + timeout
        while True:
            held = self.held_blocks()
            if all(n == 0 for n in held.values()) or time.monotonic() > deadline:
                return {c: n for c, n in held.items() if n != 0}
            time.sleep(1)

    def roster(self) -> list[str]:
        """Who each container of the stack is to its peers (hostname, address) and whether its process was
        replaced (restarts, when it started, killed for memory): the services' logs name peers by hostname."""
        lines = []
        for container in [*self.engines(), *self.containers("proxy")]:
            found = json.loads(docker("inspect", "--format", "{{json .}}", container).stdout)
            state = found["State"]
            networks = found["NetworkSettings"]["Networks"].values()
            lines.append(f"{container}: host {found['Config']['Hostname']} "
                         f"at {','.join(n['IPAddress'] for n in networks) or '-'}, "
                         f"{found['RestartCount']} restarts, started {state['StartedAt']}, "
                         f"exit {state['ExitCode']}{', killed for memory' if state['OOMKilled'] else ''}")
        return lines

    def warnings_since(self, since: float, per_container: int = 12) -> list[str]:
        """The WARNING and ERROR lines every container of the stack logged since `since` (Unix time), and the
        marks of a process that died without logging (a traceback, a native crash)."""
        lines = []
        for container in [*self.engines(), *self.containers("proxy")]:
            done = docker("logs", "--since", f"{since:.0f}", container, check=False)
            found = [line for line in (done.stdout + done.stderr).splitlines() if any(mark in line for mark in _ALARMS)]
            lines += [f"{container}: {line[:400]}" for line in found[-per_container:]]
        return lines

    # -- KV taps -------------------------------------------------------------------------------------
    def install_taps(self) -> None:
        """A KV tap on every prefill whose current process has none (a restarted container is a new one)."""
        for container in self.containers("prefill"):
            pid = self.pid(container)
            tap = self.taps.get(container)
            if tap is not None and tap.pid == pid and tap.proc.poll() is None:
                continue
            if tap is not None:
                tap.stop()
            self.taps[container] = KVTap(container, pid, self.workdir)

    def set_taps(self, delay: float = 0.0, flip: bool = False) -> None:
        for tap in self.taps.values():
            tap.set_mode(delay, flip)
        for tap in self.taps.values():
            tap.wait_mode(delay, flip)

    def tapped_fetches(self) -> int:
        """KV fetch messages the taps have seen so far."""
        return sum(tap.read_stats().get("requests", 0) for tap in self.taps.values())

    def flipped(self) -> list[str]:
        return [rid for tap in self.taps.values() for rid in tap.read_stats().get("flipped", [])]

    def close(self) -> None:
        for tap in self.taps.values():
            tap.stop()

    # -- healing -------------------------------------------------------------------------------------
    def heal(self) -> list[str]:
        """Every container running and ready, the proxy routing to all of them, no fault left in a network
        namespace; what had to be done, for the record."""
        done = []
        for container in list(self.frozen):
            self.thaw(container)
            done.append(f"thawed {container}")
        for service in (*ENGINE_SERVICES, "proxy"):
            for container in self.containers(service):
                state = self.state(container)
                if state["Paused"]:
                    docker("unpause", container)
                    done.append(f"unpaused {container}")
                elif not state["Running"] and not state["Restarting"]:
                    docker("start", container)
                    done.append(f"started {container}")
        for container in self.engines():
            wait_for(lambda: self.state(container)["Health"]["Status"] == "healthy", f"{container} healthy again",
                     HEAL_TIMEOUT_S, 1)
        wait_for(lambda: self.healthy_instances() == HEALTHY, f"the proxy to route to every instance again "
                 f"({self.healthy_instances()})", 60, 0.5)
        return done
