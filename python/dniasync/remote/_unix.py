"""Same-host links over a Unix socket: the websocket without TCP's loopback work.

A node listens on an abstract Unix socket too (Linux: a name in the network
namespace, no file, gone with the process however it ends) and names it in
its challenge with its host identity. A dialer that finds the same identity
(hostname and boot id) upgrades to the websocket through that socket;
the upgrade carries the same proof as over TCP, the node keeps its TCP
address as its name, and a socket that cannot be reached (another network
namespace, a listener gone) sends the dialer back to TCP.
"""

from __future__ import annotations

import secrets
import socket
import sys
from typing import Any

import aiohttp
from aiohttp.connector import UnixConnector

from ._shm import host_identity

__all__ = ["AbstractUnixConnector", "listen_socket", "offer", "offered_name"]


def listen_socket() -> socket.socket | None:
    """A Unix socket bound to a fresh unguessable abstract name; None where there are none."""
    if not sys.platform.startswith("linux"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0dniasync-" + secrets.token_hex(16))
    except OSError:
        sock.close()
        return None
    return sock


def offer(sock: socket.socket) -> dict[str, Any]:
    """What the challenge says about the Unix socket: its name and this host's identity."""
    name = sock.getsockname()
    return {"unix": name.decode() if isinstance(name, bytes) else name, "host": list(host_identity())}


def offered_name(challenge: dict[str, Any]) -> str | None:
    """The abstract socket a challenge offers, if the node that sent it runs on this host."""
    name = challenge.get("unix")
    if type(name) is not str or not name.startswith("\0dniasync-") or len(name) > 64:
        return None
    return name if challenge.get("host") == list(host_identity()) else None


class AbstractUnixConnector(UnixConnector):
    """Connects to an abstract Unix socket (uvloop does not take the name as a path)."""

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(self._path)  # a Unix socket connects at once, or fails at once
        except OSError as exc:
            sock.close()
            raise aiohttp.ClientConnectorError(req.connection_key, exc) from exc
        _, protocol = await self._loop.create_unix_connection(self._factory, sock=sock)
        return protocol
