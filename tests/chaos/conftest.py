"""The chaos suite: one compose project (1 encoder, 2 prefills, 2 decodes, the proxy; small KV pools, one torch
thread per engine) put through one fault at a time while streams run, healed between faults.

Runs only under `make test-chaos` (tests/chaos/run.sh -> tests/compose/run.sh tests/chaos), which starts an
engine when none runs, builds the image and sets EPDSERVE_COMPOSE_TEST=1; under a plain `pytest` every test
here is skipped. Needs root on the host: network faults are iptables rules run in containers' network
namespaces, and the KV taps run there too.

At the end of the run a table of every fault's measurements is printed and written to
benchmarks/results/chaos.json.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ENABLED = os.environ.get("EPDSERVE_COMPOSE_TEST") == "1"
RESULTS_PATH = REPO / "benchmarks" / "results" / "chaos.json"
# Short enough that a stopped decode's grace runs out mid-stream (its streams then continue elsewhere).
os.environ.setdefault("EPDSERVE_DRAIN_TIMEOUT", "3")


def _load(name: str, path: Path):
    """A helper module loaded by path under `name` (no folder of the tests goes onto sys.path)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before it runs: dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


stacks = _load("epdserve_compose_stack", HERE.parent / "compose" / "conftest.py")
load = _load("epdserve_chaos_load", HERE / "load.py")
cluster_module = _load("epdserve_chaos_cluster", HERE / "cluster.py")
faults = _load("epdserve_chaos_faults", HERE / "faults.py")

RESULTS = faults.RESULTS
SUITE = {"started": time.time()}


def pytest_collection_modifyitems(config, items):
    """The faults need the stack: skipped unless run.sh set EPDSERVE_COMPOSE_TEST=1 (the suite's parts
    run everywhere)."""
    skip = pytest.mark.skip(reason="needs a Docker engine, root and the built image: run `make test-chaos`")
    for item in items:
        if Path(item.path) == HERE / "test_chaos.py" and not ENABLED:
            item.add_marker(skip)


def pytest_generate_tests(metafunc):
    if "fault" in metafunc.fixturenames:
        metafunc.parametrize("fault", faults.FAULTS, ids=[f.name for f in faults.FAULTS])


def pytest_runtest_logreport(report):
    stacks.pytest_runtest_logreport(report)  # one line per test in run.sh's summary


@pytest.fixture(scope="session")
def stack():
    with stacks.compose_up(["compose.yaml", "tests/chaos/compose.chaos.yaml"], ["proxy"],
                           scale={"prefill": 2, "decode": 2}) as stack:
        yield stack


@pytest.fixture(scope="session")
def cluster(stack, tmp_path_factory):
    cluster = cluster_module.Cluster(stack, stacks.API_KEY, tmp_path_factory.mktemp("kv-taps"))
    try:
        # Before any KV moves: a tap sees only connections opened after its redirect went in.
        cluster.install_taps()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def client(stack):
    return stacks.api_client(stack)


@pytest.fixture(scope="session")
def catalog():
    return load.requests(stacks.picture_png())


@pytest.fixture(scope="session")
def reference(cluster, client, catalog):
    """The no-fault answers, from the same stack: one wave, nothing else running."""
    started, started_at = time.monotonic(), time.time()
    wave = load.start_wave(client, catalog, "reference")
    load.join_all(wave, faults.STREAMS_TIMEOUT_S)
    if not all(s.completed for s in wave):
        # What the stack said meanwhile, and whether an engine died: the run has nothing else to go on.
        states = [f"{c}: restarts {cluster.restart_count(c)}, " + ", ".join(
            f"{key} {state[key]}" for key in ("Status", "ExitCode", "OOMKilled", "StartedAt"))
            for c in cluster.engines() for state in [cluster.state(c)]]
        pytest.fail("the no-fault run failed: " + "; ".join(s.describe() for s in wave) + "\n" +
                    "\n".join(states + cluster.warnings_since(started_at)), pytrace=False)
    SUITE["reference_seconds"] = round(time.monotonic() - started, 1)
    SUITE["reference_longest_stall_s"] = round(max(s.longest_gap for s in wave), 1)
    return {s.name: s.answer for s in wave}


# -- the report ------------------------------------------------------------------------------------------
COLUMNS = [("fault", "fault", 17), ("target", "target", 26), ("streams", "streams", 7), ("completed", "done", 5),
           ("identical", "same", 5), ("leaked_blocks", "leaked", 6), ("longest_stall_s", "stall s", 7),
           ("corruptions", "flipped/detected", 16), ("migrations", "migr", 4), ("seconds", "secs", 5),
           ("outcome", "outcome", 0)]


def _cell(result, key: str) -> str:
    if key == "corruptions":
        if result.corruptions_injected is None:
            return "-"
        detected = "?" if result.corruptions_detected is None else result.corruptions_detected
        return f"{result.corruptions_injected}/{detected}"
    if key == "outcome" and len(result.outcome) > 100:
        return result.outcome[:97] + "..."
    if key == "target":
        return result.target.removeprefix(f"{os.environ.get('EPDSERVE_COMPOSE_PROJECT', 'epdserve-test')}-")
    return str(getattr(result, key))


def table() -> list[str]:
    lines = ["  ".join(f"{title:<{width}}" for _, title, width in COLUMNS).rstrip()]
    for result in RESULTS:
        lines.append("  ".join(f"{_cell(result, key):<{width}}" for key, _, width in COLUMNS).rstrip())
    return lines


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    lines = table()
    terminalreporter.section("chaos: one fault at a time, under load")
    for line in lines:
        terminalreporter.write_line(line)
    for result in RESULTS:
        for note in result.notes + result.failures + [f"log: {line}" for line in result.logs]:
            terminalreporter.write_line(f"  {result.fault}: {note}")
    report = os.environ.get("EPDSERVE_COMPOSE_REPORT")
    if report:  # run.sh's closing summary shows the table too
        with open(report, "a") as out:
            out.write("-- faults (benchmarks/results/chaos.json)\n" + "\n".join(lines) + "\n")
    _write_json()


def _write_json() -> None:
    from dataclasses import asdict

    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "what": "tests/chaos (make test-chaos): one compose project - 1 encoder, 2 prefills, 2 decodes, the proxy; "
                "--num-kv-blocks 256 and one torch thread per engine - put through one fault at a time while two "
                "waves of streams run (text, image, JSON schema, seeded sampling; greedy except the seeded one), "
                "answers compared token for token with the no-fault run on the same stack",
        "streams_per_wave": len(load.requests(b"")),
        "max_tokens": load.MAX_TOKENS,
        "max_stall_s": faults.MAX_STALL_S,
        "pause_s": faults.PAUSE_S,
        "partition_s": faults.PARTITION_S,
        "loss_probability": float(faults.LOSS_PROBABILITY),
        "kv_delay_s": faults.KV_DELAY_S,
        "reference_seconds": SUITE.get("reference_seconds"),
        "suite_seconds": round(time.time() - SUITE["started"]),
        "faults": [asdict(result) for result in RESULTS],
    }
    RESULTS_PATH.write_text(json.dumps(body, indent=1) + "\n")
