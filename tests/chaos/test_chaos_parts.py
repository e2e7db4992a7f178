"""The chaos suite's own parts, without Docker (run by `make test`): the KV tap over real sockets, and the
stack's compose overlay against compose.yaml."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ANSWER = bytes(range(256)) * 1024  # 256 KiB: one answer of the fake prefill


def test_the_overlay_only_shrinks_the_kv_pools_and_checks_restarts_sooner():
    """compose.chaos.yaml restates the prefill and decode commands: they must stay compose.yaml's, plus the pool;
    of the engines' health checks it changes only how often a starting engine is checked."""
    base = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    overlay = yaml.safe_load((HERE / "compose.chaos.yaml").read_text())["services"]
    assert set(overlay) == {"encoder", "prefill", "decode"}
    for service, spec in overlay.items():
        assert spec["healthcheck"] == {"start_interval": "1s"}, service
        if service == "encoder":
            assert set(spec) == {"healthcheck"}
            continue
        assert set(spec) == {"command", "healthcheck"}, service
        command = list(spec["command"])
        at = command.index("--num-kv-blocks")
        assert command[at + 1] == "256"
        assert command[:at] + command[at + 2:] == base[service]["command"], service


def _fake_prefill(listener: socket.socket) -> None:
    """Reads the token, then answers each [u32 length][frame] request with ANSWER."""
    conn, _ = listener.accept()
    with conn:
        conn.recv(32, socket.MSG_WAITALL)
        while True:
            head = conn.recv(4, socket.MSG_WAITALL)
            if len(head) < 4:
                return
            conn.recv(int.from_bytes(head, "little"), socket.MSG_WAITALL)
            conn.sendall(ANSWER)


def test_kv_tap_delays_answers_and_flips_one_bit_per_request(tmp_path):
    from epdserve.services.cli.launcher import free_port
    from epdserve.transport.channel import codec
    from epdserve.transport.channel.protocol import FetchBlocks

    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_fake_prefill, args=(listener,), daemon=True).start()
    control, stats, port = tmp_path / "control.json", tmp_path / "stats.json", free_port()
    control.write_text(json.dumps({"delay": 0.3, "flip": True}))
    tap = subprocess.Popen([sys.executable, str(HERE / "kv_tap.py"), "--listen", str(port), "--upstream",
                            f"127.0.0.1:{listener.getsockname()[1]}", "--control", str(control), "--stats",
                            str(stats)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                client = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline and tap.poll() is None, tap.stderr.read()
                time.sleep(0.05)
        with client:
            client.sendall(b"t" * 32)
            for rid, flipped in (("req-a", True), ("req-a", False), ("req-b", True)):
                (frame,) = codec.encode(FetchBlocks(rid, 1, (1, 2), ()))
                started = time.monotonic()
                client.sendall(len(frame).to_bytes(4, "little") + bytes(frame))
                got = bytearray(len(ANSWER))
                view, n = memoryview(got), 0
                while n < len(got):
                    n += client.recv_into(view[n:])
                assert time.monotonic() - started >= 0.3  # the delay
                diff = [i for i in range(len(got)) if got[i] != ANSWER[i]]
                if flipped:  # one bit, within the answer's first 4 KiB
                    assert len(diff) == 1 and diff[0] < 4096 and bin(got[diff[0]] ^ ANSWER[diff[0]]).count("1") == 1
                else:  # a request's later answers (a re-fetch) pass intact
                    assert diff == []
        deadline = time.monotonic() + 10
        while json.loads(stats.read_text())["flipped"] != ["req-a", "req-b"]:
            assert time.monotonic() < deadline, stats.read_text()
            time.sleep(0.05)
    finally:
        tap.terminate()
        tap.wait(10)
        listener.close()
