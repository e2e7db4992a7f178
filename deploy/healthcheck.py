#!/usr/bin/env python3
"""The image's health check: exit 0 when the epdserve server in this container answers GET /ready.

Ready, not merely alive: an engine is READY once its model and its kernels are loaded, the proxy
once every role has a ready instance. Until then the container stays `starting` (its start period allows
for loading), so `depends_on: condition: service_healthy` and `docker compose up --wait` wait for a
stack that serves.

    epdserve-healthcheck            port and host read from the server's own command line
    epdserve-healthcheck PORT       check 127.0.0.1:PORT
    epdserve-healthcheck --pid PID  read the command line of process PID

The command line is read with epdserve's own parser, so the check follows whatever the container was
told: the proxy and `epdserve up` answer on --port, every other role on --http-port. The server is
PID 1, or (under an init such as tini or docker-init) the first process running an epdserve command.
"""
from __future__ import annotations

import argparse
import os
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


def server_options(args: list[str]) -> argparse.Namespace:
    """`args` as the server parsed them (defaults from this process's environment: see `main`)."""
    from epdserve.services.cli.main import build_parser

    return build_parser().parse_args(args)


def ready_url(ns: argparse.Namespace) -> str:
    if ns.command == "up" or ns.role == "proxy":
        port = ns.port
    elif ns.command == "serve":
        port = ns.http_port
    else:
        raise SystemExit(f"epdserve {ns.command} serves no HTTP")
    if not port:
        raise SystemExit("the server picked a random --http-port: give it a fixed one to health-check it")
    host = "127.0.0.1" if ns.host in WILDCARD_HOSTS else ns.host
    return f"http://{host}:{port}/ready"


def bearer_token(ns: argparse.Namespace) -> str | None:
    """The API key the server's /ready is behind (None: open), as the server read it."""
    from epdserve.services.cli.main import api_key

    return api_key(ns) if hasattr(ns, "api_key") else None  # only the proxy and `up` take a key


def read_cmdline(pid: int | str) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [w.decode() for w in raw.split(b"\0")[:-1]]


def read_environ(pid: int | str) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(w.decode().split("=", 1) for w in raw.split(b"\0") if b"=" in w)


def find_server() -> int:
    pids = sorted(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
    for pid in pids:
        try:
            if server_args(read_cmdline(pid)):
                return pid
        except OSError:
            continue  # exited while we looked
    raise SystemExit("no epdserve process in this container")


def main(argv: list[str]) -> int:
    if len(argv) == 1 and argv[0].isdigit():
        # Only a port: the key, if any, as a server given none on its command line reads it.
        ns, url = server_options(["up"]), f"http://127.0.0.1:{argv[0]}/ready"
    else:
        if argv[:1] == ["--pid"] and len(argv) == 2:
            pid = argv[1]
        elif not argv:
            pid = find_server()
        else:
            raise SystemExit(__doc__)
        args = server_args(read_cmdline(pid))
        if args is None:
            raise SystemExit(f"process {pid} is not an epdserve server")
        # Its options' defaults came from its environment: the same in its container, not always elsewhere.
        try:
            os.environ.update(read_environ(pid))
        except OSError:
            pass  # another user's process: this environment's
        ns = server_options(args)
        url = ready_url(ns)
    key = bearer_token(ns)
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return 0 if response.status == 200 else 1
    except OSError as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
