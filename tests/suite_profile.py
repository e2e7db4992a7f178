"""Where the suite's time goes: each test's seconds (setup + call + teardown) and CPU-seconds, and per folder of
tests/ how many stacks, service processes, in-process engines and model loads it started.

A test's CPU-seconds are its process's (the pytest worker: in-process engines, HF references, the Triton
interpreter, hypothesis), its subprocesses' that ended during it, and those of the stacks' services that ended
during it (forked from the worker's fork server: a module's stack counts in the test whose teardown stopped it).
With the machine's cores shared by several workers, CPU-seconds say what a test costs; seconds include waiting.

Turned on by `pytest --suite-profile=FILE` (tests/conftest.py registers it), which writes FILE as JSON when the
session ends (and FILE.gw0, ... from pytest-xdist's workers); `python tests/suite_profile.py FILE...` renders one
or more runs (`make test`, the compose and chaos suites) as the tables of tests/TIMINGS.md. What a fixture
starts counts for the test whose setup started it, so a module-scoped stack counts once, in its folder.
"""
import collections
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROLES = ("encoder", "prefill", "decode", "unified", "proxy", "kvstore", "planner")


class SuiteProfile:
    def __init__(self, path: str, worker: str | None = None) -> None:
        # Under pytest-xdist each worker writes FILE.<worker id> (what it started); the controller, which sees
        # every test's report, writes FILE.
        self.path = Path(f"{path}.{worker}" if worker else path)
        self.worker = worker
        self.folder = "(collection)"
        self.seconds: dict[str, float] = collections.defaultdict(float)  # test node id -> seconds
        self.outcomes: dict[str, str] = {}
        self.cpu: dict[str, float] = collections.defaultdict(float)  # test node id -> CPU-seconds (workers')
        self._cpu_at: float | None = None
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.started = time.monotonic()
        self._patch()

    def count(self, what: str) -> None:
        self.counts[self.folder][what] += 1

    def _patch(self) -> None:
        """Counts what the suite starts by wrapping the places that start it (in this process; a service
        process counts once, as the role it was started as)."""
        profile = self
        popen_init = subprocess.Popen.__init__

        def init(self, args, *rest, **kwargs):
            argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
            profile._count_process(argv)
            popen_init(self, args, *rest, **kwargs)

        subprocess.Popen.__init__ = init
        from tests.e2e.service_fork import ForkedProcess  # the stacks' services: forked, not Popen's

        fork_init = ForkedProcess.__init__

        def forked(self, args, *rest, **kwargs):
            profile._count_process(["epdserve", *args])
            fork_init(self, args, *rest, **kwargs)

        ForkedProcess.__init__ = forked

        from epdserve.shared.engine import llm_engine, model_runner

        engine_init = llm_engine.LLMEngine.__init__

        def new_engine(self, *args, **kwargs):
            profile.count("engines in-process")
            engine_init(self, *args, **kwargs)

        llm_engine.LLMEngine.__init__ = new_engine
        load_model = model_runner.load_model

        def load(config, **kwargs):
            profile.count("model loads (engine)")
            return load_model(config, **kwargs)

        model_runner.load_model = load
        from transformers import PreTrainedModel

        from_pretrained = PreTrainedModel.from_pretrained.__func__

        def hf_load(cls, *args, **kwargs):
            profile.count("model loads (HF)")
            return from_pretrained(cls, *args, **kwargs)

        PreTrainedModel.from_pretrained = classmethod(hf_load)

    def _count_process(self, argv: list[str]) -> None:
        joined = " ".join(argv)
        if "epdserve" in joined and "serve" in argv:
            role = argv[argv.index("serve") + 1] if argv.index("serve") + 1 < len(argv) else "?"
            self.count(f"service processes ({role})" if role in ROLES else "service processes (other)")
            if role == "proxy":
                self.count("stacks")
        elif "epdserve" in joined and " up" in f" {joined}":
            self.count("stacks")
            self.count("`epdserve up` processes")
        elif argv and Path(argv[0]).name in ("docker", "docker-compose") and "up" in argv:
            self.count("stacks")
            self.count("compose ups")
        elif argv and Path(argv[0]).name in ("docker", "docker-compose") and "build" in argv:
            self.count("image builds")

    # pytest hooks -------------------------------------------------------------------------------------

    def pytest_runtest_protocol(self, item, nextitem):
        self.folder = folder_of(item.nodeid)
        self._cpu_at = cpu_seconds()

    def pytest_runtest_logfinish(self, nodeid, location):
        if self._cpu_at is None:  # pytest-xdist's controller: its workers ran the test
            return
        now = cpu_seconds()
        self.cpu[nodeid] += now - self._cpu_at
        self._cpu_at = now

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] += report.duration
        if report.when == "call" or report.outcome != "passed":  # a setup's skip or error, a teardown's error
            self.outcomes[report.nodeid] = report.outcome

    def pytest_sessionfinish(self, session, exitstatus):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({
            "argv": sys.argv, "worker": self.worker, "wall_seconds": round(time.monotonic() - self.started, 1),
            "tests": {k: [round(v, 3), self.outcomes.get(k, "?")] for k, v in self.seconds.items()},
            "cpu_seconds": {k: round(v, 3) for k, v in self.cpu.items()},
            "counts": {k: dict(v) for k, v in self.counts.items()},
        }, indent=1))


