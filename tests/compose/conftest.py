"""The real image under a real Docker engine, driven by `docker compose` as a user drives it.

These tests run only under `make test-compose` (tests/compose/run.sh), which starts an engine when none
runs, builds the image and sets EPDSERVE_COMPOSE_TEST=1 with the image's tag and the compose command.
Under a plain `pytest` they are skipped. The stack is one per session: brought up once with two decodes
and the monitoring profile's Prometheus, always taken down with `down -v`; test_compose_ucx.py's, with
the UCX overlay, is up only while that module runs, before it.
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from epdserve.services.cli.launcher import free_port


HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ENABLED = os.environ.get("EPDSERVE_COMPOSE_TEST") == "1"
# run.sh names it (make test-chaos runs its own project, so that it never meets this suite's).
PROJECT = os.environ.get("EPDSERVE_COMPOSE_PROJECT", "epdserve-test")
API_KEY = "compose-test-key"
# Where the Dockerfile bakes the demo model ($EPDSERVE_CACHE_DIR/models/llava-demo).
MODEL_IN_IMAGE = "/models/models/llava-demo"
ENGINE_SERVICES = ("encoder", "prefill", "decode")
# How long a stack may take to become ready (its engines load the model, four containers on a shared CPU).
READY_TIMEOUT_S = 480


def pytest_collection_modifyitems(config, items):
    if ENABLED:
        return
    skip = pytest.mark.skip(reason="needs a Docker engine and the built image: run `make test-compose`")
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """One line per test for run.sh's closing summary: outcome, seconds, name."""
    path = os.environ.get("EPDSERVE_COMPOSE_REPORT")
    if not path or not ENABLED:
        return
    # Setup counts when it did real work: the first test's holds the references and `compose up`.
    if report.when == "call" or report.outcome != "passed" or report.duration > 5:
        with open(path, "a") as out:
            out.write(f"{report.outcome:8} {report.duration:6.1f}s  {report.nodeid.rsplit('::', 1)[-1]}"
                      f"{'' if report.when == 'call' else f' ({report.when})'}\n")



def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done


