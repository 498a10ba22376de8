"""Downpour SGD (Dean et al. 2012): replicas push gradients to, and pull parameters from, PS shards.

The flat parameter vector is cut into ``n_ps_shards`` contiguous ranges,
each served by a :class:`~dniasync.train.ps.PSShard` that applies pushes
asynchronously with ``[optimizer]`` (and the staleness policy); every worker
process runs one :class:`~dniasync.train.replica.Replica` on its own data shard.
With a codec, traffic is compressed both ways: quantized gradients up,
quantized parameter deltas down, a dense pull every ``resync_every``.

With ``[sync] local_steps = H > 1`` (DiLoCo, Downpour's ``n_push`` done the
modern way) each replica steps its own copy of ``[optimizer]`` for H steps,
then pushes the pseudo-gradient (weights at its last pull minus now) and pulls.
The shards run the outer optimizer instead of ``[optimizer]``: Nesterov with
``sync.outer_momentum`` and lr ``sync.outer_lr / n_replicas``. DiLoCo's outer
lr applies to the mean of the N replicas' pseudo-gradients, once per round; the
shards apply each replica's push as it arrives, N outer steps per round. N
steps of lr/N on the N pushes move the weights exactly as one step of lr on
their mean without momentum; with it, the steady-state step per round is the
same (lr times the mean over 1 - momentum), the momentum decaying per push
instead of per round.

With ``[sync] kind = "shm"`` (every replica on one host) the parameter server
is the machine's shared-memory store (:mod:`._shared_store`): each replica
copies the weights from it every ``n_fetch`` steps and applies its gradient
summed over ``n_push`` steps with the store's Rust optimizer. No PS process
shares the cores and nothing goes through a socket.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal

from msgspec import Meta

from ...actors import ActorError, ActorRef, Directive
from ...train.chain import CopySpec
from ...train.messages import Params, Pull, ShardStats
from ...train.sparse import sparse_mode
from ...train.specs import OptimizerSpec, PSLinkSpec, ReplicaSpec, ShardSpec
from .._schema import ConfigError, KeyProblem, Section
from ..chains import host_copy
from ..mode_api import Hoster, Snapshot
from ..panels import PS_PANELS, Panel
from ..plan import codec_spec
from ._data_parallel import DataParallelJob, DataParallelMode, host_replica
from ._shared_store import SharedStoreJob

if TYPE_CHECKING:
    from torch import nn

    from ..config import Config
    from ..hosts import Host
    from ..mode_api import Runner
    from ..report import RunReport

__all__ = ["DOWNPOUR", "DownpourConfig", "record_ps_stats"]


class DownpourConfig(Section, frozen=True):
    """Replicas, PS shards, fetch/push cadence, codec, staleness (mode `downpour`)."""

    only_for = {"tau": ("codec", ("threshold",)), "block": ("codec", ("onebit", "int8")),
                "delta_tau": ("codec", ("threshold",)), "resync_every": ("codec", ("threshold", "onebit", "int8")),
                "max_staleness": ("staleness", ("bound",))}

    n_replicas: Annotated[int, Meta(ge=1, description="model replicas, one data shard each; at most data.n_train")] = 1
    n_ps_shards: Annotated[int, Meta(ge=1, description=(
        "the flat parameter vector is cut into this many contiguous ranges (at most the number of parameters)"))] = 1
    n_fetch: Annotated[int, Meta(ge=1, description="a replica pulls parameters every n_fetch steps")] = 1
    n_push: Annotated[int, Meta(ge=1, description="it pushes its accumulated gradient every n_push steps")] = 1
    warm_start_steps: Annotated[int, Meta(ge=0, description=(
        "steps the first replica runs alone before the others start (DistBelief's warm start). While the replicas "
        "wait for each other (`wait_for_replicas_s`), the others build their data and model meanwhile and start "
        "once its progress report says it took them; with 0 s of waiting they join only then"))] = 0
    wait_for_replicas_s: Annotated[float, Meta(ge=0.0, description=(
        "seconds the replicas that are ready (data and model built) wait for the others before they start training "
        "without them: the replicas start together once all n_replicas are ready, and the job's clock with them; a "
        "replica ready later starts at once; with a warm start, the first alone. 0: each starts when it is "
        "ready"))] = 60.0
    codec: Annotated[Literal["none", "threshold", "onebit", "int8"], Meta(description=(
        "gradient compression: `threshold` (Strom), `onebit` (1-bit SGD), `int8` (blockwise 8-bit)"))] = "none"
    tau: Annotated[float, Meta(gt=0.0, description="the threshold; required with `threshold`")] | None = None
    block: Annotated[int, Meta(ge=1, description="block size for `onebit` (a multiple of 8) and `int8`")] = 256
    delta_tau: Annotated[float, Meta(gt=0.0, description=(
        "with `threshold`, the threshold of the parameter deltas PS shards send replicas (a replica's copy stays "
        "within it of the shard's parameters after each pull); default: 10% of the shard's parameter RMS, "
        "recomputed at each pull"))] | None = None
    resync_every: Annotated[int, Meta(ge=1, description=(
        "with a codec, PS shards answer a replica's pulls with quantized parameter deltas and every "
        "resync_every-th pull (and any pull after a missed answer) densely; 1: every pull dense"))] = 100
    staleness: Annotated[Literal["none", "inverse", "bound"], Meta(description=(
        "`inverse`: lr / staleness (Zhang et al. 2016); `bound`: drop pushes staler than max_staleness"))] = "none"
    max_staleness: Annotated[int, Meta(ge=0, description="required with `bound`")] | None = None
    ps_replicas: Annotated[int, Meta(ge=1, description=(
        "copies of each PS shard, each in a PS process of its own, chain-replicated: a push is acknowledged once "
        "every live copy applied it, pulls read the chain's tail, and a copy's death loses no acknowledged push "
        "(the chain closes around it; a restarted copy catches up from the tail). 1: one copy, restarted from "
        "the last snapshot"))] = 1
    sparse: Annotated[Literal["auto"] | bool, Meta(description=(
        "push only the rows of an embedding table (`nn.Embedding`, `nn.EmbeddingBag` weights) whose gradient is "
        "not zero, as row spans plus their float32 values, instead of the whole table: `auto` when fewer than half "
        "a table's rows are touched since the last push, `true` always, `false` never. Without a codec only "
        "(`auto` with a codec pushes densely through it; `true` with one is an error). The shards step the "
        "scattered gradient as a dense one, so the updates are the dense pushes' for every optimizer; only the "
        "bytes pushed change"))] = "auto"

    def __post_init__(self) -> None:
        if self.codec == "threshold" and self.tau is None:
            raise KeyProblem("tau", "missing required key '{key}'")
        if self.staleness == "bound" and self.max_staleness is None:
            raise KeyProblem("max_staleness", "missing required key '{key}'")
        if self.sparse is True and self.codec != "none":
            raise KeyProblem("sparse", f"'{{key}}' = true pushes float32 rows: it takes codec 'none', not "
                                       f"{self.codec!r} (or set it to 'auto' or false)")
        if self.codec == "onebit" and self.block % 8:
            raise KeyProblem("block", f"'{{key}}' must be a multiple of 8 for the onebit codec, got {self.block}")


async def record_ps_stats(report: RunReport, shards: list[ActorRef | None]) -> None:
    """Put each PS shard's counters (applied, rejections, staleness histogram) into the run summary."""
    for index, ps in enumerate(shards):
        if ps is None:
            continue
        try:
            stats = await ps.ask(ShardStats(), timeout=5.0)
        except ActorError as exc:
            report.set_metric(f"ps{index}_stats_error", repr(exc))
            continue
        for key in ("applied", "samples", "version", "staleness_sum", "dense_pulls", "delta_pulls"):
            report.set_metric(f"ps{index}_{key}", int(stats[key]))
        if math.isfinite(stats["lr_last"]):  # the lr the shard applied its last push with (lr_scale: DNI's gate)
            report.set_metric(f"ps{index}_lr_last", float(stats["lr_last"]))
        for key, count in stats["rejected"].items():
            report.set_metric(f"ps{index}_rejected_{key}", int(count))
        for bound, count in zip([*map(str, stats["staleness_buckets"]), "inf"], stats["staleness_counts"]):
            report.set_metric(f"ps{index}_staleness_le_{bound}", int(count))


