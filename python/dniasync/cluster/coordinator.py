"""The training coordinator: assignment, liveness, evaluation, stopping.

It turns a job config into work: which PS node hosts which shard of the
flat parameter vector, which replica trains which data shard (and who takes
over a dead replica's shard from its last reported cursor), when to
evaluate on held-out data, and when to stop. It writes the run summary
(JSON) and a PNG of held-out accuracy and loss against wall time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from .. import _core
from ..actors import Actor, ActorError, ActorNotFound, ActorRef, handler, message
from ..train.data import DataCursor
from ..train.flat import FlatModel, evaluate, flatten_parameters, split_ranges
from ..train.messages import (
    COORDINATOR_NAME,
    Assignment,
    Fence,
    JobStatus,
    JobStatusReply,
    NoJob,
    Params,
    Progress,
    PSAssignment,
    PSJoin,
    PSReady,
    Pull,
    RegisterReplica,
    Shards,
    ShardStats,
    StopTraining,
)
from ..train.models import build_model
from ..train.ps import PSShard, ShardSettings
from ..train.replica import HOGWILD_SEGMENT, TrainPlan, load_split
from ..train.staleness import StalenessPolicy
from .config import Config, DownpourConfig
from .report import EVENT_REPLICA_FAILED, EVENT_REPLICA_JOINED, EVENT_SHARD_REASSIGNED, RunReport
from .telemetry import track_trainer

__all__ = ["COORDINATOR_NAME", "PSHost", "TrainingCoordinator", "record_ps_stats", "shard_settings", "train_plan"]

log = logging.getLogger("dniasync.cluster.coordinator")


FIRST_PROGRESS_GRACE_S = 60.0
"""A replica that registered gets this long to load its data and report once."""


def train_plan(config: Config) -> TrainPlan:
    """The replica's view of a job config."""
    data = config.data
    data_kwargs: dict[str, Any] = {
        "label_column": data.csv_label_column, "x_key": data.npz_x_key, "y_key": data.npz_y_key,
    }
    if data.csv_header is not None:
        data_kwargs["header"] = data.csv_header
    if data.scale is not None:
        data_kwargs["scale"] = data.scale
    opt = config.optimizer
    common = dict(
        model_factory=config.model.factory, model_kwargs=dict(config.model.kwargs), seed=config.job.seed,
        dataset=data.dataset, data_kwargs=data_kwargs, n_train=data.n_train, n_test=data.n_test,
        batch_size=data.batch_size, n_shards=config.n_data_shards, clip_norm=opt.clip_norm, lr=opt.lr,
        optimizer=opt.name,
    )
    if isinstance(config.settings, DownpourConfig):
        d = config.settings
        return TrainPlan(mode="downpour", n_fetch=d.n_fetch, n_push=d.n_push, codec=d.codec,
                         tau=d.tau or 1e-3, block=d.block, **common)  # type: ignore[arg-type]
    store_options = {"momentum": opt.momentum, "beta1": opt.betas[0], "beta2": opt.betas[1],
                     "eps": opt.eps, "weight_decay": opt.weight_decay}
    return TrainPlan(mode="hogwild", store_options=store_options, **common)  # type: ignore[arg-type]


def shard_settings(config: Config) -> ShardSettings:
    d, opt = config.downpour, config.optimizer
    return ShardSettings(
        optimizer=opt.name, lr=opt.lr, momentum=opt.momentum, betas=opt.betas, eps=opt.eps,
        weight_decay=opt.weight_decay, staleness=StalenessPolicy(d.staleness, d.max_staleness or 0),
        codec=d.codec, tau=d.tau or 1e-3, block=d.block,
    )


