"""One websocket to one peer node: reads, writes, dispatches frames."""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import sys
import termios
from collections import deque
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
from aiohttp import web

from ..actors import ActorNotFound, ActorStopped, MailboxFull
from . import _shm
from ._codec import FLAG_SHM, OP_ASK, OP_FAIL, OP_PING, OP_REPLY, OP_SHM, OP_TELL, Decoder, Encoded, Frame, encode
from ._errors import DecodeError
from ._pump import hook_parser, queue_has_news, take
from ._reply import ReplySink

if TYPE_CHECKING:
    from ._peer import Peer
    from ._transport import WebSocketTransport

log = logging.getLogger("dniasync.remote")

WebSocket = web.WebSocketResponse | aiohttp.ClientWebSocketResponse

_PING = encode(OP_PING, "", 0, None)
_PING_STARTING = encode(OP_PING, "starting", 0, None)
"""The heartbeat of a node still starting up: its peers allow it ``startup_grace_s`` of silence."""
_SIOCOUTQ: int | None = getattr(termios, "TIOCOUTQ", None) if sys.platform.startswith("linux") else None
"""ioctl: the bytes in a socket's send queue not yet acknowledged by the peer (Linux's SIOCOUTQ = TIOCOUTQ)."""


class Connection:
    """A websocket to ``peer``; ``dialer`` is the node that opened it."""

    def __init__(
        self, transport: WebSocketTransport, peer: Peer, ws: WebSocket, incarnation: str, dialer: str
    ) -> None:
        self.transport = transport
        self.peer = peer
        self.ws = ws
        self.incarnation = incarnation
        self.dialer = dialer
        self.loop = asyncio.get_running_loop()
        self.decoder = Decoder(transport.resolve_ref, transport.settings.limits)
        self.outbox: deque[tuple[int, Encoded]] = deque()
        self.last_rx = self.loop.time()
        self.closed = False
        self.retired = False
        self.peer_starting = False
        """The peer said it is still starting (upgrade header, challenge, or its last heartbeat)."""
        self._wake = asyncio.Event()
        self._stream_ids = itertools.count(1)
        self._part_bytes = transport.settings.limits.part_bytes
        self._overflow: dict[str, deque[tuple[Any, ReplySink | None]]] = {}
        self._room = asyncio.Event()
        self._draining = False
        self._drained = asyncio.Event()
        self._space = asyncio.Event()
        self.ring: _shm.SendRing | None = None
        """This node's shared-memory ring for payloads to the peer; used once the peer accepted it."""
        self._ring_freed = asyncio.Event()
        self._shm_min = transport.settings.shm_min_bytes
        self._queue: Any = None
        """aiohttp's message queue of this websocket, once frames are handled as they are parsed."""
        self._parked = False
        """The read loop waits on ``_kick``: frames are handled where aiohttp parses them."""
        self._kick = asyncio.Event()
        self._rx_pause = False
        self._rx_error: str | None = None
        # the socket under the websocket, for unsent_bytes (aiohttp keeps its transport on the frame writer)
        self._socket_transport: asyncio.Transport | None = getattr(getattr(ws, "_writer", None), "transport", None)
        sock = self._socket_transport.get_extra_info("socket") if self._socket_transport is not None else None
        self._fd: int | None = sock.fileno() if sock is not None else None
        self.sender: asyncio.Task[None] = transport.spawn_task(self._send_loop(), f"ws-send:{peer.node}")
        if transport.settings.shm and _shm.available():
            self._offer_ring()

    def __repr__(self) -> str:
        return f"<Connection to {self.peer.node} dialed by {self.dialer}{' closed' if self.closed else ''}>"

    # -- the shared-memory ring ------------------------------------------------------
    def _offer_ring(self) -> None:
        try:
            ring = _shm.SendRing(self.transport.settings.shm_ring_bytes, f"{self.transport.address}>{self.peer.node}")
        except OSError as exc:  # no memfd here, or out of memory: the socket carries everything
            log.debug("no shared-memory ring to %s: %s", self.peer.node, exc)
            return
        self.ring = ring
        self.send_nowait(OP_SHM, encode(OP_SHM, "", 0, {"offer": ring.offer()}), bounded=False)

    def _ring_fits(self, frame: Encoded) -> bool:
        ring = self.ring
        return (
            ring is not None and ring.accepted and self._shm_min <= frame.payload_len <= ring.max_payload
        )

    def inline(self, op: int, frame: Encoded) -> bytes:
        """``frame`` as one websocket message: its payload in the ring if it fits there, else inline."""
        if frame.payload_len < self._shm_min:
            return frame.single(op)
        return (self._ring_fits(frame) and self._place(op, frame)) or frame.single(op)

    def _place(self, op: int, frame: Encoded) -> bytes | None:
        """The ring frame of ``frame`` with its payload copied into the ring; None if it has no room."""
        assert self.ring is not None
        placed = self.ring.place(frame.buffers, frame.payload_len)
        counters = self.transport.counters
        if placed is None:
            counters.shm_fallbacks += 1
            return None
        counters.shm_frames_out += 1
        counters.shm_bytes_out += frame.payload_len
        return frame.in_ring(op, *placed)

    async def _wait_ring(self, ring: _shm.SendRing) -> None:
        """Wait for the peer to free the ring (it has read everything sent before our ``want``)."""
        if not ring.wanted:
            ring.wanted = True
            self._ring_freed.clear()
            await self.ws.send_bytes(encode(OP_SHM, "", 0, {"want": True}).single(OP_SHM))
        while ring.wanted and not self.closed:
            await self._ring_freed.wait()
            self._ring_freed.clear()

    def _shm_control(self, body: Any) -> None:
        """Offers, answers and releases of the rings of this connection."""
        ring = self.ring
        kind: Any = ""
        value: Any = None
        if type(body) is dict and len(body) == 1:
            kind, value = next(iter(body.items()))
        if kind == "release" and ring is not None and ring.release(value):
            self._ring_freed.set()
        elif kind == "want" and self.decoder.ring is not None:
            self._release(self.decoder.ring)
        elif kind == "offer" and self.decoder.ring is None:
            answer: dict[str, Any]
            try:
                if not self.transport.settings.shm:
                    raise ValueError("shared memory is off on this node")
                self.decoder.ring = _shm.PeerRing.open(value)
                answer = {"accept": value["nonce"]}
            except ValueError as exc:
                log.debug("payloads from %s take the socket: %s", self.peer.node, exc)
                answer = {"refuse": str(exc)}
            self.send_nowait(OP_SHM, encode(OP_SHM, "", 0, answer), bounded=False)
        elif kind == "accept" and ring is not None and ring.accept(value):
            log.debug("payloads to %s go through shared memory", self.peer.node)
        elif kind == "refuse" and ring is not None and not ring.accepted:
            self.ring = None
            ring.close()
        else:
            raise DecodeError(f"unexpected shared-memory control frame {str(body)[:80]!r}")

    def _release(self, ring: _shm.PeerRing) -> None:
        if ring.consumed != ring.acked:
            ring.acked = ring.consumed
            self.send_nowait(OP_SHM, encode(OP_SHM, "", 0, {"release": ring.consumed}), bounded=False)

    # -- sending ---------------------------------------------------------------
    async def send(self, op: int, frame: Encoded) -> None:
        """Write a frame now (after whatever is queued), waiting on backpressure."""
        outbox = self.outbox
        if outbox or self._draining:  # keep order behind queued frames
            outbox.append((op, frame))
            self._wake.set()
            high = self.transport.settings.outbox_size // 2
            while len(outbox) > high and not self.closed:  # backpressure on a busy connection
                self._space.clear()
                await self._space.wait()
            return
        await self._write(op, frame)

    def can_write_now(self, frame: Encoded) -> bool:
        """True if ``frame`` may be written synchronously (small on the wire, nothing queued before it)."""
        return (
            not self.outbox
            and not self._draining
            and (frame.payload_len <= self._part_bytes or self._ring_has_room(frame))
        )

    def _ring_has_room(self, frame: Encoded) -> bool:
        ring = self.ring
        return self._ring_fits(frame) and ring is not None and ring.has_room(frame.payload_len)

    def unsent_bytes(self) -> int:
        """Bytes written to this connection that the peer has not taken yet: the payloads in the outbox (the
        frame being written included), the event loop transport's buffer, and the kernel's send queue (sent
        but not acknowledged: ``SIOCOUTQ``, Linux; 0 where it cannot be read). Any thread may call it."""
        queued = sum(frame.payload_len for _, frame in list(self.outbox))
        transport = self._socket_transport
        if transport is None:
            return queued
        try:
            queued += transport.get_write_buffer_size()
        except (AttributeError, RuntimeError):
            pass
        if self._fd is not None and _SIOCOUTQ is not None:
            try:
                out = fcntl.ioctl(self._fd, _SIOCOUTQ, b"\0\0\0\0")
                queued += int.from_bytes(out, sys.byteorder, signed=True)
            except OSError:
                pass  # closed meanwhile
        return queued

    async def drained(self) -> None:
        """Wait until a write that hit backpressure has been flushed."""
        if self._draining:
            await self._drained.wait()

    def send_nowait(self, op: int, frame: Encoded, *, bounded: bool = True) -> None:
        """Write a small frame at once, or queue it; ``MailboxFull`` past ``outbox_size`` if ``bounded``."""
        if self.can_write_now(frame):
            if not self.write_now(self.inline(op, frame)) and op == OP_TELL:
                self.transport.counters.dropped_tells += 1
            return
        if bounded and len(self.outbox) >= self.transport.settings.outbox_size:
            raise MailboxFull(f"outbox to {self.peer.node} full ({len(self.outbox)} frames)")
        self.outbox.append((op, frame))
        self._wake.set()

    def write_now(self, data: bytes) -> bool:
        """Write one websocket message synchronously; False if the connection just broke.

        aiohttp writes an uncompressed frame before its first suspension point
        (the wait for the transport to drain), so stepping the coroutine once
        puts the bytes on the wire in order; if it then has to wait for
        backpressure, a task finishes it and later frames queue behind it.
        """
        coro = self.ws.send_bytes(data)
        state, waiting = self._start(coro)
        if state == "broken":
            return False
        if state == "waiting":
            self._draining = True
            self._drained.clear()
            self.transport.spawn_task(self._finish_send(coro, waiting), f"ws-drain:{self.peer.node}")
        self.transport.counters.bytes_out += len(data)
        self.transport.counters.frames_out += 1
        return True

    async def _finish_send(self, coro: Coroutine[Any, Any, None], waiting: Any) -> None:
        try:
            sent = await self._finish(coro, waiting)
        finally:
            self._draining = False
            self._drained.set()
        if sent and self.outbox:
            self._wake.set()

    async def _finish(self, coro: Coroutine[Any, Any, None], waiting: Any) -> bool:
        """Run a write stepped once already (it yielded ``waiting``) to its end; False if the connection broke."""
        try:
            while True:
                if waiting is None:  # a bare yield (asyncio.sleep(0)): let the loop turn
                    await asyncio.sleep(0)
                else:
                    if getattr(waiting, "_asyncio_future_blocking", False):
                        # as a Task does with what a coroutine yields: else awaiting it again raises
                        # "await wasn't used with future" while it is still pending
                        waiting._asyncio_future_blocking = False
                    try:
                        await waiting
                    except asyncio.CancelledError:
                        coro.close()
                        raise
                    except Exception:
                        pass  # the coroutine reads the outcome itself on the next step
                waiting = coro.send(None)
        except StopIteration:
            return True
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
            self.transport.connection_lost(self, f"send failed: {exc}")
            return False

    def send_reply(self, op: int, frame: Encoded) -> None:
        """Send a handler's reply without waiting. A small one, or one behind queued frames, goes as
        :meth:`send_nowait` sends it; a big one (streamed in parts) with nothing queued before it is written as a
        big tell is: started now, in order with what this node sends after it, and finished by a task, so that
        small frames sent meanwhile go between its parts instead of behind all of it (a stage's weights, asked
        for an evaluation, held up its small messages for the whole transfer: 1.8 s for an MLP's 23 MB at
        100 Mbit/s)."""
        if frame.payload_len <= self._part_bytes or self.outbox or self._draining:
            self.send_nowait(op, frame, bounded=False)
            return
        writing = self._write(op, frame)
        state, waiting = self._start(writing)
        if state == "waiting":
            self.transport.spawn_task(self._finish(writing, waiting), f"ws-reply:{self.peer.node}")

    def _start(self, coro: Coroutine[Any, Any, None]) -> tuple[Literal["waiting", "done", "broken"], Any]:
        """Step a write once, so that what it writes before its first wait goes on the wire now, in order: what
        became of it, and what it waits on (for :meth:`_finish`). Never raises into the caller (often an actor
        handing back a reply): a broken connection is lost, the peer down."""
        try:
            return "waiting", coro.send(None)
        except StopIteration:
            return "done", None
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
            self.transport.connection_lost(self, f"send failed: {exc}")
            return "broken", None

    async def _write(self, op: int, frame: Encoded) -> None:
        counters = self.transport.counters
        ws = self.ws
        ring = self.ring
        placed = None
        if ring is not None and self._ring_fits(frame):
            while not ring.has_room(frame.payload_len) and ring.in_flight and not self.closed:
                await self._wait_ring(ring)  # the peer is reading: wait for it rather than copy twice
            if self.closed:
                raise ConnectionResetError("connection closed")
            placed = self._place(op, frame)
        if placed is not None:
            await ws.send_bytes(placed)
            counters.bytes_out += len(placed)
        elif frame.payload_len <= self._part_bytes:
            data = frame.single(op)
            await ws.send_bytes(data)
            counters.bytes_out += len(data)
        else:
            stream = next(self._stream_ids) & 0xFFFFFFFF
            for data in frame.messages(op, stream, self._part_bytes):
                await ws.send_bytes(data)
                counters.bytes_out += len(data)
                await asyncio.sleep(0)  # let small frames to this node go between the parts
        counters.frames_out += 1

    async def _send_loop(self) -> None:
        outbox = self.outbox
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while outbox and not self._draining:
                    op, frame = outbox[0]
                    await self._write(op, frame)
                    outbox.popleft()  # only now: a direct send must not overtake a half-sent frame
                    self._space.set()
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
            self.transport.connection_lost(self, f"send failed: {exc}")

    def ping(self) -> None:
        if not self.outbox:
            self.send_nowait(OP_PING, _PING_STARTING if self.transport.starting else _PING, bounded=False)

    # -- receiving ---------------------------------------------------------------
    def _pump(self) -> None:
        """Handle the binary messages at the head of aiohttp's queue; wake the read loop for the rest."""
        if not self._parked:
            return
        queue = self._queue
        buffer = queue._buffer
        binary = aiohttp.WSMsgType.BINARY
        try:
            while buffer and not self.closed:
                if buffer[0][0].type is not binary:
                    break
                if self._on_binary(take(queue).data):
                    self._rx_pause = True
                    break
        except DecodeError as exc:
            self._rx_error = self._protocol_error(exc)
        except Exception as exc:  # a bug must cost this connection, not aiohttp's protocol
            log.exception("connection to %s failed", self.peer.node)
            self._rx_error = f"internal error: {exc!r}"
        if self._rx_pause or self._rx_error is not None or self.closed or queue_has_news(queue):
            self._parked = False
            self._kick.set()

    def _protocol_error(self, exc: DecodeError) -> str:
        self.transport.counters.decode_errors += 1
        log.warning("closing connection to %s: %s", self.peer.node, exc)
        return f"protocol error: {exc}"

    def _on_binary(self, data: bytes) -> bool:
        """One binary websocket message; True if reading must pause until a full mailbox has room."""
        self.last_rx = self.loop.time()
        counters = self.transport.counters
        counters.bytes_in += len(data)
        frame = self.decoder.feed(data)
        if data[2] & FLAG_SHM:
            counters.shm_frames_in += 1
            ring = self.decoder.ring
            if ring is not None and ring.ack_due():
                self._release(ring)
        if frame is None:
            return False
        counters.frames_in += 1
        return self._dispatch(frame)

    async def read_loop(self) -> None:
        """Read this websocket until it closes; the only reader of it."""
        ws = self.ws
        counters = self.transport.counters
        on_binary = self._on_binary
        binary = aiohttp.WSMsgType.BINARY
        reason = "closed by peer"
        self._queue = hook_parser(self.ws, self._pump)
        direct = self._queue is not None
        try:
            while True:
                if direct and not queue_has_news(self._queue):
                    if self.closed:
                        break
                    self._kick.clear()
                    self._parked = True
                    try:
                        await self._kick.wait()
                    finally:
                        self._parked = False
                    if self._rx_error is not None:
                        reason = self._rx_error
                        break
                    if self._rx_pause:
                        self._rx_pause = False
                        await self._room.wait()  # a full mailbox: stop reading, backpressure to the sender
                    continue
                msg = await ws.receive()
                if msg.type is binary:
                    try:
                        pause = on_binary(msg.data)
                    except DecodeError as exc:
                        reason = self._protocol_error(exc)
                        break
                    if pause:
                        await self._room.wait()  # a full mailbox: stop reading, backpressure to the sender
                elif msg.type is aiohttp.WSMsgType.ERROR:
                    counters.decode_errors += 1
                    reason = f"websocket error: {msg.data}"
                    log.warning("connection to %s failed: %s", self.peer.node, msg.data)
                    break
                elif msg.type is aiohttp.WSMsgType.TEXT:
                    counters.decode_errors += 1
                    reason = "protocol error: text frame"
                    break
                elif msg.type in (aiohttp.WSMsgType.PING, aiohttp.WSMsgType.PONG):
                    self.last_rx = self.loop.time()
                else:  # CLOSE, CLOSING, CLOSED
                    break
        except (ConnectionError, aiohttp.ClientError) as exc:
            reason = f"connection error: {exc}"
        except Exception as exc:  # a bug must cost this connection, not the node's transport
            log.exception("connection to %s failed", self.peer.node)
            reason = f"internal error: {exc!r}"
        finally:
            self._parked = False
            self.transport.connection_lost(self, reason)
            await self.close()

    def _dispatch(self, frame: Frame) -> bool:
        """Hand a frame on; True if reading must pause until a full mailbox has room."""
        op = frame.op
        if op == OP_PING:
            self.peer_starting = frame.target == "starting"
            return False
        if op == OP_REPLY or op == OP_FAIL:
            self.peer.resolve(frame)
            return False
        if op == OP_SHM:
            self._shm_control(frame.value)
            return False
        if frame.error is not None:
            self.transport.counters.decode_errors += 1
            log.warning("dropping a message from %s: %s", self.peer.node, frame.error)
            if op == OP_ASK:
                self.peer.reply(frame.corr, None, frame.error)
            return False
        target = frame.target
        reply: ReplySink | None = None
        if op == OP_ASK:
            reply = ReplySink(self.peer, frame.corr)
        elif op != OP_TELL:
            return False
        queued = self._overflow.get(target)
        if queued is not None:
            queued.append((frame.value, reply))
            if len(queued) >= self.transport.settings.overflow_size:
                self._room.clear()
                return True
            return False
        try:
            if self.transport.system.deliver(target, frame.value, reply):
                return False
        except (ActorNotFound, ActorStopped) as exc:
            self._undeliverable(target, reply, exc)
            return False
        queued = deque([(frame.value, reply)])
        self._overflow[target] = queued
        self.transport.spawn_task(self._drain(target, queued), f"ws-overflow:{target}")
        return False

    async def _drain(self, target: str, queued: deque[tuple[Any, ReplySink | None]]) -> None:
        """Feed a full mailbox in arrival order, waiting for room."""
        system = self.transport.system
        try:
            while queued:
                msg, reply = queued[0]
                try:
                    await system.deliver_wait(target, msg, reply)
                except (ActorNotFound, ActorStopped) as exc:
                    self._undeliverable(target, reply, exc)
                queued.popleft()
                if len(queued) < self.transport.settings.overflow_size:
                    self._room.set()
        finally:
            del self._overflow[target]
            self._room.set()

    def _undeliverable(self, target: str, reply: ReplySink | None, exc: Exception) -> None:
        if reply is None:
            self.transport.counters.dropped_tells += 1
            log.debug("tell to %s from %s dropped: %s", target, self.peer.node, exc)
        elif not reply.done():
            reply.set_exception(exc)

    # -- closing -------------------------------------------------------------------
    async def close(self, code: int = aiohttp.WSCloseCode.GOING_AWAY, message: bytes = b"") -> None:
        if self.closed:
            return
        self.closed = True
        self._space.set()
        self._ring_freed.set()
        self._kick.set()
        self.sender.cancel()
        ring, self.ring = self.ring, None
        if ring is not None:
            ring.close()
        peer_ring, self.decoder.ring = self.decoder.ring, None
        if peer_ring is not None:
            peer_ring.close()
        for queued in self._overflow.values():
            for _, reply in queued:
                if reply is not None and not reply.done():
                    reply.cancel()
        try:
            await self.ws.close(code=code, message=message)
        except Exception as exc:  # already broken: nothing more to say to it
            log.debug("closing websocket to %s: %r", self.peer.node, exc)

