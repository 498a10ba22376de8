"""A userspace TCP fault proxy: one link between nodes that can be slowed, reset or black-holed.

``tc netem`` needs privileges and a network namespace; an asyncio forwarder
needs neither. A :class:`FaultProxy` listens on its own port and forwards
every connection to ``target``. Faults apply to the whole link:

- ``delay``: every chunk waits ``delay_s`` before it is forwarded (both ways);
- ``reset``: every open connection is aborted (RST on both sides);
- ``blackhole``: for ``seconds``, nothing passes either way and new connections
  are held before they reach the target; bytes are held, not dropped, as TCP
  would retransmit them, so a connection that outlives the hole goes on intact.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field

__all__ = ["FaultProxy", "LinkState"]

log = logging.getLogger("dniasync.chaos.proxy")

CHUNK = 1 << 16


@dataclass
class LinkState:
    """The faults a link is under now."""

    delay_s: float = 0.0
    delay_until: float = 0.0
    hole_until: float = 0.0
    hole_open: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.hole_open.set()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a reset link does, rather than an orderly FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except OSError:
            pass
    writer.transport.abort()


class FaultProxy:
    """Forwards ``listen`` -> ``target``; :meth:`delay`, :meth:`reset` and :meth:`blackhole` break the link."""

    def __init__(self, name: str, target: str, listen: str = "127.0.0.1:0") -> None:
        self.name = name
        self.target = target
        self._listen = listen
        self.address = ""
        self.state = LinkState()
        self.connections = 0
        self.accepted = 0
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._hole_timer: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        host, _, port = self._listen.rpartition(":")
        self._server = await asyncio.start_server(self._accept, host, int(port), reuse_address=True)
        bound = self._server.sockets[0].getsockname()
        self.address = f"{bound[0]}:{bound[1]}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.reset()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    # -- faults ----------------------------------------------------------------------
    def delay(self, delay_s: float, seconds: float) -> None:
        self.state.delay_s = delay_s
        self.state.delay_until = time.monotonic() + seconds

    def reset(self) -> int:
        """Abort every open connection; returns how many."""
        pairs = list(self._pairs)
        for a, b in pairs:
            _abort(a)
            _abort(b)
        self._pairs.clear()
        return len(pairs)

    def blackhole(self, seconds: float) -> None:
        state = self.state
        state.hole_until = max(state.hole_until, time.monotonic() + seconds)
        state.hole_open.clear()
        if self._hole_timer is not None:
            self._hole_timer.cancel()
        self._hole_timer = asyncio.get_running_loop().call_at(
            asyncio.get_running_loop().time() + (state.hole_until - time.monotonic()), state.hole_open.set)

    def clear(self) -> None:
        self.state.delay_s = 0.0
        self.state.hole_until = 0.0
        self.state.hole_open.set()

    # -- forwarding --------------------------------------------------------------------
    async def _gate(self) -> None:
        state = self.state
        await state.hole_open.wait()
        if state.delay_s and time.monotonic() < state.delay_until:
            await asyncio.sleep(state.delay_s)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            await self._gate()
            host, _, port = self.target.rpartition(":")
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            _abort(writer)
            return
        pair = (writer, up_writer)
        self._pairs.add(pair)
        self.connections += 1
        try:
            async with asyncio.TaskGroup() as tg:
                self._track(tg.create_task(self._pump(reader, up_writer)))
                self._track(tg.create_task(self._pump(up_reader, writer)))
        except* (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self.connections -= 1
            self._pairs.discard(pair)
            for w in pair:
                w.close()

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(CHUNK):
            await self._gate()
            if writer.transport.is_closing():
                return
            writer.write(data)
            await writer.drain()
        if not writer.transport.is_closing():
            writer.write_eof() if writer.can_write_eof() else writer.close()
