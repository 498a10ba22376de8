"""Downpour over replicated PS shards (``[downpour] ps_replicas = R > 1``): what changes on the coordinator.

The shards' copies are kept by a :class:`~dniasync.cluster.chains.ChainKeeper`
(the runner takes it from :meth:`ReplicatedDownpourJob.shard_keeper`), the
replicas are given every copy (``PSLinkSpec.ps`` shard-major: they reach each
shard through its chain, :mod:`dniasync.train.sync.chain`), and the summary
gets each copy's counters (``ps<k>_copy<j>_*``) and ``ps_acknowledged_pushes``:
the pushes the replicas saw acknowledged (with R > 1 a replica's ``pushes``
counts a push once every shard acknowledged it; its last count is asked for
when training stops), to set against what each copy applied, and
``ps_acknowledged_pushes_kept``: of those, the pushes every live copy of
every shard holds at the end (per incarnation of each replica, the fewer of
what it saw acknowledged and what each copy's state holds of it: a replica
sends its pushes one at a time, in order, so a copy holds a prefix of them).
Equal to ``ps_acknowledged_pushes`` when nothing was lost. The job's status
(:meth:`ReplicatedDownpourJob.extra`) gets each shard's chain now
(``ps_chains``: :meth:`~dniasync.cluster.chains.ChainKeeper.chains`) and
``ps_chain_changes``: the live page and the coordinator's metrics show them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...actors import ActorError
from ...train.chain import pusher
from ...train.messages import Progress, StopTraining
from ...train.specs import PSLinkSpec, ShardSpec
from ..chains import ChainKeeper, record_chains
from .downpour import _DownpourJob

if TYPE_CHECKING:
    from ..config import Config
    from ..mode_api import Runner
    from ..report import RunReport
    from ._data_parallel import _Replica

__all__ = ["ReplicatedDownpourJob"]

STOP_TIMEOUT_S = 10.0


class ReplicatedDownpourJob(_DownpourJob):
    def __init__(self, config: Config, runner: Runner) -> None:
        super().__init__(config, runner)
        self.keeper: ChainKeeper | None = None
        self.acknowledged: dict[tuple[str, int], int] = {}
        """(replica, incarnation) -> the pushes it last reported acknowledged."""

    def shard_keeper(self, specs: list[ShardSpec], event: Callable[..., None], *, lost_after_s: float,
                     samples: Callable[[], int]) -> ChainKeeper:
        self.keeper = ChainKeeper(specs, event, lost_after_s=lost_after_s, samples=samples,
                                  copies=self.settings.ps_replicas)
        return self.keeper

    def sync_spec(self) -> PSLinkSpec:
        assert self.keeper is not None
        copies = [ref for row in self.keeper.copies for ref in row if ref is not None]
        return dataclasses.replace(super().sync_spec(), ps=copies)

    def extra(self) -> dict[str, Any]:
        out = super().extra()
        if self.keeper is not None:
            out.update(self.keeper.status())
        return out

    def progress(self, msg: Progress) -> None:
        state = self.replicas.get(msg.replica)
        if state is not None and state.incarnation == msg.incarnation:  # a fenced one's count stands too
            key = (msg.replica, msg.incarnation)
            self.acknowledged[key] = max(self.acknowledged.get(key, 0), msg.pushes)
        super().progress(msg)

    async def stop_one(self, state: _Replica, reason: str) -> None:
        """Stop it and wait: its last count of acknowledged pushes arrives before the answer."""
        if state.ref is None:
            return
        try:
            await state.ref.ask(StopTraining(reason), timeout=STOP_TIMEOUT_S)
        except ActorError:
            pass

    async def record(self, report: RunReport) -> None:
        await super().record(report)
        if self.keeper is None:
            report.set_metric("ps_acknowledged_pushes", sum(self.acknowledged.values()))
            return
        await record_chains(report, self.keeper, {pusher(*who): n for who, n in self.acknowledged.items()})
