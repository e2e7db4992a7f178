"""Peer authentication without CURVE: every service of a deployment holds one shared secret, and every
connection's Handshake proves it.

The client's hello carries a fresh nonce (16 random bytes and the sender's clock in seconds) and
HMAC-SHA256(secret, "hello" | nonce | role | engine id); the server admits it only if the MAC is right,
the clock within `MAX_SKEW` of its own and the nonce not seen before (so a recorded hello cannot be
replayed). The server's HandshakeAck answers HMAC(secret, "ack" | the client's nonce | its engine id), so
the client knows it reached a service of its own deployment, not an impostor. Nothing else on the
connection is signed: the proof admits a peer, as CURVE's allow-list does, and everything that peer may
do after it (a KV transfer's data connection with its token, UCX's endpoint from the ack's address) is
reached through this handshake. CURVE, when configured too, still encrypts.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import os
import secrets
import time

NONCE_BYTES = 24  # 16 random, then the clock: seconds since the epoch, 8 bytes big-endian
MAX_SKEW = 300.0  # seconds a hello's clock may differ from the server's (hosts' clocks drift apart)
MIN_SECRET_BYTES = 16
SECRET_ENV = "EPDSERVE_SECRET"
SECRET_FILE_ENV = "EPDSERVE_SECRET_FILE"


class PeerAuthError(ValueError):
    """A secret is unusable (too short, unreadable)."""


def new_secret() -> str:
    """A fresh deployment secret, printable (it travels in environment variables and Kubernetes Secrets)."""
    return secrets.token_hex(32)


def load_secret(text: str | None = None, path: str | None = None) -> bytes | None:
    """The secret from its text or a file holding it (surrounding whitespace ignored); None: neither."""
    if path:
        try:
            with open(path, "rb") as f:
                text = f.read().decode().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise PeerAuthError(f"cannot read the deployment secret from {path}: {e}") from None
    if text is None:
        return None
    secret = text.strip().encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise PeerAuthError(f"the deployment secret must be at least {MIN_SECRET_BYTES} characters "
                            "(make one with `epdserve keys --secret FILE`)")
    return secret


class PeerAuth:
    """One side's proof of the deployment secret, and the check of the other side's."""

    def __init__(self, secret: bytes, max_remembered: int = 65536):
        self._secret = secret
        # Nonces already admitted, with their clock: a hello older than MAX_SKEW is refused anyway, so one
        # is forgotten once its clock is that old (or, under a flood, when the cache is full).
        self._seen: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._max_remembered = max_remembered

    def _mac(self, *parts: bytes) -> bytes:
        mac = hmac.new(self._secret, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(4, "big") + part)
        return mac.digest()

    def hello(self, role: str, engine_id: str) -> tuple[bytes, bytes]:
        """(nonce, proof) for a Handshake."""
        nonce = os.urandom(16) + int(time.time()).to_bytes(8, "big")
        return nonce, self._mac(b"hello", nonce, role.encode(), engine_id.encode())

    def check_hello(self, nonce: bytes | None, proof: bytes | None, role: str, engine_id: str) -> str | None:
        """Why a hello is refused, or None to admit it."""
        if nonce is None or proof is None:
            return "no proof of the deployment secret (the peer is not configured with this stack's secret)"
        if len(nonce) != NONCE_BYTES or not hmac.compare_digest(
                proof, self._mac(b"hello", nonce, role.encode(), engine_id.encode())):
            return "wrong proof of the deployment secret (the peer holds another secret)"
        now = time.time()
        sent = int.from_bytes(nonce[16:], "big")
        if abs(now - sent) > MAX_SKEW:
            return f"hello's clock is {now - sent:+.0f} s off this host's (more than {MAX_SKEW:g} s): replayed or skewed"
        while self._seen and (len(self._seen) >= self._max_remembered
                              or next(iter(self._seen.values())) < now - 2 * MAX_SKEW):
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return "a replayed hello"
        self._seen[nonce] = now
        return None

    def ack(self, nonce: bytes, engine_id: str) -> bytes:
        return self._mac(b"ack", nonce, engine_id.encode())

    def check_ack(self, nonce: bytes, proof: bytes | None, engine_id: str) -> str | None:
        if proof is None or not hmac.compare_digest(proof, self.ack(nonce, engine_id)):
            return "the server did not prove this deployment's secret (not one of this stack's services)"
        return None
