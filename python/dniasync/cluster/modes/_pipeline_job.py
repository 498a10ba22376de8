"""The coordinator side of a pipeline job, and the worker side that hosts its stages.

Each worker host gets one placement slot (a pipeline and the stages of it
that worker holds), builds the model from the factory and seed, cuts it and
spawns its :class:`~dniasync.train.pipeline.Stage` actors. Once every stage is
up, the job drives one :class:`~dniasync.train.pipeline.PipelineDriver` per
pipeline, each on its own data shard, fed from a resumable
:class:`~dniasync.train.data.DataCursor`. Evaluation takes a copy of the
stages' weights (or, with replicas, of the PS shards'), so it takes no time
from the stages. A stage that dies fails the job, naming it.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np

from ...actors import ActorError, ActorRef, Directive
from ...train.data import DataCursor
from ...train.messages import Params, Progress, Pull, Reshard, ShardSnapshot, SnapshotShard
from ...train.specs import CodecSpec, OptimizerSpec, P2PSpec, PSLinkSpec, ShardSpec, StagesSpec
from .._schema import ConfigError
from ..mode_api import JobFailed, Snapshot
from ..plan import codec_spec, data_spec, model_spec, optimizer_spec, schedule_spec
from ..protocol import Assignment, JoinJob, NoJob, Ready
from ..report import EVENT_BATCH_SIZE, RunReport
from ..shards import ShardKeeper
from ._peers import ask_peer_stats, inbox_of, ledgers_complete, tell_peers
from .p2p import SETTLE_S
from .pipeline import STAGE_PRELOAD
from ._pipeline_durable import PipelineDurability
from .downpour import record_ps_stats

if TYPE_CHECKING:
    import torch

    from ...train.checkpoint import LoadedCheckpoint, Part
    from ...train.pipeline import PipelineDriver, StageStats
    from ...train.schedules import BatchSchedule, CursorSizes
    from ..chains import ChainKeeper
    from ..config import Config
    from ..hosts import Host
    from ..mode_api import Runner
    from .pipeline import PipelineConfig

__all__ = ["EVENT_STAGE_FAILED", "PipelineJob", "host_stages", "stage_name"]

log = logging.getLogger("dniasync.cluster.modes")

EVENT_STAGE_FAILED: Final = "stage_failed"
EVENT_STAGES_PLACED: Final = "stages_placed"
EVENT_RESUME_REFUSED: Final = "resume_refused"
EVENT_REGROUPED: Final = "regrouped"
EVENT_SPLIT_PROFILED: Final = "split_profiled"


def _stage_optimizer(name: str) -> Literal["adam", "sgd", "adagrad"]:
    """The stages' optimizer for ``[optimizer] name``: SGD for ``sgd`` and ``momentum``, Adagrad for ``adagrad``, else
    Adam. With PS shards the shards apply ``[optimizer]`` itself, and this names only the SG models' optimizer."""
    return "sgd" if name in ("sgd", "momentum") else "adagrad" if name == "adagrad" else "adam"


def split_text(groups: Sequence[Sequence[int]]) -> str:
    """``[[0, 1, 2], [3]]`` as ``"0-2 | 3"``."""
    return " | ".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)


