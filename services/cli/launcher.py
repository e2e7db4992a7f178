"""`epdserve up`: a whole local stack as child processes, stopped together.

The proxy gets --port; every other port (engines' control, data, block and metrics ports, the proxy's
inbox) is a free port on 127.0.0.1, from --internal-ports when given. The URL is printed once the proxy's
/ready answers 200 (every role has a healthy instance), and not before: the line that starts the stack
names what runs and what takes time, without it. A child that dies is started again on its ports, as a
compose restart policy would (the proxy continues its streams on the others meanwhile); one that dies
RESTART_LIMIT times within RESTART_WINDOW seconds is reported and given up on - the proxy, and with it the
stack. Ctrl-C or SIGTERM stops every child, by pid, as a deployment would drain: the proxy first (it refuses
new requests and gives those in flight up to `drain_timeout` seconds), then the engines, which have nothing
left in flight.
A second Ctrl-C or SIGTERM hurries it (every child is told again: streams still running are cut with an
error event), a third kills what is left. Children run in their own process group: a terminal's Ctrl-C
reaches only this process, which tells each child once.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from epdserve.transport.channel.peer_auth import SECRET_ENV, SECRET_FILE_ENV, new_secret

if TYPE_CHECKING:
    from epdserve.services.planner.autoscaler import PlannerConfig

ENGINE_ROLES = ("prefill", "decode", "unified")
# The ports each service of the stack listens on, besides the proxy's API: the options that give them.
PORT_OPTIONS = {"encoder": ("--port", "--data-port", "--http-port"),
                "prefill": ("--port", "--data-port", "--block-port", "--http-port"),
                "decode": ("--port", "--http-port"), "unified": ("--port", "--http-port"),
                "kvstore": ("--port", "--http-port"),
                "proxy": ("--inbox-port",)}


# Ports this process has handed out: the OS may offer a port again once the probe socket is closed, and two
# services given the same one would race for it at startup.
_handed_out: set[int] = set()


def first_ephemeral_port() -> int:
    """Where the range the OS takes outgoing connections' local ports from begins (Linux's default elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", taken: set[int] | None = None) -> int:
    """A port nothing listens on now, not handed out before nor in `taken` (added to both), below the OS's
    ephemeral range: a port from that range can be taken by any outgoing connection between this check and
    the service's bind."""
    below = first_ephemeral_port() - 1
    while True:
        port = random.randint(10000, below) if below > 10000 else os_assigned_port(host)
        if port in _handed_out or (taken is not None and port in taken) or bind_error(host, port) is not None:
            continue
        _handed_out.add(port)
        if taken is not None:
            taken.add(port)
        return port


def os_assigned_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bind_error(host: str, port: int) -> str | None:
    """Why `port` cannot be listened on now (None: it can)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.strerror
    return None


def check_port_free(host: str, port: int) -> None:
    """Refuse to start when something already listens on the proxy's port: its /ready would pass for ours."""
    error = bind_error(host, port)
    if error is not None:
        raise SystemExit(f"epdserve up: cannot serve on {host}:{port}: {error}; is another server "
                         "running there? (choose another --port)")


def internal_ports(count: int, span: tuple[int, int] | None, taken: set[int]) -> list[int]:
    """`count` ports nothing listens on, not in `taken`: the first free ones of `span` (LOW, HIGH), else any."""
    if span is None:
        return [free_port(taken=taken) for _ in range(count)]
    low, high = span
    ports = [port for port in range(low, high + 1) if port not in taken and bind_error("127.0.0.1", port) is None]
    if len(ports) < count:
        raise SystemExit(f"epdserve up: --internal-ports {low}-{high} has {len(ports)} free ports; this stack's "
                         f"services listen on {count} (give a wider range)")
    return ports[:count]


def is_multimodal(model: str) -> bool:
    return "vision_config" in json.loads((Path(model) / "config.json").read_text())


