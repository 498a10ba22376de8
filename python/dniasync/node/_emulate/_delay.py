"""The delay proxy: every TCP connection into an emulated host arrives ``delay`` seconds late, each way.

``tc netem`` is not in every kernel, so latency is added in user space. In each host's network
namespace an nftables rule redirects every TCP connection arriving on the host's link to this
proxy's listener there; the proxy reads the original destination (``SO_ORIGINAL_DST``), opens a
connection to it from inside the same namespace, and relays both directions through a delay
line: each chunk read is written ``delay`` seconds after it arrived, in order, so the rate is
kept and only latency is added (a connection between two hosts crosses exactly one proxy, the
callee's: one-way delay ``delay``, round trip twice that). What a delay line holds is bounded;
past that it stops reading, so TCP's backpressure still reaches the sender. Any listener on the
host is covered (dniasync nodes, gloo, a TCP store) with no port known in advance.

One process serves every host: a socket belongs to the network namespace its creator was in
when it was made, so the proxy enters each host's namespace just long enough to create its
listener and its outgoing sockets. Standard library (and uvloop when present) only: the
launcher runs this file as a script, ``python _delay.py DELAY_S NETNS=ADDRESS...``; it prints ``ready``
once every listener is bound.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import heapq
import itertools
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

PORT = 6999
"""Where the proxy listens in every host (below the ephemeral range: no node takes it first)."""
CHUNK = 1 << 18
SO_ORIGINAL_DST = 80
CLONE_NEWNET = 0x40000000
MIN_HELD = 4 << 20

_libc = ctypes.CDLL(None, use_errno=True)


def setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class Namespaces:
    """Create sockets in other network namespaces (this thread returns home after each)."""

    def __init__(self) -> None:
        self.home = os.open("/proc/self/ns/net", os.O_RDONLY)

    def socket_in(self, fd: int) -> socket.socket:
        setns(fd)
        try:
            return socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        finally:
            setns(self.home)


def original_destination(sock: socket.socket) -> tuple[str, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return socket.inet_ntoa(packed), port


class Alarm:
    """Wake-ups at a ``time.monotonic()`` instant to within ~0.1 ms.

    The event loop's own timers have a resolution of a millisecond (uvloop rounds a 0.2 ms sleep
    down to nothing, asyncio's epoll up to 1 ms); a thread sleeping on a condition variable uses the
    kernel's high-resolution timers, then hands the wake-up to the loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.due: list[tuple[float, int, asyncio.Future[None]]] = []
        self.order = itertools.count()
        self.cond = threading.Condition()
        threading.Thread(target=self._run, name="delay-alarm", daemon=True).start()

    def at(self, when: float) -> asyncio.Future[None]:
        future: asyncio.Future[None] = self.loop.create_future()
        with self.cond:
            heapq.heappush(self.due, (when, next(self.order), future))
            if self.due[0][2] is future:
                self.cond.notify()
        return future

    def _run(self) -> None:
        with self.cond:
            while True:
                if not self.due:
                    self.cond.wait()
                    continue
                wait = self.due[0][0] - time.monotonic()
                if wait > 0:
                    self.cond.wait(wait)
                    continue
                _, _, future = heapq.heappop(self.due)
                self.loop.call_soon_threadsafe(_wake, future)


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def delay_line(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: float, held_max: int,
                     alarm: Alarm) -> None:
    """Copy ``src`` to ``dst``, each chunk ``delay`` s after it was read; half-close ``dst`` at the end."""
    line: collections.deque[tuple[float, bytes]] = collections.deque()
    arrived = asyncio.Event()
    room = asyncio.Event()
    room.set()
    held = 0

    async def read() -> None:
        nonlocal held
        while True:
            data = await src.read(CHUNK)
            line.append((time.monotonic() + delay, data))
            arrived.set()
            if not data:
                return
            held += len(data)
            if held > held_max:
                room.clear()
                await room.wait()

    reader = asyncio.create_task(read())
    try:
        while True:
            while not line:
                arrived.clear()
                await arrived.wait()
            due, data = line.popleft()
            if due > time.monotonic():
                await alarm.at(due)
            if not data:
                if dst.can_write_eof():
                    dst.write_eof()
                return
            dst.write(data)
            held -= len(data)
            if held <= held_max:
                room.set()
            await dst.drain()
    finally:
        reader.cancel()


class DelayProxy:
    def __init__(self, delay: float, namespaces: list[tuple[str, str]]) -> None:
        self.delay = delay
        self.names = namespaces
        """(network namespace, its host's address): the redirect delivers to the address of the link it came in on"""
        self.ns = Namespaces()
        # a delay line holds what the link delivers in twice the delay (its rate is not known here: 1 Gbit/s)
        self.held_max = max(MIN_HELD, int(2 * delay * 125_000_000))
        self.tasks: set[asyncio.Task[None]] = set()
        self.alarm: Alarm | None = None

    async def serve(self) -> None:
        self.alarm = Alarm(asyncio.get_running_loop())
        servers = []
        for name, address in self.names:
            fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
            listener = self.ns.socket_in(fd)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((address, PORT))
            listener.listen(1024)
            servers.append(await asyncio.start_server(self._accepting(fd), sock=listener))
        print("ready", flush=True)
        await asyncio.gather(*(s.serve_forever() for s in servers))

    def _accepting(self, fd: int) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], None]:
        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.get_running_loop().create_task(self.relay(reader, writer, fd))
            self.tasks.add(task)  # the loop keeps only a weak reference to a task
            task.add_done_callback(self.tasks.discard)

        return accepted

    async def relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, fd: int) -> None:
        loop = asyncio.get_running_loop()
        up_writer: asyncio.StreamWriter | None = None
        try:
            target = original_destination(writer.get_extra_info("socket"))
            sock = self.ns.socket_in(fd)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, target)
            except OSError:
                sock.close()
                raise
            for s in (sock, writer.get_extra_info("socket")):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            up_reader, up_writer = await asyncio.open_connection(sock=sock, limit=CHUNK)
            async with asyncio.TaskGroup() as both:  # one direction failing ends the other
                assert self.alarm is not None
                both.create_task(delay_line(reader, up_writer, self.delay, self.held_max, self.alarm))
                both.create_task(delay_line(up_reader, writer, self.delay, self.held_max, self.alarm))
        except* OSError:
            pass  # either end went away: the other is closed below, as a cut cable would leave it
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    w.close()


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: _delay.py DELAY_S NETNS=ADDRESS...", file=sys.stderr)
        return 2
    proxy = DelayProxy(float(argv[0]), [tuple(arg.split("=", 1)) for arg in argv[1:]])  # type: ignore[misc]
    sys.setswitchinterval(1e-4)  # the alarm thread must not wait 5 ms for the loop's thread to let go
    try:
        import uvloop
    except ImportError:
        asyncio.run(proxy.serve())
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(proxy.serve())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
