"""A DNI job across processes: the coordinator places layer groups on workers and drives the pipelines.

The coordinator node runs a :class:`DNIJob` under the name ``trainer`` (it
answers :class:`~dniasync.train.messages.JobStatus` like the data-parallel
coordinator, so the launcher's progress bar and summary work unchanged).
Each worker node runs a :class:`GroupHost`, which asks the job once what to
host (:class:`HostRequest`), builds the model from the factory and seed,
cuts it, spawns its :class:`~dniasync.train.dni.LayerGroup` actors and
reports their refs (:class:`GroupsReady`). With ``dni.replicas > 1`` (DNI x
Downpour) every group also gets a PS shard, served by a ``ps`` node's
:class:`~dniasync.cluster.coordinator.PSHost` as in Downpour, and the groups
are :class:`~dniasync.train.dni_replica.ReplicatedLayerGroup` actors.

Once every group is up, the job drives one
:class:`~dniasync.train.pipeline.PipelineDriver` per pipeline over the remote
refs, each pipeline on its own data shard; evaluates the whole model on the
held-out set at intervals (on a copy of the groups' current weights, or of
the PS shards' with replicas, so evaluating takes no time from the groups); stops at the epoch budget, the target accuracy or
the time limit; and writes ``summary.json`` and ``accuracy.png``. A group
that dies stops the run with state ``failed`` and an event naming it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import numpy as np
import torch
from torch import nn

from ..actors import Actor, ActorError, ActorNotFound, ActorRef, Directive, handler, message
from ..train.dni import DNISettings, GroupStats, LayerGroup, build_layer_groups, split_sequential
from ..train.dni_replica import ReplicatedLayerGroup
from ..train.flat import FlatModel, evaluate, flatten_parameters
from ..train.messages import (
    JobStatus,
    JobStatusReply,
    NoJob,
    Params,
    PSAssignment,
    PSJoin,
    PSReady,
    Pull,
)
from ..train.models import build_model
from ..train.pipeline import PipelineBroken, PipelineDriver
from ..train.ps import ShardSettings
from ..train.replica import load_split
from ..train.staleness import StalenessPolicy
from .config import Config, parse_config
from .coordinator import record_ps_stats, train_plan
from .report import RunReport
from .telemetry import track_trainer

__all__ = [
    "EVENT_GROUP_FAILED",
    "DNIJob",
    "GroupHost",
    "GroupsReady",
    "HostAssignment",
    "HostRequest",
    "dni_settings",
    "group_name",
]

log = logging.getLogger("dniasync.cluster.dni_job")

EVENT_GROUP_FAILED = "group_failed"
EVENT_GROUPS_PLACED = "groups_placed"


@message("dniasync.cluster.dni.HostRequest")
@dataclass(frozen=True)
class HostRequest:
    """A worker asks the DNI job which layer groups to host."""

    node: str


@message("dniasync.cluster.dni.HostAssignment")
@dataclass(frozen=True)
class HostAssignment:
    """Host ``groups`` of pipeline ``pipeline``; ``ps[i]`` is the PS shard of ``groups[i]`` (replicas only)."""

    job: str
    """The job config as JSON (``Config.to_dict()``)."""
    pipeline: int
    groups: list[int]
    num_classes: int
    in_features: int
    ps: list[ActorRef]


@message("dniasync.cluster.dni.GroupsReady")
@dataclass(frozen=True)
class GroupsReady:
    """Ask (answered with True): these groups are up. Idempotent, so a host retries until answered."""

    pipeline: int
    groups: list[int]
    refs: list[ActorRef]


def group_name(pipeline: int, group: int, replicas: int) -> str:
    """The actor name of a layer group: ``layer-group-k`` (``layer-group-r-k`` with replicas)."""
    return f"layer-group-{group}" if replicas == 1 else f"layer-group-{pipeline}-{group}"


def dni_settings(config: Config, num_classes: int) -> DNISettings:
    """How every layer group of the job trains."""
    d, opt = config.dni, config.optimizer
    return DNISettings(
        mode="sync" if d.variant == "sync" else "dni",
        lr=opt.lr,
        optimizer="sgd" if opt.name == "sgd" else "adam",  # with replicas the PS applies [optimizer]
        num_classes=num_classes,
        conditioned=d.variant == "cdni",
        sg_hidden_layers=d.sg_hidden_layers,
        sg_hidden_width=d.sg_hidden_width,
        sg_lr=d.sg_lr,
        sg_fit_rows=d.sg_fit_rows,
        synthetic_inputs=d.synthetic_inputs,
        cache_size=max(64, 2 * d.max_in_flight, 2 * d.micro_batches),
    )


def _mailbox_size(config: Config) -> int:
    d = config.dni
    return 3 * max(d.max_in_flight, d.micro_batches) + 4  # >= 3W: see LayerGroup


def _shard_settings(config: Config) -> ShardSettings:
    opt = config.optimizer
    return ShardSettings(optimizer=opt.name, lr=opt.lr, momentum=opt.momentum, betas=opt.betas, eps=opt.eps,
                         weight_decay=opt.weight_decay, staleness=StalenessPolicy())


MAX_DEFERRED_SNAPSHOTS: Final = 256
"""``eval.deferred`` keeps at most this many sets of weights; beyond, the oldest is scored at once."""


@dataclass
class _Snapshot:
    """Weights taken for an evaluation, dated when they arrived."""

    wall: float
    samples: int
    states: list[dict[str, torch.Tensor]] | None = None
    """One pipeline: each group's state."""
    shards: dict[int, np.ndarray[Any, Any]] = field(default_factory=dict)
    """Replicated groups: each group's PS shard values."""


