"""Model replicas: Downpour replicas and Hogwild workers.

A replica trains a torch model whose parameters are views of a local
``ParamStore``. In Downpour mode it pulls parameters from the PS shards every
``n_fetch`` steps, accumulates gradients, and every ``n_push`` steps pushes
them (quantized with its own residual when a codec is set) to each shard. In
Hogwild mode the store is the job's shared-memory store and every step is
applied in place, without locks, by the Rust optimizer.

Training advances one step per ``_Step`` message the replica sends itself,
so between steps it still handles new shard assignments and stop requests.
Torch work runs on the system's worker threads, off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from .. import _core
from ..actors import Actor, ActorError, ActorNotFound, ActorRef, handler, message
from .compression import Codec, make_codec
from .data import DataCursor, ShardPlan, load_dataset, split
from .flat import FlatModel
from .messages import Assignment, NoJob, Params, Progress, Pull, Push, RegisterReplica, Shards, StopTraining
from .models import build_model
from .telemetry import track_replica

__all__ = ["HOGWILD_SEGMENT", "Replica", "TrainPlan", "load_split"]

log = logging.getLogger("dniasync.train.replica")

HOGWILD_SEGMENT = "params"
HOGWILD_STEPS_PER_CALL = 8


@dataclass(frozen=True)
class TrainPlan:
    """Everything a replica needs to know about the job, as plain JSON-able data."""

    mode: str
    model_factory: str
    seed: int
    dataset: str
    n_train: int
    n_test: int
    batch_size: int
    n_shards: int
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    data_kwargs: dict[str, Any] = field(default_factory=dict)
    n_fetch: int = 1
    n_push: int = 1
    codec: str = "none"
    tau: float = 1e-3
    block: int = 256
    clip_norm: float | None = None
    lr: float = 0.01
    optimizer: str = "sgd"
    store_options: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrainPlan:
        return cls(**json.loads(text))


def load_split(plan: TrainPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The seeded (train x, train y, held-out x, held-out y) split of the plan's data."""
    ds = load_dataset(plan.dataset, **plan.data_kwargs)
    train, test = split(ds, plan.n_train, plan.n_test, plan.seed)
    return (torch.from_numpy(train.x), torch.from_numpy(train.y), torch.from_numpy(test.x), torch.from_numpy(test.y))


def cursor_triples(cursors: dict[int, DataCursor]) -> list[list[int]]:
    return [[c.shard, c.epoch, c.position] for c in cursors.values()]


@message("dniasync.train.replica.Begin")
@dataclass(frozen=True)
class _Begin:
    pass


@message("dniasync.train.replica.Step")
@dataclass(frozen=True)
class _Step:
    pass