async def host_shard(host: Host, spec: ShardSpec) -> list[ActorRef]:
    """On a PS node: the shard of ``spec``, a child of ``host``."""
    from ...train.ps import PSShard

    return [await host.spawn(PSShard, spec, name=f"ps-{spec.shard}", supervision=Directive.STOP)]


class _DownpourJob(DataParallelJob):
    def __init__(self, config: Config, runner: Runner) -> None:
        from ...train.flat import split_ranges

        super().__init__(config, runner)
        self.settings: DownpourConfig = config.settings
        self.warm_start_steps = self.settings.warm_start_steps
        self.wait_for_trainers_s = self.settings.wait_for_replicas_s
        self.ranges = split_ranges(self.n_params, self.settings.n_ps_shards)
        self.codec = codec_spec(self.settings.codec, self.settings.tau, self.settings.block, self.settings.delta_tau,
                                self.settings.resync_every)

    @property
    def shard_optimizer(self) -> OptimizerSpec:
        """``[optimizer]``; with local steps the outer Nesterov step, its lr split over the replicas' pushes."""
        sync = self.config.sync
        if sync.local_steps == 1:
            return self.optimizer_spec
        return OptimizerSpec("nesterov", sync.outer_lr / self.settings.n_replicas, sync.outer_momentum)

    def ps_shards(self) -> list[Any]:
        return [
            ShardSpec(k, offset, self.initial[offset:offset + length].copy(), self.shard_optimizer, self.codec,
                      self.settings.staleness, self.settings.max_staleness or 0)
            for k, (offset, length) in enumerate(self.ranges)
        ]

    def sync_spec(self) -> PSLinkSpec:
        ps = [ref for ref in self.runner.ps if ref is not None]
        local_steps = self.config.sync.local_steps
        return PSLinkSpec(ps, [offset for offset, _ in self.ranges], self.settings.n_fetch, self.settings.n_push,
                          self.codec, local_steps, self.optimizer_spec if local_steps > 1 else None,
                          sparse_mode(self.settings.sparse))

    async def snapshot(self) -> Snapshot:
        replies = await asyncio.gather(*(ps.ask(Pull(), timeout=self.config.eval.timeout_s) for ps in self.runner.ps if ps is not None))
        weights = self.eval_buffer.copy()
        for reply in replies:
            assert isinstance(reply, Params)
            offset, length = self.ranges[reply.shard]
            weights[offset:offset + length] = reply.values
        return Snapshot(weights)

    async def record(self, report: RunReport) -> None:
        await super().record(report)
        await record_ps_stats(report, self.runner.ps)


