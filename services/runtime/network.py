"""How services find and trust each other: advertised addresses, the deployment's secret and its CURVE
certificate."""
from __future__ import annotations

import logging
import socket
from pathlib import Path

from epdserve.shared.config import TransportConfig
from epdserve.transport.channel.peer_auth import PeerAuth
from epdserve.transport.channel.security import WILDCARD_HOSTS, CurveConfig, bracketed

logger = logging.getLogger(__name__)
CURVE_CERT = "epdserve"  # <curve_dir>/epdserve.key (public) and epdserve.key_secret


def server_curve(transport: TransportConfig) -> CurveConfig | None:
    """Every service shares one certificate: a server accepts exactly the clients holding it."""
    if not transport.curve_dir:
        return None
    folder = Path(transport.curve_dir)
    return CurveConfig(folder / f"{CURVE_CERT}.key_secret", allowed_clients=(folder / f"{CURVE_CERT}.key",))


def peer_auth(transport: TransportConfig) -> PeerAuth | None:
    """Every service shares one secret: each handshake proves it, each side checks the other's proof. A
    server gets one of its own (it remembers the nonces it admitted)."""
    return PeerAuth(transport.secret) if transport.secret else None


def say_if_unauthenticated(transport: TransportConfig, host: str) -> None:
    """One line at startup when peers are not authenticated (allowed only on loopback: cli.py refuses the rest)."""
    if not transport.secret and not transport.curve_dir:
        logger.warning("no deployment secret: peers are not authenticated, which is safe only because this "
                       "service binds loopback (%s), where only this machine's users reach it", host)


def client_curve(transport: TransportConfig) -> CurveConfig | None:
    if not transport.curve_dir:
        return None
    folder = Path(transport.curve_dir)
    return CurveConfig(folder / f"{CURVE_CERT}.key_secret", server_public_key_file=folder / f"{CURVE_CERT}.key")


def split_target(target: str) -> tuple[str, int]:
    """(host, port) of a peer's control address `host:port`, `[ipv6]:port` or `tcp://host:port`.

    Raises ValueError naming what is wrong, so that a typo is refused at startup rather than retried
    (and logged) forever.
    """
    address = target.strip().removeprefix("tcp://")
    scheme, sep, rest = address.partition("://")
    if sep:
        raise ValueError(f"{target!r}: give HOST:PORT without a scheme ({rest or 'HOST:PORT'}, not {scheme}://...)")
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [IPv6]:port
    if not host or not port.isdigit():
        raise ValueError(f"{target!r} is not HOST:PORT (for example 127.0.0.1:7002)")
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"{target!r}: port {port} is not between 1 and 65535")
    if any(c.isspace() or c in "/?#@" for c in host):
        raise ValueError(f"{target!r}: {host!r} is not a host name or IP address")
    return host, int(port)


def advertised(address: str, bind_host: str, advertise_host: str | None) -> str:
    """tcp://host:port as peers must dial it: the advertised host, else the bound one (a wildcard
    bind advertises this machine's name)."""
    host = advertise_host
    if host is None:
        host = socket.gethostname() if bind_host in WILDCARD_HOSTS else bind_host
    port = address.rsplit(":", 1)[1]
    return f"tcp://{bracketed(host)}:{port}"