def exit_message(name: str, returncode: int) -> str:
    """Why a child of the stack ended, in one line, with what to do about it where we can tell."""
    if returncode == -signal.SIGKILL:
        message = f"{name} was killed (SIGKILL), probably by the kernel's out-of-memory killer"
        if name.split("-")[0] in ENGINE_ROLES:
            # Each engine takes its whole KV pool at startup, sized by the options named here.
            message += ("; give each engine a smaller KV cache, e.g. `epdserve up -- --kv-cache-memory 0.5` "
                        "(GiB; or --kv-cache-memory-fraction, --num-kv-blocks), or run fewer --prefills/--decodes")
        return message
    if returncode < 0:
        try:
            return f"{name} was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"{name} was killed by signal {-returncode}"
    return f"{name} exited with code {returncode} (its log lines above say why)"


@dataclass(frozen=True, slots=True)
class StackConfig:
    model: str
    host: str = "127.0.0.1"  # the proxy's bind address; every other service binds 127.0.0.1
    port: int = 8000
    encoders: int = 0
    prefills: int = 1
    decodes: int = 1
    unified: bool = False  # one unified engine instead of prefills + decodes
    # Given to the proxy through its environment: a command line is visible to every user in `ps`.
    api_key: str | None = None
    threads: int = 1  # compute threads per engine
    log_level: str = "info"
    engine_args: tuple[str, ...] = ()  # passed to every engine service
    drain_timeout: float = 10.0  # on stop: seconds the proxy, then each engine, gets to finish requests
    routing_policy: str = "kv"  # the proxy's --routing-policy
    # Given to every encoder, prefill, decode and unified engine alike: peers on different transports
    # cannot exchange embeddings or KV blocks.
    kv_transport: str = "zmq"
    ucx_net_devices: str = "all"
    otlp_traces_endpoint: str | None = None  # the proxy's --otlp-traces-endpoint
    request_trace: bool = False  # the proxy's --request-trace
    # Given to every service: the model's names in the API (the first in responses, metrics and traces).
    served_model_name: tuple[str, ...] = ()
    internal_ports: tuple[int, int] | None = None  # (LOW, HIGH): where the services but the API listen
    migration_limit: int = 3  # the proxy's --migration-limit
    speculative_config: str | None = None  # the decode and unified engines' --speculative-config (JSON)
    kv_store_size: float | None = None  # GiB of a shared KV store every engine uses (None: no store)
    # LoRA options of every engine (--enable-lora, --max-loras, ...); --lora-modules of them go to the proxy too.
    lora_args: tuple[str, ...] = ()
    enable_lora_runtime_updates: bool = False  # the proxy's
    max_prefill_queue_tokens: int = 1024  # the proxy's --max-prefill-queue-tokens
    encoder_args: tuple[str, ...] = ()  # passed to every encoder (the engine options it takes)
    proxy_args: tuple[str, ...] = ()  # passed to the proxy
    planner: PlannerConfig | None = None  # scale prefills and decodes with the load (planner_loop.py)

    @property
    def model_name(self) -> str:
        return self.served_model_name[0] if self.served_model_name else Path(self.model).name


# A child that dies is started again (as a compose restart policy would), unless it died this many times
# within RESTART_WINDOW seconds: then it is given up on.
RESTART_LIMIT = 5
RESTART_WINDOW = 120.0
# An instance the planner retires gets SIGTERM once idle, but not before the proxy has re-read its discovery file
# and stopped routing to it (RETIRE_GRACE), and at the latest RETIRE_TIMEOUT seconds after (its drain then
# finishes or migrates what it still streams).
RETIRE_GRACE = 3.0
RETIRE_TIMEOUT = 120.0


