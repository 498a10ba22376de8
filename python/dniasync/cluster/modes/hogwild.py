"""Hogwild! (Niu et al. 2011): worker processes update one shared-memory store without locks.

The coordinator creates the job's :class:`~dniasync._core.ParamStore` in
``/dev/shm`` (and removes it when the job ends); every worker process maps it
and applies each step in place with the Rust optimizer.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from msgspec import Meta

from ...train.sparse import sparse_mode
from ...train.specs import ReplicaSpec, SharedStoreSpec
from .._schema import Section
from ..mode_api import Hoster, Snapshot
from ..panels import Panel
from ._data_parallel import DataParallelJob, DataParallelMode, host_replica

if TYPE_CHECKING:
    from torch import nn

    from ...train.checkpoint import LoadedCheckpoint, Part

    from ..config import Config
    from ..mode_api import Runner

__all__ = ["HOGWILD", "HogwildConfig"]


class HogwildConfig(Section, frozen=True):
    """Lock-free workers over one shared store (mode `hogwild`)."""

    n_workers: Annotated[int, Meta(ge=1, description="processes sharing one ParamStore; at most data.n_train")] = 1
    sparse: Annotated[Literal["auto"] | bool, Meta(description=(
        "step only the rows of an embedding table (`nn.Embedding`, `nn.EmbeddingBag` weights) that the gradient "
        "touched, so a worker never writes back rows another one is updating (the case Hogwild was designed "
        "for): `auto` when fewer than half a table's rows are touched, `true` always, `false` never. The "
        "parameters end where the dense step leaves them; with momentum, Nesterov, Adam or weight decay, which "
        "move untouched rows too, the store steps densely"))] = "auto"


class _HogwildJob(DataParallelJob):
    def __init__(self, config: Config, runner: Runner) -> None:
        from ... import _core
        from ...train.sync import HOGWILD_SEGMENT

        super().__init__(config, runner)
        name = f"{config.job.name}-{os.getpid()}"
        if os.path.exists(f"/dev/shm/dniasync-{name}") and _core.ParamStore.is_stale(name):
            _core.ParamStore.remove_stale(name)  # left by a crashed run with our pid
        self.store = self.optimizer_spec.store([(HOGWILD_SEGMENT, self.n_params)], shm_name=name)
        self.store.write(HOGWILD_SEGMENT, self.initial)
        self.shm_name = name
        self.segment = HOGWILD_SEGMENT

    def sync_spec(self) -> SharedStoreSpec:
        return SharedStoreSpec(self.shm_name, sparse_mode(self.config.settings.sparse))

    async def snapshot(self) -> Snapshot:
        return Snapshot(self.store.view(self.segment).copy())

    def checkpoint(self) -> tuple[dict[str, Any], dict[str, Part]]:
        from ...train.checkpoint import Part

        meta, _ = super().checkpoint()
        tensors = {"values": self.store.view(self.segment).copy()}
        for slot in range(1, self.store.state_slots + 1):
            tensors[f"state{slot}"] = self.store.view(self.segment, state=slot).copy()
        return meta, {"hogwild": Part(tensors)}

    def restore(self, loaded: LoadedCheckpoint) -> None:
        super().restore(loaded)
        tensors = loaded.tensors("hogwild")
        for slot in range(self.store.state_slots + 1):
            self.store.write(self.segment, tensors["values" if slot == 0 else f"state{slot}"], state=slot)

    async def close(self) -> None:
        self.store.close()


class _Hogwild(DataParallelMode):
    name = "hogwild"
    settings = HogwildConfig
    shards_key = "hogwild.n_workers"
    worker_kind = "worker"
    schedules = True

    def data_shards(self, settings: HogwildConfig) -> int:
        return settings.n_workers

    def syncs(self, settings: HogwildConfig) -> tuple[str, ...]:
        return ("shm",)

    def check(self, config: Config, raw: Mapping[str, Any]) -> None:
        return

    def resolve(self, config: Config, model: nn.Module) -> None:
        return

    def processes(self, config: Config) -> tuple[int, int]:
        return 0, config.settings.n_workers

    def summary_lines(self, config: Config, doc: Mapping[str, Any]) -> list[str]:
        return []

    def panels(self, config: Config) -> tuple[Panel, ...]:
        return ()  # one shared store: no pushes, no bytes, no staleness to chart

    def job(self, config: Config, runner: Runner) -> _HogwildJob:
        return _HogwildJob(config, runner)

    def hosters(self) -> dict[type, Hoster]:
        return {ReplicaSpec: host_replica}


HOGWILD = _Hogwild()
