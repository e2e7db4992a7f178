"""Guards for the one-namespace layout: every package folder is importable as epdserve.<folder>; the layer
contracts and the import graph hold, and a module that breaks them fails here."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_FOLDERS = ("shared", "kernels", "transport", "services")
SKIP_DIRS = {"__pycache__", ".venv", ".git", "results"}


def _skipped(path: Path) -> bool:
    parts = path.relative_to(ROOT).parts
    return bool(SKIP_DIRS.intersection(parts)) or any(p.startswith(".venv") for p in parts)


def _python_dirs(top: Path):
    for path in [top, *top.rglob("*")]:
        if path.is_dir() and not _skipped(path):
            if any(path.glob("*.py")):
                yield path


def test_every_package_folder_has_init():
    missing = [
        str(d.relative_to(ROOT))
        for folder in PACKAGE_FOLDERS
        for d in _python_dirs(ROOT / folder)
        if not (d / "__init__.py").is_file()
    ]
    assert not missing, f"folders with .py files but no __init__.py (dropped from the wheel): {missing}"


BARE_IMPORT = re.compile(r"^\s*(from|import)\s+(kernels|shared|transport|services)(\.|\s|$)", re.M)


def test_no_bare_imports_of_top_level_folders():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if _skipped(path):
            continue
        if BARE_IMPORT.search(path.read_text(encoding="utf-8")):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"import these as epdserve.<folder>: {offenders}"


def test_packages_import_under_namespace():
    import epdserve
    import epdserve.kernels
    import epdserve.services
    import epdserve.shared
    import epdserve.transport

    for module in (epdserve.shared, epdserve.kernels, epdserve.transport, epdserve.services):
        assert Path(module.__file__).parent.name in PACKAGE_FOLDERS


def _lint_imports(package_root: Path) -> subprocess.CompletedProcess:
    """import-linter over pyproject.toml's contracts. It reads packages from disk as the import system would find
    them, so it gets the `epdserve` tree as installed: the top-level folders under one package, as setup.py maps
    them (`package_root`/epdserve)."""
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=package_root,
                          env={**os.environ, "PYTHONPATH": str(package_root)}, capture_output=True, text=True,
                          timeout=300)


def _link_package(tree: Path, into: Path) -> None:
    """`into`/epdserve: `tree`'s top-level folders under one package, as setup.py maps them."""
    package = into / "epdserve"
    package.mkdir()
    for source in (tree / "shared" / "api").glob("*.py"):
        (package / source.name).symlink_to(source)
    for folder in PACKAGE_FOLDERS:
        (package / folder).symlink_to(tree / folder, target_is_directory=True)


def test_the_layer_contracts_hold(tmp_path):
    """Dependencies point one way; services reach the engine through its door only; the proxy loads no torch."""
    _link_package(ROOT, tmp_path)
    result = _lint_imports(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def _import_graph():
    """tests/import_graph.py, by its path (tests/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("epdserve_import_graph", ROOT / "tests" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_import_cycle_between_subpackages():
    """Imports inside functions included (tests/import_graph.py)."""
    graphs = _import_graph()
    graph = graphs.subpackage_graph(ROOT)
    found = graphs.cycles(graph)
    assert not found, [(c, {a: sorted(graph[a][b]) for a in c for b in c if b in graph[a]}) for c in found]


# One module per contract that breaks it, in a copy of the tree: the contracts and the cycle check must see them.
PROBES = {
    "kernels import nothing of ours": ("kernels/probe.py", "import epdserve.shared.config"),
    "transport imports no engine and no service": ("transport/probe.py", "import epdserve.services.runtime.network"),
    "the engine and the shared library import neither services nor transport":
        ("shared/probe.py", "import epdserve.transport.channel.protocol"),
    "processing imports neither the engine nor the models (the models read its image processors and configs)":
        ("shared/processing/probe.py", "def later():\n    import epdserve.shared.models.llama"),
    "services use the engine through its door only: the names epdserve.shared.engine exports":
        ("services/host/probe.py", "import epdserve.shared.engine.scheduler"),
    "services are layered by who runs them: the command line; what it serves; what hosts an engine; every service's "
    "runtime": ("services/runtime/probe.py", "import epdserve.services.host.wire"),
    "the proxy loads neither torch nor the engine's machinery: only the engine's parameter and output types":
        ("services/proxy/probe.py", "def later():\n    import torch"),
    "transport is layered: the transports; the data paths, independent of each other; the KV-transfer core; the "
    "channel layer": ("transport/kv/probe.py", "import epdserve.transport.zmq_frames.path"),
}


def test_a_probe_breaks_every_contract_and_the_cycle_check(tmp_path):
    import shutil
    import tomllib

    graphs = _import_graph()
    contracts = [c["name"] for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
                 ["contracts"]]
    assert sorted(contracts) == sorted(PROBES), "every contract needs its probe here"
    tree = tmp_path / "tree"
    for folder in PACKAGE_FOLDERS:
        shutil.copytree(ROOT / folder, tree / folder,
                        ignore=lambda d, names: [n for n in names if n in SKIP_DIRS or n.startswith(".")
                                                 or not (n.endswith(".py") or (Path(d) / n).is_dir())])
    for path, code in PROBES.values():
        (tree / path).write_text(f'"""Breaks a contract."""\n{code}\n')
    (tree / "shared" / "probe_a.py").write_text("import epdserve.shared.probe_b\n")
    (tree / "shared" / "probe_b.py").write_text("def later():\n    import epdserve.shared.probe_a\n")

    assert ["epdserve.shared.probe_a", "epdserve.shared.probe_b"] in graphs.cycles(graphs.subpackage_graph(tree))
    _link_package(tree, tmp_path)
    result = _lint_imports(tmp_path)
    report = " ".join(result.stdout.split())  # import-linter wraps long names
    assert result.returncode != 0
    for name in contracts:
        assert f"{name} BROKEN" in report, (name, result.stdout)


def test_the_constraints_pin_versions_the_project_accepts():
    """constraints.txt pins what `make install` and the image install; a pin outside pyproject.toml's ranges
    would make pip refuse to install, and a pinned torch would fight the build the Makefile picks."""
    import tomllib

    from packaging.requirements import Requirement

    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version
    assert "torch" not in pins
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in declared["dependencies"]]
    requirements += [Requirement(r) for extra in declared["optional-dependencies"].values() for r in extra]
    for requirement in requirements:
        name = requirement.name.lower().replace("_", "-")
        if name in pins:
            assert requirement.specifier.contains(pins[name], prereleases=True), (requirement, pins[name])
        elif name != "torch":
            raise AssertionError(f"{name} is not pinned in constraints.txt")
