"""Fixtures for the deployment files: the real validators (compose v2, helm, schema checkers) and the
objects they produce, read back as Python data.

The validators are installed by `make test` (tools.py says where); a missing one fails these tests
rather than skipping them, so a green run always means the files were checked.
"""
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml


def _load_tools():
    # tools.py is also a script run by `make`; loaded by path so that no folder goes onto sys.path.
    spec = importlib.util.spec_from_file_location("epdserve_deploy_tools", Path(__file__).with_name("tools.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tools = _load_tools()

REPO = tools.REPO
CHART = REPO / "helm" / "epdserve"
COMPOSE_FILE = REPO / "compose.yaml"
CURVE_OVERLAY = REPO / "deploy" / "compose.curve.yaml"


def run(argv, **kwargs) -> subprocess.CompletedProcess:
    """Runs a validator; its output is kept for the assertion message."""
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=120, **kwargs)


@pytest.fixture(scope="session")
def validators():
    missing = tools.missing()
    if missing:
        pytest.fail(f"deployment validators missing: {missing}; `make test` installs them")
    return tools


@pytest.fixture(scope="session")
def validate(validators):
    """validate(tool name, *args, input=None) -> CompletedProcess of a validator from the tools venv."""

    def call(name, *args, input=None):
        return run([validators.tool(name), *args], input=input)

    return call


# -- compose --------------------------------------------------------------------------------------------
def compose_env(**overrides: str) -> dict[str, str]:
    """The caller's environment without EPDSERVE_* settings (they would change what compose resolves)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPDSERVE_", "COMPOSE_"))}
    return {**env, **overrides}


@pytest.fixture(scope="session")
def compose(validators, tmp_path_factory):
    """compose(*args, files=..., **env) -> CompletedProcess of the docker-compose v2 binary."""
    # Compose reads a .env beside the file; a developer's own must not change what is checked.
    workdir = tmp_path_factory.mktemp("compose")

    def call(*args, files=(COMPOSE_FILE,), **env):
        file_args = [a for f in files for a in ("-f", f)]
        return run([tools.docker_compose(), "--project-directory", REPO, "--env-file", os.devnull, *file_args,
                    *args], env=compose_env(**env), cwd=workdir)

    return call


@pytest.fixture(scope="session")
def compose_config(compose):
    """compose_config(*profiles, **env) -> the project as compose resolves it (anchors merged, variables set)."""
    cache = {}

    def config(*profiles, **env):
        key = (profiles, tuple(sorted(env.items())))
        if key not in cache:
            profile_args = [a for p in profiles for a in ("--profile", p)]
            done = compose(*profile_args, "config", "--format", "json", **env)
            assert done.returncode == 0, done.stderr
            cache[key] = json.loads(done.stdout)
        return cache[key]

    return config


# -- helm -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def helm(validators, tmp_path_factory):
    """helm(*args) -> CompletedProcess; helm's caches and config live in a temp folder (it works offline)."""
    home = tmp_path_factory.mktemp("helm-home")
    env = {**os.environ, **{f"HELM_{k}_HOME": str(home / k.lower()) for k in ("CACHE", "CONFIG", "DATA")}}

    def call(*args):
        return run([tools.tool("helm"), *args], env=env)

    return call


@pytest.fixture(scope="session")
def render(helm):
    """render(values_file=None) -> (manifest text, [objects]) of `helm template` for that value set."""
    cache = {}

    def template(values_file=None):
        if values_file not in cache:
            extra = ["-f", values_file] if values_file else []
            done = helm("template", "rel", CHART, "--namespace", "llm", *extra)
            assert done.returncode == 0, done.stderr
            cache[values_file] = (done.stdout, [o for o in yaml.safe_load_all(done.stdout) if o])
        return cache[values_file]

    return template


@pytest.fixture(scope="session")
def parse_cli():
    """parse_cli(argv) -> argparse.Namespace: an epdserve command line (argv[0] is the program) read by
    the CLI's own parser, which exits (failing the test) on anything it would refuse."""
    from epdserve.services.cli.main import parse_args

    def parse(argv):
        assert Path(argv[0]).name == "epdserve", argv
        return parse_args(argv[1:])

    return parse
