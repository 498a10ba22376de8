"""Hostile raw clients: the node drops them, keeps its memory, and keeps serving."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from dniasync import ActorSystem
from dniasync.node import NodeStatus, NodeStatusReply
from dniasync.node.demo import Ping
from dniasync.remote import WebSocketTransport
from dniasync.remote._codec import FRAME_PREFIX, OP_TELL, VERSION

pytestmark = pytest.mark.timeout(60)

DETECT_S = 1.0


def ws_frame(payload: bytes, opcode: int = 2, announce: int | None = None) -> bytes:
    """A masked client frame; ``announce`` overrides the length in the header."""
    length = len(payload) if announce is None else announce
    head = bytes([0x80 | opcode])
    if length < 126:
        head += bytes([0x80 | length])
    elif length < 1 << 16:
        head += bytes([0x80 | 126]) + length.to_bytes(2, "big")
    else:
        head += bytes([0x80 | 127]) + length.to_bytes(8, "big")
    mask = os.urandom(4)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def upgraded_socket(address: str) -> socket.socket:
    """A raw TCP socket that completed the websocket upgrade (the node has no token)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(
        (
            f"GET /dniasync/ws HTTP/1.1\r\nHost: {address}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
            "X-Dniasync-Node: 127.0.0.1:9\r\nX-Dniasync-Incarnation: raw\r\n\r\n"
        ).encode()
    )
    response = b""
    while b"\r\n\r\n" not in response:
        chunk = sock.recv(4096)
        assert chunk, "closed during the upgrade"
        response += chunk
    assert response.startswith(b"HTTP/1.1 101"), response[:200]
    return sock


def closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the node closed ``sock`` (reading and discarding what it sends)."""
    started = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - started < seconds:
        try:
            if not sock.recv(65536):
                return time.monotonic() - started
        except TimeoutError:
            continue
        except ConnectionError:
            return time.monotonic() - started
    raise AssertionError(f"the node kept the connection open for {seconds} s")


def dniasync_frame_announcing(nbytes: int) -> bytes:
    """A streamed dniasync frame whose prefix announces ``nbytes`` of tensor payload."""
    header = msgpack.packb(["dniasync.demo.Tensor", "echo", None, 0, [None]])
    return FRAME_PREFIX.pack(VERSION, OP_TELL, 1, len(header), 1, nbytes) + header


ATTACKS: dict[str, Callable[[str], socket.socket]] = {}


def attack(name: str) -> Callable[[Callable[[str], socket.socket]], Callable[[str], socket.socket]]:
    def register(func: Callable[[str], socket.socket]) -> Callable[[str], socket.socket]:
        ATTACKS[name] = func
        return func

    return register


@attack("not http")
def _not_http(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.sendall(os.urandom(3000) + b"\r\n\r\n")
    return sock


@attack("garbage after upgrade")
def _garbage(address: str) -> socket.socket:
    sock = upgraded_socket(address)
    sock.sendall(b"\xff" * 64 + os.urandom(1000))
    return sock


@attack("garbage in a binary frame")
def _garbage_frame(address: str) -> socket.socket:
    sock = upgraded_socket(address)
    sock.sendall(ws_frame(os.urandom(500)))
    return sock


@attack("2^62-byte websocket frame header")
def _huge_header(address: str) -> socket.socket:
    sock = upgraded_socket(address)
    sock.sendall(ws_frame(b"x" * 100, announce=1 << 62)[:14] + b"x" * 100)
    return sock


@attack("frame announcing more than it sends")
def _short_frame(address: str) -> socket.socket:
    sock = upgraded_socket(address)
    sock.sendall(ws_frame(b"y" * 1000, announce=60_000)[:8 + 1000])
    return sock


@attack("dniasync frame announcing 2^62 tensor bytes")
def _huge_tensor(address: str) -> socket.socket:
    sock = upgraded_socket(address)
    sock.sendall(ws_frame(dniasync_frame_announcing(1 << 62)))
    return sock


async def test_hostile_clients_are_disconnected_without_memory_growth(start_node: Any) -> None:
    node = start_node("--role", "coordinator", "--spawn", "dniasync.node.demo:Echo=echo", "--detect-s", str(DETECT_S),
                      "--heartbeat-s", "0.25")
    async with ActorSystem() as system, WebSocketTransport(system):
        echo = system.ref(f"echo@{node.address}")
        assert await echo.ask(Ping(0), timeout=5) == 1
        baseline = node.rss_kib()
        for round_ in range(3):
            for name, start in ATTACKS.items():
                sock = await asyncio.to_thread(start, node.address)
                try:
                    took = await asyncio.to_thread(closed_within, sock, DETECT_S + 3)
                finally:
                    sock.close()
                assert took < DETECT_S + 3, name
                # the node and its honest peer carry on after every attack
                assert await echo.ask(Ping(round_), timeout=5) == round_ + 1, name
        grown = node.rss_kib() - baseline
        assert grown < 16 * 1024, f"node RSS grew by {grown} KiB"
        status: NodeStatusReply = await system.ref(f"node@{node.address}").ask(NodeStatus(), timeout=5)
        assert status.counters["decode_errors"] >= 3 * 3
