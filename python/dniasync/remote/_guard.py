"""The listening socket's guard: connection caps and deadlines below aiohttp.

aiohttp holds a connection open for as long as its client likes while the
request headers trickle in (slowloris), and accepts as many as the process
has file descriptors. Every accepted connection therefore passes through a
:class:`ConnectionGuard` first:

- at most ``max_connections`` open in total, and ``max_connections_per_address``
  from one peer address that are not members' websockets (a one-host cluster
  is all 127.0.0.1); at a cap, the oldest connection that is not an
  authenticated member's websocket makes room (so a flood of idle or slow
  clients cannot lock a member out), and if there is none the newcomer is
  reset at once;
- a connection whose request headers are not complete ``header_timeout_s``
  after it was accepted, or after its previous response (an idle keep-alive),
  is closed;
- a member's websocket, once upgraded (and authenticated when the node has a
  token), is exempt from the deadline; the heartbeat watches it instead.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.typedefs import Middleware

from ._settings import RemoteCounters, RemoteSettings

__all__ = ["ConnectionGuard", "GuardedSite", "serve_guarded"]

log = logging.getLogger("dniasync.remote")

_TRANSPORT_KEY = "dniasync.guard.entry"


class _Entry:
    """One accepted connection as the guard tracks it."""

    __slots__ = ("address", "transport", "deadline", "trusted", "busy")

    def __init__(self, address: str, transport: asyncio.Transport) -> None:
        self.address = address
        self.transport = transport
        self.deadline: asyncio.TimerHandle | None = None
        self.trusted = False
        self.busy = 0  # requests being handled on this connection now


class ConnectionGuard:
    """Counts, caps and times out the connections of one listener."""

    def __init__(self, settings: RemoteSettings, counters: RemoteCounters) -> None:
        self.settings = settings
        self.counters = counters
        self._untrusted: OrderedDict[asyncio.Transport, _Entry] = OrderedDict()  # oldest first
        self._entries: dict[asyncio.Transport, _Entry] = {}
        self._per_address: dict[str, int] = {}

    @property
    def open_connections(self) -> int:
        return len(self._entries)

    def connections_from(self, address: str) -> int:
        """Connections open from ``address`` that are not members' websockets."""
        return self._per_address.get(address, 0)

    # -- accept / lose ----------------------------------------------------------------
    def admit(self, transport: asyncio.Transport) -> _Entry | None:
        """A new connection: its entry, or None if it was refused (and reset)."""
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        settings = self.settings
        if self._per_address.get(address, 0) >= settings.max_connections_per_address:
            self._make_room(address)
        if len(self._entries) >= settings.max_connections and self._per_address.get(
            address, 0
        ) < settings.max_connections_per_address:
            self._make_room(None)
        if (
            len(self._entries) >= settings.max_connections
            or self._per_address.get(address, 0) >= settings.max_connections_per_address
        ):
            self.counters.connections_refused += 1
            transport.abort()
            return None
        entry = _Entry(address, transport)
        self._entries[transport] = entry
        self._untrusted[transport] = entry
        self._per_address[address] = self._per_address.get(address, 0) + 1
        self._arm(entry)
        return entry

    def lost(self, entry: _Entry) -> None:
        if self._entries.pop(entry.transport, None) is None:
            return
        if entry.deadline is not None:
            entry.deadline.cancel()
            entry.deadline = None
        if self._untrusted.pop(entry.transport, None) is not None:
            self._uncount(entry.address)

    def _uncount(self, address: str) -> None:
        left = self._per_address[address] - 1
        if left:
            self._per_address[address] = left
        else:
            del self._per_address[address]

    def _make_room(self, address: str | None) -> None:
        """Drop the oldest untrusted connection (from ``address`` if given) that is not mid-request."""
        for entry in self._untrusted.values():
            if (address is None or entry.address == address) and not entry.busy:
                self.counters.connections_evicted += 1
                self._drop(entry)
                return

    def _drop(self, entry: _Entry) -> None:
        transport = entry.transport
        self.lost(entry)  # the slot is free now, before the loop reports the close
        if transport.get_write_buffer_size():
            transport.abort()  # a client that does not read must not keep its socket
        else:
            transport.close()

    # -- deadlines ---------------------------------------------------------------------
    def _arm(self, entry: _Entry) -> None:
        if entry.deadline is not None:
            entry.deadline.cancel()
        loop = asyncio.get_running_loop()
        entry.deadline = loop.call_later(self.settings.header_timeout_s, self._expire, entry)

    def _expire(self, entry: _Entry) -> None:
        entry.deadline = None
        if entry.transport in self._entries:
            self.counters.connections_timed_out += 1
            self._drop(entry)

    def request_started(self, transport: Any) -> _Entry | None:
        """The headers of a request arrived: no deadline while it is handled."""
        entry = self._entries.get(transport)
        if entry is not None:
            entry.busy += 1
            if entry.deadline is not None:
                entry.deadline.cancel()
                entry.deadline = None
        return entry

    def request_done(self, entry: _Entry) -> None:
        """A response went out: the next request's headers are due within the timeout."""
        entry.busy -= 1
        if not entry.busy and not entry.trusted and entry.transport in self._entries:
            self._untrusted.move_to_end(entry.transport)
            self._arm(entry)

    def trust(self, transport: Any) -> None:
        """``transport`` carries a member's websocket now: no deadline, never evicted."""
        entry = self._entries.get(transport)
        if entry is not None and not entry.trusted:
            entry.trusted = True
            if entry.deadline is not None:
                entry.deadline.cancel()
                entry.deadline = None
            if self._untrusted.pop(transport, None) is not None:
                self._uncount(entry.address)

    def middleware(self) -> Middleware:
        """The aiohttp middleware that tells the guard where requests start and end."""
        guard = self

        @web.middleware
        async def guard_requests(
            request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
        ) -> web.StreamResponse:
            entry = guard.request_started(request.transport)
            try:
                return await handler(request)
            finally:
                if entry is not None:
                    guard.request_done(entry)

        return guard_requests

    def protocol_factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        def make() -> asyncio.Protocol:
            return _GuardedProtocol(self, inner)

        return make