_PS_ONLY = {"n_ps_shards": 1, "ps_replicas": 1, "codec": "none", "staleness": "none"}
"""Downpour's keys that need PS shards, with the values that mean "not used"."""


def _check_shared_store(config: Config, raw: Mapping[str, Any]) -> None:
    """What Downpour over the machine's shared store cannot do: it has no PS shards, nothing travels."""
    settings: DownpourConfig = config.settings
    for key, unused in _PS_ONLY.items():
        if getattr(settings, key) != unused:
            raise ConfigError(f"'downpour.{key}' is {getattr(settings, key)!r}; with sync.kind 'shm' the replicas "
                              "share one store in shared memory, without PS shards: leave it out or use "
                              "sync.kind 'ps'", f"downpour.{key}")
    if config.sync.local_steps > 1:
        raise ConfigError(f"'sync.local_steps' is {config.sync.local_steps}; with sync.kind 'shm' use "
                          "downpour.n_push and n_fetch (or sync.kind 'ps' for local steps)", "sync.local_steps")


class _Downpour(DataParallelMode):
    name = "downpour"
    settings = DownpourConfig
    shards_key = "downpour.n_replicas"
    worker_kind = "replica"
    schedules = True
    takes_local_steps = True

    def preload(self, config: Config) -> tuple[str, ...]:
        # with local steps the inner steps run torch's optimizer (LocalOptimizer)
        return ("torch._dynamo",) if config.sync.local_steps > 1 else ()

    def data_shards(self, settings: DownpourConfig) -> int:
        return settings.n_replicas

    def syncs(self, settings: DownpourConfig) -> tuple[str, ...]:
        return ("ps", "shm")

    def check(self, config: Config, raw: Mapping[str, Any]) -> None:
        if config.sync_kind == "shm":
            _check_shared_store(config, raw)
        if config.sync.local_steps > 1:
            for key in ("n_push", "n_fetch"):
                if getattr(config.settings, key) != 1:
                    raise ConfigError(f"'downpour.{key}' is {getattr(config.settings, key)}; with sync.local_steps = "
                                      f"{config.sync.local_steps} a replica pushes its pseudo-gradient and pulls every "
                                      "local_steps steps: leave n_push and n_fetch at 1", f"downpour.{key}")

    def resolve(self, config: Config, model: nn.Module) -> None:
        from ...train.models import count_parameters

        n_params, shards = count_parameters(model), config.settings.n_ps_shards
        if shards > n_params:
            raise ConfigError(f"'downpour.n_ps_shards' is {shards}, but the model has only {n_params} parameters "
                              "to split into contiguous shards", "downpour.n_ps_shards")

    def processes(self, config: Config) -> tuple[int, int]:
        if config.sync_kind == "shm":
            return 0, config.settings.n_replicas
        return config.settings.n_ps_shards * config.settings.ps_replicas, config.settings.n_replicas

    def summary_lines(self, config: Config, doc: Mapping[str, Any]) -> list[str]:
        lines = [f"  bytes pushed       {doc.get('bytes_pushed', 0):,} (codec {config.settings.codec})",
                 f"  bytes pulled       {doc.get('bytes_pulled', 0):,}"]
        sync = config.sync
        if sync.local_steps > 1:
            lines.append(f"  local steps        {sync.local_steps} (inner {config.optimizer.name} lr "
                         f"{config.optimizer.lr:g}; outer nesterov lr {sync.outer_lr:g} / {config.settings.n_replicas}"
                         f" replicas, momentum {sync.outer_momentum:g})")
        return lines

    def panels(self, config: Config) -> tuple[Panel, ...]:
        return () if config.sync_kind == "shm" else PS_PANELS  # a shared store: no pushes or bytes to chart

    def job(self, config: Config, runner: Runner) -> _DownpourJob | SharedStoreJob:
        settings: DownpourConfig = config.settings
        if config.sync_kind == "shm":
            job = SharedStoreJob(config, runner, sparse_mode(settings.sparse), settings.n_fetch, settings.n_push)
            job.warm_start_steps = settings.warm_start_steps
            job.wait_for_trainers_s = settings.wait_for_replicas_s
            return job
        if settings.ps_replicas > 1:
            from ._replicated import ReplicatedDownpourJob

            return ReplicatedDownpourJob(config, runner)
        return _DownpourJob(config, runner)

    def hosters(self) -> dict[type, Hoster]:
        return {ShardSpec: host_shard, ReplicaSpec: host_replica, CopySpec: host_copy}


DOWNPOUR = _Downpour()
