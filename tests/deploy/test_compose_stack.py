"""The exact commands compose.yaml gives each service, run as local processes, answer a chat request.

Only what a container network provides is changed: hosts become 127.0.0.1, each (service, port) a free
local port, the model path the demo fixture, each named volume a local folder (fill-volumes' command makes
the deployment's secret in the `secret` one). Services start in compose's order - the proxy once every
engine's own compose health check passes - and the test then drives the proxy with the openai client.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from epdserve.services.cli.launcher import free_port

pytestmark = pytest.mark.slow  # more than ten seconds: left out of `make test-fast`


REPO = Path(__file__).resolve().parents[2]
HEALTHCHECK = REPO / "deploy" / "healthcheck.py"
API_KEY = "compose-test-key"
PORT_OPTIONS = {"--port", "--data-port", "--http-port", "--inbox-port"}
TARGET_OPTIONS = {"--encoder", "--prefill", "--decode", "--unified"}
STARTUP_TIMEOUT_S = 300



class LocalProject:
    """compose's services as processes on 127.0.0.1; `ports[(service, container port)]` is the local port."""

    def __init__(self, project: dict, model: str, log_dir: Path) -> None:
        self.services = {n: s for n, s in project["services"].items() if s["command"][:2] == ["epdserve", "serve"]}
        self.model, self.log_dir = model, log_dir
        self.fill = project["services"]["fill-volumes"]
        # Container paths of the secret volume -> a local folder, as every service mounts it.
        self.volume = log_dir / "secret-volume"
        self.mounts = {v["target"]: str(self.volume) for s in project["services"].values()
                       for v in s.get("volumes", []) if v.get("source") == "secret"}
        self.ports = {(name, int(port)): free_port() for name, s in self.services.items()
                      for option, port in zip(s["command"], s["command"][1:]) if option in PORT_OPTIONS}
        self.procs: dict[str, subprocess.Popen] = {}

    def target(self, address: str) -> str:
        host, port = address.rsplit(":", 1)
        return f"127.0.0.1:{self.ports[(host, int(port))]}"

    def argv(self, name: str) -> list[str]:
        command = self.services[name]["command"]
        argv = [sys.executable, "-m", "epdserve.services.cli"]
        words = iter(command[1:])
        for word in words:
            argv.append(word)
            if word in PORT_OPTIONS:
                argv.append(str(self.ports[(name, int(next(words)))]))
            elif word in TARGET_OPTIONS:
                argv.append(",".join(self.target(t) for t in next(words).split(",")))
            elif word == "--host":
                next(words)
                argv.append("127.0.0.1")
            elif word == "--model":
                next(words)
                argv.append(self.model)
        return argv

    def healthcheck(self, name: str) -> list[str]:
        test = self.services[name]["healthcheck"]["test"]
        assert test[:2] == ["CMD", "epdserve-healthcheck"], test
        return [sys.executable, str(HEALTHCHECK), *(str(self.ports[(name, int(a))]) for a in test[2:])]

    def environment(self, name: str) -> dict[str, str]:
        """A service's environment: its process's, and its health check's (Docker runs it in the container)."""
        env = {key: self.local(value) for key, value in self.services[name].get("environment", {}).items()}
        if env.get("EPDSERVE_KV_STORE"):  # the store's service name, as compose's DNS resolves it
            env["EPDSERVE_KV_STORE"] = self.target(env["EPDSERVE_KV_STORE"])
        return {**os.environ, **env, "PYTHONSAFEPATH": "1", "PYTHONUNBUFFERED": "1"}

    def local(self, text: str) -> str:
        for target, folder in self.mounts.items():
            text = text.replace(target, folder)
        return text

    def fill_volumes(self) -> None:
        """fill-volumes' command (`sh -c ...`), its volume a local folder and `epdserve` this Python's."""
        shell, flag, script = self.fill["command"]
        assert (shell, flag) == ("sh", "-c"), self.fill["command"]
        self.volume.mkdir(exist_ok=True)
        cli = f"{sys.executable} -m epdserve.services.cli"
        for _ in range(2):  # the second `up` keeps the secret the first made
            done = subprocess.run([shell, flag, self.local(script).replace("epdserve keys", f"{cli} keys")],
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr

    def start(self, name: str) -> None:
        log = (self.log_dir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(self.argv(name), env=self.environment(name), stdout=log,
                                            stderr=subprocess.STDOUT)

    def wait_healthy(self, names, deadline: float) -> None:
        pending = set(names)
        while pending:
            for name in sorted(pending):
                assert self.procs[name].poll() is None, f"{name} exited: {self.logs()}"
                if subprocess.run(self.healthcheck(name), env=self.environment(name), capture_output=True,
                                  timeout=30).returncode == 0:
                    pending.discard(name)
            assert time.monotonic() < deadline, f"{sorted(pending)} not healthy in time: {self.logs()}"
            time.sleep(1)

    def up(self) -> None:
        """Starts services whose depends_on are healthy, like `docker compose up`, until all run."""
        self.fill_volumes()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(self.procs) < len(self.services):
            # A dependency that runs no server (fill-volumes fills container volumes) has no local part.
            ready = [n for n, s in self.services.items()
                     if n not in self.procs and set(s.get("depends_on", {})) & set(self.services) <= set(self.procs)]
            assert ready, "depends_on has a cycle or names an unknown service"
            for name in ready:
                self.start(name)
            self.wait_healthy(ready, deadline)

    def logs(self) -> str:
        return "\n".join(f"--- {p.stem}\n{p.read_text()[-2000:]}" for p in sorted(self.log_dir.glob("*.log")))

    def down(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def local_compose(compose_config, llava_demo_path, tmp_path_factory):
    # One torch thread per engine: three engines share this machine's cores.
    # With the shared KV store (its profile, and every engine pointed at it), as the file's header shows.
    project = compose_config("kvstore", EPDSERVE_API_KEY=API_KEY, EPDSERVE_THREADS="1", EPDSERVE_KV_STORE="kvstore:7000",
                             EPDSERVE_KV_STORE_SIZE="0.05")
    stack = LocalProject(project, llava_demo_path, tmp_path_factory.mktemp("compose-logs"))
    try:
        stack.up()
        yield stack
    finally:
        stack.down()


def test_the_compose_stack_completes_a_chat(local_compose):
    url = f"http://127.0.0.1:{local_compose.ports[('proxy', 8000)]}"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    deadline = time.monotonic() + 60
    while httpx.get(url + "/ready", headers=headers, timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the proxy never routed to every role: " + local_compose.logs()
        time.sleep(0.5)
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="llava-demo", temperature=0, max_tokens=8,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    choice = reply.choices[0]
    assert choice.message.content.strip() and choice.finish_reason in ("stop", "length")
    # The key compose passes from the environment is enforced.
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_the_image_healthcheck_finds_each_server_by_its_command_line(local_compose):
    # What the Dockerfile's HEALTHCHECK runs in a container, pointed at each process instead of PID 1.
    for name, proc in local_compose.procs.items():
        done = subprocess.run([sys.executable, str(HEALTHCHECK), "--pid", str(proc.pid)], capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, f"{name}: {done.stderr}"


def test_the_helm_test_script_passes_against_the_stack(local_compose):
    script = REPO / "helm" / "epdserve" / "files" / "chat_test.py"
    env = {**os.environ, "EPDSERVE_URL": f"http://127.0.0.1:{local_compose.ports[('proxy', 8000)]}",
           "EPDSERVE_API_KEY": API_KEY, "EPDSERVE_TEST_TIMEOUT": "60"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "answered" in done.stdout


def test_a_peer_without_the_deployment_secret_is_refused(local_compose):
    """Every service bound 0.0.0.0 in compose proves the secret fill-volumes made; a client without it (another
    container on the network) gets no handshake, one holding it does."""
    import asyncio

    from epdserve.transport.channel import protocol as p
    from epdserve.transport.channel.common import HandshakeError
    from epdserve.transport.channel.peer_auth import PeerAuth, load_secret
    from epdserve.transport.channel.request_client import RequestClient

    secret = load_secret(path=local_compose.environment("prefill")["EPDSERVE_SECRET_FILE"])

    async def probe(service: str, auth):
        address = f"tcp://127.0.0.1:{local_compose.ports[(service, 7000)]}"
        async with RequestClient(address, engine_id="probe", role=p.Role.PREFILL, timeout=5, auth=auth) as client:
            return await client.request(p.StatusRequest())

    for service in ("encoder", "prefill", "decode", "kvstore"):
        with pytest.raises(HandshakeError, match="unauthenticated"):
            asyncio.run(probe(service, None))
        assert isinstance(asyncio.run(probe(service, PeerAuth(secret))), p.Status)


def test_the_compose_store_gives_no_prompt_to_a_peer_and_takes_no_forged_block(local_compose):
    """The store probe against compose's store: a raw client without the secret is refused; one holding it
    lists the store's block hashes but reads none of them without their tokens, and plants nothing over them."""
    import asyncio

    import torch

    from epdserve.services.cli.main import engine_config, parse_args
    from epdserve.services.host.engine_worker import kv_layout
    from epdserve.transport.channel import protocol as p
    from epdserve.transport.channel.common import ErrorReply, HandshakeError
    from epdserve.transport.kv.checksum import checksum
    from epdserve.transport.channel.peer_auth import PeerAuth, load_secret
    from epdserve.transport.channel.request_client import RequestClient

    test_the_compose_stack_completes_a_chat(local_compose)  # a request whose blocks the engines put there
    secret = load_secret(path=local_compose.environment("kvstore")["EPDSERVE_SECRET_FILE"])
    layout = kv_layout(engine_config(parse_args(["serve", "prefill"]), local_compose.model))
    address = f"tcp://127.0.0.1:{local_compose.ports[('kvstore', 7000)]}"

    async def main():
        async with RequestClient(address, engine_id="probe", role=p.Role.PREFILL, timeout=5) as stranger:
            with pytest.raises(HandshakeError, match="unauthenticated"):
                await stranger.request(p.KVEventsRequest(None))
        async with RequestClient(address, engine_id="probe", role=p.Role.PREFILL, timeout=5,
                                 auth=PeerAuth(secret)) as peer:
            deadline = time.monotonic() + 20
            while not (events := await peer.request(p.KVEventsRequest(None), expect=p.KVEvents)).stored:
                assert time.monotonic() < deadline, "no block reached the store: " + local_compose.logs()
                await asyncio.sleep(0.5)
            held = [events.stored[i:i + 16] for i in range(0, len(events.stored), 16)]
            guess = (0,) * layout.block_size
            for block_hash in held:
                got = await peer.request(p.KVStoreGet(layout, block_hash, guess), expect=p.KVStoreBlocks)
                assert got.block_hashes == b"" and not got.blocks
            shape = (1, layout.num_layers, 2, layout.num_kv_heads, layout.block_size, layout.head_size)
            forged = torch.randn(shape, dtype=getattr(torch, layout.dtype))
            with pytest.raises(ErrorReply, match="other token ids"):
                await peer.request(p.KVStorePut(layout, held[0], guess, (checksum(forged[0]),), (forged,)),
                                   expect=p.Ack)

    asyncio.run(main())