class _GuardedProtocol(asyncio.Protocol):
    """Admits the connection through the guard, then hands every event to aiohttp's protocol."""

    __slots__ = ("_guard", "_make_inner", "_inner", "_entry")

    def __init__(self, guard: ConnectionGuard, make_inner: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._make_inner = make_inner
        self._inner: asyncio.Protocol | None = None
        self._entry: _Entry | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._entry = self._guard.admit(cast(asyncio.Transport, transport))  # uvloop's is no subclass
        if self._entry is None:
            return  # refused: aiohttp never sees it
        self._inner = self._make_inner()
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._entry is not None:
            self._guard.lost(self._entry)
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


class GuardedSite(web.SockSite):
    """``web.SockSite`` whose every connection passes the guard first."""

    def __init__(self, runner: web.BaseRunner, sock: Any, guard: ConnectionGuard, *, backlog: int = 1024) -> None:
        super().__init__(runner, sock, backlog=backlog)
        self._guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.protocol_factory(server), sock=self._sock, backlog=self._backlog
        )


async def serve_guarded(
    app: web.Application, listen: tuple[str, int], settings: RemoteSettings, counters: RemoteCounters
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on ``listen`` behind its own guard (same caps and timeouts); the runner and the port.

    For a node's operator listener (``--metrics-listen``): ``/metrics`` and the
    live page without the token, on an address the operator chose.
    """
    guard = ConnectionGuard(settings, counters)
    app.middlewares.insert(0, guard.middleware())
    host, port = listen
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=settings.close_timeout_s)
    await runner.setup()
    await GuardedSite(runner, sock, guard).start()
    return runner, int(sock.getsockname()[1])
