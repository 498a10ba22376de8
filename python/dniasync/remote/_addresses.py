"""Node addresses (``host:port``, loopback or not) and refs to local actors that are gone."""

from __future__ import annotations

import ipaddress
import math
from typing import Any

from ..actors import ActorStopped

__all__ = ["DeadDestination", "is_loopback", "parse_hostport"]

_NOT_IN_HOST = frozenset("/?#@\\ \t\r\n%")


def parse_hostport(text: str) -> tuple[str, int]:
    """``"host:port"`` (``[v6]:port`` for IPv6) -> ``(host, port)``; ``ValueError`` if malformed."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if any(c in _NOT_IN_HOST for c in host) or len(host) > 255:
        raise ValueError(f"not a host name: {host!r}")
    return host.strip("[]"), int(port_text)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class DeadDestination:
    """A ref to a local actor that is no longer running (received inside a message)."""

    def __init__(self, address: str) -> None:
        self.address = address

    @property
    def alive(self) -> bool:
        return False

    async def ask(self, msg: Any, timeout: float | None) -> Any:
        raise ActorStopped(self.address)

    async def tell(self, msg: Any) -> None:
        raise ActorStopped(self.address)

    def tell_nowait(self, msg: Any) -> None:
        raise ActorStopped(self.address)

    def unsent_bytes(self) -> int:
        return 0

    def silent_for(self) -> float:
        return math.inf
