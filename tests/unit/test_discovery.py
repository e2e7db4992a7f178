"""The proxy's discovery file (services/proxy/discovery.py): what it lists, read again when it changes, and a bad
version changing nothing."""
import json
import os

import pytest

from epdserve.services.proxy.discovery import Discovery, parse
from epdserve.transport.channel.protocol import Role


def write(path, data) -> None:
    text = data if isinstance(data, str) else json.dumps(data)
    path.write_text(text)
    stat = path.stat()  # a new modification time, even within the file system's clock tick
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))


def test_a_changed_file_is_read_again_and_an_unchanged_one_is_not(tmp_path):
    path = tmp_path / "instances.json"
    discovery = Discovery(str(path))
    assert not discovery.changed()  # no file yet: the command line's instances stay
    write(path, {"decode": ["127.0.0.1:7000", "127.0.0.1:7001"], "planner": {"desired": {"decode": 2}}})
    assert discovery.changed()
    assert discovery.targets == {Role.DECODE: ["127.0.0.1:7000", "127.0.0.1:7001"]}
    assert discovery.desired == {"decode": 2}
    assert not discovery.changed()
    write(path, {"decode": ["127.0.0.1:7000"], "prefill": ["[::1]:7100"]})
    assert discovery.changed() and discovery.targets[Role.DECODE] == ["127.0.0.1:7000"]


def test_a_bad_version_changes_nothing_and_is_warned_about_once(tmp_path, caplog):
    path = tmp_path / "instances.json"
    write(path, {"decode": ["127.0.0.1:7000"]})
    discovery = Discovery(str(path))
    assert discovery.changed()
    for bad in ("{", {"decode": "127.0.0.1:7000"}):
        write(path, bad)
        assert not discovery.changed()
    assert discovery.targets == {Role.DECODE: ["127.0.0.1:7000"]}
    assert len([r for r in caplog.records if "discovery file" in r.message]) == 1


@pytest.mark.parametrize("data, error", [
    ([], "not a JSON object"), ({"decodes": []}, "unknown key"), ({"decode": [7000]}, "list of HOST:PORT"),
    ({"decode": ["http://h:1"]}, "without a scheme"), ({"planner": {"desired": {"decode": -1}}}, "planner.desired"),
    ({"planner": {"desired": {"gpu": 1}}}, "planner.desired")])
def test_what_is_wrong_is_named(data, error):
    with pytest.raises(ValueError, match=error):
        parse(json.dumps(data))
