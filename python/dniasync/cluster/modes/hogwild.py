"""Hogwild! (Niu et al. 2011): worker processes update one shared-memory store without locks.

The coordinator creates the job's :class:`~dniasync._core.ParamStore` in
``/dev/shm`` (and removes it when the job ends, :mod:`._shared_store`); every
worker process maps it and applies each step in place with the Rust optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from msgspec import Meta

from ...train.sparse import sparse_mode
from ...train.specs import ReplicaSpec
from .._schema import Section
from ..mode_api import Hoster
from ..panels import Panel
from ._data_parallel import DataParallelMode, host_replica
from ._shared_store import SharedStoreJob

if TYPE_CHECKING:
    from torch import nn

    from ..config import Config
    from ..mode_api import Runner

__all__ = ["HOGWILD", "HogwildConfig"]


class HogwildConfig(Section, frozen=True):
    """Lock-free workers over one shared store (mode `hogwild`)."""

    n_workers: Annotated[int, Meta(ge=1, description="processes sharing one ParamStore; at most data.n_train")] = 1
    wait_for_workers_s: Annotated[float, Meta(ge=0.0, description=(
        "seconds the workers that are ready (data and model built) wait for the others before they start training "
        "without them: the workers start together once all n_workers are ready, and the job's clock with them; a "
        "worker ready later starts at once. 0: each starts when it is ready"))] = 60.0
    sparse: Annotated[Literal["auto"] | bool, Meta(description=(
        "step only the rows of an embedding table (`nn.Embedding`, `nn.EmbeddingBag` weights) that the gradient "
        "touched, so a worker never writes back rows another one is updating (the case Hogwild was designed "
        "for): `auto` when fewer than half a table's rows are touched, `true` always, `false` never. The "
        "parameters end where the dense step leaves them; with momentum, Nesterov, Adam or weight decay, which "
        "move untouched rows too, the store steps densely"))] = "auto"


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

    def job(self, config: Config, runner: Runner) -> SharedStoreJob:
        job = SharedStoreJob(config, runner, sparse_mode(config.settings.sparse))
        job.wait_for_trainers_s = config.settings.wait_for_workers_s
        job.trainers = "workers"
        return job

    def hosters(self) -> dict[type, Hoster]:
        return {ReplicaSpec: host_replica}


HOGWILD = _Hogwild()
