"""Guards for the one-namespace layout: every package folder is importable as epdserve.<folder>."""
import re
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


def test_the_layer_contracts_hold(tmp_path):
    """import-linter checks pyproject.toml's contracts (dependencies point one way; services reach the engine
    through its door only). It reads packages from disk as the import system would find them, so it gets
    the `epdserve` tree as installed: top-level folders linked under one package, as setup.py maps them."""
    import os
    import subprocess
    import sys

    package = tmp_path / "epdserve"
    package.mkdir()
    for source in (ROOT / "shared" / "api").glob("*.py"):
        (package / source.name).symlink_to(source)
    for folder in PACKAGE_FOLDERS:
        (package / folder).symlink_to(ROOT / folder, target_is_directory=True)
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


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
