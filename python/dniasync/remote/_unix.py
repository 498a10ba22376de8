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

__all__ = ["AbstractUnixConnector", "listen_socket", "offer", "offered_name", "socket_name"]


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


def socket_name(sock: socket.socket) -> str:
    name = sock.getsockname()
    return name.decode() if isinstance(name, bytes) else str(name)


def offer(name: str, transport: Any) -> dict[str, Any]:
    """What a challenge answered on ``transport`` says about the Unix socket ``name``: the name, this
    host's identity, and the TCP address the challenge arrived at."""
    local = transport.get_extra_info("sockname") if transport is not None else None
    if not (isinstance(local, tuple) and len(local) >= 2):
        return {}
    return {
        "unix": name,
        "host": list(host_identity()),
        "tcp": [str(local[0]), int(local[1])],
    }


def offered_name(challenge: dict[str, Any], dialed: tuple[str, int]) -> str | None:
    """The abstract socket a challenge offers, if the node that sent it runs on this host and the
    challenge came straight from it: it arrived at the address this node dialed, so no proxy sits
    between them (a fault proxy must keep carrying the link). Else None: TCP."""
    name = challenge.get("unix")
    if type(name) is not str or not name.startswith("\0dniasync-") or len(name) > 64:
        return None
    if challenge.get("host") != list(host_identity()):
        return None
    return name if challenge.get("tcp") == [dialed[0], dialed[1]] else None


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