async def record_ps_stats(report: RunReport, shards: Iterable[tuple[int, ActorRef | None]]) -> None:
    """Put each PS shard's counters (applied, rejections, staleness histogram) into the run summary."""
    for index, ps in shards:
        if ps is None:
            continue
        try:
            stats = await ps.ask(ShardStats(), timeout=5.0)
        except ActorError as exc:
            log.warning("no stats from PS shard %d (%s): %s", index, ps, exc)
            continue
        for key in ("applied", "version", "staleness_sum"):
            report.set_metric(f"ps{index}_{key}", int(stats[key]))
        for key, count in stats["rejected"].items():
            report.set_metric(f"ps{index}_rejected_{key}", int(count))
        for bound, count in zip([*map(str, stats["staleness_buckets"]), "inf"], stats["staleness_counts"]):
            report.set_metric(f"ps{index}_staleness_le_{bound}", int(count))


@message("dniasync.cluster.Tick")
@dataclass(frozen=True)
class _Tick:
    pass


@dataclass
class _ReplicaState:
    ref: ActorRef
    incarnation: int
    registered: float
    shards: set[int] = field(default_factory=set)
    last_seen: float = 0.0
    reported: bool = False
    status: str = "alive"
    samples: int = 0
    steps: int = 0
    loss: float = float("nan")
    bytes_pushed: int = 0
    bytes_pulled: int = 0