class Replica(Actor):
    """A model replica (Downpour) or a lock-free worker (Hogwild), driven by the coordinator."""

    mailbox_size = 0  # it tells itself to step; an unbounded mailbox cannot deadlock that

    def __init__(
        self,
        coordinator: str,
        *,
        incarnation: int | None = None,
        progress_every_s: float = 0.25,
        retry_s: float = 0.5,
    ) -> None:
        self.coordinator_address = coordinator
        self.incarnation = incarnation if incarnation is not None else time.time_ns() // 1000
        self.progress_every_s = progress_every_s
        self.retry_s = retry_s
        self.plan: TrainPlan | None = None
        self.running = False
        self.cursors: dict[int, DataCursor] = {}
        self._turn = 0
        self.steps = 0
        self.samples = 0
        self.seq = 0
        self.pushes = 0
        self.pulls = 0
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self.dense_bytes_pushed = 0
        self._loss_sum = 0.0
        self._loss_n = 0
        self._last_loss = float("nan")
        self._last_report = 0.0
        self._retry: asyncio.TimerHandle | None = None

    async def on_start(self) -> None:
        self.coordinator: ActorRef = self.system.ref(self.coordinator_address)
        track_replica(self.system, self)
        self.ref.tell_nowait(_Begin())

    @property
    def loss(self) -> float:
        """Mean training loss over the steps before the last progress report (NaN before it)."""
        return self._last_loss

    async def on_stop(self) -> None:
        if self._retry is not None:
            self._retry.cancel()

    def _later(self, msg: Any, delay: float) -> None:
        def poke() -> None:
            try:
                self.ref.tell_nowait(msg)
            except ActorError:
                pass  # stopped meanwhile

        self._retry = asyncio.get_running_loop().call_later(delay, poke)

    # -- joining ------------------------------------------------------------
    @handler
    async def begin(self, msg: _Begin) -> None:
        if self.plan is not None:
            return
        try:
            reply = await self.coordinator.ask(RegisterReplica(self.name, self.incarnation, self.ref), timeout=10.0)
        except ActorError as exc:
            if isinstance(exc, ActorNotFound):  # the node is up but runs no trainer
                log.info("replica %s: the coordinator runs no training job; idle", self.name)
                return
            log.info("replica %s: coordinator not reachable yet (%s); retrying", self.name, exc)
            self._later(_Begin(), self.retry_s)
            return
        if isinstance(reply, NoJob):
            if reply.retry:
                self._later(_Begin(), self.retry_s)
            else:
                log.info("replica %s: no job: %s", self.name, reply.reason)
            return
        assert isinstance(reply, Assignment)
        await self.run_blocking(self._setup, reply)
        self.running = True
        log.info("replica %s: training shards %s", self.name, sorted(self.cursors))
        if self.mode == "downpour":
            await self._pull()  # warm start: never push before the first pull
        self.ref.tell_nowait(_Step())

    def _setup(self, assignment: Assignment) -> None:
        plan = TrainPlan.from_json(assignment.job)
        torch.set_num_threads(1)
        self.plan = plan
        self.mode = plan.mode
        self.x, self.y, _, _ = load_split(plan)
        self.shard_plan = ShardPlan(plan.n_train, plan.n_shards, plan.seed)
        self._set_cursors(assignment.cursors)
        model = build_model(plan.model_factory, plan.model_kwargs, seed=plan.seed)
        n = sum(p.numel() for p in model.parameters())
        if plan.mode == "hogwild":
            self.store = _core.ParamStore.attach(
                assignment.shm_name, [(HOGWILD_SEGMENT, n)], plan.optimizer,  # type: ignore[arg-type]
                **plan.store_options,
            )
            self.flat = FlatModel(model, self.store.view(HOGWILD_SEGMENT))
            return
        self.ps = list(assignment.ps)
        offsets = list(assignment.ps_offsets) + [n]
        self.ranges = [(offsets[i], offsets[i + 1] - offsets[i]) for i in range(len(self.ps))]
        self.store = _core.ParamStore([(f"ps{i}", length) for i, (_, length) in enumerate(self.ranges)], "sgd")
        self.flat = FlatModel(model, self.store.view())
        self.versions = [0] * len(self.ps)
        self.codecs: list[Codec] = [
            make_codec(plan.codec, length, tau=plan.tau, block=plan.block)  # type: ignore[arg-type]
            for _, length in self.ranges
        ]

    def _set_cursors(self, triples: list[list[int]]) -> None:
        self.cursors = {s: DataCursor(s, e, p) for s, e, p in triples}

    # -- training -----------------------------------------------------------
    @handler
    async def step(self, msg: _Step) -> None:
        if not self.running or self.plan is None:
            return
        if not self.cursors:
            return  # nothing to train on until the coordinator hands a shard over
        plan = self.plan
        if self.mode == "downpour" and self.steps and self.steps % plan.n_fetch == 0:
            await self._pull()
        batches = [self._next_indices() for _ in range(self._steps_until_sync())]
        losses = await self.run_blocking(self._compute_many, batches)
        self.steps += len(batches)
        self.samples += sum(len(b) for b in batches)
        self._loss_sum += sum(losses)
        self._loss_n += len(losses)
        if self.mode == "downpour" and self.steps % plan.n_push == 0:
            await self._push(plan.n_push * plan.batch_size)
        now = time.monotonic()
        if now - self._last_report >= self.progress_every_s:
            self._last_report = now
            await self._report()
        if self.running:
            self.ref.tell_nowait(_Step())

    def _steps_until_sync(self) -> int:
        """Steps to run in one hand-off to a worker thread: up to the next pull or push.

        Each hand-off costs a thread hop (~0.1 ms, a sixth of a small step), so
        Hogwild, which never talks between steps, runs several per hand-off.
        """
        plan = self.plan
        assert plan is not None
        if self.mode == "hogwild":
            return HOGWILD_STEPS_PER_CALL
        return min(plan.n_push - self.steps % plan.n_push, plan.n_fetch - self.steps % plan.n_fetch)

    def _next_indices(self) -> np.ndarray:
        shard = sorted(self.cursors)[self._turn % len(self.cursors)]
        self._turn += 1
        assert self.plan is not None
        indices, self.cursors[shard] = self.shard_plan.next_batch(self.cursors[shard], self.plan.batch_size)
        return indices

    def _compute_many(self, batches: list[np.ndarray]) -> list[float]:
        return [self._compute(indices) for indices in batches]

    def _compute(self, indices: np.ndarray) -> float:
        plan = self.plan
        assert plan is not None
        idx = torch.from_numpy(indices)
        model = self.flat.model
        out = model(self.x[idx])
        loss = F.cross_entropy(out, self.y[idx])
        loss.backward()  # type: ignore[no-untyped-call]
        if plan.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), plan.clip_norm)
        self.flat.accumulate_grad()
        if self.mode == "hogwild":
            self.store.step(HOGWILD_SEGMENT, self.flat.grad.numpy(), plan.lr)
            self.flat.grad.zero_()
        return float(loss.detach())

    async def _pull(self) -> None:
        async def one(i: int) -> None:
            try:
                reply: Params = await self.ps[i].ask(Pull(), timeout=10.0)
            except ActorError as exc:
                log.warning("replica %s: pull from shard %d failed: %s", self.name, i, exc)
                return
            self.store.write(f"ps{i}", reply.values)
            self.versions[i] = reply.version
            self.bytes_pulled += int(reply.values.nbytes)
            self.pulls += 1

        await asyncio.gather(*(one(i) for i in range(len(self.ps))))

    async def _push(self, samples: int) -> None:
        self.seq += 1
        grad = self.flat.grad.numpy()
        for i, (offset, length) in enumerate(self.ranges):
            compressed = self.codecs[i].compress(grad[offset:offset + length])
            push = Push(self.name, self.incarnation, self.seq, self.versions[i], compressed.codec,
                        compressed.payload, samples)
            try:
                await self.ps[i].tell(push)
            except ActorError as exc:
                log.warning("replica %s: push to shard %d failed: %s", self.name, i, exc)
                continue
            self.bytes_pushed += compressed.nbytes
            self.dense_bytes_pushed += 4 * length
        self.pushes += 1
        self.flat.grad.zero_()

    async def _report(self) -> None:
        if self._loss_n:
            self._last_loss = self._loss_sum / self._loss_n
            self._loss_sum, self._loss_n = 0.0, 0
        progress = Progress(
            self.name, self.incarnation, self.samples, self.steps, self._last_loss,
            cursor_triples(self.cursors), self.bytes_pushed, self.bytes_pulled, self.pushes,
        )
        try:
            await self.coordinator.tell(progress)
        except ActorError as exc:
            log.warning("replica %s: progress report failed: %s", self.name, exc)

    # -- control ------------------------------------------------------------
    @handler
    def shards(self, msg: Shards) -> None:
        """The coordinator changed which data shards this replica trains."""
        idle = not self.cursors
        self._set_cursors(msg.cursors)
        log.info("replica %s: now training shards %s", self.name, sorted(self.cursors))
        if idle and self.cursors and self.running:
            self.ref.tell_nowait(_Step())

    @handler
    async def stop_training(self, msg: StopTraining) -> None:
        if self.running:
            self.running = False
            await self._report()
        log.info("replica %s: stopped training (%s)", self.name, msg.reason)
