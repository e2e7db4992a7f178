"""The folders runtime adapters may come from: a path leads into them or is refused with one message, whether
it leads out by `..`, by a symlink, or names nothing; adapter names are model names, never paths."""
import os

import pytest

from epdserve.shared.models.lora_roots import LoRARoots, check_adapter_name, outside_message


@pytest.fixture()
def tree(tmp_path):
    root = tmp_path / "adapters"
    (root / "sql").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", root / "escape")
    os.symlink(root / "sql", root / "alias")
    return root


@pytest.mark.parametrize("name", ["sql", "sql-v2", "org.team_sql:3", "A" * 128])
def test_model_names_are_taken(name):
    assert check_adapter_name(name) == name


@pytest.mark.parametrize("name", ["../x", "a/b", "a\\b", ".hidden", "", "A" * 129, "x\x00", " sql", 7, None])
def test_names_that_could_be_paths_or_are_no_names_are_refused(name):
    with pytest.raises(ValueError, match="lora_name must be"):
        check_adapter_name(name)


def test_folders_inside_a_root_resolve_by_absolute_or_relative_path(tree):
    roots = LoRARoots([str(tree)])
    assert roots.folder(str(tree / "sql")) == (tree / "sql").resolve()
    assert roots.folder("sql") == (tree / "sql").resolve()
    assert roots.folder(str(tree / "alias")) == (tree / "sql").resolve()  # a link that stays inside


@pytest.mark.parametrize("path", ["../secret", "{tree}/../secret", "{tree}/escape", "escape", "/etc", "/proc/self/mem",
                                  "../../etc/passwd", "{tree}/absent", "absent", "/no/such/folder", "",
                                  "{tree}/sql/../../secret", "sql\x00"])
def test_every_way_out_and_every_absent_folder_reads_the_same(tree, path):
    path = path.format(tree=tree)
    with pytest.raises(ValueError) as refused:
        LoRARoots([str(tree)]).folder(path)
    assert str(refused.value) == outside_message(path)


def test_files_linked_out_of_a_root_are_outside(tree, tmp_path):
    (tmp_path / "secret" / "weights").write_bytes(b"x")
    os.symlink(tmp_path / "secret" / "weights", tree / "sql" / "adapter_model.safetensors")
    roots = LoRARoots([str(tree)])
    assert not roots.contains(tree / "sql" / "adapter_model.safetensors")
    assert roots.contains(tree / "sql")


def test_no_roots_admit_nothing_and_a_missing_root_is_refused_where_it_must_exist(tree, tmp_path):
    with pytest.raises(ValueError):
        LoRARoots([]).folder(str(tree / "sql"))
    with pytest.raises(ValueError, match="is not a folder"):
        LoRARoots([str(tmp_path / "none")])
    assert not LoRARoots([str(tmp_path / "none")], must_exist=False).lexically_inside("/etc")


@pytest.mark.parametrize("path, inside", [("{tree}/sql", True), ("sql", True), ("a/b/c", True),
                                          ("{tree}/../secret", False), ("../x", False), ("..", False),
                                          ("/etc", False), ("{tree}x/sql", False), ("", False), ("a\x00", False)])
def test_the_proxy_checks_the_text_of_a_path(tree, path, inside):
    assert LoRARoots([str(tree)], must_exist=False).lexically_inside(path.format(tree=tree)) is inside
