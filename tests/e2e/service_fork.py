"""Service processes forked from a server that has already imported torch, transformers and the rest.

A stack's services are each `python -m epdserve.services.cli serve ...`; started that way, every one of them
spends two to three CPU-seconds importing the same libraries before it does anything, and the suite starts
some two hundred. multiprocessing's forkserver pays those imports once per test process: each service is then
a fork of it that runs the same command line as `python -m` would (its own pid, signals, exit status and log),
so a test sees exactly the process it would have started."""
from __future__ import annotations

import multiprocessing
import os
import runpy
import subprocess
import sys

# Imported once by the fork server. Only libraries and modules that read no environment at import: a
# service's environment is set after the fork.
PRELOAD = ["numpy", "torch", "transformers", "safetensors", "PIL.Image", "zmq", "msgpack", "httpx", "fastapi",
           "uvicorn", "epdserve.services.runtime.service", "epdserve.shared.engine.llm_engine",
           "epdserve.services.proxy.app"]

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def _run(args: list[str], log: str, env: dict[str, str]) -> None:
    """In the forked child: become `python -m epdserve.services.cli ARGS`, stdout and stderr into `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Line by line, as PYTHONUNBUFFERED has it: a test reads a service's log while it runs.
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = ["epdserve.services.cli", *args]
    runpy.run_module("epdserve.services.cli", run_name="__main__", alter_sys=True)


class ForkedProcess:
    """What a test uses of subprocess.Popen, for a forked service."""

    def __init__(self, args: list[str], log: str, env: dict[str, str]) -> None:
        # Daemonic: one a test leaves running is terminated when the test process exits, not waited for.
        self._process = _context.Process(target=_run, args=(args, log, env), daemon=True)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["epdserve.services.cli"], timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()
