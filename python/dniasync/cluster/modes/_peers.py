"""The coordinator's side of the ``p2p`` weight sync, shared by the modes whose trainers use it.

The data-parallel ``p2p`` mode (peers are replicas) and the ``pipeline`` mode
with ``sync.kind = "p2p"`` (peers are the replicas of one stage) both find a
trainer's inbox by its name, tell the live inboxes the membership, and at the
end wait for every ledger to hold every update the others sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ...actors import ActorError, ActorRef, ActorSystem

__all__ = ["ask_peer_stats", "inbox_of", "ledgers_complete", "tell_peers"]

log = logging.getLogger("dniasync.cluster.modes.peers")


def inbox_of(system: ActorSystem, trainer: ActorRef) -> ActorRef:
    """The inbox (:class:`~dniasync.train.sync.p2p.PeerInbox`) of the p2p sync of ``trainer``, on its node."""
    from ...train.sync.p2p import inbox_name

    return system.ref(f"{inbox_name(trainer.name)}@{trainer.node}")


def tell_peers(inboxes: Sequence[ActorRef], epoch: int) -> None:
    """Tell every inbox of ``inboxes`` that they are the membership, version ``epoch`` (a full one is skipped)."""
    from ...train.sync.p2p import Peers

    msg = Peers(epoch, list(inboxes))
    for inbox in inboxes:
        try:
            inbox.tell_nowait(msg)
        except ActorError as exc:
            log.debug("membership not told to %s: %s", inbox, exc)


async def ask_peer_stats(inboxes: Sequence[ActorRef], timeout: float = 5.0) -> list[dict[str, Any] | None]:
    """Each inbox's counters and ledger (:meth:`~dniasync.train.sync.p2p.P2PSync.report`); None where none came."""
    from ...train.sync.p2p import P2PStatsRequest

    replies = await asyncio.gather(*(inbox.ask(P2PStatsRequest(), timeout=timeout) for inbox in inboxes),
                                   return_exceptions=True)
    for reply in replies:
        if isinstance(reply, BaseException) and not isinstance(reply, ActorError):
            raise reply
    return [reply if isinstance(reply, dict) else None for reply in replies]


def ledgers_complete(stats: Mapping[str, Mapping[str, Any]]) -> bool:
    """Every peer's ledger holds each other peer's every update, contiguously."""
    sent = {s["origin"]: int(s["sent"]) for s in stats.values()}
    return all(s["complete"].get(origin, 0) >= count for s in stats.values() for origin, count in sent.items()
               if origin != s["origin"])
