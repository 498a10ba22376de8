"""The job side of a shared-memory store (sync kind ``shm``): Hogwild, and Downpour on one host.

The coordinator creates the job's :class:`~dniasync._core.ParamStore` in
``/dev/shm`` with the model's initial weights (and removes it when the job
ends); every trainer process maps it (:mod:`dniasync.train.sync.shm`).
Snapshots and checkpoints read the store directly.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ...train.specs import SharedStoreSpec
from ..mode_api import Snapshot
from ._data_parallel import DataParallelJob

if TYPE_CHECKING:
    from ...train.checkpoint import LoadedCheckpoint, Part

    from ..config import Config
    from ..mode_api import Runner

__all__ = ["SharedStoreJob"]


class SharedStoreJob(DataParallelJob):
    """A data-parallel job whose trainers share one store in ``/dev/shm``; each trainer fetches and steps it
    as ``n_fetch`` and ``n_push`` say (0 and 0: Hogwild's live views), embedding tables as ``sparse`` says."""

    def __init__(self, config: Config, runner: Runner, sparse: str, n_fetch: int = 0, n_push: int = 0) -> None:
        from ... import _core
        from ...train.sync import HOGWILD_SEGMENT

        super().__init__(config, runner)
        name = f"{config.job.name}-{os.getpid()}"
        if os.path.exists(f"/dev/shm/dniasync-{name}") and _core.ParamStore.is_stale(name):
            _core.ParamStore.remove_stale(name)  # left by a crashed run with our pid
        self.store = self.optimizer_spec.store([(HOGWILD_SEGMENT, self.n_params)], shm_name=name)
        self.store.write(HOGWILD_SEGMENT, self.initial)
        self.spec = SharedStoreSpec(name, sparse, n_fetch, n_push)
        self.segment = HOGWILD_SEGMENT

    def sync_spec(self) -> SharedStoreSpec:
        return self.spec

    async def snapshot(self) -> Snapshot:
        return Snapshot(self.store.view(self.segment).copy())

    def checkpoint(self) -> tuple[dict[str, Any], dict[str, Part]]:
        from ...train.checkpoint import Part

        meta, _ = super().checkpoint()
        tensors = {"values": self.store.view(self.segment).copy()}
        for slot in range(1, self.store.state_slots + 1):
            tensors[f"state{slot}"] = self.store.view(self.segment, state=slot).copy()
        return meta, {"hogwild": Part(tensors, {"steps": self.store.steps(self.segment)})}

    def restore(self, loaded: LoadedCheckpoint) -> None:
        super().restore(loaded)
        tensors = loaded.tensors("hogwild")
        for slot in range(self.store.state_slots + 1):
            self.store.write(self.segment, tensors["values" if slot == 0 else f"state{slot}"], state=slot)
        # Adam's bias correction goes on from the saved count (a checkpoint from before it was saved: the job's
        # steps, every one of them a step of this store)
        self.store.set_steps(self.segment, int(loaded.part_meta("hogwild").get("steps", self.steps_before)))

    async def close(self) -> None:
        self.store.close()
