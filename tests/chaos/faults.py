"""The faults of the chaos suite, and one fault's run: the load, the fault while it streams, the invariants.

A fault's run (`run_fault`), on a stack healed beforehand:

1. wave A (every stream of the catalog, a salt of its own) starts and gets going (a few chunks each);
2. wave B starts - its requests are encoding, prefilling or queued - and the fault lands 0.3 s later, on the
   instance that holds the most (a decode by its running requests, a prefill by running + waiting); faults
   of the KV path are in place before wave A, so that every request's pull meets them;
3. the fault lasts as long as it says (`hold`), is undone (`end`), and both waves are read to their ends;
4. once the engines are idle, what was measured becomes a Result: streams completed, answers equal to the
   no-fault run's, KV blocks still held, the longest silence of any stream, corruptions flipped and detected.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

# Loaded by path (tests/chaos/conftest.py): no folder of the tests goes onto sys.path.
from epdserve_chaos_cluster import Cluster, docker, wait_for
from epdserve_chaos_load import Answer, Stream, join_all, start_wave, wait_started

# The proxy drops an instance after 3 missed polls: a round every second, each poll timing out after 2 s.
HEARTBEAT_WINDOW_S = 3 * (1.0 + 2.0)
PAUSE_S = HEARTBEAT_WINDOW_S + 3  # outlasts the heartbeats: the proxy must give up on the frozen instance
PARTITION_S = 10.0
LOSS_PROBABILITY = "0.01"
KV_DELAY_S = 1.0  # before every KV answer (one per fetch message) of every prefill
MAX_STALL_S = 30.0
IDLE_TIMEOUT_S = 40.0  # prefill's leases (10 s) run out well within it
STREAMS_TIMEOUT_S = 300.0
INTEGRITY_METRIC = "epdserve:transfer_integrity_failures_total"
RESULTS: list["Result"] = []  # every fault's, in the order run: the suite's table and JSON (conftest.py)


@dataclass
class Result:
    fault: str
    target: str = ""
    streams: int = 0
    completed: int = 0
    identical: int = 0
    leaked_blocks: int = 0
    longest_stall_s: float = 0.0
    corruptions_injected: int | None = None
    corruptions_detected: int | None = None
    migrations: int = 0
    kv_fetches_tapped: int | None = None  # KV fetch messages that went through the taps (faults of the KV path)
    seconds: float = 0.0
    outcome: str = "passed"
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # streams that did not complete or differ
    logs: list[str] = field(default_factory=list)  # the stack's warnings during a fault that broke an invariant
    started_at: float = 0.0  # Unix time


@dataclass
class Fault:
    """`inject(cluster, victim)` starts the fault on the busiest container of `service`; `hold` seconds later
    (None: once every stream ended) `end(cluster, victim)` undoes it. A victim left down (killed, stopped) is
    brought back by `Cluster.heal`, as an operator or a restart policy would."""

    name: str
    service: str
    inject: Callable[[Cluster, str], None]
    end: Callable[[Cluster, str], None] = lambda cluster, victim: None
    hold: float | None = 0.0
    description: str = ""
    before_load: bool = False  # injected before wave A starts (the KV path: every request's pull meets it)


def _kill(cluster: Cluster, victim: str) -> None:
    docker("kill", victim)


def _pause(cluster: Cluster, victim: str) -> None:
    cluster.freeze(victim)


def _unpause(cluster: Cluster, victim: str) -> None:
    cluster.thaw(victim)


def _stop(cluster: Cluster, victim: str) -> None:
    # SIGTERM: the decode drains for EPDSERVE_DRAIN_TIMEOUT seconds, then cuts its streams (Error ABORTED) and
    # exits. `docker stop` waits for that: on a thread of its own, so that the waves go on.
    threading.Thread(target=docker, args=("stop", "--time", "45", victim), kwargs={"timeout": 90},
                     daemon=True).start()


def _stopped(cluster: Cluster, victim: str) -> None:
    wait_for(lambda: not cluster.state(victim)["Running"], f"{victim} to exit after its drain", 60)


_PARTITION = [("INPUT", "-i"), ("OUTPUT", "-o")]


def _partition(cluster: Cluster, victim: str) -> None:
    for chain, way in _PARTITION:
        cluster.iptables(victim, "-I", chain, way, "eth0", "-j", "DROP")


def _heal_partition(cluster: Cluster, victim: str) -> None:
    for chain, way in _PARTITION:
        cluster.iptables(victim, "-D", chain, way, "eth0", "-j", "DROP")


_LOSS = ["-m", "statistic", "--mode", "random", "--probability", LOSS_PROBABILITY, "-j", "DROP"]


def _loss(cluster: Cluster, victim: str) -> None:
    for chain, way in _PARTITION:
        cluster.iptables(victim, "-I", chain, way, "eth0", *_LOSS)


def _heal_loss(cluster: Cluster, victim: str) -> None:
    for chain, way in _PARTITION:
        cluster.iptables(victim, "-D", chain, way, "eth0", *_LOSS)


FAULTS = [
    # The control: the same two waves with no fault. Anything it shows is not the faults' doing.
    Fault("none", "decode", lambda c, v: None, description="no fault (control)"),
    # The KV path first: the taps went in before any KV moved, on the prefills as they were started.
    Fault("kv-delay", "prefill", lambda c, v: c.set_taps(delay=KV_DELAY_S), lambda c, v: c.set_taps(), None,
          f"{KV_DELAY_S:.1f} s before every KV answer of both prefills", before_load=True),
    Fault("kv-bitflip", "prefill", lambda c, v: c.set_taps(flip=True), lambda c, v: c.set_taps(), None,
          "one bit flipped in the first KV answer of every request, on both prefills", before_load=True),
    Fault("kill-decode", "decode", _kill, description="docker kill of the decode streaming the most"),
    Fault("pause-decode", "decode", _pause, _unpause, PAUSE_S, f"docker pause for {PAUSE_S:.0f} s"),
    Fault("stop-decode", "decode", _stop, _stopped, None, description="docker stop: drain grace runs out mid-stream"),
    Fault("partition-decode", "decode", _partition, _heal_partition, PARTITION_S,
          f"{PARTITION_S:.0f} s network partition (iptables DROP on eth0, both ways)"),
    Fault("loss-decode", "decode", _loss, _heal_loss, None,
          f"{float(LOSS_PROBABILITY):.0%} random packet loss on eth0, both ways, while the waves run"),
    Fault("kill-prefill", "prefill", _kill, description="docker kill of the busiest prefill"),
    Fault("pause-prefill", "prefill", _pause, _unpause, PAUSE_S, f"docker pause for {PAUSE_S:.0f} s"),
    Fault("kill-encoder", "encoder", _kill, description="docker kill of the only encoder"),
    Fault("pause-encoder", "encoder", _pause, _unpause, PAUSE_S, f"docker pause for {PAUSE_S:.0f} s"),
]


def pick_victim(cluster: Cluster, service: str) -> str:
    """The instance of `service` with the most work right now (the first on a tie)."""
    containers = [c for c in cluster.containers(service) if cluster.state(c)["Running"]]
    if service == "encoder" or len(containers) == 1:
        return containers[0]

    def load(container: str) -> float:
        m = cluster.metrics(container)
        return m.get("vllm:num_requests_running", 0.0) + m.get("vllm:num_requests_waiting", 0.0)

    return max(containers, key=load)


def integrity_failures(cluster: Cluster) -> float | None:
    """KV integrity failures counted by every decode (None: no decode exports the metric)."""
    found = [m.get(f'{INTEGRITY_METRIC}{{kind=kv}}') for m in map(cluster.metrics, cluster.containers("decode"))]
    found = [v for v in found if v is not None]
    return sum(found) if found else None


def migrations(cluster: Cluster) -> dict[str, float]:
    """The proxy's migrations so far: in all (""), and by reason."""
    metrics = cluster.proxy_metrics()
    prefix = "epdserve:request_migrations_total{reason="
    return {"": metrics.get("epdserve:request_migrations_total", 0.0),
            **{k.removeprefix(prefix).rstrip("}"): v for k, v in metrics.items() if k.startswith(prefix)}}