def merge_stage_states(groups: Sequence[Sequence[int]], states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stage-local state-dict keys (``"1.weight"`` of the stage holding layers 2..4) as the model's (``"3.weight"``)."""
    out = {}
    for group, state in zip(groups, states, strict=True):
        for name, tensor in state.items():
            local, rest = name.split(".", 1)
            out[f"{group[int(local)]}.{rest}"] = tensor
    return out


def stage_name(pipeline: int, group: int, replicas: int) -> str:
    """The actor name of a stage: ``stage-k`` (``stage-r-k`` with replicas)."""
    return f"stage-{group}" if replicas == 1 else f"stage-{pipeline}-{group}"


class PipelineJob:
    """Places the stages of every pipeline on the workers that join, then drives and evaluates them."""

    def __init__(self, config: Config, runner: Runner) -> None:
        import torch

        from ...train.flat import flatten_parameters
        from ...train.pipeline import LrDecay, Schedule, split_sequential

        torch.set_num_threads(1)
        self.config = config
        self.runner = runner
        self.p: PipelineConfig = config.settings
        self.model_spec, self.data_spec = model_spec(config), data_spec(config)
        self.train_rows, self.x_test, self.y_test = self.data_spec.open_split()  # a converted set stays mapped
        self.num_classes = max(self.train_rows.n_classes, int(self.y_test.max()) + 1)
        self.in_features = self.train_rows.n_features
        model = self.model_spec.build()
        assert isinstance(model, torch.nn.Sequential)  # checked when the config was resolved
        self.eval_model = model
        self.groups = [list(g) for g in self.p.groups]
        """The split now: layer indices of each stage (moves with regrouping)."""
        self.regrouper = self._regrouper(model)
        self._check_stages(model)
        self.eval_parts = split_sequential(model, self.groups)
        self.eval_buffers = [flatten_parameters(part) for part in self.eval_parts]
        self.schedule = Schedule.for_rule(self.p.method, max_in_flight=self.p.max_in_flight,
                                          micro_batches=self.p.micro_batches)
        self.lr_decay = LrDecay(self.p.lr_decay, self.p.lr_decay_start, self.p.lr_decay_final)
        n_pipelines, n_groups = self.p.replicas, len(self.p.groups)
        # placement slots, handed out in this order: (pipeline, stages on that worker)
        self.slots: list[tuple[int, list[int]]] = [
            (r, [k for k, w in enumerate(self.p.group_workers) if w == worker])
            for r in range(n_pipelines) for worker in range(self.p.workers_per_pipeline)
        ]
        self.hosts: dict[str, int] = {}
        """worker host -> slot index"""
        self.refs: list[list[ActorRef | None]] = [[None] * n_groups for _ in range(n_pipelines)]
        self.shard_plan = self.data_spec.shard_plan()
        self.cursors = [DataCursor(r) for r in range(n_pipelines)]
        self.drivers: list[PipelineDriver] = []
        self.tasks: list[asyncio.Task[None]] = []
        self._regroup_lock = asyncio.Lock()
        self._pause: asyncio.Event | None = None
        """Set while a regrouping of replicated stages runs: the other pipelines wait, drained, until it is done."""
        self._parked: set[int] = set()
        self._parked_changed = asyncio.Event()
        self._next_regroup_log = 0.0
        self._proposal: Any = None  # the policy's move, waiting for pipeline 0's next pause between mini-batches
        self._watcher: asyncio.Task[None] | None = None
        self._clock_seen: dict[int, tuple[int, list[float], int, float]] = {}
        self._moves = 0
        self._sizes: dict[int, CursorSizes] = {}
        self._last_batch: dict[int, tuple[torch.Tensor, float]] = {}
        self._batches_seen: dict[int, int] = {}
        self._norm_tests: dict[int, asyncio.Task[None]] = {}
        self._sg_first: dict[str, float] = {}
        self._sg_last: dict[str, float] = {}
        self._stage_bytes: dict[str, tuple[int, int]] = {}
        self._stage_view: list[StageStats] = []  # pipeline 0's latest stats, for the live page
        self.durability = PipelineDurability(self)
        """Captures for checkpoints, and the rollback-restart of a pipeline whose stage died."""
        self.gone: set[str] = set()
        """Addresses of stages whose slot went to another worker (their process died, froze or was cut off)."""
        self.p2p = config.sync_kind == "p2p"
        """The replicas of each stage share its weights peer to peer (no PS shards)."""
        self.keeper: ChainKeeper | None = None
        """With ``ps_replicas > 1``: each stage's PS shard copies and their chains."""
        self.acknowledged: dict[str, tuple[int, int]] = {}
        """With ``ps_replicas > 1``: each stage incarnation's pusher key -> (its stage, the pushes its chain
        acknowledged, as it last reported)."""
        self._peers_epoch = 0

    def stage_settings(self) -> dict[str, Any]:
        from ...train.pipeline import StageSettings

        p, opt = self.p, self.config.optimizer
        settings = StageSettings(
            rule=p.method, lr=opt.lr, optimizer=_stage_optimizer(opt.name),
            momentum=opt.momentum if opt.name == "momentum" and not self.config.sync_needs_ps else 0.0,  # they apply it
            optimizer_on_ps=self.config.sync_needs_ps,
            max_in_flight=p.max_in_flight, num_classes=self.num_classes, cache_size=max(64, 2 * p.max_in_flight, 2 * p.micro_batches),
            sg_hidden_layers=p.sg_hidden_layers, sg_hidden_width=p.sg_hidden_width, sg_lr=p.sg_lr,
            sg_fit_rows=p.sg_fit_rows, synthetic_inputs=p.synthetic_inputs,
        )
        return asdict(settings)

    def _regrouper(self, model: torch.nn.Sequential) -> Any:
        """The regrouping decision side (``[regroup]``), or None; with ``profile`` the first split comes from timing
        every layer here, before any stage exists."""
        from ...train.pipeline.regroup import Regrouper, best_split, get_policy, profile_layers

        rg = self.config.regroup
        if not rg.enabled:
            return None
        regrouper = Regrouper(tuple(map(tuple, self.groups)), get_policy(rg.policy, min_gain=rg.min_gain),
                              rg.cooldown_s, rg.max_moves)
        if rg.profile:
            times = profile_layers(model, (self.in_features,), self.config.data.batch_size,
                                   num_classes=self.num_classes)
            split, _ = best_split([times[i] for i in range(len(model))], [1.0] * len(self.groups))
            log.info("profiled split %s (configured %s)", split_text(split), split_text(self.groups))
            self.runner.event(EVENT_SPLIT_PROFILED, configured=split_text(self.groups), split=split_text(split))
            self.groups = [list(g) for g in split]
            regrouper.groups = split  # its costs are calibrated on the stages, as without a profile
        return regrouper

    def _check_stages(self, model: torch.nn.Sequential) -> None:
        """Probe the cut with the data's shape here, so a bad cut or layer fails the job at start, named."""
        from ...train.pipeline import GroupConfigError, StageSettings, build_stages

        try:
            build_stages(model, self.groups, StageSettings(**self.stage_settings()), self.in_features)
        except GroupConfigError as e:
            raise ConfigError(f"'pipeline.groups': {e}", "pipeline.groups") from None
        except ValueError as e:
            raise ConfigError(f"'pipeline.method': {e}", "pipeline.method") from None

    def ps_shards(self) -> list[Any]:
        if not self.config.sync_needs_ps:
            return []
        opt = optimizer_spec(self.config)
        return [ShardSpec(k, 0, buffer.copy(), opt, self.codec) for k, buffer in enumerate(self.eval_buffers)]

    @property
    def codec(self) -> CodecSpec:
        """``[pipeline] codec``: the stages' pushes to their PS shards and the shards' answers to their pulls."""
        return codec_spec(self.p.codec, self.p.tau, 256)

    def shard_keeper(self, specs: list[ShardSpec], event: Any, *, lost_after_s: float,
                     samples: Any) -> ShardKeeper:
        """The runner's keeper of the stages' PS shards: their chains of copies with ``ps_replicas > 1``."""
        if self.p.ps_replicas == 1:
            return ShardKeeper(specs, event, lost_after_s=lost_after_s, samples=samples)
        from ..chains import ChainKeeper

        self.keeper = ChainKeeper(specs, event, lost_after_s=lost_after_s, samples=samples,
                                  copies=self.p.ps_replicas)
        return self.keeper

    def _stage_ps(self, k: int) -> list[ActorRef]:
        """What a replica of stage ``k`` pushes to: its PS shard, or every copy of it (a chain)."""
        if self.keeper is not None:
            return [ref for ref in self.keeper.copies[k] if ref is not None]
        ref = self.runner.ps[k] if self.runner.ps else None
        return [ref] if ref is not None else []

    # -- placement ------------------------------------------------------------------
    def assign(self, join: JoinJob) -> Assignment | NoJob:
        slot = self.hosts.get(join.member)
        if slot is None:
            vacant = sorted(set(range(len(self.slots))) - set(self.hosts.values()))
            if not vacant:  # with restarts, a worker started again may come before its slot is freed: it asks again
                return NoJob("every stage is placed", retry=self.durability.enabled and not self.runner.ending)
            slot = self.hosts[join.member] = vacant[0]
        pipeline, groups = self.slots[slot]
        log.info("pipeline %d, stages %s go to %s", pipeline, groups, join.member)
        ps = [ref for k in groups for ref in self._stage_ps(k)]
        copies = self.p.ps_replicas if self.keeper is not None else 1
        return Assignment(StagesSpec(
            self.model_spec, [list(g) for g in self.groups], groups, pipeline, self.p.replicas,
            self.stage_settings(), self.in_features, self.schedule.stage_mailbox_size(), ps,
            self.p.n_fetch, self.p.n_push, [self._p2p_spec(k) for k in groups] if self.p2p else [], copies,
            self.codec,
        ))

    # -- p2p: the replicas of a stage are its peers -------------------------------------
    def _p2p_spec(self, k: int) -> P2PSpec:
        """Stage ``k``'s sync: the inboxes of its replicas placed so far (the rest are told as they come)."""
        sync = self.config.sync
        return P2PSpec(self._stage_inboxes(k), self._peers_epoch, "threshold", self.p.tau or 1e-3, sync.fanout,
                       sync.max_lag, update_cap_bytes=sync.update_cap_bytes)

    def _stage_inboxes(self, k: int) -> list[ActorRef]:
        return [inbox_of(self.runner.system, ref) for row in self.refs for ref in [row[k]] if ref is not None]

    def _tell_stage_peers(self) -> None:
        """Each stage's replicas, told their membership (again: an inbox starts with its stage's first batch)."""
        for k in range(len(self.groups)):
            tell_peers(self._stage_inboxes(k), self._peers_epoch)

    async def _settled_peer_stats(self) -> tuple[list[list[dict[str, Any] | None]], bool]:
        """Per stage, each pipeline's p2p counters once every ledger holds every update its peers sent (at most
        :data:`~dniasync.cluster.modes.p2p.SETTLE_S`)."""
        deadline = time.monotonic() + SETTLE_S
        before: list[list[int]] | None = None
        while True:
            self._tell_stage_peers()
            stats = [await ask_peer_stats(self._stage_inboxes(k)) for k in range(len(self.groups))]
            complete = all(None not in row and ledgers_complete({s["origin"]: s for s in row if s is not None})
                           for row in stats)
            sent = [[int(s["sent"]) if s is not None else -1 for s in row] for row in stats]
            # and nothing sent since the last ask: a stage may still apply a batch in flight after the stop
            if (complete and sent == before) or time.monotonic() >= deadline:
                return stats, complete
            before = sent
            await asyncio.sleep(0.2)

    async def _record_p2p(self, report: RunReport) -> None:
        """Per stage replica: updates and bytes sent, updates received and applied, and how many of each peer's
        updates its copy holds (``..._p2p_has_pipeline<r>``: all of them once settled)."""
        stats, complete = await self._settled_peer_stats()
        report.set_metric("p2p_ledgers_complete", complete)
        for k, row in enumerate(stats):
            origins = {s["origin"]: r for r, s in enumerate(row) if s is not None}
            for r, s in enumerate(row):
                if s is None:
                    continue
                key, c = self._key(r, k), s["counters"]
                report.set_metric(f"{key}_p2p_sent", int(s["sent"]))
                report.set_metric(f"{key}_p2p_bytes_sent", int(c["bytes_sent"]))
                for counter in ("received", "applied", "duplicate", "skipped", "resent", "dense_taken"):
                    report.set_metric(f"{key}_p2p_{counter}", int(c[counter]))
                for origin, count in s["ledger"].items():
                    if origin in origins and origins[origin] != r:
                        report.set_metric(f"{key}_p2p_has_pipeline{origins[origin]}", int(count))

    def vacate(self, r: int, k: int, reason: str) -> None:
        """Stage ``k`` of pipeline ``r`` is gone: its slot (every stage of its worker) goes to the next worker."""
        for slot, (pipeline, groups) in enumerate(self.slots):
            if pipeline == r and k in groups:
                gone = [m for m, s in self.hosts.items() if s == slot]
                for member in gone:
                    del self.hosts[member]
                for g in groups:
                    ref = self.refs[r][g]
                    if ref is not None:  # reported dead from now on: a launcher ends its process if it still runs
                        self.gone.add(ref.address)
                    self.refs[r][g] = None
                log.warning("pipeline %d, stages %s: %s is gone (%s); waiting for a worker to take them", r, groups,
                            ", ".join(gone), reason)

    async def ready(self, ready: Ready) -> None:
        slot = self.hosts.get(ready.member)
        if slot is None:
            return
        pipeline, groups = self.slots[slot]
        for k, ref in zip(groups, ready.refs):
            self.refs[pipeline][k] = ref
        if self.p2p:
            self._peers_epoch += 1
            self._tell_stage_peers()
        if not self.drivers and all(ref is not None for row in self.refs for ref in row):
            await self._start()

    async def _start(self) -> None:
        from ...train.pipeline import PipelineBroken, PipelineDriver

        pipelines = [[ref for ref in row if ref is not None] for row in self.refs]
        addresses = ", ".join(ref.address for row in pipelines for ref in row)
        for r, refs in enumerate(pipelines):
            driver = PipelineDriver(self.runner.system, refs, self.schedule, synthetic_inputs=self.p.synthetic_inputs,
                                    name=f"pipeline-monitor-{r}")
            self.drivers.append(driver)
            try:
                await driver.start()
            except PipelineBroken as exc:
                raise JobFailed(f"stage {exc.address} is down ({exc.reason})", EVENT_STAGE_FAILED,
                                stage=exc.address) from None
            if self.durability.restore_on_start:  # --resume: the stages take the checkpoint's states
                await self.durability.load_into(r, driver)
                log.info("pipeline %d: every stage loaded its state from the checkpoint", r)
        self.runner.mark_started()
        self.runner.event(EVENT_STAGES_PLACED, stages=addresses, split=split_text(self.groups))
        log.info("training %d pipeline(s) over %s", len(pipelines), addresses)
        self.tasks = [asyncio.create_task(self._train(r, d), name=f"pipeline-{r}") for r, d in enumerate(self.drivers)]
        if self.regrouper is not None:
            if self.config.regroup.profile:  # the profiled split is the first decision: it holds for cooldown_s
                self.regrouper.hold(asyncio.get_running_loop().time())
            self._watcher = asyncio.create_task(self._watch_regroup(), name="regroup-watch")

    def _batches(self, r: int) -> Iterator[torch.Tensor]:
        import torch

        from ...train.schedules import CursorSizes

        sizes = self._sizes.get(r)
        if sizes is None:  # [schedule]; one per pipeline for the whole run (a dynamic one grows on its tests)
            sizes = self._sizes[r] = CursorSizes(schedule_spec(self.config), self.config.data.batch_size)
        while self.cursors[r].epoch < self.config.stop.max_epochs:
            c = self.cursors[r]
            shard_size = self.shard_plan.shard_size(c.shard)
            size = sizes.at(c.epoch, c.position, shard_size)
            if sizes.changed:
                self.runner.event(EVENT_BATCH_SIZE, pipeline=r, epoch=c.epoch, position=c.position, batch_size=size)
            indices, self.cursors[r] = self.shard_plan.next_batch(c, size)
            if self.cursors[r].epoch < self.config.stop.max_epochs:  # read the next batch while this one is fed
                self.train_rows.prefetch(self.shard_plan.next_batch(self.cursors[r], size)[0])
            batch = torch.from_numpy(np.ascontiguousarray(indices))
            epoch = c.epoch + c.position / shard_size
            self._last_batch[r] = (batch, epoch)
            self.drivers[r].lr_scale = self.lr_decay.scale(epoch / self.config.stop.max_epochs)
            yield batch

    def _maybe_norm_test(self, r: int) -> None:
        """Dynamic sampling: every ``test_every`` batches of pipeline ``r``, Byrd's norm test on its latest batch
        (the gradient of the last stage's parameters, the one stage that has the true loss), in a task beside the
        training: its asks wait behind the batches queued at each stage, and the driver must not."""
        sizes = self._sizes.get(r)
        schedule = sizes.schedule if sizes is not None else None
        last = self._last_batch.get(r)
        if schedule is None or not schedule.needs_chunks or last is None:
            return
        seen = self._batches_seen[r] = self._batches_seen.get(r, 0) + 1
        pending = self._norm_tests.get(r)
        if not schedule.test_due(seen - 1) or (pending is not None and not pending.done()):
            return
        self._norm_tests[r] = asyncio.create_task(self._norm_test(r, schedule, *last), name=f"pipeline-{r}-norm-test")

    async def _norm_test(self, r: int, schedule: BatchSchedule, batch: torch.Tensor, epoch: float) -> None:
        import torch

        from ...train.pipeline import PipelineBroken

        try:
            bx, by = await self.train_rows.take_async(batch.numpy())
            probe = await self.drivers[r].norm_probe(torch.from_numpy(bx), torch.from_numpy(by), schedule.spec.chunks)
        except (PipelineBroken, ActorError) as exc:  # the pipeline's own training reports what broke
            log.info("pipeline %d: norm test skipped (%r)", r, exc)
            return
        schedule.observe_norms(epoch, probe.sum_sq, probe.norm2, probe.count, probe.chunk_size)

    async def _train(self, r: int, driver: PipelineDriver) -> None:
        from ...train.pipeline import PipelineBroken

        try:
            use_between = (self.regrouper is not None or self.durability.enabled
                           or self.config.schedule.kind == "dynamic")
            between = functools.partial(self._between, r) if use_between else None
            if self.durability.enabled:
                await self.durability.capture(r, first=True)  # a stage dying from the first batch has a state to go back to
            while True:
                try:
                    result = await self.drivers[r].train(self.train_rows, None, self._batches(r), between=between)
                    break
                except PipelineBroken as exc:
                    if not self.durability.can_recover(r):
                        raise
                    await self.durability.recover(r, exc)  # the cursor goes back: _batches(r) drives from there
            self._note_stats(r, result.stats)  # asked of the stages last: their SG losses are the latest
        finally:
            self.runner.poke()  # done or broken: the runner ends the job now, not at its next tick

    # -- regrouping ----------------------------------------------------------------------
    def _per_batch(self, k: int, stats: StageStats) -> tuple[dict[int, float], float]:
        """Stage ``k``'s per-layer seconds per batch since the previous look, and its busy seconds per batch (its
        clock restarts when its layers change)."""
        key = (stats.first_layer, len(stats.layer_seconds))
        seen = self._clock_seen.get(k)
        self._clock_seen[k] = (stats.first_layer, list(stats.layer_seconds), stats.layer_batches, stats.busy_seconds)
        before, batches, busy = [0.0] * len(stats.layer_seconds), 0, 0.0
        if seen is not None and (seen[0], len(seen[1])) == key and seen[2] <= stats.layer_batches:
            before, batches, busy = seen[1], seen[2], seen[3]
        n = stats.layer_batches - batches
        if n <= 0:
            return {}, 0.0
        return ({stats.first_layer + j: (now - then) / n
                 for j, (now, then) in enumerate(zip(stats.layer_seconds, before, strict=True))},
                (stats.busy_seconds - busy) / n)

    async def _between(self, r: int) -> None:
        """Pipeline ``r``'s driver calls this between two mini-batches: pipeline 0 asks the policy; the others
        wait here, drained, while a regrouping of replicated stages runs."""
        pause = self._pause
        if pause is not None and r != 0:
            await self.drivers[r].drain()
            self._parked.add(r)
            self._parked_changed.set()
            try:
                await pause.wait()
            finally:
                self._parked.discard(r)
        elif r == 0 and self.regrouper is not None:
            await self._maybe_regroup()
        self._maybe_norm_test(r)
        await self.durability.maybe_capture(r)

    def _layer_sizes(self) -> list[int]:
        return [sum(p.numel() for p in layer.parameters()) for layer in self.eval_model]

    async def _regroup_replicated(self, old: list[list[int]], new: Sequence[Sequence[int]]) -> list[Any]:
        """Every pipeline drained and parked, every stage's accumulated gradient pushed; then the PS shards of the
        groups that change take their new slices (values and optimizer state by layer, versions moving up),
        and every pipeline moves its layers (the stages then pull their new slices)."""
        from ...train.pipeline.protocol import FlushParams

        self._pause = asyncio.Event()
        try:
            others = range(1, len(self.drivers))
            await self.drivers[0].drain()
            while not all(r in self._parked or self.tasks[r].done() for r in others):
                self._parked_changed.clear()
                try:
                    async with asyncio.timeout(0.5):
                        await self._parked_changed.wait()
                except TimeoutError:
                    pass  # a pipeline that ended or broke meanwhile counts as parked
            live = [d for r, d in enumerate(self.drivers) if r == 0 or not self.tasks[r].done()]
            for driver in live:
                for ref in driver.stages:
                    await ref.ask(FlushParams(), timeout=60.0)
            await self._reshard(old, new)
            moves: list[Any] = []
            for driver in live:
                moves += await driver.regroup(old, new)
            return moves
        finally:
            pause, self._pause = self._pause, None
            pause.set()

    async def _reshard(self, old: Sequence[Sequence[int]], new: Sequence[Sequence[int]]) -> None:
        sizes = self._layer_sizes()
        shards = [ps for ps in self.runner.ps]
        snaps = await asyncio.gather(*(ps.ask(SnapshotShard(), timeout=60.0) for ps in shards if ps is not None))
        if len(snaps) != len(old):
            raise JobFailed(f"regrouping needs every PS shard up; {len(old) - len(snaps)} are down", EVENT_STAGE_FAILED,
                            stage="")
        values: dict[int, np.ndarray] = {}
        state: dict[int, list[np.ndarray]] = {}
        for group, snap in zip(old, snaps, strict=True):
            assert isinstance(snap, ShardSnapshot)
            offset = 0
            for i in group:
                values[i] = snap.values[offset:offset + sizes[i]]
                state[i] = [slot[offset:offset + sizes[i]] for slot in snap.state]
                offset += sizes[i]
        version = max(snap.version for snap in snaps) + 1  # above every version any shard has served
        # one count per shard: the moved layers' shards stepped about as often; the highest keeps Adam's bias
        # correction where it was (it starts again at step 1 otherwise)
        steps = max(snap.steps for snap in snaps)
        slots = len(snaps[0].state)
        for k, (before, after) in enumerate(zip(old, new, strict=True)):
            if list(before) == list(after):
                continue
            ref = shards[k]
            assert ref is not None
            await ref.ask(Reshard(np.concatenate([values[i] for i in after]).astype(np.float32),
                                  [np.concatenate([state[i][s] for i in after]).astype(np.float32)
                                   for s in range(slots)], version, steps), timeout=60.0)

    async def _watch_regroup(self) -> None:
        """Every ``interval_s``, beside the training: the stages' times to the policy, and its move, if any, left for
        :meth:`_maybe_regroup`. The stats asks wait behind the batches queued at each stage, so asking them
        between two mini-batches would hold the driver's feed and drain the pipeline every time."""
        regrouper = self.regrouper
        assert regrouper is not None
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.regroup.interval_s)
            if self._proposal is not None:
                continue
            try:
                async with self._regroup_lock:  # the stats and the split they were taken on, together
                    stats = await self.drivers[0].stats()
                    self._note_stats(0, stats)
                    for k, s in enumerate(stats):
                        regrouper.observe(k, *self._per_batch(k, s))
                    self._proposal = regrouper.decide(loop.time())
            except Exception as exc:  # a stage down or rolling back: the pipeline's own task reports it
                log.debug("regrouping: no stats this round (%r)", exc)
                continue
            if loop.time() >= self._next_regroup_log and regrouper.estimates.costs is not None:
                self._next_regroup_log = loop.time() + 10.0
                log.info("regrouping: split %s, estimated ms per batch %s, slowness %s", split_text(self.groups),
                         self.extra().get("stage_ms"), regrouper.estimates.slowness)

    async def _maybe_regroup(self) -> None:
        """Between two mini-batches of pipeline 0: make the move the policy proposed, if any."""
        regrouper = self.regrouper
        loop = asyncio.get_running_loop()
        proposal, self._proposal = self._proposal, None
        if regrouper is None or proposal is None:
            return
        driver = self.drivers[0]
        sizes = self._layer_sizes()
        if self.config.sync_needs_ps and any(sum(sizes[i] for i in g) == 0 for g in proposal.groups):
            regrouper.hold(loop.time())  # a stage without parameters would leave its PS shard empty
            return
        old = self.groups
        async with self._regroup_lock:
            started = time.perf_counter()
            if self.config.sync_needs_ps:  # every pipeline parks while the shards take their new slices
                moves = await self._regroup_replicated(old, proposal.groups)
            else:
                moves = await driver.regroup(old, proposal.groups)
            pause = time.perf_counter() - started
            self.groups = [list(g) for g in proposal.groups]
        slowness = ",".join(f"{v:.2f}" for v in regrouper.estimates.stage_slowness(len(old)))
        regrouper.applied(proposal.groups, loop.time())
        self._clock_seen.clear()
        self._moves += 1
        moved = sorted(i for m in moves for i in m.layers)
        log.info("regrouped %s -> %s (predicted gain %.0f%%, paused %.0f ms)", split_text(old),
                 split_text(self.groups), 100 * proposal.gain, 1000 * pause)
        self.runner.event(EVENT_REGROUPED, before=split_text(old), split=split_text(self.groups),
                          layers=",".join(map(str, moved)), predicted_gain=round(proposal.gain, 4),
                          pause_ms=round(1000 * pause, 2), bytes=sum(m.bytes for m in moves),
                          slowness=slowness)

    # -- the runner's questions ---------------------------------------------------------
    def progress(self, msg: Progress) -> None:
        return

    def _failure(self) -> JobFailed | None:
        from ...train.pipeline import PipelineBroken

        for task in self.tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                if isinstance(exc, PipelineBroken):
                    return JobFailed(f"stage {exc.address} is down ({exc.reason})", EVENT_STAGE_FAILED,
                                     stage=exc.address)
                return JobFailed(f"a pipeline failed: {exc!r}", EVENT_STAGE_FAILED, stage="")
        return None

    def check(self, now: float) -> None:
        failure = self._failure()
        if failure is not None:
            raise failure
        if self.p2p:  # at every tick, not every PEERS_REPEAT_S: an inbox starts with its stage's first batch, and
            self._tell_stage_peers()  # the updates it sends before it knows its peers are repaired one by one

    def done(self) -> str | None:
        if self.tasks and all(task.done() for task in self.tasks):
            failure = self._failure()
            if failure is not None:
                raise failure
            return f"trained {self.config.stop.max_epochs} epochs"
        return None

    def samples(self) -> int:
        return sum(self.durability.pipeline_samples(r) for r in range(len(self.drivers)))

    def checkpoint(self) -> tuple[dict[str, Any], dict[str, Part]]:
        return self.durability.checkpoint()

    def restore(self, loaded: LoadedCheckpoint) -> None:
        self.durability.restore(loaded)

    def steps(self) -> int:
        return self.samples() // self.config.data.batch_size

    def members(self) -> dict[str, str]:
        placed = {ref.address: ("alive" if ref.is_alive else "dead") for row in self.refs for ref in row if ref}
        return {**{address: "dead" for address in self.gone}, **placed}

    def extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"stages": len(self.p.groups), "pipelines": self.p.replicas, "method": self.p.method,
                                 "split": split_text(self.groups)}
        if self.regrouper is not None:
            extra["regroup_moves"] = self._moves
            costs = self.regrouper.estimates.costs
            if costs is not None:
                slowness = self.regrouper.estimates.stage_slowness(len(self.groups))
                extra["stage_ms"] = " | ".join(f"{1000 * slowness[k] * sum(costs[i] for i in g):.1f}"
                                               for k, g in enumerate(self.groups))
        view = self._stage_view
        if len(view) == len(self.groups):  # per stage of pipeline 0, " | "-separated like the split
            extra["stage_version_gap"] = " | ".join(
                f"{s.sg_staleness_total / s.steps:.2f}" if s.steps else "-" for s in view)
            extra["stage_stash_bytes"] = " | ".join(str(s.stash_bytes) for s in view)
            extra["stage_estimate_error"] = " | ".join(
                f"{s.estimate_error_ratio:.3f}" if math.isfinite(s.estimate_error_ratio) else "-" for s in view)
            # the counters behind the live page's per-stage charts (pipeline.STAGE_PANELS); busy time and batches
            # restart when a stage's layers change
            extra["stage_gap_total"] = [s.sg_staleness_total for s in view]
            extra["stage_steps"] = [s.steps for s in view]
            extra["stage_busy_s"] = [s.busy_seconds for s in view]
            extra["stage_batches"] = [s.layer_batches for s in view]
        if self.keeper is not None:  # the live page's "PS chains" and the chain metrics
            extra |= self.keeper.status()
        return extra

    # -- evaluation -------------------------------------------------------------------
    async def snapshot(self) -> Snapshot:
        from ...train.pipeline import PipelineBroken

        capture = self.durability.captures[0]
        try:
            for r in range(len(self.drivers)):
                await self._quiet_stats(r)
            if not self.config.sync_needs_ps:  # the weights are the stages'
                if 0 in self.durability.recovering and capture is not None:  # the weights it is going back to
                    return Snapshot([merge_stage_states(capture.groups, [_layer_state(s) for s in capture.states])])
                async with self._regroup_lock:  # the states and the split they belong to, together
                    states = await self.drivers[0].states()
                    return Snapshot([merge_stage_states(self.groups, states)])
        except PipelineBroken:
            if not self.durability.enabled or capture is None or self.config.sync_needs_ps:
                raise
            # broken, about to roll back to its capture: those are the weights it trains on next
            return Snapshot([merge_stage_states(capture.groups, [_layer_state(s) for s in capture.states])])
        async with self._regroup_lock:  # the shards' slices and the split they belong to, together
            replies = await asyncio.gather(*(ps.ask(Pull(), timeout=self.config.eval.timeout_s) for ps in self.runner.ps if ps is not None))
            groups = [list(g) for g in self.groups]
        shards: dict[int, np.ndarray] = {}
        for reply in replies:
            assert isinstance(reply, Params)
            shards[reply.shard] = np.array(reply.values, copy=True)
        return Snapshot([self._unflatten(groups, shards)])

    async def _quiet_stats(self, r: int) -> list[StageStats]:
        """Pipeline ``r``'s stage stats, noted; none while it is broken and will be rolled back."""
        from ...train.pipeline import PipelineBroken

        if r in self.durability.recovering:
            return []
        try:
            stats = await self.drivers[r].stats()
        except PipelineBroken:
            if not self.durability.enabled:
                raise
            return []
        self._note_stats(r, stats)
        return stats

    def _unflatten(self, groups: list[list[int]], shards: dict[int, np.ndarray]) -> dict[str, Any]:
        """The shards' flat vectors (one per stage) as the model's parameters, by state-dict key."""
        import torch

        out: dict[str, Any] = {}
        for k, group in enumerate(groups):
            flat, offset = shards[k], 0
            for i in group:
                for name, p in self.eval_model[i].named_parameters():
                    n = p.numel()
                    out[f"{i}.{name}"] = torch.from_numpy(flat[offset:offset + n].copy()).reshape(p.shape)
                    offset += n
        return out

    async def score(self, snapshot: Snapshot) -> tuple[float, float]:
        from ...train.flat import evaluate

        await self.runner.run_blocking(self._load, snapshot.weights)
        return await self.runner.run_blocking(evaluate, self.eval_model, self.x_test, self.y_test,
                                             threads=snapshot.threads)

    def _load(self, weights: list[dict[str, torch.Tensor]] | dict[int, np.ndarray]) -> None:
        import torch

        assert isinstance(weights, list), "a pipeline's snapshot is the model's state dict"
        with torch.no_grad():  # replicated stages: parameters only (buffers are not in PS shards)
            self.eval_model.load_state_dict(weights[0], strict=not self.config.sync_needs_ps)

    # -- ending ---------------------------------------------------------------------
    async def stop(self, reason: str) -> None:
        tasks = [*self.tasks, *([self._watcher] if self._watcher is not None else []), *self._norm_tests.values(),
                 *self.durability.background()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _key(self, r: int, k: int) -> str:
        return f"stage{k}" if self.p.replicas == 1 else f"pipeline{r}_stage{k}"

    def _note_stats(self, r: int, stats: list[StageStats]) -> None:
        """Each stage's mean SG loss since the previous stats request (first and latest kept) and PS bytes."""
        if r == 0:
            self._stage_view = list(stats)
        for k, s in enumerate(stats):
            key = self._key(r, k)
            if math.isfinite(s.sg_loss):
                self._sg_first.setdefault(key, s.sg_loss)
                self._sg_last[key] = s.sg_loss
            if s.pusher:  # a replicated shard's copies count its pushes under this key
                self.acknowledged[s.pusher] = (k, max(s.pushes, self.acknowledged.get(s.pusher, (k, 0))[1]))
            pushed, pulled = self._stage_bytes.get(s.address, (0, 0))
            self.runner.report.add_bytes(pushed=s.bytes_pushed - pushed, pulled=s.bytes_pulled - pulled)
            self._stage_bytes[s.address] = (s.bytes_pushed, s.bytes_pulled)

    async def record(self, report: RunReport) -> None:
        from ...train.flat import model_arrays

        p = self.p
        report.set_final_weights(model_arrays(self.eval_model))  # the weights the last evaluation scored
        report.set_metric("stages", len(p.groups))
        report.set_metric("pipelines", p.replicas)
        report.set_metric("method", p.method)
        report.set_metric("synthetic_inputs", p.synthetic_inputs)
        report.set_metric("split", split_text(self.groups))
        if self.regrouper is not None:
            report.set_metric("regroup_moves", self._moves)
        if self.durability.enabled:
            report.set_metric("pipeline_restarts", self.durability.restarts)
            report.set_metric("samples_lost", self.durability.samples_lost)
        for r in range(len(self.drivers)):
            stats = await self._quiet_stats(r)
            for k, s in enumerate(stats):
                key = self._key(r, k)
                report.set_metric(f"{key}_address", s.address)
                for name in ("steps", "sg_steps", "input_steps", "evictions", "late_gradients"):
                    report.set_metric(f"{key}_{name}", int(getattr(s, name)))
                if s.stash_peak_bytes:
                    report.set_metric(f"{key}_stash_peak_bytes", s.stash_peak_bytes)
                if math.isfinite(s.lr):  # the lr its layers stepped with last (pipeline.lr_decay scales it)
                    report.set_metric(f"{key}_lr_last", s.lr)
                if s.layer_batches:  # where a batch's time goes at the stage: its layers' forward and backward, and
                    # everything it did for the batch (optimizer step, prediction, SG work, (de)serialising, sends)
                    report.set_metric(f"{key}_layers_ms_per_batch", 1e3 * sum(s.layer_seconds) / s.layer_batches)
                    report.set_metric(f"{key}_busy_ms_per_batch", 1e3 * s.busy_seconds / s.layer_batches)
                if s.steps and not s.sg_steps and s.sg_staleness_total:  # real gradients: the stage's version gap
                    report.set_metric(f"{key}_version_gap_mean", s.sg_staleness_total / s.steps)
                if s.sg_steps:  # mean updates between a batch's forward and its SG fit
                    report.set_metric(f"{key}_sg_staleness_mean", s.sg_staleness_total / s.sg_steps)
                if math.isfinite(s.input_loss):
                    report.set_metric(f"{key}_input_loss_last", s.input_loss)
                for name in ("estimate_error_ratio", "prediction_error"):  # the rule's own measure (spectrain, SG)
                    if math.isfinite(getattr(s, name)):
                        report.set_metric(f"{key}_{name}", getattr(s, name))
        await record_ps_stats(report, self.runner.ps)  # one shard per stage
        if self.keeper is not None:
            from ..chains import record_chains

            await record_chains(report, self.keeper, {who: n for who, (_, n) in self.acknowledged.items()},
                                {who: [k] for who, (k, _) in self.acknowledged.items()})  # a stage: its own shard
        if self.p2p:
            await self._record_p2p(report)
        for key, value in self._sg_first.items():
            report.set_metric(f"{key}_sg_loss_first", value)
            report.set_metric(f"{key}_sg_loss_last", self._sg_last[key])

    async def close(self) -> None:
        for driver in self.drivers:
            await driver.close()


def _layer_state(state: Any) -> dict[str, Any]:
    """A stage capture's layer tensors by the stage's own state-dict keys."""
    return {name.removeprefix("layers."): t for name, t in zip(state.names, state.tensors) if name.startswith("layers.")}


async def host_stages(host: Host, spec: StagesSpec) -> list[ActorRef]:
    """On a worker node: build the model, cut it, spawn the stages ``spec`` assigns to this worker."""
    pipeline_module = await host.run_blocking(_import_stage_modules)
    sync = importlib.import_module("dniasync.train.sync")
    settings = pipeline_module.StageSettings(**spec.settings)
    stages = await host.run_blocking(_build, spec, settings)
    refs = []
    for i, k in enumerate(spec.hosted):
        name = stage_name(spec.pipeline, k, spec.replicas)
        params = None
        peers = None
        optimizer = OptimizerSpec(settings.optimizer, settings.lr, momentum=settings.momentum)
        if spec.p2p:  # the stage's replicas send each other their updates: its sync is built with it, as its actor
            peers = (spec.p2p[i], sync.SyncContext(name, time.time_ns() // 1000, optimizer, ask_timeout_s=30.0))
        elif spec.replicas > 1:  # the stage's replicas share its weights through its PS shard (or its copies' chain)
            link = PSLinkSpec(spec.ps[i * spec.ps_copies:(i + 1) * spec.ps_copies], [0], spec.n_fetch, spec.n_push,
                              spec.codec)
            params = sync.build_sync(link, stages[k].layers, sync.SyncContext(
                f"{name}@{host.system.node}", time.time_ns() // 1000, optimizer, ask_timeout_s=30.0))
        refs.append(await host.spawn(pipeline_module.Stage, *stages[k].args(), **stages[k].kwargs(), params=params,
                                     sync=peers, name=name, mailbox_size=spec.mailbox_size,
                                     supervision=Directive.STOP))
    log.info("hosting stages %s of pipeline %d", spec.hosted, spec.pipeline)
    return refs


def _import_stage_modules() -> Any:
    """The pipeline module, and ``torch._dynamo``, which the first torch optimizer a stage makes imports: seconds of
    CPU (1 s quiet, 3.1-3.6 s seen under load) that on the event loop would stop the node's heartbeats as long, in a
    node no fork server imported them for (one started by hand, by Slurm or torchrun, or emulated)."""
    for name in STAGE_PRELOAD:
        importlib.import_module(name)
    return importlib.import_module("dniasync.train.pipeline")


def _build(spec: StagesSpec, settings: Any) -> list[Any]:
    import torch

    from ...train.pipeline import build_stages

    torch.set_num_threads(1)
    model = spec.model.build()
    assert isinstance(model, torch.nn.Sequential)  # checked when the config was resolved
    return build_stages(model, spec.groups, settings, spec.in_features, seed=spec.model.seed)