def cpu_seconds() -> float:
    """CPU-seconds so far of this process, its ended subprocesses, and the fork server's ended services."""
    own, ended = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + ended.ru_utime + ended.ru_stime
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):  # none started yet, or it has ended (its CPU is then in RUSAGE_CHILDREN)
        return total
    # utime, stime, cutime, cstime: the fork server's own and its ended children's (the services)
    return total + sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def folder_of(nodeid: str) -> str:
    parts = nodeid.split("::")[0].split("/")
    return "/".join(parts[:2]) if parts[0] == "tests" and len(parts) > 2 else parts[0]


def render(runs: list[dict], slowest: int = 30) -> str:
    """The tables of tests/TIMINGS.md from one or more runs' JSON (with their workers')."""
    runs, workers = [r for r in runs if not r.get("worker")], runs
    tests = {k: v for run in runs for k, v in run["tests"].items()}
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for run in workers:
        for folder, c in run["counts"].items():
            counts[folder].update(c)
    per_folder: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for nodeid, (seconds, _) in tests.items():
        per_folder[folder_of(nodeid)][0] += seconds
        per_folder[folder_of(nodeid)][1] += 1
    cpu = {k: v for run in workers for k, v in run.get("cpu_seconds", {}).items()}
    columns = sorted({what for c in counts.values() for what in c})
    out = [f"Runs: {', '.join(' '.join(Path(a).name if i == 0 else a for i, a in enumerate(r['argv'])) for r in runs)}; "
           f"wall {' + '.join(str(r['wall_seconds']) for r in runs)} s.", "",
           f"### The {slowest} slowest tests", "", "| seconds | test |", "|---:|---|"]
    for nodeid, (seconds, outcome) in sorted(tests.items(), key=lambda kv: -kv[1][0])[:slowest]:
        out.append(f"| {seconds:.1f} | `{nodeid}`{'' if outcome == 'passed' else f' ({outcome})'} |")
    if cpu:
        per_file: dict[str, list] = collections.defaultdict(lambda: [0.0, 0.0, 0])
        for nodeid, (seconds, _) in tests.items():
            row = per_file[nodeid.split("::")[0]]
            row[0] += cpu.get(nodeid, 0.0)
            row[1] += seconds
            row[2] += 1
        out += ["", f"### The {slowest} test files that cost the most CPU-seconds "
                f"({sum(cpu.values()):,.0f} in all)", "", "| CPU-seconds | seconds | tests | file |", "|---:|---:|---:|---|"]
        for path, (cpu_s, seconds, n) in sorted(per_file.items(), key=lambda kv: -kv[1][0])[:slowest]:
            out.append(f"| {cpu_s:.1f} | {seconds:.1f} | {n} | `{path}` |")
    out += ["", "### Seconds per folder, and what each folder starts", "",
            "| folder | tests | seconds | " + " | ".join(columns) + " |",
            "|---|---:|---:|" + "---:|" * len(columns)]
    for folder in sorted(set(per_folder) | set(counts), key=lambda f: -per_folder[f][0]):
        seconds, n = per_folder[folder]
        out.append(f"| {folder} | {n} | {seconds:.0f} | "
                   + " | ".join(str(counts[folder].get(c, "")) for c in columns) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    files = [f for p in sys.argv[1:] for f in sorted(Path(p).parent.glob(Path(p).name + "*"))]
    print(render([json.loads(f.read_text()) for f in files]), end="")
