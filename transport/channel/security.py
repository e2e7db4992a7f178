"""Who may listen where, and who may talk to whom: bind-address policy and ZMQ CURVE.

CURVE (pyzmq) authenticates and encrypts a connection with long-term key pairs. Key files are the
certificates written by `zmq.auth.create_certificates(folder, name)`: `name.key` holds the public
key, `name.key_secret` both keys. A server lists the public certificates of the clients it accepts
(`allowed_clients`: files, or folders of `*.key` files); a client must know the server's public
certificate. A refused client never completes its ZMQ handshake, so nothing it sends reaches a
handler.
"""
from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

logger = logging.getLogger(__name__)

# Hosts that mean "every interface". Binding one exposes the service beyond this machine, so it
# must be asked for explicitly.
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


class SecurityError(Exception):
    """A security setting is unusable (missing key file, wildcard bind not allowed...)."""


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a service out of reach of other machines (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: whatever it resolves to, it may be reachable
        return False


def bind_endpoint(host: str, port: int, allow_wildcard: bool = False) -> str:
    """The ZMQ endpoint to bind for host:port (port 0: any free port)."""
    if host in WILDCARD_HOSTS and not allow_wildcard:
        raise SecurityError(f"refusing to bind {host!r} (every interface) unless explicitly allowed")
    if not 0 <= port <= 65535:
        raise SecurityError(f"invalid port {port}")
    return f"tcp://{bracketed(host)}:{port if port else '*'}"


def bracketed(host: str) -> str:
    """`host` as it goes before `:port` in an endpoint: IPv6 literals in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclass(frozen=True, slots=True)
class CurveConfig:
    """CURVE keys of one side. Servers set `allowed_clients`; clients set `server_public_key_file`."""

    secret_key_file: Path  # this side's `*.key_secret` certificate
    server_public_key_file: Path | None = None  # client side: the server's `*.key` certificate
    allowed_clients: tuple[Path, ...] = field(default=())  # server side: client `*.key` files or folders
    allow_any_client: bool = False  # server side: encrypt, but accept any client key

    def keypair(self) -> tuple[bytes, bytes]:
        public, secret = _load(self.secret_key_file)
        if secret is None:
            raise SecurityError(f"{self.secret_key_file} holds no secret key")
        return public, secret

    def server_public_key(self) -> bytes:
        if self.server_public_key_file is None:
            raise SecurityError("a CURVE client needs the server's public key file")
        return _load(self.server_public_key_file)[0]

    def allowed_client_keys(self) -> frozenset[bytes]:
        keys = set()
        for path in self.allowed_clients:
            files = sorted(Path(path).glob("*.key")) if Path(path).is_dir() else [Path(path)]
            keys.update(_load(f)[0] for f in files)
        return frozenset(keys)


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise SecurityError(f"cannot load CURVE certificate {path}: {e}") from e


def configure_client(socket: zmq.Socket, curve: CurveConfig | None) -> None:
    if curve is None:
        return
    socket.curve_publickey, socket.curve_secretkey = curve.keypair()
    socket.curve_serverkey = curve.server_public_key()


class ClientAllowList:
    """ZAP callback: admits the listed public keys and counts the rest."""

    def __init__(self, keys: frozenset[bytes]):
        self.keys = keys
        self.num_denied = 0  # exported as a metric by the service

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.num_denied += 1
        logger.warning("CURVE client key %s refused (not in the allow-list)", key.decode(errors="replace"))
        return False


def configure_server(
    socket: zmq.Socket, context: zmq.Context, curve: CurveConfig | None
) -> tuple[AsyncioAuthenticator | None, ClientAllowList | None]:
    """Make `socket` a CURVE server; start the ZAP authenticator of its (private) context.

    ZAP handlers are per context and every CURVE server socket of the context consults it, so a
    server with an allow-list needs a context of its own. Must run inside the event loop.
    """
    if curve is None:
        return None, None
    socket.curve_publickey, socket.curve_secretkey = curve.keypair()
    socket.curve_server = True
    if curve.allow_any_client:
        return None, None  # no ZAP handler: libzmq admits every client that completes CURVE
    allow_list = ClientAllowList(curve.allowed_client_keys())
    if not allow_list.keys:
        raise SecurityError("CURVE server has an empty client allow-list (set allow_any_client to accept any)")
    auth = AsyncioAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=allow_list)
    return auth, allow_list
