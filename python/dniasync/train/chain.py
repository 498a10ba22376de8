"""Wire messages of replicated PS shards: a shard's copies form a chain (``[downpour] ps_replicas``).

Chain replication (van Renesse & Schneider, OSDI 2004; the parameter server
of Li et al., OSDI 2014): a replica's push enters at the head of its shard's
chain, each copy applies it and forwards it to the next, and the answer goes
back only once the tail has applied it, so a push the replica saw
acknowledged is on every live copy, applied in the same order everywhere.
The job runner names the chain (:class:`ChainView`, numbered: a copy refuses
what comes from a view it no longer holds); the copies are
:class:`~dniasync.train.ps_chain.ChainShard` actors and the replicas reach
them through :class:`~dniasync.train.sync.chain.ChainRoute`.

Plain fields, nested messages and numpy arrays only, like every wire message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..actors import ActorRef, message
from .messages import Push, ShardSnapshot
from .specs import ShardSpec

__all__ = ["ChainAck", "ChainPush", "ChainView", "CopySpec", "CopyState", "GetChainView", "pusher"]


def pusher(replica: str, incarnation: int) -> str:
    """The key under which a copy counts the pushes of one incarnation of a replica (``applied_by``)."""
    return f"{replica}#{incarnation}"


@message("dniasync.train.chain.CopySpec")
@dataclass(frozen=True)
class CopySpec:
    """One copy of a replicated PS shard: ``shard`` as :class:`~dniasync.train.specs.ShardSpec` says, copy number
    ``copy``. ``joining``: a restarted copy, which serves nothing until its predecessor in the chain sent it its
    state (:class:`CopyState`)."""

    shard: ShardSpec
    copy: int
    joining: bool = False


@message("dniasync.train.chain.ChainView")
@dataclass(frozen=True)
class ChainView:
    """The chain of shard ``shard`` as of view ``number``: ``chain[0]`` is the head (replicas push there),
    ``chain[-1]`` the tail (replicas pull there). ``joining``: addresses of copies that take their state from
    their predecessor before it forwards them anything."""

    shard: int
    number: int
    chain: list[ActorRef]
    joining: list[str]


@message("dniasync.train.chain.GetChainView")
@dataclass(frozen=True)
class GetChainView:
    """Ask a copy for the view it holds (a :class:`ChainView`, or None before its first)."""


@message("dniasync.train.chain.ChainPush")
@dataclass(frozen=True)
class ChainPush:
    """A push entering the chain (``origin`` empty: from a replica, to the head) or forwarded along it (``origin``:
    the address of the copy that forwards, in view ``view``; ``verdict``: what the head made of it)."""

    push: Push
    view: int = 0
    origin: str = ""
    verdict: str = ""


@message("dniasync.train.chain.ChainAck")
@dataclass(frozen=True)
class ChainAck:
    """The answer to a :class:`ChainPush`.

    ``status``: ``ok`` (every copy after this one has it; ``verdict`` says what the head made of it:
    ``applied``, or a rejection such as ``stale`` or ``zombie``), ``redirect`` (this copy cannot take it in the
    sender's view: ``view`` is the one it holds) or ``broken`` (the next copy did not answer: send it again once
    the chain has closed around the dead copy).
    """

    status: str
    verdict: str
    version: int
    view: ChainView | None = None


@message("dniasync.train.chain.CopyState")
@dataclass(frozen=True)
class CopyState:
    """Everything a joining copy needs to continue where its predecessor stands: parameters, optimizer state,
    version, push ledger, fenced replicas, the verdict of each replica's last push (``[incarnation, seq,
    verdict]``: a push sent again is answered as the first time), and how many pushes of each incarnation of
    each replica its state holds (``applied_by``, keyed by :func:`pusher`)."""

    snapshot: ShardSnapshot
    verdicts: dict[str, list[Any]]
    applied_by: dict[str, int]
