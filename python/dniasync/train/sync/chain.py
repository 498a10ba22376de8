"""A replica's way into a replicated PS shard: push at the head of its chain, pull from the tail.

:class:`ChainRoute` is the :class:`~dniasync.actors.Destination` of the ref
a :class:`~dniasync.train.sync.ps.ShardLink` holds for a shard with several
copies (:func:`chain_refs`), so the link pushes and pulls as it does with a
single copy. A push (the link's ``tell``) returns only once the chain
acknowledged it (:mod:`dniasync.train.chain`): every live copy applied it.
Until then the route sends the same push again (same ``(replica, incarnation,
seq)``: applied at most once per copy) to the head of the newest view it can
learn of, asking the copies for theirs after each failure, so a dead copy
costs the replica the time the job runner takes to close the chain around it.
A pull goes to the tail, which holds every acknowledged push and nothing a
failure could take back; a version lower than one pulled before is counted
(``regressions``) and logged. Only after ``give_up_s`` does either fail (as an
``AskTimeout``, which the link handles as any failed push or pull).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from ...actors import ActorError, ActorRef, AskTimeout
from ..chain import ChainAck, ChainPush, ChainView, GetChainView
from ..messages import Push
from ..ps_chain import CatchingUp
from .base import Clock

__all__ = ["GIVE_UP_S", "ChainRoute", "chain_refs"]

log = logging.getLogger("dniasync.train.sync.chain")

GIVE_UP_S = 60.0
"""How long a push or a pull is retried through view changes before it fails."""
VIEW_TIMEOUT_S = 2.0
RETRY_S = (0.02, 0.5)
"""The first and the longest pause between two attempts (doubling)."""


class ChainRoute:
    """Pushes to the head and pulls from the tail of one shard's chain of ``copies`` (in chain order at first)."""

    def __init__(self, shard: int, copies: Sequence[ActorRef], *, replica: str, give_up_s: float = GIVE_UP_S,
                 clock: Clock = time.monotonic) -> None:
        if not copies:
            raise ValueError(f"shard {shard}: a chain needs at least one copy")
        self.shard = shard
        self.copies = list(copies)
        self.view = ChainView(shard, 0, list(copies), [])
        self.replica = replica
        self.give_up_s = give_up_s
        self._clock = clock
        self.acknowledged = 0
        """Pushes the chain acknowledged as applied."""
        self.refused = 0
        """Pushes the chain acknowledged as not applied (stale, zombie, ...)."""
        self.sent_again = 0
        """Pushes that needed more than one attempt."""
        self.regressions = 0
        self.last_version = -1

    @property
    def alive(self) -> bool:
        return any(ref.is_alive for ref in self.view.chain)

    def _adopt(self, view: ChainView | None) -> bool:
        if view is None or view.number <= self.view.number or not view.chain:
            return False
        log.info("replica %s: shard %d chain view %d: head %s, tail %s", self.replica, self.shard, view.number,
                 view.chain[0].address, view.chain[-1].address)
        self.view = view
        known = {ref.address for ref in self.copies}
        # a copy that took a dead one's place (a spare) is asked for views too, once the first copies are gone
        self.copies.extend(ref for ref in view.chain if ref.address not in known)
        return True

    async def _refresh(self) -> None:
        """Adopt the newest view any copy holds."""
        async def one(ref: ActorRef) -> ChainView | None:
            try:
                reply = await ref.ask(GetChainView(), timeout=VIEW_TIMEOUT_S)
            except ActorError:
                return None
            return reply if isinstance(reply, ChainView) else None

        views = await asyncio.gather(*(one(ref) for ref in self.copies))
        for view in sorted((v for v in views if v is not None), key=lambda v: v.number):
            self._adopt(view)

    async def _pause(self, attempt: int, deadline: float, what: str, detail: str) -> None:
        if self._clock() >= deadline:
            log.warning("replica %s: %s shard %d failed for %.0f s, last: %s", self.replica, what, self.shard,
                        self.give_up_s, detail)
            raise AskTimeout(f"chain of shard {self.shard}", self.give_up_s)
        await asyncio.sleep(min(RETRY_S[0] * 2 ** attempt, RETRY_S[1]))
        await self._refresh()

    async def push(self, push: Push) -> None:
        """Send ``push`` until the chain acknowledges it."""
        deadline = self._clock() + self.give_up_s
        attempt = 0
        while True:
            head = self.view.chain[0]
            try:
                ack = await head.ask(ChainPush(push), timeout=self.give_up_s)
                detail = f"{getattr(ack, 'status', ack)} from {head.address}"
            except ActorError as exc:
                ack, detail = None, repr(exc)
            if isinstance(ack, ChainAck):
                if ack.status == "ok":
                    if ack.verdict == "applied":
                        self.acknowledged += 1
                    else:
                        self.refused += 1
                    if attempt:
                        self.sent_again += 1
                        log.info("replica %s: push %d acknowledged by shard %d after %d attempts", self.replica,
                                 push.seq, self.shard, attempt + 1)
                    return
                self._adopt(ack.view)
            await self._pause(attempt, deadline, "push to", detail)
            attempt += 1

    async def _ask_tail(self, msg: Any, timeout: float | None) -> tuple[Any, ActorRef]:
        """``msg`` answered by the tail, or by the copy before it while a joining tail still waits for its state
        (that copy holds every acknowledged push); the answer and who gave it."""
        chain = self.view.chain
        for i in range(len(chain) - 1, -1, -1):
            try:
                return await chain[i].ask(msg, timeout=timeout), chain[i]
            except ActorError as exc:
                if i == 0 or not _catching_up(exc):
                    raise
            except CatchingUp:
                if i == 0:
                    raise
        raise AssertionError("unreachable: a view's chain is never empty")

    async def pull(self, msg: Any, timeout: float | None) -> Any:
        """``msg`` (a pull) answered by the tail."""
        deadline = self._clock() + self.give_up_s
        attempt = 0
        while True:
            try:
                reply, tail = await self._ask_tail(msg, timeout)
            except (ActorError, CatchingUp) as exc:
                await self._pause(attempt, deadline, "pull from", repr(exc))
                attempt += 1
                continue
            version = int(getattr(reply, "version", -1))
            if version < self.last_version:
                self.regressions += 1
                log.warning("replica %s: shard %d version went back from %d to %d (%s)", self.replica, self.shard,
                            self.last_version, version, tail.address)
            self.last_version = max(self.last_version, version)
            return reply

    # -- the Destination a ShardLink's ref delivers to --------------------------------------
    def ask(self, msg: Any, timeout: float | None) -> Coroutine[Any, Any, Any]:
        return self.pull(msg, timeout)

    def tell(self, msg: Any) -> Coroutine[Any, Any, None]:
        if not isinstance(msg, Push):
            raise TypeError(f"a chain takes pushes, not {type(msg).__name__}")
        return self.push(msg)

    def tell_nowait(self, msg: Any) -> None:
        raise TypeError("a push to a chain waits for its acknowledgement: use tell")

    def unsent_bytes(self) -> int:
        """What is on its way to the chain's head."""
        return self.view.chain[0].unsent_bytes()

    def silent_for(self) -> float:
        """Since the chain's head's node was last heard from."""
        return self.view.chain[0].silent_for()


def _catching_up(exc: ActorError) -> bool:
    """Whether a remote copy refused a pull because it is still taking its state."""
    return getattr(exc, "remote_type", None) == CatchingUp.__name__


def chain_refs(copies: Sequence[ActorRef], n_shards: int, *, replica: str,
               clock: Clock = time.monotonic) -> list[ActorRef]:
    """One ref per shard from every shard's copies, shard-major (``copies[i * r + j]``: copy j of shard i)."""
    if n_shards < 1 or len(copies) % n_shards:
        raise ValueError(f"{len(copies)} PS copies do not divide into {n_shards} shards")
    r = len(copies) // n_shards
    return [ActorRef(f"chain-{i}@{copies[i * r].node}",
                     ChainRoute(i, copies[i * r:(i + 1) * r], replica=replica, clock=clock))
            for i in range(n_shards)]