class TrainingCoordinator(Actor):
    """Runs one data-parallel job (Downpour or Hogwild) over the replicas that register."""

    mailbox_size = 0

    def __init__(self, config: Config, *, liveness_s: float = 3.0, finished: asyncio.Event | None = None) -> None:
        self.config = config
        self.plan = train_plan(config)
        self.liveness_s = liveness_s
        self.finished = finished or asyncio.Event()
        self.state = "waiting"
        self.replicas: dict[str, _ReplicaState] = {}
        self.owners: dict[int, str | None] = {s: None for s in range(config.n_data_shards)}
        self.cursors: dict[int, DataCursor] = {s: DataCursor(s) for s in range(config.n_data_shards)}
        self.started_at: float | None = None
        self.accuracy: float | None = None
        self.loss: float | None = None
        self.summary_path = ""
        self._rate = (0.0, 0)
        self._samples_per_s = 0.0
        self._next_eval_steps = 0
        self._final_eval = False
        self._timer: asyncio.TimerHandle | None = None
        self._shm_store: _core.ParamStore | None = None

    # -- setup --------------------------------------------------------------
    async def on_start(self) -> None:
        await self.run_blocking(self._setup)
        self.report = RunReport(self.config.job.name, self.config.mode,
                                target_accuracy=self.config.stop.target_accuracy, config=self.config.to_dict())
        if self.config.mode == "hogwild":
            self.state = "training-ready"
        track_trainer(self.system, self)
        self._schedule_tick()

    def _setup(self) -> None:
        torch.set_num_threads(1)
        model = build_model(self.plan.model_factory, self.plan.model_kwargs, seed=self.plan.seed)
        self.initial = flatten_parameters(model)
        self.n_params = self.initial.size
        _, _, self.x_test, self.y_test = load_split(self.plan)
        if self.config.mode == "hogwild":
            name = f"{self.config.job.name}-{os.getpid()}"
            if os.path.exists(f"/dev/shm/dniasync-{name}") and _core.ParamStore.is_stale(name):
                _core.ParamStore.remove_stale(name)  # left by a crashed run with our pid
            self._shm_store = _core.ParamStore(
                [(HOGWILD_SEGMENT, self.n_params)], self.plan.optimizer,  # type: ignore[arg-type]
                shm_name=name, **self.plan.store_options,
            )
            self._shm_store.write(HOGWILD_SEGMENT, self.initial)
            self.shm_name = name
            self.eval_flat = FlatModel(model, self._shm_store.view(HOGWILD_SEGMENT))
            self.ps: list[ActorRef | None] = []
            self.ranges: list[tuple[int, int]] = []
        else:
            self.shm_name = ""
            self.eval_buffer = self.initial.copy()
            self.eval_flat = FlatModel(model, self.eval_buffer)
            self.ranges = split_ranges(self.n_params, self.config.downpour.n_ps_shards)
            self.ps = [None] * len(self.ranges)
            self._ps_pending: set[int] = set()

    async def on_stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._shm_store is not None:
            self._shm_store.close()

    def _schedule_tick(self) -> None:
        every = self.config.eval.every_seconds or 0.25

        def poke() -> None:
            try:
                self.ref.tell_nowait(_Tick())
            except ActorError:
                pass

        self._timer = asyncio.get_running_loop().call_later(min(every, 0.5), poke)

    def _now(self) -> float:
        return time.monotonic()

    def _wall(self) -> float:
        return 0.0 if self.started_at is None else self._now() - self.started_at

    # -- parameter servers --------------------------------------------------
    @handler
    def ps_join(self, msg: PSJoin) -> PSAssignment | NoJob:
        if self.config.mode != "downpour":
            return NoJob(f"job {self.config.job.name} is {self.config.mode}: no PS shards", retry=False)
        for shard, ref in enumerate(self.ps):
            if ref is None and shard not in self._ps_pending:
                self._ps_pending.add(shard)
                offset, length = self.ranges[shard]
                settings = json.dumps({k: v for k, v in asdict(shard_settings(self.config)).items()})
                log.info("PS shard %d (%d parameters) goes to %s", shard, length, msg.node)
                return PSAssignment(shard, offset, self.initial[offset:offset + length].copy(), settings)
        return NoJob("every PS shard is hosted", retry=False)

    @handler
    def ps_ready(self, msg: PSReady) -> None:
        self.ps[msg.shard] = msg.ref
        self._ps_pending.discard(msg.shard)
        if all(ref is not None for ref in self.ps):
            self.state = "training-ready"
            log.info("all %d PS shards ready", len(self.ps))

    # -- replicas -----------------------------------------------------------
    @handler
    def register(self, msg: RegisterReplica) -> Assignment | NoJob:
        if self.state == "finished":
            return NoJob("the job has finished", retry=False)
        if self.state == "waiting":
            return NoJob("waiting for the PS shards", retry=True)
        warm = self.config.settings.warm_start_steps if isinstance(self.config.settings, DownpourConfig) else 0
        if warm and self.replicas and not any(r.steps >= warm for r in self.replicas.values()):
            if msg.replica not in self.replicas:
                return NoJob(f"warm start: the first replica runs {warm} steps alone", retry=True)
        now = self._now()
        old = self.replicas.get(msg.replica)
        if old is not None and old.status == "alive" and old.incarnation == msg.incarnation:
            shards = old.shards  # a retried registration: same answer
        else:
            if old is not None:
                self._declare_dead(msg.replica, "re-registered with a new incarnation")
            free = [s for s, owner in self.owners.items() if owner is None]
            shards = {free[0]} if free else set()
            for s in shards:
                self.owners[s] = msg.replica
            self.replicas[msg.replica] = _ReplicaState(msg.ref, msg.incarnation, now, shards, last_seen=now)
            if self.started_at is None:
                self.started_at = now
                self.state = "training"
            self.report.record_event(self._wall(), EVENT_REPLICA_JOINED, replica=msg.replica,
                                     shards=",".join(map(str, sorted(shards))),
                                     cluster_steps=sum(r.steps for r in self.replicas.values()))
            log.info("replica %s joined; data shards %s", msg.replica, sorted(shards))
        return Assignment(
            self.plan.to_json(),
            [[c.shard, c.epoch, c.position] for s in sorted(shards) for c in [self.cursors[s]]],
            [ref for ref in self.ps if ref is not None],
            [offset for offset, _ in self.ranges],
            self.shm_name,
        )

    @handler
    def progress(self, msg: Progress) -> None:
        state = self.replicas.get(msg.replica)
        if state is None or state.incarnation != msg.incarnation or state.status != "alive":
            return  # a fenced replica's late words
        state.last_seen = self._now()
        state.reported = True
        self.report.add_bytes(pushed=msg.bytes_pushed - state.bytes_pushed, pulled=msg.bytes_pulled - state.bytes_pulled)
        state.samples, state.steps, state.loss = msg.samples, msg.steps, msg.loss
        state.bytes_pushed, state.bytes_pulled = msg.bytes_pushed, msg.bytes_pulled
        for shard, epoch, position in msg.cursors:
            if self.owners.get(shard) == msg.replica:
                self.cursors[shard] = DataCursor(shard, epoch, position)
        if not self._final_eval and self._samples() >= self.config.stop.max_epochs * self.config.data.n_train:
            self._final_eval = True  # the epoch budget is spent: evaluate and stop now, not at the next tick
            self.ref.tell_nowait(_Tick())

    def _declare_dead(self, name: str, why: str) -> None:
        state = self.replicas[name]
        if state.status != "alive":
            return
        state.status = "dead"
        log.warning("replica %s declared dead (%s); its data shards %s are reassigned", name, why, sorted(state.shards))
        self.report.record_event(self._wall(), EVENT_REPLICA_FAILED, replica=name, reason=why)
        for ps in self.ps:
            if ps is not None:
                try:
                    ps.tell_nowait(Fence(name))
                except ActorError as exc:
                    log.warning("could not fence %s on %s: %s", name, ps, exc)
        orphans = sorted(state.shards)
        state.shards = set()
        for shard in orphans:
            self.owners[shard] = None
        self._reassign()

    def _reassign(self) -> None:
        orphans = [s for s, owner in self.owners.items() if owner is None]
        alive = [(n, r) for n, r in self.replicas.items() if r.status == "alive"]
        if not orphans or not alive:
            return
        changed: set[str] = set()
        for shard in orphans:
            name, state = min(alive, key=lambda item: (len(item[1].shards), item[0]))
            state.shards.add(shard)
            self.owners[shard] = name
            changed.add(name)
            cursor = self.cursors[shard]
            self.report.record_event(self._wall(), EVENT_SHARD_REASSIGNED, shard=shard, to=name,
                                     epoch=cursor.epoch, position=cursor.position)
            log.info("data shard %d goes to %s from epoch %d position %d", shard, name, cursor.epoch, cursor.position)
        for name in changed:
            state = self.replicas[name]
            cursors = [[self.cursors[s].shard, self.cursors[s].epoch, self.cursors[s].position] for s in sorted(state.shards)]
            try:
                state.ref.tell_nowait(Shards(cursors))
            except ActorError as exc:
                log.warning("could not hand shards to %s: %s", name, exc)

    # -- the clock ----------------------------------------------------------
    @handler
    async def tick(self, msg: _Tick) -> None:
        if self.state == "finished":
            return
        try:
            now = self._now()
            for name, state in list(self.replicas.items()):
                limit = self.liveness_s if state.reported else FIRST_PROGRESS_GRACE_S
                if state.status == "alive" and now - state.last_seen > limit:
                    self._declare_dead(name, f"silent for {now - state.last_seen:.1f} s")
            if self.state == "training" and (self._final_eval or self._eval_due()):
                await self._evaluate()
                await self._maybe_stop()
        finally:
            if self.state != "finished":
                self._schedule_tick()

    def _samples(self) -> int:
        return sum(r.samples for r in self.replicas.values())

    def _eval_due(self) -> bool:
        every = self.config.eval
        if every.every_steps is not None:
            steps = sum(r.steps for r in self.replicas.values())
            if steps < self._next_eval_steps:
                return False
            self._next_eval_steps = steps + every.every_steps
            return True
        last = self.report.history[-1].wall_s if self.report.history else -1e9
        return self._wall() - last >= (every.every_seconds or 1.0)

    async def _evaluate(self) -> None:
        if self.config.mode == "downpour":
            replies: list[Params] = await asyncio.gather(*(ps.ask(Pull(), timeout=10.0) for ps in self.ps if ps))
            for reply in replies:
                offset, length = self.ranges[reply.shard]
                self.eval_buffer[offset:offset + length] = reply.values
        wall, samples = self._wall(), self._samples()  # when the weights were taken, not when their forward ended
        accuracy, loss = await self.run_blocking(evaluate, self.eval_flat.model, self.x_test, self.y_test)
        last_wall, last_samples = self._rate
        if wall > last_wall:
            self._samples_per_s = (samples - last_samples) / (wall - last_wall)
        self._rate = (wall, samples)
        self.accuracy, self.loss = accuracy, loss
        self.report.record_eval(wall, samples, accuracy, loss)
        log.info("eval: %.1f s, %d samples, accuracy %.4f, loss %.4f", wall, samples, accuracy, loss)

    async def _maybe_stop(self) -> None:
        stop = self.config.stop
        reason = None
        if stop.target_accuracy is not None and self.accuracy is not None and self.accuracy >= stop.target_accuracy:
            reason = f"reached target accuracy {stop.target_accuracy:g}"
        elif self._samples() >= stop.max_epochs * self.config.data.n_train:
            reason = f"trained {stop.max_epochs} epochs"
        elif stop.max_seconds is not None and self._wall() >= stop.max_seconds:
            reason = f"ran {stop.max_seconds:g} s"
        if reason is not None:
            await self._finish(reason)

    async def _finish(self, reason: str) -> None:
        self.state = "finished"
        for state in self.replicas.values():
            if state.status == "alive":
                try:
                    await state.ref.tell(StopTraining(reason))
                except ActorError:
                    pass
        await record_ps_stats(self.report, enumerate(self.ps))
        self.report.finish(self._wall(), self._samples(), reason)
        self.summary_path = str(await self.run_blocking(self.report.write_outputs, self.config.job.output_dir))
        log.info("job finished: %s; summary in %s", reason, self.summary_path)
        self.finished.set()

    @handler
    def status(self, msg: JobStatus) -> JobStatusReply:
        return self.snapshot()

    @property
    def evaluations(self) -> int:
        """Held-out evaluations run so far."""
        return len(self.report.history)

    def snapshot(self) -> JobStatusReply:
        """The job's state now (what :class:`JobStatus` answers); read by the node's metrics and live page."""
        return JobStatusReply(
            job=self.config.job.name, mode=self.config.mode,
            state="waiting" if self.state in ("waiting", "training-ready") else self.state,
            wall_s=self._wall(), samples=self._samples(), epochs=self._samples() / self.config.data.n_train,
            max_epochs=self.config.stop.max_epochs, accuracy=self.accuracy, loss=self.loss,
            samples_per_s=self._samples_per_s,
            replicas={n: r.status for n, r in self.replicas.items()}, summary=self.summary_path,
            extra={"bytes_pushed": self.report.bytes_pushed, "bytes_pulled": self.report.bytes_pulled},
        )


