"""Real stacks for end-to-end tests: every service its own process on 127.0.0.1 (or ::1), stopped by pid.
Every service a test starts holds the same deployment secret (STACK_SECRET), as a deployment's do: their
handshakes prove it, and a test that talks to a service directly proves it with `stack_auth()`."""
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from epdserve.services.cli.launcher import free_port
from tests.e2e.service_fork import ForkedProcess


def http_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class Service:
    def __init__(self, name: str, role: str, argv: list[str], port: int, data_port: int | None, http_port: int,
                 log: Path, host: str = "127.0.0.1") -> None:
        self.name, self.role, self.argv, self.host = name, role, argv, host
        self.port, self.data_port, self.http_port, self.log = port, data_port, http_port, log
        self.proc: ForkedProcess | None = None

    def start(self) -> None:
        """`argv` (python -m epdserve.services.cli ...) as a fork of the test process's fork server."""
        assert self.argv[:3] == [sys.executable, "-m", "epdserve.services.cli"], self.argv
        self.proc = ForkedProcess([os.fspath(a) for a in self.argv[3:]], str(self.log), dict(os.environ))

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def metrics(self) -> dict[str, float]:
        """Prometheus samples of the service, labels dropped (one engine per process)."""
        text = httpx.get(f"http://{http_host(self.host)}:{self.http_port}/metrics", timeout=5).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                key = name.split("{")[0]
                out[key] = out.get(key, 0.0) + float(value)
        return out

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.alive:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Stack:
    """encoders/prefills/decodes/unified counts -> processes + a proxy; `url` is the OpenAI base URL."""

    def __init__(self, model: str, log_dir: Path, encoders=0, prefills=0, decodes=0, unified=0,
                 engine_args=(), proxy_args=(), host="127.0.0.1", transport_args=(),
                 hosts: dict[str, str] | None = None) -> None:
        """`engine_args` go to prefill, decode and unified engines; `transport_args` to those and the
        encoders (e.g. --kv-transport ucx: every peer of a transfer must use the same). `hosts`: an address of
        its own for each role named (the proxy's too), as on separate hosts: then every port is fixed, the
        prefills' block ports and the proxy's inbox port included."""
        hosts = hosts or {}
        fixed = bool(hosts)
        self.model = model
        self.services: dict[str, Service] = {}
        base = [sys.executable, "-m", "epdserve.services.cli", "--log-level", "INFO", "serve"]
        targets: dict[str, list[str]] = {}
        for role, count in (("encoder", encoders), ("prefill", prefills), ("decode", decodes), ("unified", unified)):
            for i in range(count):
                name, at = f"{role}-{i}", hosts.get(role, host)
                port, data_port, http_port = free_port(at), free_port(at), free_port(at)
                argv = [*base, role, "--model", model, "--host", at, "--port", str(port),
                        "--data-port", str(data_port), "--http-port", str(http_port), "--engine-id", name,
                        *transport_args]
                if role != "encoder":
                    argv += ["--threads", "1", *engine_args]
                if fixed and role == "prefill":
                    argv += ["--block-port", str(free_port(at))]
                self.services[name] = Service(name, role, argv, port, data_port, http_port, log_dir / f"{name}.log",
                                              at)
                targets.setdefault(role, []).append(f"{http_host(at)}:{port}")
        host = hosts.get("proxy", host)
        self.port = free_port(host)
        proxy = [*base, "proxy", "--model", model, "--host", host, "--port", str(self.port),
                 "--served-model-name", "demo",
                 "--poll-interval", "0.5", *proxy_args]
        if fixed:
            proxy += ["--inbox-port", str(free_port(host))]
        for role, addrs in targets.items():
            proxy += [f"--{role}", ",".join(addrs)]
        self.services["proxy"] = Service("proxy", "proxy", proxy, self.port, None, self.port, log_dir / "proxy.log",
                                         host)
        self.url = f"http://{http_host(host)}:{self.port}"
        # /ready is behind the proxy's API key, when it has one.
        key = proxy_args[list(proxy_args).index("--api-key") + 1] if "--api-key" in proxy_args else None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def start(self, timeout: float = 300) -> "Stack":
        for s in self.services.values():
            s.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [s.name for s in self.services.values() if not s.alive]
            assert not dead, f"{dead} exited during startup: " + self.logs()
            try:
                if self._all_ready():
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError("stack not ready in time: " + self.logs())

    def _all_ready(self) -> bool:
        """Every service answers /ready, and the proxy routes to every one of them."""
        r = httpx.get(self.url + "/ready", timeout=2, headers=self.headers)
        if r.status_code != 200:
            return False
        expected: dict[str, int] = {}
        for s in self.services.values():
            if s.role != "proxy":
                expected[s.role] = expected.get(s.role, 0) + 1
                if httpx.get(f"http://{http_host(s.host)}:{s.http_port}/ready", timeout=2).status_code != 200:
                    return False
        return r.json()["healthy_instances"] == expected

    def logs(self) -> str:
        return "\n".join(f"--- {s.name}\n{s.log.read_text()[-3000:]}" for s in self.services.values() if s.log.exists())

    def stop(self) -> None:
        for s in reversed(list(self.services.values())):
            s.stop()


