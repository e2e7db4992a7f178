"""`epdserve up`: a whole local stack as child processes, stopped together.

Ports come from the OS (free ports on 127.0.0.1); the proxy gets --port. The URL is printed once the
proxy's /ready answers 200 (every role has a healthy instance). Ctrl-C, SIGTERM, or any child dying
stops every child, by pid.
"""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Refuse to start when something already listens on the proxy's port: its /ready would pass for ours."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as exc:
            raise SystemExit(f"cannot serve on {host}:{port}: {exc.strerror}; is another server running there? "
                             "(choose another --port)") from None


def is_multimodal(model: str) -> bool:
    return "vision_config" in json.loads((Path(model) / "config.json").read_text())


class LocalStack:
    def __init__(self, model: str, host: str, port: int, encoders: int | None, prefills: int, decodes: int,
                 unified: bool, api_key: str | None, threads: int, extra_engine_args: list[str]) -> None:
        self.model, self.host, self.port = model, host, port
        self.encoders = encoders if encoders is not None else int(is_multimodal(model))
        self.prefills, self.decodes, self.unified = prefills, decodes, unified
        self.api_key, self.threads, self.extra = api_key, threads, extra_engine_args
        self.children: list[tuple[str, subprocess.Popen]] = []

    def commands(self) -> list[tuple[str, list[str]]]:
        """(name, argv) of every process, the proxy last."""
        base = [sys.executable, "-m", "epdserve.services.cli", "serve"]
        procs, targets = [], {"encoder": [], "prefill": [], "decode": [], "unified": []}
        counts = [("encoder", self.encoders)]
        counts += [("unified", 1)] if self.unified else [("prefill", self.prefills), ("decode", self.decodes)]
        for role, count in counts:
            for i in range(count):
                port = free_port()
                argv = [*base, role, "--model", self.model, "--host", "127.0.0.1", "--port", str(port),
                        "--data-port", str(free_port()), "--http-port", str(free_port()),
                        "--engine-id", f"{role}-{i}"]
                if role != "encoder":
                    argv += ["--threads", str(self.threads), *self.extra]
                procs.append((f"{role}-{i}", argv))
                targets[role].append(f"127.0.0.1:{port}")
        proxy = [*base, "proxy", "--model", self.model, "--host", self.host, "--port", str(self.port)]
        for role, addrs in targets.items():
            if addrs:
                proxy += [f"--{role}", ",".join(addrs)]
        if self.api_key:
            proxy += ["--api-key", self.api_key]
        procs.append(("proxy", proxy))
        return procs

    def run(self, startup_timeout: float) -> int:
        check_port_free(self.host, self.port)
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        # Ctrl-C stops the stack even when started from a script's background job (which ignores SIGINT).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            for name, argv in self.commands():
                self.children.append((name, subprocess.Popen(argv)))
            url = f"http://{self.host}:{self.port}"
            self._wait_ready(url, startup_timeout)
            print(f"epdserve is ready: {url}/v1 (model {Path(self.model).name}); Ctrl-C stops it", flush=True)
            while not stop:
                for name, proc in self.children:
                    if proc.poll() is not None:
                        print(f"{name} exited with code {proc.returncode}; stopping the stack", file=sys.stderr)
                        return 1
                time.sleep(0.5)
            return 0
        except KeyboardInterrupt:
            return 0
        finally:
            self.stop()

    def _wait_ready(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        while time.monotonic() < deadline:
            for name, proc in self.children:
                if proc.poll() is not None:
                    raise SystemExit(f"{name} exited with code {proc.returncode} during startup")
            try:
                with urllib.request.urlopen(urllib.request.Request(url + "/ready", headers=headers), timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise SystemExit(f"the stack was not ready within {timeout:.0f}s")

    def stop(self) -> None:
        for _, proc in reversed(self.children):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for _, proc in self.children:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