class PSHost(Actor):
    """On a PS node: asks the coordinator which shard to host, then runs it as a child."""

    def __init__(self, coordinator: str, retry_s: float = 0.5) -> None:
        self.coordinator_address = coordinator
        self.retry_s = retry_s
        self.shard: ActorRef | None = None

    async def on_start(self) -> None:
        self.ref.tell_nowait(_Tick())

    @handler
    async def join(self, msg: _Tick) -> None:
        if self.shard is not None:
            return
        coordinator = self.system.ref(self.coordinator_address)
        try:
            reply = await coordinator.ask(PSJoin(self.system.node), timeout=10.0)
        except ActorError as exc:
            if isinstance(exc, ActorNotFound):
                log.info("PS host: the coordinator runs no training job; idle")
                return
            log.info("PS host: coordinator not reachable yet (%s); retrying", exc)
            asyncio.get_running_loop().call_later(self.retry_s, self._poke)
            return
        if isinstance(reply, NoJob):
            log.info("PS host: no shard to host: %s", reply.reason)
            return
        assert isinstance(reply, PSAssignment)
        raw = json.loads(reply.job)
        raw["staleness"] = StalenessPolicy(**raw["staleness"])
        raw["betas"] = tuple(raw["betas"])
        settings = ShardSettings(**raw)
        self.shard = await self.spawn(PSShard, reply.shard, reply.values, settings, name=f"ps-{reply.shard}")
        await coordinator.tell(PSReady(reply.shard, self.shard))

    def _poke(self) -> None:
        try:
            self.ref.tell_nowait(_Tick())
        except ActorError:
            pass
