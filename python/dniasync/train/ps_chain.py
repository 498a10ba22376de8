"""One copy of a replicated PS shard: a :class:`~dniasync.train.ps.PSShard` that is a link of a chain.

Why chain replication rather than primary-backup: both acknowledge a push
only once every live copy applied it; the chain does it with one message per
copy per push (primary-backup: the primary sends to every backup), it needs
no extra step to agree on an order (each copy applies in the order its
predecessor forwards), and its tail is a copy that holds exactly the
acknowledged pushes, which is where pulls go, so a replica never reads a
version a failure could take back.

A copy handles one message at a time (the actor's contract), and a push's
handler returns only once the copy after it answered: so every copy applies
the pushes in the head's order, and the head's answer means the tail has it.
The head decides what a push is (applied, or refused as stale, duplicate,
zombie...) through :meth:`PSShard.push` itself; a copy after it runs the same
code on the same state, which gives the same verdict (a different one is
counted as ``divergent`` and logged). Each push is applied at most once per
copy (the push ledger); one sent again after a failure is answered with the
verdict it had. A copy keeps the pushes it could not forward (its successor
died) and forwards them, in order, before anything else once the chain has
closed around the dead copy.

A restarted copy joins at the tail: its predecessor sends it its whole state
(:class:`~dniasync.train.chain.CopyState`) while handling the view that adds
it, before it forwards it a single push, so nothing falls between the state
and the pushes that follow; until then it answers no pull.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..actors import ActorError, ActorRef, handler
from .chain import ChainAck, ChainPush, ChainView, CopySpec, CopyState, GetChainView, pusher
from .messages import Fence, Params, ParamsDelta, Pull, PullDelta, Push, ShardStats, SnapshotShard
from .ps import SEGMENT, PSShard
from .staleness import PushLedger

__all__ = ["ChainShard", "FORWARD_TIMEOUT_S"]

log = logging.getLogger("dniasync.train.ps_chain")

FORWARD_TIMEOUT_S = 10.0
"""How long a copy waits for the next one to take a push (a dead one fails at once: its connection drops)."""
STATE_TIMEOUT_S = 60.0
"""How long a copy waits for a joining successor to take its state."""


class CatchingUp(RuntimeError):
    """A joining copy has not received its state yet: ask the tail of the current chain."""


class ChainShard(PSShard):
    """Copy ``spec.copy`` of a PS shard, linked into its chain by the views the job runner sends."""

    def __init__(self, spec: CopySpec) -> None:
        super().__init__(spec.shard)
        self.copy = spec.copy
        self.view: ChainView | None = None
        self.catching_up = spec.joining
        self._verdicts: dict[str, tuple[int, int, str]] = {}
        """replica -> (incarnation, seq, verdict) of the last push of it this copy took."""
        self._unforwarded: list[tuple[Push, str]] = []
        """Pushes taken here that the next copy has not acknowledged, in order, with their verdicts."""
        self.forwarded = 0
        self.acknowledged = 0
        """Pushes this copy answered ``ok`` as the head."""
        self.divergent = 0
        self.transfers = 0
        self.applied_by: dict[str, int] = {}
        """:func:`pusher` -> pushes of that incarnation of that replica in this copy's state (a joining copy takes
        its predecessor's): set against what the replicas saw acknowledged, what a failure lost."""
        self._owes_state = ""
        """The address of a joining successor that has not taken this copy's state yet."""

    # -- where this copy stands --------------------------------------------------------
    def _position(self, view: ChainView | None) -> int | None:
        if view is None:
            return None
        me = self.ref.address
        for i, ref in enumerate(view.chain):
            if ref.address == me:
                return i
        return None

    def _successor(self, view: ChainView | None) -> ActorRef | None:
        pos = self._position(view)
        if view is None or pos is None or pos + 1 >= len(view.chain):
            return None
        return view.chain[pos + 1]

    @handler
    def get_chain_view(self, msg: GetChainView) -> ChainView | None:
        return self.view

    @handler
    async def chain_view(self, msg: ChainView) -> bool:
        """A new view from the job runner: a joining successor gets this copy's state before anything else."""
        if self.view is not None and msg.number <= self.view.number:
            return True
        self.view = msg
        pos = self._position(msg)
        if pos is None:
            log.warning("shard %d copy %d: not in view %d of the chain any more", self.shard, self.copy, msg.number)
            return True
        after = self._successor(msg)
        log.info("shard %d copy %d: view %d, position %d of %d", self.shard, self.copy, msg.number, pos,
                 len(msg.chain))
        if self.ref.address in msg.joining and not self.catching_up:
            # cut out while it could not be reached, back in at the tail: its own state is behind the chain's
            self.catching_up = True
            log.info("shard %d copy %d: rejoins; it takes its predecessor's state", self.shard, self.copy)
        if self.catching_up and pos > 0:
            await self._greet(msg.chain[pos - 1])
        self._owes_state = after.address if after is not None and after.address in msg.joining else ""
        if after is None:
            self._unforwarded.clear()  # the tail: what it took is acknowledged
        elif self._owes_state:
            await self._send_state(after)
        return True

    async def _greet(self, before: ActorRef) -> None:
        """Reach the copy this one joins after, so that its node has a connection to this (restarted) one before it
        sends the state: its own dialer may be backing off from the address's previous process."""
        try:
            await before.ask(GetChainView(), timeout=STATE_TIMEOUT_S)
        except ActorError as exc:
            log.warning("shard %d copy %d: could not reach %s: %r", self.shard, self.copy, before.address, exc)

    async def _send_state(self, after: ActorRef) -> bool:
        """Send the joining successor this copy's state (again at the next forward if it does not take it)."""
        state = CopyState(self.snapshot(SnapshotShard()),
                          {r: [inc, seq, verdict] for r, (inc, seq, verdict) in self._verdicts.items()},
                          dict(self.applied_by))
        try:
            await after.ask(state, timeout=STATE_TIMEOUT_S)
        except ActorError as exc:
            log.warning("shard %d copy %d: could not send the state to %s: %r", self.shard, self.copy, after.address,
                        exc)
            return False
        self._owes_state = ""
        self.transfers += 1
        self._unforwarded.clear()  # the state holds them
        log.info("shard %d copy %d: sent its state at version %d to %s", self.shard, self.copy, self.version,
                 after.address)
        return True

    @handler
    def copy_state(self, msg: CopyState) -> bool:
        """The state of the predecessor this copy joins after."""
        snap = msg.snapshot
        self.store.write(SEGMENT, np.ascontiguousarray(snap.values, dtype=np.float32).reshape(-1))
        for slot, values in enumerate(snap.state, start=1):
            self.store.write(SEGMENT, np.ascontiguousarray(values, dtype=np.float32).reshape(-1), state=slot)
        self.store.set_steps(SEGMENT, snap.steps)
        self._version_offset = snap.version - self.store.version(SEGMENT)
        self.ledger = PushLedger.restore(snap.ledger)
        self.fenced = set(snap.fenced)
        self._verdicts = {r: (int(v[0]), int(v[1]), str(v[2])) for r, v in msg.verdicts.items()}
        self.applied_by = {key: int(n) for key, n in msg.applied_by.items()}
        self.followers.clear()
        self.catching_up = False
        log.info("shard %d copy %d: took its predecessor's state at version %d", self.shard, self.copy, self.version)
        return True

    # -- pushes ----------------------------------------------------------------------
    def _take(self, push: Push) -> str:
        """Apply ``push`` here as a plain shard would; what became of it (``applied`` or a rejection)."""
        last = self._verdicts.get(push.replica)
        if last is not None and (last[0], last[1]) == (push.incarnation, push.seq):
            return last[2]  # sent again after a failure: taken already
        applied, rejected = self.applied, dict(self.rejected)
        PSShard.push(self, push)
        if self.applied > applied:
            verdict = "applied"
            key = pusher(push.replica, push.incarnation)
            self.applied_by[key] = self.applied_by.get(key, 0) + 1
        else:
            verdict = next((k for k, n in self.rejected.items() if n > rejected.get(k, 0)), "rejected")
        if verdict not in ("duplicate", "zombie"):  # the ledger took it: remember what it became
            self._verdicts[push.replica] = (push.incarnation, push.seq, verdict)
        return verdict

    @handler
    async def chain_push(self, msg: ChainPush) -> ChainAck:
        view = self.view
        pos = self._position(view)
        if self.catching_up or view is None or pos is None:
            return ChainAck("redirect", "", self.version, view)
        if not msg.origin:
            if pos != 0:
                return ChainAck("redirect", "", self.version, view)
        elif msg.view != view.number or pos == 0 or view.chain[pos - 1].address != msg.origin:
            return ChainAck("redirect", "", self.version, view)
        verdict = self._take(msg.push)
        if msg.origin and msg.verdict and verdict != msg.verdict and verdict != "duplicate":
            self.divergent += 1
            log.error("shard %d copy %d: push %s/%d: the head's verdict was %s, here %s", self.shard, self.copy,
                      msg.push.replica, msg.push.seq, msg.verdict, verdict)
        verdict = msg.verdict or verdict
        if verdict in ("zombie", "duplicate") and not msg.origin:
            return ChainAck("ok", verdict, self.version)  # nothing was written: nothing to forward
        if not await self._forward(msg.push, verdict):
            return ChainAck("broken", verdict, self.version, self.view)
        if not msg.origin:
            self.acknowledged += 1
        return ChainAck("ok", verdict, self.version)

    async def _forward(self, push: Push, verdict: str) -> bool:
        """Forward what the next copy lacks, ``push`` last; True once it has all of it."""
        key = (push.replica, push.incarnation, push.seq)
        if not any((p.replica, p.incarnation, p.seq) == key for p, _ in self._unforwarded):
            self._unforwarded.append((push, verdict))
        view = self.view
        after = self._successor(view)
        if after is None or view is None:
            self._unforwarded.clear()
            return True
        if self._owes_state == after.address and not await self._send_state(after):
            return False
        while self._unforwarded:
            pending, said = self._unforwarded[0]
            try:
                ack = await after.ask(ChainPush(pending, view.number, self.ref.address, said),
                                      timeout=FORWARD_TIMEOUT_S)
            except ActorError as exc:
                log.info("shard %d copy %d: %s did not take a push: %r", self.shard, self.copy, after.address, exc)
                return False
            if not isinstance(ack, ChainAck) or ack.status != "ok":
                return False
            self._unforwarded.pop(0)
            self.forwarded += 1
        return True

    @handler
    def fence(self, msg: Fence) -> None:
        super().fence(msg)
        after = self._successor(self.view)
        if after is not None:  # behind the pushes already forwarded, ahead of the next ones
            try:
                after.tell_nowait(msg)
            except ActorError as exc:
                log.info("shard %d copy %d: could not pass the fence of %s on: %r", self.shard, self.copy,
                         msg.replica, exc)

    # -- pulls: never from a copy still catching up ---------------------------------------
    def _serving(self) -> None:
        if self.catching_up:
            raise CatchingUp(f"shard {self.shard} copy {self.copy} is taking its state; pull from the chain's tail")

    @handler
    def pull(self, msg: Pull) -> Params:
        self._serving()
        return super().pull(msg)

    @handler
    def pull_delta(self, msg: PullDelta) -> ParamsDelta:
        self._serving()
        return super().pull_delta(msg)

    @handler
    def stats(self, msg: ShardStats) -> dict[str, Any]:
        return {**super().stats(msg), "copy": self.copy, "view": self.view.number if self.view else 0,
                "forwarded": self.forwarded, "acknowledged": self.acknowledged, "divergent": self.divergent,
                "transfers": self.transfers, "catching_up": int(self.catching_up), "applied_by": dict(self.applied_by)}