def run_fault(cluster: Cluster, client, catalog: dict, reference: dict[str, Answer], fault: Fault) -> tuple[
        Result, list[Stream]]:
    """One fault under load (see the module's docstring): its Result, and the streams."""
    result = Result(fault.name, started_at=time.time())
    started = time.monotonic()
    cluster.heal()  # a no-op after a fault that passed: the last one healed
    cluster.take_notes()
    corrupting = fault.name == "kv-bitflip"
    migrations_before = migrations(cluster)
    integrity_before, flipped_before = (integrity_failures(cluster), len(cluster.flipped())) if corrupting else (0, 0)
    tapped_before = cluster.tapped_fetches()
    streams = _under_fault(cluster, client, catalog, fault, result)
    if fault.before_load:
        result.kv_fetches_tapped = cluster.tapped_fetches() - tapped_before
    result.streams = len(streams)
    result.completed = sum(s.completed for s in streams)
    result.identical = sum(s.completed and s.answer == reference[s.name] for s in streams)
    result.longest_stall_s = round(max(s.longest_gap for s in streams), 1)
    result.failures = [describe_difference(s, reference[s.name]) for s in streams
                       if not (s.completed and s.answer == reference[s.name])]
    if corrupting:
        result.corruptions_injected = len(cluster.flipped()) - flipped_before
        integrity_after = integrity_failures(cluster)
        if integrity_before is not None and integrity_after is not None:
            result.corruptions_detected = int(integrity_after - integrity_before)
    result.notes += cluster.take_notes() + cluster.heal()
    held = cluster.wait_idle(IDLE_TIMEOUT_S)
    result.leaked_blocks = sum(n or 0 for n in held.values())
    if held:
        result.notes.append(f"blocks held once idle: {held}")
    result.failures += [f"{c}: /metrics unreadable once healed" for c, n in held.items() if n is None]
    after = migrations(cluster)
    result.migrations = int(after[""] - migrations_before[""])
    reasons = {k: int(v - migrations_before.get(k, 0.0)) for k, v in after.items()
               if k and v > migrations_before.get(k, 0.0)}
    if reasons:
        result.notes.append(f"migrations by reason: {reasons}")
    result.seconds = round(time.monotonic() - started, 1)
    return result, streams


