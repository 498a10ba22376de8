"""One websocket to one peer node: reads, writes, dispatches frames."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from ..actors import ActorNotFound, ActorStopped, ActorUnreachable, MailboxFull, UnhandledMessage
from ._codec import OP_ASK, OP_FAIL, OP_PING, OP_REPLY, OP_TELL, Decoder, Encoded, Frame, encode
from ._errors import DecodeError, RemoteError

if TYPE_CHECKING:
    from ._peer import Peer
    from ._transport import WebSocketTransport

log = logging.getLogger("dniasync.remote")

WebSocket = web.WebSocketResponse | aiohttp.ClientWebSocketResponse

_PING = encode(OP_PING, "", 0, None)


def remote_error(address: str, remote_type: str, detail: str) -> Exception:
    """The local exception for an error that a remote handler (or node) raised."""
    if remote_type == "ActorNotFound":
        return ActorNotFound(detail)
    if remote_type == "ActorUnreachable":
        return ActorUnreachable(address, detail)
    if remote_type == "ActorStopped":
        return ActorStopped(address, "stopped on its node")
    if remote_type == "UnhandledMessage":
        return UnhandledMessage(detail)
    if remote_type == "DecodeError":
        return DecodeError(f"{address}: the receiving node could not decode the message: {detail}", fatal=False)
    return RemoteError(remote_type, detail, address)


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
        self._wake = asyncio.Event()
        self._stream_ids = itertools.count(1)
        self._part_bytes = transport.settings.limits.part_bytes
        self._overflow: dict[str, deque[tuple[Any, asyncio.Future[Any] | None]]] = {}
        self._room = asyncio.Event()
        self.sender: asyncio.Task[None] = transport.spawn_task(self._send_loop(), f"ws-send:{peer.node}")

    def __repr__(self) -> str:
        return f"<Connection to {self.peer.node} dialed by {self.dialer}{' closed' if self.closed else ''}>"

    # -- sending ---------------------------------------------------------------
    async def send(self, op: int, frame: Encoded) -> None:
        """Write a frame now (after whatever is queued), waiting on backpressure."""
        if self.outbox:  # keep order behind queued frames
            self.outbox.append((op, frame))
            self._wake.set()
            return
        await self._write(op, frame)

    def send_nowait(self, op: int, frame: Encoded, *, bounded: bool = True) -> None:
        """Queue a frame for the sender task; ``MailboxFull`` past ``outbox_size`` if ``bounded``."""
        if bounded and len(self.outbox) >= self.transport.settings.outbox_size:
            raise MailboxFull(f"outbox to {self.peer.node} full ({len(self.outbox)} frames)")
        self.outbox.append((op, frame))
        self._wake.set()

    async def _write(self, op: int, frame: Encoded) -> None:
        counters = self.transport.counters
        ws = self.ws
        if frame.payload_len <= self._part_bytes:
            for data in frame.messages(op, 0, self._part_bytes):
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
                while outbox:
                    op, frame = outbox[0]
                    await self._write(op, frame)
                    outbox.popleft()  # only now: a direct send must not overtake a half-sent frame
        except (ConnectionError, aiohttp.ClientError, RuntimeError) as exc:
            self.transport.connection_lost(self, f"send failed: {exc}")

    def ping(self) -> None:
        if not self.outbox:
            self.send_nowait(OP_PING, _PING, bounded=False)

    # -- receiving ---------------------------------------------------------------
    async def read_loop(self) -> None:
        """Read this websocket until it closes; the only reader of it."""
        ws = self.ws
        counters = self.transport.counters
        reason = "closed by peer"
        try:
            while True:
                msg = await ws.receive()
                if msg.type is aiohttp.WSMsgType.BINARY:
                    data: bytes = msg.data
                    self.last_rx = self.loop.time()
                    counters.bytes_in += len(data)
                    try:
                        frame = self.decoder.feed(data)
                    except DecodeError as exc:
                        counters.decode_errors += 1
                        reason = f"protocol error: {exc}"
                        log.warning("closing connection to %s: %s", self.peer.node, exc)
                        break
                    if frame is not None:
                        counters.frames_in += 1
                        await self._dispatch(frame)
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
        finally:
            self.transport.connection_lost(self, reason)
            await self.close()

    async def _dispatch(self, frame: Frame) -> None:
        op = frame.op
        if op == OP_PING:
            return
        if op == OP_REPLY or op == OP_FAIL:
            self.peer.resolve(frame)
            return
        if frame.error is not None:
            self.transport.counters.decode_errors += 1
            log.warning("dropping a message from %s: %s", self.peer.node, frame.error)
            if op == OP_ASK:
                self._fail_ask(frame.corr, frame.error)
            return
        target = frame.target
        reply: asyncio.Future[Any] | None = None
        if op == OP_ASK:
            reply = self.loop.create_future()
            corr = frame.corr
            reply.add_done_callback(lambda fut: self.peer.reply(corr, fut))
        elif op != OP_TELL:
            return
        queued = self._overflow.get(target)
        if queued is not None:
            queued.append((frame.value, reply))
            if len(queued) >= self.transport.settings.overflow_size:
                self._room.clear()
                await self._room.wait()  # stop reading: backpressure to the sender
            return
        try:
            if self.transport.system.deliver(target, frame.value, reply):
                return
        except (ActorNotFound, ActorStopped) as exc:
            self._undeliverable(target, reply, exc)
            return
        queued = deque([(frame.value, reply)])
        self._overflow[target] = queued
        self.transport.spawn_task(self._drain(target, queued), f"ws-overflow:{target}")

    async def _drain(self, target: str, queued: deque[tuple[Any, asyncio.Future[Any] | None]]) -> None:
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

    def _undeliverable(self, target: str, reply: asyncio.Future[Any] | None, exc: Exception) -> None:
        if reply is None:
            self.transport.counters.dropped_tells += 1
            log.debug("tell to %s from %s dropped: %s", target, self.peer.node, exc)
        elif not reply.done():
            reply.set_exception(exc)

    def _fail_ask(self, corr: int, exc: BaseException) -> None:
        self.peer.send_reply(OP_FAIL, encode(OP_FAIL, "", corr, [type(exc).__name__, str(exc)]))

    # -- closing -------------------------------------------------------------------
    async def close(self, code: int = aiohttp.WSCloseCode.GOING_AWAY, message: bytes = b"") -> None:
        if self.closed:
            return
        self.closed = True
        self.sender.cancel()
        for queued in self._overflow.values():
            for _, reply in queued:
                if reply is not None and not reply.done():
                    reply.cancel()
        try:
            await self.ws.close(code=code, message=message)
        except Exception as exc:  # already broken: nothing more to say to it
            log.debug("closing websocket to %s: %r", self.peer.node, exc)