@dataclass
class Stack:
    """The compose project under test: its command, environment and published ports."""

    compose_argv: list[str]
    env: dict[str, str]
    api_port: int
    prometheus_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([*self.compose_argv, *args], cwd=REPO, env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return done

    def containers(self, service: str, all_states: bool = False) -> list[str]:
        """Names of the service's containers (running ones unless `all_states`), sorted."""
        ids = self.compose("ps", "-q", *(["-a"] if all_states else []), service).stdout.split()
        if not ids:
            return []
        return sorted(docker("inspect", "--format", "{{.Name}}", *ids).stdout.replace("/", "").split())

    def engine_containers(self) -> list[str]:
        return [c for s in ENGINE_SERVICES for c in self.containers(s)]

    def http_get(self, container: str, path: str, port: int = 9000) -> tuple[int, str]:
        """GET 127.0.0.1:port/path inside a container (engines publish no port): (status, body)."""
        script = ("import urllib.request, urllib.error\n"
                  "try:\n"
                  f"    r = urllib.request.urlopen('http://127.0.0.1:{port}{path}', timeout=10)\n"
                  "    print(r.status); print(r.read().decode())\n"
                  "except urllib.error.HTTPError as e:\n"
                  "    print(e.code)\n")
        status, _, body = docker("exec", container, "python", "-c", script, timeout=60).stdout.partition("\n")
        return int(status), body

    def logs(self, container: str) -> str:
        done = docker("logs", container, timeout=60, check=False)
        return done.stdout + done.stderr

    def tail_logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", timeout=120, check=False).stdout

    def ip(self, container: str) -> str:
        networks = json.loads(docker("inspect", "--format", "{{json .NetworkSettings.Networks}}", container).stdout)
        (network,) = networks.values()
        return network["IPAddress"]

    def prometheus_targets(self) -> list[dict]:
        import httpx

        body = httpx.get(f"http://127.0.0.1:{self.prometheus_port}/api/v1/targets", timeout=10).json()
        return body["data"]["activeTargets"]

    def wait_proxy_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.proxy_ready():
            assert time.monotonic() < deadline, f"the proxy never got ready:\n{self.tail_logs()}"
            time.sleep(1)

    def proxy_ready(self) -> bool:
        import httpx

        try:
            return httpx.get(self.url + "/ready", headers={"Authorization": f"Bearer {API_KEY}"},
                             timeout=5).status_code == 200
        except httpx.HTTPError:
            return False


@pytest.fixture(scope="session")
def docker_cli():
    return docker


@pytest.fixture(scope="session")
def image() -> str:
    return os.environ["EPDSERVE_IMAGE"]


@pytest.fixture(scope="session")
def model_folder(image, tmp_path_factory) -> Path:
    """The demo model the image bakes in, copied out of it: the local references read the same weights."""
    dest = tmp_path_factory.mktemp("image-model")
    container = docker("create", image).stdout.strip()
    try:
        docker("cp", f"{container}:{MODEL_IN_IMAGE}", str(dest))
    finally:
        docker("rm", container)
    return dest / Path(MODEL_IN_IMAGE).name


@contextlib.contextmanager
def compose_up(files: list[str], services: list[str], profiles: tuple[str, ...] = (),
               scale: dict[str, int] | None = None, env: dict[str, str] | None = None) -> Iterator[Stack]:
    """`compose up --wait` of `services` (and what they depend on) from the repo's compose `files`, every
    engine and the proxy ready; `down -v` on leaving, whatever happened."""
    api_port, prometheus_port = free_port(), free_port()
    # --env-file: a developer's own .env beside compose.yaml must not change what is tested.
    argv = [*shlex.split(os.environ["EPDSERVE_COMPOSE"]), "--env-file", os.devnull,
            *[a for f in files for a in ("-f", str(REPO / f))], *[a for p in profiles for a in ("--profile", p)]]
    env = {**os.environ, **(env or {}), "COMPOSE_PROJECT_NAME": PROJECT, "EPDSERVE_API_KEY": API_KEY,
           # One torch thread per engine: the engines share this machine's cores.
           "EPDSERVE_THREADS": os.environ.get("EPDSERVE_THREADS", "1"),
           "EPDSERVE_PORT": str(api_port), "EPDSERVE_PROMETHEUS_PORT": str(prometheus_port)}
    stack = Stack(argv, env, api_port, prometheus_port)
    try:
        up = stack.compose("up", "--detach", "--pull", "never", "--wait", "--wait-timeout", str(READY_TIMEOUT_S),
                           *[a for name, n in (scale or {}).items() for a in ("--scale", f"{name}={n}")], *services,
                           check=False)
        assert up.returncode == 0, f"compose up --wait failed:\n{up.stderr[-3000:]}\n{stack.tail_logs()}"
        # The image's health check asks /ready: once --wait returns, every engine and the proxy serve.
        not_ready = [c for c in stack.engine_containers() if stack.http_get(c, "/ready")[0] != 200]
        assert not not_ready and stack.proxy_ready(), f"healthy but not ready: {not_ready or ['proxy']}"
        yield stack
    finally:
        stack.compose("down", "-v", "--remove-orphans", "--timeout", "60", timeout=300, check=False)


@pytest.fixture(scope="session")
def stack(references) -> Iterator[Stack]:
    """encoder, prefill, 2 decodes, the proxy and Prometheus, up and ready; `down -v` at the end.

    Depends on `references` so the local models are computed and freed before the containers start."""
    # Only Prometheus from the monitoring profile (and what it depends on): Grafana adds nothing
    # to test here, and its image may not be at hand where no registry is.
    with compose_up(["compose.yaml"], ["prometheus"], profiles=("monitoring",), scale={"decode": 2}) as stack:
        yield stack


@pytest.fixture(scope="module")
def ucx_stack(references) -> Iterator[Stack]:
    """encoder, prefill, decode and the proxy with compose.ucx.yaml: every engine on UCX. Its module's
    alone, taken down when that module ends, so that it never runs beside the session's stack."""
    with compose_up(["compose.yaml", "compose.ucx.yaml"], ["proxy"]) as stack:
        yield stack


@pytest.fixture(scope="module")
def store_stack(references) -> Iterator[Stack]:
    """encoder, prefill, decode, the proxy and the KV store the engines share (the kvstore profile). Its module's
    alone, as ucx_stack."""
    with compose_up(["compose.yaml"], ["proxy", "kvstore"], profiles=("kvstore",),
                    env={"EPDSERVE_KV_STORE": "kvstore:7000"}) as stack:
        yield stack


@pytest.fixture(scope="module")
def store_client(store_stack):
    return api_client(store_stack)


def api_client(stack: Stack):
    import openai

    # No retries: a failure must show. The timeout bounds a hung stream; nothing asserts on time.
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def client(stack):
    return api_client(stack)


@pytest.fixture(scope="module")
def ucx_client(ucx_stack):
    return api_client(ucx_stack)


TEXT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
IMAGE_QUESTION = "What is in this picture?"
MAX_TOKENS = 16


def picture_png(size=(240, 320)) -> bytes:
    """A fixed, smooth test picture."""
    import io

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:size[0], 0:size[1]] / max(size)
    rgb = np.stack([np.sin(x * (3 + 2 * c)) * np.cos(y * (7 - c)) for c in range(3)], -1)
    buf = io.BytesIO()
    Image.fromarray(((rgb + 1) * 127.5).astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class References:
    """Greedy answers computed here from the image's own model folder, and the requests they answer."""

    text_ids: list[int]  # the local LLM's answer to TEXT_MESSAGES
    image_ids: list[int]  # HF transformers' LLaVA answer to the picture and IMAGE_QUESTION
    image_logits: list  # HF's per-step logits, for the near-tie rule the e2e tests use
    image_prompt_tokens: int
    text_messages: list = field(default_factory=lambda: TEXT_MESSAGES)
    image_question: str = IMAGE_QUESTION
    max_tokens: int = MAX_TOKENS

    @staticmethod
    def picture_png() -> bytes:
        return picture_png()


@pytest.fixture(scope="session")
def references(model_folder) -> References:
    import gc
    import io

    import torch
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from epdserve import LLM, SamplingParams

    llm = LLM(model=str(model_folder), kv_cache_memory_bytes=64 << 20)
    (out,) = llm.chat(TEXT_MESSAGES, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    text_ids = list(out.outputs[0].token_ids)
    del llm, out

    model = LlavaForConditionalGeneration.from_pretrained(model_folder, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(model_folder)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": IMAGE_QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[Image.open(io.BytesIO(picture_png()))], return_tensors="pt")
    ids = inputs["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), pixel_values=inputs["pixel_values"],
                             max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=model.generation_config.eos_token_id)
    refs = References(text_ids, out.sequences[0, ids.shape[1]:].tolist(), [step[0] for step in out.logits],
                      ids.shape[1])
    del model, out
    gc.collect()
    return refs
