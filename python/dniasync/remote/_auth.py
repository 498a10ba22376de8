"""Cluster auth: an HMAC challenge on the websocket upgrade. The token never travels.

1. The dialer sends ``GET /dniasync/challenge?cn=<client nonce>``. The server
   answers a *server nonce* (time, random, and a MAC under a per-process key,
   so issuing one stores nothing) and its own proof
   ``HMAC(token, "server" | cn | sn | server node)``: the dialer checks it and
   so knows it talks to a holder of the token.
2. The dialer upgrades ``GET /dniasync/ws`` with headers naming itself and
   ``HMAC(token, "client" | sn | cn | client node | server node | incarnation)``.
   The server checks the nonce's MAC and age, the proof, and that the nonce
   was never used before (used nonces are kept until they expire, in a
   bounded table), all before the upgrade: a refused dialer creates no state.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["Authenticator", "read_token_file"]

_NONCE_BYTES = 16
_MAC_BYTES = 16


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def read_token_file(path: str) -> bytes:
    """The cluster token in ``path`` (surrounding whitespace ignored); at least 16 bytes."""
    with open(path, "rb") as fh:
        token = fh.read().strip()
    if len(token) < 16:
        raise ValueError(f"token file {path} holds {len(token)} bytes; use at least 16 random bytes")
    return token


class Authenticator:
    """Issues and checks challenges for one node. ``token=None`` disables auth (loopback only)."""

    def __init__(
        self,
        token: bytes | None,
        *,
        nonce_ttl_s: float = 30.0,
        max_used_nonces: int = 100_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.token = token
        self.nonce_ttl_s = nonce_ttl_s
        self.max_used_nonces = max_used_nonces
        self._clock = clock
        self._key = secrets.token_bytes(32)  # MACs server nonces; never leaves the process
        self._used: OrderedDict[bytes, float] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.token is not None

    # -- both sides ----------------------------------------------------------
    def _mac(self, *parts: bytes) -> bytes:
        assert self.token is not None
        return hmac.new(self.token, b"\0".join(parts), hashlib.sha256).digest()

    @staticmethod
    def client_nonce() -> str:
        return _b64(os.urandom(_NONCE_BYTES))

    def server_proof(self, client_nonce: str, server_nonce: str, server_node: str) -> str:
        return _b64(self._mac(b"dniasync-v1-server", client_nonce.encode(), server_nonce.encode(), server_node.encode()))

    def client_proof(
        self, server_nonce: str, client_nonce: str, client_node: str, server_node: str, incarnation: str
    ) -> str:
        return _b64(
            self._mac(
                b"dniasync-v1-client",
                server_nonce.encode(),
                client_nonce.encode(),
                client_node.encode(),
                server_node.encode(),
                incarnation.encode(),
            )
        )

    # -- server side -----------------------------------------------------------
    def check_bearer(self, authorization: str) -> bool:
        """True if an ``Authorization`` header carries the token itself (``Bearer <token>``).

        For operators' HTTP routes (``/metrics``, the live page) on a node that listens
        beyond loopback: Prometheus sends it from ``authorization.credentials_file``.
        """
        if self.token is None:
            return False
        scheme, _, credentials = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), self.token)

    def issue_server_nonce(self) -> str:
        """A fresh server nonce; stateless (time + random + MAC under a process key)."""
        stamp = int(self._clock() * 1000).to_bytes(8, "big")
        body = stamp + os.urandom(_NONCE_BYTES)
        mac = hmac.new(self._key, body, hashlib.sha256).digest()[:_MAC_BYTES]
        return _b64(body + mac)

    def check_client(
        self, server_nonce: str, client_nonce: str, client_node: str, server_node: str, incarnation: str, proof: str
    ) -> str | None:
        """None if the dialer proved the token with a fresh, unused nonce; else why not."""
        if self.token is None:
            return None
        try:
            raw = _unb64(server_nonce)
        except (ValueError, TypeError):
            return "malformed server nonce"
        if len(raw) != 8 + _NONCE_BYTES + _MAC_BYTES:
            return "malformed server nonce"
        body, mac = raw[:-_MAC_BYTES], raw[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, hmac.new(self._key, body, hashlib.sha256).digest()[:_MAC_BYTES]):
            return "server nonce was not issued by this node"
        now = self._clock()
        issued = int.from_bytes(body[:8], "big") / 1000
        if not (issued - 1.0 <= now <= issued + self.nonce_ttl_s):
            return "server nonce expired"
        expected = self.client_proof(server_nonce, client_nonce, client_node, server_node, incarnation)
        if not hmac.compare_digest(expected.encode(), proof.encode()):
            return "wrong proof (token mismatch)"
        self._forget_expired(now)
        if body in self._used:
            return "replayed handshake (server nonce already used)"
        if len(self._used) >= self.max_used_nonces:
            return "too many handshakes in flight; retry later"
        self._used[body] = issued + self.nonce_ttl_s
        return None

    def _forget_expired(self, now: float) -> None:
        used = self._used
        while used:
            oldest, expires = next(iter(used.items()))
            if expires > now:
                break
            del used[oldest]
