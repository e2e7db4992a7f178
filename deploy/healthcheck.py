#!/usr/bin/env python3
"""The image's health check: exit 0 when the epdserve server in this container answers GET /health.

    epdserve-healthcheck            port and host read from the server's own command line
    epdserve-healthcheck PORT       check 127.0.0.1:PORT
    epdserve-healthcheck --pid PID  read the command line of process PID

The command line is read with epdserve's own parser, so the check follows whatever the container was
told: the proxy and `epdserve up` answer on --port, every other role on --http-port. The server is
PID 1, or (under an init such as tini or docker-init) the first process running an epdserve command.
"""
from __future__ import annotations

import sys
import urllib.request
from pathlib import Path

# Binding one of these means every interface, loopback included.
WILDCARD_HOSTS = {"", "*", "0.0.0.0", "::", "[::]"}
TIMEOUT_S = 4.0


def server_args(cmdline: list[str]) -> list[str] | None:
    """The arguments after the `epdserve` program in a process's argv (console script or `-m`), or None."""
    for i, word in enumerate(cmdline):
        if Path(word).name == "epdserve" or word == "epdserve.services.cli":
            return cmdline[i + 1:]
    return None


def health_url(args: list[str]) -> str:
    from epdserve.services.cli import build_parser

    ns = build_parser().parse_args(args)
    if ns.command == "up" or ns.role == "proxy":
        port = ns.port
    elif ns.command == "serve":
        port = ns.http_port
    else:
        raise SystemExit(f"epdserve {ns.command} serves no HTTP")
    if not port:
        raise SystemExit("the server picked a random --http-port: give it a fixed one to health-check it")
    host = "127.0.0.1" if ns.host in WILDCARD_HOSTS else ns.host
    return f"http://{host}:{port}/health"


def read_cmdline(pid: int | str) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [w.decode() for w in raw.split(b"\0")[:-1]]


def find_server() -> list[str]:
    pids = sorted(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
    for pid in pids:
        try:
            args = server_args(read_cmdline(pid))
        except OSError:
            continue  # exited while we looked
        if args:
            return args
    raise SystemExit("no epdserve process in this container")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--pid"] and len(argv) == 2:
        args = server_args(read_cmdline(argv[1]))
        if args is None:
            raise SystemExit(f"process {argv[1]} is not an epdserve server")
        url = health_url(args)
    elif len(argv) == 1 and argv[0].isdigit():
        url = f"http://127.0.0.1:{argv[0]}/health"
    elif not argv:
        url = health_url(find_server())
    else:
        raise SystemExit(__doc__)
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return 0 if response.status == 200 else 1
    except OSError as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