@message("dniasync.cluster.dni.Begin")
@dataclass(frozen=True)
class _Begin:
    pass


class DNIJob(Actor):
    """Places the layer groups of a DNI job on the workers that ask, then trains and reports."""

    mailbox_size = 0

    def __init__(self, config: Config, *, finished: asyncio.Event | None = None) -> None:
        self.config = config
        self.d = config.dni
        self.finished = finished or asyncio.Event()
        self.state = "waiting"
        self.started_at: float | None = None
        self.accuracy: float | None = None
        self.loss: float | None = None
        self.summary_path = ""
        self.samples_per_s = 0.0
        self._rate = (0.0, 0)
        n_pipelines, n_groups = self.d.replicas, len(self.d.groups)
        # placement slots, handed out in this order: (pipeline, groups on that worker)
        self.slots: list[tuple[int, list[int]]] = [
            (r, [k for k, w in enumerate(self.d.group_workers) if w == worker])
            for r in range(n_pipelines)
            for worker in range(self.d.workers_per_pipeline)
        ]
        self.hosts: dict[str, int] = {}
        """worker node -> slot index"""
        self.refs: list[list[ActorRef | None]] = [[None] * n_groups for _ in range(n_pipelines)]
        self.ps: list[ActorRef | None] = [None] * (n_groups if n_pipelines > 1 else 0)
        self._ps_pending: set[int] = set()
        self.drivers: list[PipelineDriver] = []
        self._main: asyncio.Task[None] | None = None
        self._sg_first: dict[str, float] = {}
        self._sg_last: dict[str, float] = {}
        self._group_bytes: dict[str, tuple[int, int]] = {}
        """group address -> (pushed, pulled) bytes it had reported (DNI x Downpour)"""
        self._deferred: deque[_Snapshot] = deque()
        """With ``eval.deferred``: weights taken while training, evaluated once it ends."""

    # -- setup --------------------------------------------------------------
    async def on_start(self) -> None:
        await self.run_blocking(self._setup)
        self.report = RunReport(self.config.job.name, self.config.mode,
                                target_accuracy=self.config.stop.target_accuracy, config=self.config.to_dict())
        track_trainer(self.system, self)

    def _setup(self) -> None:
        torch.set_num_threads(1)
        self.x_train, self.y_train, self.x_test, self.y_test = load_split(train_plan(self.config))
        self.num_classes = int(max(int(self.y_train.max()), int(self.y_test.max()))) + 1
        self.in_features = int(self.x_train.shape[1])
        model = build_model(self.config.model.factory, self.config.model.kwargs, seed=self.config.job.seed)
        assert isinstance(model, nn.Sequential)  # checked when the config was resolved
        self.eval_model = model
        # every group's flat parameters: the PS shards' initial values, and the evaluation buffers
        self.eval_parts = split_sequential(model, self.d.groups)
        self.eval_buffers = [flatten_parameters(part) for part in self.eval_parts]
        self.eval_flats = [FlatModel(part, buf) for part, buf in zip(self.eval_parts, self.eval_buffers)]

    async def on_stop(self) -> None:
        if self._main is not None and not self._main.done():
            self._main.cancel()
            await asyncio.gather(self._main, return_exceptions=True)

    def _wall(self) -> float:
        if self.state in ("finished", "failed"):
            return self.report.wall_s
        return 0.0 if self.started_at is None else time.monotonic() - self.started_at

    # -- placement ------------------------------------------------------------
    @handler
    def ps_join(self, msg: PSJoin) -> PSAssignment | NoJob:
        for group, ref in enumerate(self.ps):
            if ref is None and group not in self._ps_pending:
                self._ps_pending.add(group)
                settings = json.dumps(asdict(_shard_settings(self.config)))
                log.info("PS shard of group %d goes to %s", group, msg.node)
                return PSAssignment(group, 0, self.eval_buffers[group].copy(), settings)
        return NoJob("every layer group's PS shard is hosted", retry=False)

    @handler
    def ps_ready(self, msg: PSReady) -> None:
        self.ps[msg.shard] = msg.ref
        self._ps_pending.discard(msg.shard)

    @handler
    def host(self, msg: HostRequest) -> HostAssignment | NoJob:
        if self.state != "waiting":
            return NoJob(f"the job is {self.state}: every group is placed", retry=False)
        if any(ref is None for ref in self.ps):
            return NoJob("waiting for the layer groups' PS shards", retry=True)
        slot = self.hosts.get(msg.node)
        if slot is None:
            if len(self.hosts) == len(self.slots):
                return NoJob("every layer group is placed", retry=False)
            slot = self.hosts[msg.node] = len(self.hosts)
        pipeline, groups = self.slots[slot]
        log.info("pipeline %d, groups %s go to %s", pipeline, groups, msg.node)
        return HostAssignment(
            json.dumps(self.config.to_dict()), pipeline, groups, self.num_classes, self.in_features,
            [ref for k in groups if self.ps for ref in [self.ps[k]] if ref is not None],
        )

    @handler
    def groups_ready(self, msg: GroupsReady) -> bool:
        for k, ref in zip(msg.groups, msg.refs):
            self.refs[msg.pipeline][k] = ref
        if self._main is None and all(ref is not None for row in self.refs for ref in row):
            self.state = "training"
            self._main = asyncio.create_task(self._run(), name=f"dni-job-{self.config.job.name}")
        return True

    # -- training -------------------------------------------------------------
    def _shard(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.array_split(np.arange(self.config.data.n_train), self.d.replicas)[r]
        index = torch.from_numpy(idx)
        return self.x_train[index], self.y_train[index]

    def _samples(self) -> int:
        return sum(driver.samples_done for driver in self.drivers)

    async def _run(self) -> None:
        d, job = self.d, self.config.job
        pipelines = [[ref for ref in row if ref is not None] for row in self.refs]
        addresses = ", ".join(ref.address for row in pipelines for ref in row)
        try:
            for r, refs in enumerate(pipelines):
                driver = PipelineDriver(
                    self.system, refs, mode="sync" if d.variant == "sync" else "dni",
                    max_in_flight=d.max_in_flight, micro_batches=d.micro_batches if d.variant == "sync" else 1,
                    synthetic_inputs=d.synthetic_inputs, name=f"pipeline-monitor-{r}",
                )
                await driver.start()
                self.drivers.append(driver)
            self.started_at = time.monotonic()
            self.report.record_event(0.0, EVENT_GROUPS_PLACED, groups=addresses)
            log.info("training %d pipeline(s) over %s", len(pipelines), addresses)
            trainers = [
                asyncio.create_task(self._train(r, driver), name=f"pipeline-{r}")
                for r, driver in enumerate(self.drivers)
            ]
            reason = await self._supervise(trainers)
            train_wall = self._wall()
            train_samples = self._samples()
            # the evaluation that met the target is the result; otherwise evaluate what training left
            last = self._deferred[-1].samples if self._deferred else (
                self.report.history[-1].samples if self.report.history else None)
            if not reason.startswith("reached") and last != train_samples:
                await self._evaluate()
            if self._deferred:
                await self._evaluate_deferred()
            self.report.set_metric("train_samples_per_s", train_samples / train_wall if train_wall > 0 else 0.0)
            await self._record_stats()
            # deferred: the summary's wall time is training's (and its last snapshot's), not the scoring's
            wall = max(train_wall, self.report.history[-1].wall_s) if self.config.eval.deferred else None
            await self._finish(reason, wall=wall)
        except PipelineBroken as exc:
            await self._fail(exc)
        except (ActorError, TimeoutError) as exc:  # e.g. a PS shard gone while evaluating: fail, never hang
            await self._fail(PipelineBroken(getattr(exc, "address", "") or "the job", repr(exc)))
        except Exception as exc:  # a bug ends the job as failed; it must never leave the launcher waiting
            log.exception("DNI job failed unexpectedly")
            try:
                await self._finish(f"failed: {exc!r}", state="failed")
            except Exception:
                log.exception("could not write the summary")
                self.state = "failed"
                self.finished.set()
        finally:
            for driver in self.drivers:
                try:
                    await driver.close()
                except ActorError:
                    pass

    async def _train(self, r: int, driver: PipelineDriver) -> None:
        x, y = self._shard(r)
        result = await driver.train(x, y, epochs=self.config.stop.max_epochs,
                                    batch_size=self.config.data.batch_size, seed=self.config.job.seed + r)
        self._note_stats(r, result.stats)  # they asked the groups last: their SG losses are the latest

    async def _supervise(self, trainers: list[asyncio.Task[None]]) -> str:
        """Evaluate at the configured cadence until the pipelines finish or a stop condition holds."""
        stop, every = self.config.stop, self.config.eval
        next_steps = every.every_steps or 0
        last_eval = 0.0
        try:
            while True:
                done, _ = await asyncio.wait(trainers, timeout=0.1 if every.every_steps else 0.25)
                for task in done:
                    if task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                if len(done) == len(trainers):
                    return f"trained {stop.max_epochs} epochs"
                steps = self._samples() // self.config.data.batch_size
                if every.every_steps is not None:
                    due = steps >= next_steps
                    if due:
                        next_steps = steps + every.every_steps
                else:
                    due = self._wall() - last_eval >= (every.every_seconds or 2.0)
                if due:
                    await self._evaluate()
                    last_eval = self._wall()
                    if stop.target_accuracy is not None and (self.accuracy or 0.0) >= stop.target_accuracy:
                        return f"reached target accuracy {stop.target_accuracy:g}"
                if stop.max_seconds is not None and self._wall() >= stop.max_seconds:
                    return f"ran {stop.max_seconds:g} s"
        finally:
            for task in trainers:
                task.cancel()
            await asyncio.gather(*trainers, return_exceptions=True)

    async def _evaluate(self) -> None:
        """Take the weights now and score them (with ``eval.deferred``: keep them to score after training)."""
        snapshot = await self._snapshot()
        for r, driver in enumerate(self.drivers):
            self._note_stats(r, await driver.stats())
        if not self.config.eval.deferred:
            await self._score(snapshot)
            return
        self._deferred.append(snapshot)
        log.debug("eval: weights taken at %.1f s, %d samples (scored after training)", snapshot.wall, snapshot.samples)
        if len(self._deferred) > MAX_DEFERRED_SNAPSHOTS:
            await self._score(self._deferred.popleft())

    async def _snapshot(self) -> _Snapshot:
        # a copy of the current weights: the forward pass runs here and takes no time from the groups;
        # the point is dated when the weights have arrived, not when their forward pass has finished
        if self.d.replicas == 1:
            states = await self.drivers[0].states()
            return _Snapshot(self._wall(), self._samples(), states=states)
        # the shared weights: what the PS shards hold now
        replies = await asyncio.gather(*(ps.ask(Pull(), timeout=10.0) for ps in self.ps if ps is not None))
        shards = {}
        for reply in replies:
            assert isinstance(reply, Params)
            shards[reply.shard] = np.array(reply.values, copy=True)
        return _Snapshot(self._wall(), self._samples(), shards=shards)

    async def _score(self, snapshot: _Snapshot) -> None:
        if snapshot.states is not None:
            await self.run_blocking(self._load_states, snapshot.states)
        for shard, values in snapshot.shards.items():
            np.copyto(self.eval_buffers[shard], values)
        accuracy, loss = await self.run_blocking(evaluate, self.eval_model, self.x_test, self.y_test)
        wall, samples = snapshot.wall, snapshot.samples
        last_wall, last_samples = self._rate
        if wall > last_wall:
            self.samples_per_s = (samples - last_samples) / (wall - last_wall)
        self._rate = (wall, samples)
        self.accuracy, self.loss = accuracy, loss
        self.report.record_eval(wall, samples, accuracy, loss)
        log.info("eval: %.1f s, %d samples, accuracy %.4f, loss %.4f", wall, samples, accuracy, loss)

    async def _evaluate_deferred(self) -> None:
        total = len(self._deferred)
        log.info("training done: scoring %d deferred evaluations", total)
        for done in range(1, total + 1):
            await self._score(self._deferred.popleft())
            if done % 20 == 0 or done == total:
                log.info("deferred evaluations: %d/%d", done, total)

    def _load_states(self, states: list[dict[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for part, state in zip(self.eval_parts, states):
                part.load_state_dict(state)

    def _note_stats(self, r: int, stats: list[GroupStats]) -> None:
        """Each group's mean SG loss since the previous stats request (first and latest kept) and PS bytes."""
        for k, s in enumerate(stats):
            key = f"group{k}" if self.d.replicas == 1 else f"pipeline{r}_group{k}"
            if math.isfinite(s.sg_loss):
                self._sg_first.setdefault(key, s.sg_loss)
                self._sg_last[key] = s.sg_loss
            pushed, pulled = self._group_bytes.get(s.address, (0, 0))
            self.report.add_bytes(pushed=s.bytes_pushed - pushed, pulled=s.bytes_pulled - pulled)
            self._group_bytes[s.address] = (s.bytes_pushed, s.bytes_pulled)

    async def _record_stats(self) -> None:
        for r, driver in enumerate(self.drivers):
            stats: list[GroupStats] = await driver.stats()
            self._note_stats(r, stats)
            for k, s in enumerate(stats):
                key = f"group{k}" if self.d.replicas == 1 else f"pipeline{r}_group{k}"
                self.report.set_metric(f"{key}_address", s.address)
                for name in ("steps", "sg_steps", "input_steps", "evictions", "late_gradients"):
                    self.report.set_metric(f"{key}_{name}", int(getattr(s, name)))
                if s.sg_steps:  # mean updates between a batch's forward and its SG fit
                    self.report.set_metric(f"{key}_sg_staleness_mean", s.sg_staleness_total / s.sg_steps)
                if math.isfinite(s.input_loss):
                    self.report.set_metric(f"{key}_input_loss_last", s.input_loss)
        await record_ps_stats(self.report, enumerate(self.ps))  # one shard per group
        for key, value in self._sg_first.items():
            self.report.set_metric(f"{key}_sg_loss_first", value)
            self.report.set_metric(f"{key}_sg_loss_last", self._sg_last[key])

    async def _fail(self, exc: PipelineBroken) -> None:
        log.error("DNI job failed: %s", exc)
        self.report.record_event(self._wall(), EVENT_GROUP_FAILED, group=exc.address, reason=exc.reason)
        await self._finish(f"failed: layer group {exc.address} is down ({exc.reason})", state="failed")

    async def _finish(self, reason: str, state: str = "finished", wall: float | None = None) -> None:
        """Write the summary; ``wall``: the run's wall time if not now (deferred evaluations came after)."""
        self.report.set_metric("groups", len(self.d.groups))
        self.report.set_metric("pipelines", self.d.replicas)
        self.report.set_metric("variant", self.d.variant)
        self.report.set_metric("synthetic_inputs", self.d.synthetic_inputs)
        wall_s = wall if wall is not None else max(self._wall(), self.report.wall_s)
        self.report.finish(wall_s, max(self._samples(), self.report.samples), reason)
        self.summary_path = str(await self.run_blocking(self.report.write_outputs, self.config.job.output_dir))
        self.state = state
        log.info("job %s: %s; summary in %s", state, reason, self.summary_path)
        self.finished.set()

    # -- status ---------------------------------------------------------------
    @handler
    def status(self, msg: JobStatus) -> JobStatusReply:
        return self.snapshot()

    @property
    def evaluations(self) -> int:
        return len(self.report.history)

    def snapshot(self) -> JobStatusReply:
        """The job's state now; ``replicas`` lists the layer groups."""
        samples = self._samples()
        alive = {ref.address: ("alive" if ref.is_alive else "dead") for row in self.refs for ref in row if ref}
        return JobStatusReply(
            job=self.config.job.name, mode=self.config.mode, state=self.state, wall_s=self._wall(),
            samples=samples, epochs=samples / self.config.data.n_train, max_epochs=self.config.stop.max_epochs,
            accuracy=self.accuracy, loss=self.loss, samples_per_s=self.samples_per_s, replicas=alive,
            summary=self.summary_path,
            extra={"groups": len(self.d.groups), "pipelines": self.d.replicas, "variant": self.d.variant,
                   "bytes_pushed": self.report.bytes_pushed, "bytes_pulled": self.report.bytes_pulled},
        )


class GroupHost(Actor):
    """On a worker node of a DNI job: asks the job which groups to host, then runs them as children."""

    def __init__(self, coordinator: str, retry_s: float = 0.5) -> None:
        self.coordinator_address = coordinator
        self.retry_s = retry_s
        self.groups: list[ActorRef] = []
        self.ready: GroupsReady | None = None
        """What to tell the job once it answers (a busy machine may drop a connection meanwhile)."""

    async def on_start(self) -> None:
        self.ref.tell_nowait(_Begin())

    def _poke(self) -> None:
        try:
            self.ref.tell_nowait(_Begin())
        except ActorError:
            pass

    @handler
    async def begin(self, msg: _Begin) -> None:
        coordinator = self.system.ref(self.coordinator_address)
        if self.ready is not None:
            await self._announce(coordinator, self.ready)
            return
        try:
            reply = await coordinator.ask(HostRequest(self.system.node), timeout=10.0)
        except ActorError as exc:
            if isinstance(exc, ActorNotFound):
                log.info("group host: the coordinator runs no training job; idle")
                return
            log.info("group host: coordinator not reachable yet (%s); retrying", exc)
            asyncio.get_running_loop().call_later(self.retry_s, self._poke)
            return
        if isinstance(reply, NoJob):
            if reply.retry:
                asyncio.get_running_loop().call_later(self.retry_s, self._poke)
            else:
                log.info("group host: nothing to host: %s", reply.reason)
            return
        assert isinstance(reply, HostAssignment)
        config = parse_config(json.loads(reply.job), resolve=False)
        settings = dni_settings(config, reply.num_classes)
        specs = await self.run_blocking(self._build, config, settings, reply.in_features)
        replicas = config.dni.replicas
        for i, k in enumerate(reply.groups):
            name = group_name(reply.pipeline, k, replicas)
            common: dict[str, Any] = {"name": name, "mailbox_size": _mailbox_size(config),
                                      "supervision": Directive.STOP}
            if replicas == 1:
                ref = await self.system.spawn(LayerGroup, *specs[k].args(), **common)
            else:
                ref = await self.system.spawn(
                    ReplicatedLayerGroup, *specs[k].args(), ps=reply.ps[i], replica=f"{name}@{self.system.node}",
                    n_fetch=config.dni.n_fetch, n_push=config.dni.n_push, **common,
                )
            self.groups.append(ref)
        log.info("hosting layer groups %s of pipeline %d", reply.groups, reply.pipeline)
        self.ready = GroupsReady(reply.pipeline, list(reply.groups), list(self.groups))
        await self._announce(coordinator, self.ready)

    async def _announce(self, coordinator: ActorRef, ready: GroupsReady) -> None:
        try:
            await coordinator.ask(ready, timeout=10.0)
        except ActorError as exc:
            log.info("group host: could not report groups ready (%s); retrying", exc)
            asyncio.get_running_loop().call_later(self.retry_s, self._poke)

    @staticmethod
    def _build(config: Config, settings: DNISettings, in_features: int) -> list[Any]:
        torch.set_num_threads(1)
        model = build_model(config.model.factory, config.model.kwargs, seed=config.job.seed)
        assert isinstance(model, nn.Sequential)
        return build_layer_groups(model, config.dni.groups, settings, in_features, seed=config.job.seed)
