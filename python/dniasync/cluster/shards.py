"""The job's PS shards as the job runner keeps them: placement, liveness, snapshots, restarts.

Each shard goes to the first PS host that asks. The runner takes a snapshot
of every shard now and then (parameters, optimizer state, version, push
ledger, fenced replicas: :class:`~dniasync.train.messages.ShardSnapshot`).
A host that joins again with a new incarnation (its process was restarted,
by the launcher or an operator) gets its shard back from the last snapshot,
so training loses at most one snapshot interval of that shard's updates, and
its version continues above any version a replica has seen, never back.
A shard that stays unreachable for ``lost_after_s`` ends the job.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from ..actors import ActorError, ActorRef, ActorSystem
from ..train.messages import ShardSnapshot, SnapshotShard
from ..train.specs import ShardResume, ShardSpec
from .mode_api import JobFailed
from .protocol import Assignment, JoinJob, NoJob
from .report import EVENT_PS_RESTARTED

__all__ = ["EVENT_PS_DOWN", "EVENT_PS_LOST", "EVENT_PS_UP", "ShardKeeper"]

log = logging.getLogger("dniasync.cluster.shards")

EVENT_PS_DOWN: Final = "ps_down"
EVENT_PS_UP: Final = "ps_up"
EVENT_PS_LOST: Final = "ps_lost"


@dataclass
class _Host:
    shard: int
    incarnation: int


class ShardKeeper:
    """Where each PS shard lives and what it held at the last snapshot."""

    def __init__(self, specs: list[ShardSpec], event: Callable[..., None], *, lost_after_s: float,
                 samples: Callable[[], int] = lambda: 0) -> None:
        self.specs = specs
        self.refs: list[ActorRef | None] = [None] * len(specs)
        self.snapshots: dict[int, ShardSnapshot] = {}
        self.restarts = 0
        self._event = event
        self._lost_after_s = lost_after_s
        self._hosts: dict[str, _Host] = {}
        self._down: dict[int, float] = {}
        self._seen_versions = [0] * len(specs)
        self._samples = samples
        self._snapshot_samples: dict[int, int] = {}
        """The job's samples when each shard's snapshot was taken: a restart loses the updates of those since."""

    @property
    def placed(self) -> bool:
        return all(ref is not None for ref in self.refs)

    def note_version(self, shard: int, version: int) -> None:
        """A version of ``shard`` somebody was served: a restart continues above it."""
        if 0 <= shard < len(self._seen_versions):
            self._seen_versions[shard] = max(self._seen_versions[shard], version)

    # -- placement --------------------------------------------------------------
    def place(self, join: JoinJob) -> Assignment | NoJob:
        host = self._hosts.get(join.member)
        if host is None:
            placed = {h.shard for h in self._hosts.values()}
            free = [k for k in range(len(self.specs)) if k not in placed]
            if not free:
                return NoJob("every PS shard is hosted", retry=False)
            host = self._hosts[join.member] = _Host(free[0], join.incarnation)
            log.info("PS shard %d (%d parameters) goes to %s", host.shard, self.specs[host.shard].values.size,
                     join.member)
            return Assignment(self.specs[host.shard])
        if join.incarnation == host.incarnation:
            return Assignment(self.specs[host.shard])  # a retried join: the same answer
        host.incarnation = join.incarnation
        return Assignment(self._restart(host.shard, join.member))

    def _restart(self, k: int, member: str) -> ShardSpec:
        spec = self.specs[k]
        snap = self.snapshots.get(k)
        version = max(snap.version if snap else 0, self._seen_versions[k]) + 1
        self.restarts += 1
        self._event(EVENT_PS_RESTARTED, shard=k, host=member, version=version,
                    snapshot_version=snap.version if snap else -1,
                    samples_since_snapshot=self._samples() - self._snapshot_samples.get(k, 0))
        if snap is None:  # never snapshotted: its initial values, its updates lost
            log.warning("PS shard %d restarts on %s from its initial values (no snapshot yet)", k, member)
            resume = ShardResume(version, [], {}, [])
            return ShardSpec(k, spec.offset, spec.values, spec.optimizer, spec.codec, spec.staleness,
                             spec.max_staleness, resume)
        log.warning("PS shard %d restarts on %s from its snapshot at version %d (now %d)", k, member, snap.version,
                    version)
        resume = ShardResume(version, snap.state, snap.ledger, snap.fenced, snap.steps)
        return ShardSpec(k, spec.offset, snap.values, spec.optimizer, spec.codec, spec.staleness, spec.max_staleness,
                         resume)

    def ready(self, member: str, refs: list[ActorRef]) -> bool:
        """Note a PS host's shard ref; False if ``member`` hosts no shard."""
        host = self._hosts.get(member)
        if host is None:
            return False
        self.refs[host.shard] = refs[0]
        if self.placed:
            log.info("all %d PS shards ready", len(self.refs))
        return True

    # -- a standby coordinator's view ----------------------------------------------------
    def follow(self) -> list[list[Any]]:
        """``[member, incarnation, shard, ref address]`` of every hosted shard (a standby adopts them)."""
        return [[member, host.incarnation, host.shard, ref.address if (ref := self.refs[host.shard]) else ""]
                for member, host in self._hosts.items()]

    def adopt(self, system: ActorSystem, hosted: list[list[Any]]) -> None:
        """Take over the shards a dead coordinator placed (:meth:`follow`'s list): the same processes go on."""
        for member, incarnation, shard, address in hosted:
            self._hosts[member] = _Host(int(shard), int(incarnation))
            if address:
                self.refs[int(shard)] = system.ref(address)

    def addresses(self) -> list[str]:
        """The actors a new coordinator tells of itself: each PS host and shard."""
        return [*self._hosts, *(ref.address for ref in self.refs if ref is not None)]

    # -- liveness -----------------------------------------------------------------
    def check(self, now: float) -> None:
        for k, ref in enumerate(self.refs):
            if ref is None:
                continue
            if ref.is_alive:
                if self._down.pop(k, None) is not None:
                    self._event(EVENT_PS_UP, shard=k, address=ref.address)
                    log.info("PS shard %d at %s is reachable again", k, ref.address)
                continue
            since = self._down.setdefault(k, now)
            if since == now:
                self._event(EVENT_PS_DOWN, shard=k, address=ref.address,
                            samples_since_snapshot=self._samples() - self._snapshot_samples.get(k, 0))
                log.warning("PS shard %d at %s is unreachable", k, ref.address)
            elif now - since >= self._lost_after_s:
                raise JobFailed(f"PS shard {k} at {ref.address} is down (unreachable for {now - since:.0f} s)",
                                EVENT_PS_LOST, shard=k, address=ref.address)

    # -- snapshots -----------------------------------------------------------------
    async def snapshot(self, timeout_s: float = 10.0) -> int:
        """Take every reachable shard's snapshot; returns how many were taken.

        Each shard's snapshot is kept as soon as it arrives: a frozen shard delays
        the checkpoint on disk, not the in-memory snapshot another shard restarts from.
        """
        samples = self._samples()

        async def one(ref: ActorRef) -> bool:
            try:
                reply = await ref.ask(SnapshotShard(), timeout=timeout_s)
            except (ActorError, TimeoutError) as exc:
                log.info("no snapshot of %s this time: %r", ref.address, exc)
                return False
            assert isinstance(reply, ShardSnapshot)
            self.snapshots[reply.shard] = reply
            self._snapshot_samples[reply.shard] = samples
            self.note_version(reply.shard, reply.version)
            return True

        live = [ref for ref in self.refs if ref is not None and ref.is_alive]
        taken = sum(await asyncio.gather(*(one(ref) for ref in live)))
        if taken:
            log.info("snapshot of %d PS shard(s), versions %s", taken,
                     {k: snap.version for k, snap in sorted(self.snapshots.items())})
        return taken