class LocalStack:
    """Starts every service of a stack, restarts the ones that die (their requests meanwhile continue on
    the others: the proxy migrates streams and fails over calls), and stops them all in order."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.signals = 0  # Ctrl-Cs and SIGTERMs received: the first stops the stack, more hurry it
        self._argv: dict[str, list[str]] = {}
        self._deaths: dict[str, list[float]] = {}  # name -> when it died, within the restart window
        self._given_up: set[str] = set()
        self._taken = {config.port}  # ports handed to a service of the stack
        # Each role's instances the proxy routes to: name -> control address.
        self.targets: dict[str, dict[str, str]] = {"encoder": {}, "prefill": {}, "decode": {}, "unified": {}}
        self._retiring: dict[str, float] = {}  # name -> when it was taken out of routing
        self._told: set[str] = set()  # retiring instances sent SIGTERM
        self._desired: dict[str, int] = {}  # what the planner last wanted (exported by the proxy)
        self.discovery_file = None
        if config.planner is not None:
            self.discovery_file = Path(tempfile.mkdtemp(prefix="epdserve-up-")) / "instances.json"
        # The stack's own secret, which every handshake between its services proves (unless the caller's
        # environment names one): handed to each child in its environment, never on a command line.
        given = os.environ.get(SECRET_ENV) or os.environ.get(SECRET_FILE_ENV)
        self._secret = None if given else new_secret()

    def _on_signal(self, *_) -> None:
        self.signals += 1

    def commands(self) -> list[tuple[str, list[str]]]:
        """(name, argv) of every process, the proxy last."""
        c = self.config
        roles = [("encoder", c.encoders)]
        roles += [("unified", 1)] if c.unified else [("prefill", c.prefills), ("decode", c.decodes)]
        services = [(role, i) for role, count in roles for i in range(count)]
        store = [("kvstore", 0)] if c.kv_store_size is not None else []
        self._allocate(sum(len(PORT_OPTIONS[role]) for role, _ in [*store, *services, ("proxy", 0)]))
        procs = []
        self._engine_args = list(c.engine_args)
        if store:  # first: the engines find it up when they start
            listen = self._ports("kvstore")
            procs.append(("kvstore-0", [*self._base(), "kvstore", "--host", "127.0.0.1", *listen, "--engine-id",
                                        "kvstore-0", "--kv-store-size", f"{c.kv_store_size:g}", *self._drain()]))
            self._engine_args += ["--kv-store", f"127.0.0.1:{listen[listen.index('--port') + 1]}"]
        for role, i in services:
            procs.append(self._service(role, i))
        proxy = [*self._base(), "proxy", "--model", c.model, "--host", c.host, "--port", str(c.port),
                 *self._ports("proxy"), *self._names(), *self._drain(), "--routing-policy", c.routing_policy,
                 "--migration-limit", str(c.migration_limit),
                 "--max-prefill-queue-tokens", str(c.max_prefill_queue_tokens),
                 *self._engine_args[len(c.engine_args):]]  # the store, if up started one
        if c.otlp_traces_endpoint:
            proxy += ["--otlp-traces-endpoint", c.otlp_traces_endpoint]
        if c.request_trace:
            proxy.append("--request-trace")
        if "--lora-modules" in c.lora_args:  # (last of them: NAME=PATH ... to the end)
            proxy += c.lora_args[c.lora_args.index("--lora-modules"):]
        if c.enable_lora_runtime_updates:
            proxy.append("--enable-lora-runtime-updates")
        proxy += c.proxy_args
        for role, addrs in self.targets.items():
            if addrs:
                proxy += [f"--{role}", ",".join(addrs.values())]
        if self.discovery_file is not None:
            self.write_discovery()
            proxy += ["--discovery-file", str(self.discovery_file)]
        procs.append(("proxy", proxy))
        return procs

    def _base(self) -> list[str]:
        return [sys.executable, "-m", "epdserve.services.cli", "--log-level", self.config.log_level, "serve"]

    def _drain(self) -> list[str]:
        return ["--drain-timeout", f"{self.config.drain_timeout:g}"]

    def _names(self) -> list[str]:
        return ["--served-model-name", *self.config.served_model_name] if self.config.served_model_name else []

    def _allocate(self, count: int) -> None:
        """`count` free ports for the next services to take (`_ports`), never one handed out before."""
        ports = internal_ports(count, self.config.internal_ports, self._taken)
        self._taken.update(ports)
        self._free = iter(ports)

    def _ports(self, role: str) -> list[str]:
        """The role's listening options, each with a port of its own."""
        return [arg for option in PORT_OPTIONS[role] for arg in (option, str(next(self._free)))]

    def _service(self, role: str, i: int) -> tuple[str, list[str]]:
        """(name, argv) of engine or encoder `i` of `role`, on ports of its own; its control address becomes
        one of the proxy's targets."""
        c = self.config
        transport = ["--kv-transport", c.kv_transport]
        if c.kv_transport == "ucx":
            transport += ["--ucx-net-devices", c.ucx_net_devices]
        listen = self._ports(role)
        argv = [*self._base(), role, "--model", c.model, "--host", "127.0.0.1", *listen, "--engine-id", f"{role}-{i}",
                *self._names(), *self._drain(), *transport]
        if role == "encoder":
            argv += c.encoder_args
        else:
            argv += ["--threads", str(c.threads), *c.lora_args, *self._engine_args]
        if role in ("decode", "unified") and c.speculative_config is not None:
            argv += ["--speculative-config", c.speculative_config]
        self.targets[role][f"{role}-{i}"] = f"127.0.0.1:{listen[listen.index('--port') + 1]}"
        return f"{role}-{i}", argv

    # -- scaling (planner_loop.py decides) ------------------------------------------------------------------------
    def count(self, role: str) -> int:
        """Instances of `role` the proxy routes to (those retiring not counted)."""
        return len(self.targets[role])

    def add_instance(self, role: str) -> str:
        """Start one more instance of `role` on free ports; the proxy routes to it once it is ready."""
        used = [int(name.rsplit("-", 1)[1]) for name, _ in self.children if name.startswith(role + "-")]
        self._allocate(len(PORT_OPTIONS[role]))
        name, argv = self._service(role, max(used, default=-1) + 1)
        self._argv[name] = argv
        self.children.append((name, self._spawn(name)))
        self.write_discovery()
        return name

    def retire_instance(self, role: str) -> str:
        """Take the newest instance of `role` out of the proxy's routing; `_retire` stops it once it has no
        request left (or its bound passed), by SIGTERM, which drains what it still holds."""
        name = max(self.targets[role], key=lambda n: int(n.rsplit("-", 1)[1]))
        del self.targets[role][name]
        self.write_discovery()
        self._retiring[name] = time.monotonic()
        return name

    def write_discovery(self, desired: dict[str, int] | None = None) -> None:
        """The proxy's discovery file, replaced whole (the proxy never reads half of one)."""
        if desired is not None:
            self._desired = desired
        data = {role: list(addrs.values()) for role, addrs in self.targets.items() if addrs}
        data["planner"] = {"desired": self._desired}
        staged = self.discovery_file.with_suffix(".tmp")
        staged.write_text(json.dumps(data))
        os.replace(staged, self.discovery_file)

    def _retire(self) -> None:
        """SIGTERM to each retiring instance once it holds no request (its metrics say) or its bound passed;
        forget it once it exited."""
        now = time.monotonic()
        for name, since in list(self._retiring.items()):
            proc = dict(self.children)[name]
            if proc.poll() is not None:
                del self._retiring[name]
                self._told.discard(name)
                self.children = [(n, p) for n, p in self.children if n != name]
                print(f"epdserve up: planner: {name} stopped", flush=True)
            elif name not in self._told and (now - since > RETIRE_TIMEOUT or
                                             (now - since > RETIRE_GRACE and self._idle(name))):
                proc.send_signal(signal.SIGTERM)
                self._told.add(name)

    def _idle(self, name: str) -> bool:
        """No request running or waiting at `name`, by its /metrics (False when it does not answer)."""
        argv = self._argv[name]
        port = argv[argv.index("--http-port") + 1]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except (urllib.error.URLError, OSError):
            return False
        busy = [line for line in text.splitlines() if line.startswith(("vllm:num_requests_running",
                                                                       "vllm:num_requests_waiting"))]
        return bool(busy) and all(float(line.rsplit(" ", 1)[1]) == 0 for line in busy)

    def environment(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("EPDSERVE_API_KEY", "EPDSERVE_API_KEY_FILE")}
        # `python -m` would put the working folder first on the module path (Python >= 3.11 leaves it off
        # with this): a folder named epdserve there must not be run instead of the installed package.
        env["PYTHONSAFEPATH"] = "1"
        if self._secret is not None:
            env[SECRET_ENV] = self._secret
        if name == "proxy" and self.config.api_key:
            env["EPDSERVE_API_KEY"] = self.config.api_key
        return env

    def run(self, startup_timeout: float) -> int:
        check_port_free(self.config.host, self.config.port)
        # Ctrl-C stops the stack even when started from a script's background job (which ignores SIGINT).
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        try:
            commands = self.commands()
            print(f"epdserve up: starting {self.config.model_name}: {', '.join(name for name, _ in commands)}; "
                  f"engines load the model first (seconds; a minute or two more on a first start where the install "
                  f"has no C++ kernels for this CPU); the URL follows once every service is ready", flush=True)
            for name, argv in commands:
                self._argv[name] = argv
                self.children.append((name, self._spawn(name)))
            url = f"http://{self.config.host}:{self.config.port}"
            if not self._wait_ready(url, startup_timeout):
                return 0
            print(f"epdserve is ready: {url}/v1 (model {self.config.model_name}); Ctrl-C stops it", flush=True)
            planner = None
            if self.config.planner is not None:
                from epdserve.services.cli.planner_loop import PlannerLoop

                planner = PlannerLoop(self, self.config.planner, url)
            while not self.signals:
                if not self._restart_dead():
                    return 1
                if planner is not None:
                    planner.tick()
                    self._retire()
                time.sleep(0.2)
            return 0
        finally:
            started = time.monotonic()
            self.stop()
            print(f"epdserve up: stopped {len(self.children)} services in {time.monotonic() - started:.1f}s",
                  flush=True)
            if self.discovery_file is not None:
                shutil.rmtree(self.discovery_file.parent, ignore_errors=True)

    def _spawn(self, name: str) -> subprocess.Popen:
        # Its own process group: a terminal's Ctrl-C is this process's to forward, once, in order.
        return subprocess.Popen(self._argv[name], env=self.environment(name), start_new_session=True)

    def _restart_dead(self) -> bool:
        """Start again each child that died, on the same ports; give up on one that keeps dying. False once
        the stack cannot serve any more (its proxy given up on)."""
        now = time.monotonic()
        for i, (name, proc) in enumerate(self.children):
            if proc.poll() is None or name in self._given_up or name in self._retiring:
                continue
            deaths = [t for t in self._deaths.get(name, []) if now - t < RESTART_WINDOW] + [now]
            self._deaths[name] = deaths
            if len(deaths) >= RESTART_LIMIT:
                self._given_up.add(name)
                print(f"epdserve up: {exit_message(name, proc.returncode)}, the {len(deaths)}th time within "
                      f"{RESTART_WINDOW:.0f}s; giving up on it" + ("; stopping the stack" if name == "proxy" else
                                                                    " (the others serve without it)"),
                      file=sys.stderr, flush=True)
                if name == "proxy":
                    return False
                continue
            print(f"epdserve up: {exit_message(name, proc.returncode)}; restarting it (its requests continue on "
                  "the other services meanwhile)", file=sys.stderr, flush=True)
            self.children[i] = (name, self._spawn(name))
        return True

    def _wait_ready(self, url: str, timeout: float) -> bool:
        """True once the proxy is ready; False if told to stop first."""
        deadline = time.monotonic() + timeout
        key = self.config.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        while time.monotonic() < deadline:
            if self.signals:
                return False
            for name, proc in self.children:
                if proc.poll() is not None:
                    raise SystemExit(f"epdserve up: during startup, {exit_message(name, proc.returncode)}")
            try:
                with urllib.request.urlopen(urllib.request.Request(url + "/ready", headers=headers), timeout=2) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise SystemExit(f"epdserve up: the stack was not ready within {timeout:.0f}s (--startup-timeout)")

    def stop(self) -> None:
        """Drain front to back - the proxy, then the engines - each child told by pid."""
        proxies = [proc for name, proc in self.children if name == "proxy"]
        engines = [proc for name, proc in self.children if name != "proxy"]
        hurried = self.signals + 1  # the signal count at which the stop is hurried
        # Each step's bound: its drain, then the cut's last events and closing down.
        for group in (proxies, engines):
            self._terminate(group)
            if not self._wait(group, self.config.drain_timeout + 15, hurried):
                break
        # Hurried (or a child outlived its bound): every child told again; killed after one more signal.
        self._terminate(proxies + engines)
        if not self._wait(proxies + engines, 15, hurried + 1):
            for proc in proxies + engines:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()

    @staticmethod
    def _terminate(procs: list[subprocess.Popen]) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def _wait(self, procs: list[subprocess.Popen], timeout: float, until_signals: int) -> bool:
        """True once every one of `procs` exited within `timeout`, False if not or on the
        `until_signals`-th signal."""
        deadline = time.monotonic() + timeout
        while any(proc.poll() is None for proc in procs):
            if time.monotonic() > deadline or self.signals >= until_signals:
                return False
            time.sleep(0.1)
        return True