@pytest.fixture(scope="session")
def demo_model(llava_demo_path):
    return llava_demo_path


STACK_SECRET = "e2e-stack-secret-" + "7" * 32


def stack_auth():
    """The proof of the stacks' secret, for a test's own client of a service."""
    from epdserve.transport.channel.peer_auth import PeerAuth

    return PeerAuth(STACK_SECRET.encode())


@pytest.fixture(scope="session", autouse=True)
def stack_secret():
    """In the environment every service (and `epdserve up`) started by a test inherits."""
    before = os.environ.get("EPDSERVE_SECRET")
    os.environ["EPDSERVE_SECRET"] = STACK_SECRET
    yield STACK_SECRET
    if before is None:
        del os.environ["EPDSERVE_SECRET"]
    else:
        os.environ["EPDSERVE_SECRET"] = before


class _Stacks:
    """Starts stacks and stops every one it started (a machine holds only a few SmolLM2 stacks at once)."""

    def __init__(self, log_root) -> None:
        self.log_root, self.started = log_root, []

    def __call__(self, model, **kwargs) -> Stack:
        stack = Stack(model, self.log_root.mktemp("stack-logs"), **kwargs)
        self.started.append(stack)
        return stack.start()

    def stop_all(self) -> None:
        for stack in self.started:
            stack.stop()


@pytest.fixture(scope="module")
def stack_factory(tmp_path_factory):
    """make(model, encoders=.., prefills=.., ...) -> a started Stack, stopped when the module's tests end."""
    stacks = _Stacks(tmp_path_factory)
    yield stacks
    stacks.stop_all()


@pytest.fixture
def start_stack(tmp_path_factory):
    """Like stack_factory, for one test: its stacks stop when the test ends."""
    stacks = _Stacks(tmp_path_factory)
    yield stacks
    stacks.stop_all()


@pytest.fixture(scope="session")
def smollm2(default_model_path, hf_causal_lm):
    """HF transformers' SmolLM2 and its tokenizer: the reference the text answers must equal."""
    from transformers import AutoTokenizer

    return hf_causal_lm(default_model_path), AutoTokenizer.from_pretrained(default_model_path)


def picture_png(seed: int, size=(240, 320)) -> bytes:
    """A smooth synthetic picture, as PNG bytes, the same for a seed."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size[0], 0:size[1]] / max(size)
    rgb = np.stack([np.sin(x * rng.uniform(2, 9) + c) * np.cos(y * rng.uniform(2, 9)) for c in range(3)], -1)
    buf = io.BytesIO()
    Image.fromarray(((rgb + 1) * 127.5).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def token_ids(logprobs_tokens: list[str]) -> list[int]:
    """Token ids from logprob entries returned with return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


@pytest.fixture(scope="session")
def ids_of():
    return token_ids


def kill_prefill_during_pull(stack: Stack, prompt: str, max_tokens: int):
    """Kill (SIGKILL) the stack's only prefill while decode-0 pulls `prompt`'s KV from it; the completion
    (greedy, token ids as logprob tokens), which decode must answer by recomputing the prompt itself.

    The stack's decode seats one sequence (--max-num-seqs 1), and the proxy routes prefill -> decode
    (--routing-policy load). A long stream takes the seat; the request under test is prefilled and waits
    on decode for room, renewing prefill's lease. Prefill is then stopped (SIGSTOP: it answers nothing
    more), the seat freed, so that decode asks the stopped prefill for the blocks, and prefill is killed
    with that fetch in flight."""
    import asyncio
    import concurrent.futures

    import openai

    decode, prefill = stack.services["decode-0"], stack.services["prefill-0"]
    renewed = decode.metrics().get("epdserve:kv_lease_renewals_total", 0)
    http = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def main():
        async with openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as c:
            long = await c.completions.create(model="demo", prompt="Count slowly:", max_tokens=4000,
                                              temperature=0, stream=True, extra_body={"ignore_eos": True})
            await long.__anext__()  # prefill's token
            await long.__anext__()  # decode's: it runs on decode and takes its only seat
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(http.completions.create, model="demo", prompt=prompt, logprobs=0,
                                      temperature=0, max_tokens=max_tokens,
                                      extra_body={"return_tokens_as_token_ids": True})
                deadline = time.monotonic() + 60
                while decode.metrics().get("epdserve:kv_lease_renewals_total", 0) <= renewed:  # it waits for room
                    assert time.monotonic() < deadline and not waiting.done(), "the request never waited on decode"
                    await asyncio.sleep(0.1)
                prefill.proc.send_signal(signal.SIGSTOP)
                await long.response.aclose()  # the seat frees: decode reserves blocks and asks prefill for them
                await asyncio.sleep(1.0)
                prefill.proc.send_signal(signal.SIGKILL)
                prefill.proc.wait()
                return await asyncio.wrap_future(waiting)

    return asyncio.run(main())



@pytest.fixture(scope="session")
def prefill_killed_during_pull():
    """kill(stack, prompt, max_tokens) -> the completion decode recomputed (kill_prefill_during_pull)."""
    return kill_prefill_during_pull
