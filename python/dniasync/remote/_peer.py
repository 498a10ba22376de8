"""A peer node as this node sees it, and the ``Destination`` of actors living there."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from typing import TYPE_CHECKING, Any, Final

from ..actors import ActorUnreachable, AskTimeout, MailboxFull
from ._codec import OP_ASK, OP_FAIL, OP_REPLY, OP_TELL, Encoded, Frame, encode
from ._connection import Connection
from ._reply import remote_error

if TYPE_CHECKING:
    from ._transport import WebSocketTransport

log = logging.getLogger("dniasync.remote")

NEW: Final = "new"  # never connected yet
UP: Final = "up"
DOWN: Final = "down"  # lost or unreachable; reconnecting in the background


class Peer:
    """Another node: its current connection, its state, the asks waiting on it."""

    def __init__(self, transport: WebSocketTransport, node: str) -> None:
        self.transport = transport
        self.node = node
        self.state = NEW
        self.reason = ""
        self.conn: Connection | None = None
        self.pending: dict[int, tuple[asyncio.Future[Any], str, float, float]] = {}
        """corr -> (reply future, actor address, deadline on the loop clock, timeout)."""
        self.backlog: list[tuple[int, Encoded]] = []  # tell_nowait before the first connection
        self.attempted = asyncio.Event()  # set after each connection attempt, good or bad
        self.connector: asyncio.Task[None] | None = None
        self.forgotten = False

    def __repr__(self) -> str:
        return f"<Peer {self.node} {self.state}>"

    # -- connection state ------------------------------------------------------------
    async def connection(self, address: str) -> Connection:
        """The live connection, connecting first if never connected; else ``ActorUnreachable``."""
        conn = self.conn
        if conn is not None:
            return conn
        if self.state == NEW:
            self.transport.ensure_connecting(self)
            try:
                async with asyncio.timeout(self.transport.settings.connect_timeout_s):
                    await self.attempted.wait()
            except TimeoutError:
                pass
            conn = self.conn
            if conn is not None:
                return conn
        raise ActorUnreachable(address, f"node {self.node} is unreachable ({self.reason or self.state})")

    def up(self, conn: Connection) -> None:
        was = self.state
        self.conn = conn
        self.state = UP
        self.reason = ""
        self.attempted.set()
        backlog, self.backlog = self.backlog, []
        for op, frame in backlog:
            conn.send_nowait(op, frame, bounded=False)
        if was != UP:
            self.transport.notify(self.node, True)

    def down(self, reason: str) -> None:
        """The connection is gone: fail every waiting ask at once."""
        self.conn = None
        was = self.state
        self.state = DOWN
        self.reason = reason
        self.attempted.set()
        self.fail_pending(reason)
        self.transport.counters.dropped_tells += len(self.backlog)
        self.backlog.clear()
        if was == UP:
            self.transport.notify(self.node, False)

    def fail_pending(self, reason: str) -> None:
        pending, self.pending = self.pending, {}
        for future, address, _, _ in pending.values():
            if not future.done():
                future.set_exception(ActorUnreachable(address, f"node {self.node} went down: {reason}"))

    # -- replies -------------------------------------------------------------------
    def resolve(self, frame: Frame) -> None:
        entry = self.pending.pop(frame.corr, None)
        if entry is None:
            return  # the ask timed out already
        future, address, _, _ = entry
        if future.done():
            return
        if frame.error is not None:
            future.set_exception(remote_error(address, "DecodeError", str(frame.error)))
        elif frame.op == OP_REPLY:
            future.set_result(frame.value)
        else:
            remote_type, detail = frame.value
            future.set_exception(remote_error(address, remote_type, detail))

    def reply(self, corr: int, value: Any, exc: BaseException | None) -> None:
        """Send the outcome of a local handler back to the asking node."""
        if exc is None:
            try:
                self.send_reply(OP_REPLY, encode(OP_REPLY, "", corr, value))
                return
            except Exception as encode_exc:  # an unsendable return value is the handler's error
                exc = encode_exc
        self.send_reply(OP_FAIL, encode(OP_FAIL, "", corr, [type(exc).__name__, str(exc)]))

    def send_reply(self, op: int, frame: Encoded) -> None:
        conn = self.conn
        if conn is not None:
            conn.send_reply(op, frame)


_corr_ids = itertools.count(1)


_NEVER = float("inf")


def expire_asks(peers: list[Peer], now: float) -> bool:
    """Fail the asks whose deadline passed with ``AskTimeout``; True if others still wait."""
    waiting = False
    for peer in peers:
        pending = peer.pending
        for corr, (future, address, deadline, timeout) in list(pending.items()):
            if deadline <= now:
                del pending[corr]
                if not future.done():
                    future.set_exception(AskTimeout(address, timeout))
            else:
                waiting = True
    return waiting


class RemoteDestination:
    """Where a ref to an actor on another node delivers (see ``actors.Destination``).

    Ask timeouts are enforced by one sweeper per node, every ``ASK_TICK_S``
    (20 ms): an ``AskTimeout`` comes at most that much after the deadline.
    """

    __slots__ = ("transport", "address", "name", "node")

    def __init__(self, transport: WebSocketTransport, address: str, name: str, node: str) -> None:
        self.transport = transport
        self.address = address
        self.name = name
        self.node = node

    @property
    def alive(self) -> bool:
        return self.transport.peer(self.node).state != DOWN

    def unsent_bytes(self) -> int:
        """Bytes to this node not yet taken by it: its connection's (:meth:`Connection.unsent_bytes`), or the
        payloads waiting for the first connection."""
        peer = self.transport.known_peer(self.node)
        if peer is None:
            return 0
        conn = peer.conn
        if conn is None:
            return sum(frame.payload_len for _, frame in peer.backlog)
        return conn.unsent_bytes()

    def silent_for(self) -> float:
        """Seconds since a frame last came from this node on its connection; ``inf`` without one."""
        peer = self.transport.known_peer(self.node)
        conn = None if peer is None else peer.conn
        if conn is None:
            return math.inf
        return max(0.0, conn.loop.time() - conn.last_rx)

    async def ask(self, msg: Any, timeout: float | None) -> Any:
        corr = next(_corr_ids)
        frame = encode(OP_ASK, self.name, corr, msg)
        transport = self.transport
        peer = transport.peer(self.node)
        conn = peer.conn or await peer.connection(self.address)
        future: asyncio.Future[Any] = conn.loop.create_future()
        pending = peer.pending
        if timeout is None:
            pending[corr] = (future, self.address, _NEVER, 0.0)
        else:
            # one sweeper per node expires asks (a timer per ask costs more than the round trip)
            pending[corr] = (future, self.address, conn.loop.time() + timeout, timeout)
            transport.watch_deadlines()
        latency = transport.ask_latency
        started = time.perf_counter() if latency is not None else 0.0  # uvloop's loop.time() is in ms
        try:
            if conn.can_write_now(frame):
                conn.write_now(conn.inline(OP_ASK, frame))
            else:
                await conn.send(OP_ASK, frame)
            value = await future
            if latency is not None:
                latency.observe(type(msg), time.perf_counter() - started)
            return value
        except (ConnectionError, RuntimeError) as exc:
            raise ActorUnreachable(self.address, f"send to {self.node} failed: {exc}") from None
        finally:
            pending.pop(corr, None)

    async def tell(self, msg: Any) -> None:
        frame = encode(OP_TELL, self.name, 0, msg)
        peer = self.transport.peer(self.node)
        try:
            conn = peer.conn or await peer.connection(self.address)
            if conn.can_write_now(frame):
                if not conn.write_now(conn.inline(OP_TELL, frame)):
                    raise ConnectionError("connection lost")
                await conn.drained()  # backpressure: returns at once unless the socket is full
            else:
                await conn.send(OP_TELL, frame)
        except (ActorUnreachable, ConnectionError, RuntimeError) as exc:
            self.transport.counters.dropped_tells += 1
            log.debug("tell to %s dropped: %s", self.address, exc)

    def tell_nowait(self, msg: Any) -> None:
        frame = encode(OP_TELL, self.name, 0, msg)
        peer = self.transport.peer(self.node)
        conn = peer.conn
        if conn is not None:
            conn.send_nowait(OP_TELL, frame)
        elif peer.state == NEW:
            if len(peer.backlog) >= self.transport.settings.outbox_size:
                raise MailboxFull(f"backlog to {self.node} full while connecting")
            peer.backlog.append((OP_TELL, frame))
            self.transport.ensure_connecting(peer)
        else:
            self.transport.counters.dropped_tells += 1