def _under_fault(cluster: Cluster, client, catalog: dict, fault: Fault, result: Result) -> list[Stream]:
    """Both waves with the fault injected among them, read to their ends; the fault undone whatever happens."""
    victim, ended, restarts_before = "", False, 0
    try:
        if fault.before_load:
            victim = result.target = "every prefill's KV tap"
            fault.inject(cluster, victim)
        wave_a = start_wave(client, catalog, f"{fault.name}-a")
        wait_started(wave_a, 4, 180)
        wave_b = start_wave(client, catalog, f"{fault.name}-b")
        streams = wave_a + wave_b
        time.sleep(0.3)
        if not fault.before_load:
            victim = result.target = pick_victim(cluster, fault.service)
            restarts_before = cluster.restart_count(victim)
            fault.inject(cluster, victim)
        if fault.hold is not None:
            time.sleep(fault.hold)
            ended = True
            fault.end(cluster, victim)
        join_all(streams, STREAMS_TIMEOUT_S)
    finally:
        if victim and not ended:
            fault.end(cluster, victim)
    if fault.name.startswith("kill-"):  # does `restart: unless-stopped` bring a killed container back?
        time.sleep(2)
        state = cluster.state(victim)
        by_policy = state["Running"] or state["Restarting"] or cluster.restart_count(victim) > restarts_before
        result.notes.append("restarted by its restart policy" if by_policy else
                            "restart: unless-stopped did not restart it after docker kill: started again by the suite")
    return streams


def describe_difference(stream: Stream, expected: Answer) -> str:
    if not stream.completed:
        return stream.describe()
    got = stream.answer
    k = next((i for i, (a, b) in enumerate(zip(got.token_ids, expected.token_ids)) if a != b),
             min(len(got.token_ids), len(expected.token_ids)))
    return (f"{stream.name}[{stream.salt}]: differs from the no-fault answer at token {k} "
            f"(got {got.token_ids[k:k + 3]}, expected {expected.token_ids[k:k + 3]}; "
            f"{len(got.token_ids)} vs {len(expected.token_ids)} tokens, finish {got.finish_reason} vs "
            f"{expected.finish_reason})")
