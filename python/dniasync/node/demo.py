"""Small actors for trying a cluster out: ``--spawn dniasync.node.demo:Echo=echo``.

The examples and the multi-process tests use them; they are also a quick
smoke test of a real deployment (ask ``echo@host:port`` from another node).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..actors import Actor, ActorRef, handler, message

__all__ = ["Echo", "Forward", "Ping", "Relay", "Sum", "Tensor"]


@message("dniasync.demo.Ping")
@dataclass(frozen=True)
class Ping:
    n: int


@message("dniasync.demo.Tensor")
@dataclass(frozen=True)
class Tensor:
    data: np.ndarray


@message("dniasync.demo.Forward")
@dataclass(frozen=True)
class Forward:
    """Ask ``to`` a ``Ping(n)`` and answer with its reply: refs travel inside messages."""

    to: ActorRef
    n: int
    timeout: float = 10.0


@message("dniasync.demo.Fail")
@dataclass(frozen=True)
class Fail:
    reason: str


class Echo(Actor):
    """Answers ``Ping(n)`` with ``n + 1``, ``Tensor`` with its sum; ``Fail`` raises ``ValueError``."""

    @handler
    def ping(self, msg: Ping) -> int:
        return msg.n + 1

    @handler
    def tensor(self, msg: Tensor) -> float:
        return float(msg.data.sum())

    @handler
    def fail(self, msg: Fail) -> None:
        raise ValueError(msg.reason)


class Relay(Actor):
    """Forwards asks to the ref it is given."""

    @handler
    async def forward(self, msg: Forward) -> int:
        reply: int = await msg.to.ask(Ping(msg.n), timeout=msg.timeout)
        return reply


class Sum(Actor):
    """Counts tells: ``Tensor`` tells add their element count; ``Ping`` asks read it."""

    def __init__(self) -> None:
        self.elements = 0
        self.messages = 0

    @handler
    def tensor(self, msg: Tensor) -> None:
        self.elements += msg.data.size
        self.messages += 1

    @handler
    def ping(self, msg: Ping) -> int:
        return self.messages
