"""Sandblaster over replicated PS shards (``[sandblaster] ps_replicas = R > 1``): what changes on the coordinator.

Primary-backup with the coordinator as the sequencer (why, and how a copy
joins: :mod:`dniasync.train.sandblaster_queue`). The copies are placed and
watched as Downpour's are, by a :class:`~dniasync.cluster.chains.ChainKeeper`
(the same placement, ``COPY_PLACED`` log line, spares, events
``ps_copy_down`` / ``ps_copy_joined`` / ``ps_chain``, and the job fails when
every copy of a shard stays down): its views are each shard's live copies,
which the coordinator reads (:meth:`ReplicatedSandblasterJob.live_copies`);
their order means nothing here. The copies are
:class:`~dniasync.train.sandblaster.SandblasterShard` actors
(:class:`SandblasterCopyKeeper` hands out their specs).

The summary gets each copy's counters (``ps<k>_copy<j>_*``: ``stages``,
``commands``, ``transfers``, ``commanded``, ``x_sha256``), ``ps_copies_lost``
and ``ps_copies_rejoined`` (the keeper's events), ``ps_copy_transfers``,
``ps_copies_dropped``, ``ps_copy_disagreements``, ``commits_refused_copies``
(the coordinator's) and ``ps_copies_identical``: 1 when every shard's
commanded copies hold the same parameters at the end.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...actors import ActorRef
from ...train.chain import CopySpec
from ...train.sandblaster import SandblasterShardSpec
from ..chains import EVENT_PS_COPY_DOWN, EVENT_PS_COPY_JOINED, ChainKeeper, copy_stats
from ..protocol import Assignment, JoinJob, NoJob
from .sandblaster import _SandblasterJob

if TYPE_CHECKING:
    from ...train.specs import ShardSpec
    from ..report import RunReport

__all__ = ["ReplicatedSandblasterJob", "SandblasterCopyKeeper"]

log = logging.getLogger("dniasync.cluster.modes.sandblaster")


class SandblasterCopyKeeper(ChainKeeper):
    """A :class:`ChainKeeper` whose copies are Sandblaster shards: each copy's spec is the shard's
    :class:`~dniasync.train.sandblaster.SandblasterShardSpec` with its copy number (and ``joining``)."""

    def place(self, join: JoinJob) -> Assignment | NoJob:
        placed = super().place(join)
        if isinstance(placed, Assignment) and isinstance(placed.spec, CopySpec):
            spec = placed.spec
            shard: Any = spec.shard  # the keeper holds the job's specs: Sandblaster's, not Downpour's ShardSpec
            assert isinstance(shard, SandblasterShardSpec)
            return Assignment(dataclasses.replace(shard, copy=spec.copy, joining=spec.joining))
        return placed

    def _restart(self, k: int, member: str) -> ShardSpec:
        """No copy of shard ``k`` is left: the L-BFGS state is gone (there is no snapshot to restart from), and the
        coordinator, which has no copy left to take it from, ends the job. The copy starts from its first values."""
        log.warning("PS shard %d: every copy is gone; the one on %s holds only the first parameters", k, member)
        return self.specs[k]


class ReplicatedSandblasterJob(_SandblasterJob):
    """Sandblaster whose shards have copies: the runner takes its keeper, the coordinator its live copies."""

    keeper: SandblasterCopyKeeper | None = None

    def shard_keeper(self, specs: list[ShardSpec], event: Callable[..., None], *, lost_after_s: float,
                     samples: Callable[[], int]) -> SandblasterCopyKeeper:
        self.copy_events: Counter[str] = Counter()

        def counted(kind: str, **details: Any) -> None:
            self.copy_events[kind] += 1
            event(kind, **details)

        self.keeper = SandblasterCopyKeeper(specs, counted, lost_after_s=lost_after_s, samples=samples,
                                            copies=self.settings.ps_replicas)
        return self.keeper

    def live_copies(self) -> list[list[tuple[ActorRef, int]]]:
        """Each shard's copies in its view now (not declared down), with the incarnation of each one's process."""
        assert self.keeper is not None
        out: list[list[tuple[ActorRef, int]]] = []
        for k, view in enumerate(self.keeper.views):
            incarnation = {c.ref.address: c.incarnation for c in self.keeper.table[k] if c is not None and c.ref}
            chain = view.chain if view is not None else []
            out.append([(ref, incarnation.get(ref.address, -1)) for ref in chain])
        return out

    def extra(self) -> dict[str, Any]:
        out = super().extra()
        if self.keeper is not None:
            out.update(self.keeper.status())
        return out

    async def record(self, report: RunReport) -> None:
        await super().record(report)
        b = self.board
        report.set_metric("ps_copy_transfers", b.copy_transfers)
        report.set_metric("ps_copies_dropped", b.copies_dropped)
        report.set_metric("ps_copy_disagreements", b.copy_disagreements)
        report.set_metric("commits_refused_copies", b.commits_refused_copies)
        if self.keeper is None:
            return
        report.set_metric("ps_copies_lost", self.copy_events[EVENT_PS_COPY_DOWN])
        report.set_metric("ps_copies_rejoined", self.copy_events[EVENT_PS_COPY_JOINED])
        identical = True
        for k, row in enumerate(self.keeper.copies):
            commanded = {ref.address for ref in b.commanded[k]} if k < len(b.commanded) else set()
            digests = set()
            number = {ref.address: j for j, ref in enumerate(row) if ref is not None}
            async for ref, stats in copy_stats(report, k, row, ("stages", "commands", "transfers"),
                                               ("commanded", commanded)):
                report.set_metric(f"ps{k}_copy{number[ref.address]}_x_sha256", str(stats["x_sha256"]))
                if ref.address in commanded:
                    digests.add(stats["x_sha256"])
            identical = identical and len(digests) == 1
        report.set_metric("ps_copies_identical", int(identical))
