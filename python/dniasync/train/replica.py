"""Model replicas: Downpour replicas and Hogwild workers.

A replica trains a torch model on the data shards its
:class:`~dniasync.train.specs.ReplicaSpec` names and shares its parameters
the way the spec's ``sync`` says:

- :class:`~dniasync.train.specs.PSLinkSpec` (Downpour): pull from the PS
  shards every ``n_fetch`` steps (with a codec, quantized parameter deltas
  and a dense resync now and then), push the accumulated gradient (quantized,
  with its residual, by the codec) every ``n_push`` steps, through a
  :class:`~dniasync.train.param_sync.ShardLink`;
- :class:`~dniasync.train.specs.SharedStoreSpec` (Hogwild): every step is
  applied in place, without locks, by the Rust optimizer of the job's
  shared-memory store.

Training advances by ``_Step`` messages the replica sends itself, so between
steps it still handles new shard assignments and stop requests. Torch work
runs on the system's worker threads, off the event loop. It reports its
counters to the job runner (:class:`~dniasync.train.messages.Progress`),
which is also its liveness signal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch.nn import functional as F

from ..actors import Actor, ActorError, ActorRef, handler, message
from .data import DataCursor
from .flat import FlatModel, flatten_parameters
from .param_sync import ShardLink
from .schedules import make_schedule
from .messages import Progress, Shards, StopTraining
from .specs import PSLinkSpec, ReplicaSpec, SharedStoreSpec
from .telemetry import track_replica

__all__ = ["HOGWILD_SEGMENT", "Replica"]

log = logging.getLogger("dniasync.train.replica")

HOGWILD_SEGMENT = "params"
HOGWILD_STEPS_PER_CALL = 8


@message("dniasync.train.replica.Step")
@dataclass(frozen=True)
class _Step:
    pass


class _Sync(Protocol):
    """How a replica shares its parameters: what it does between its steps."""

    flat: FlatModel

    def steps_per_call(self, steps: int) -> int:
        """Steps to run in one hand-off to a worker thread."""

    def after_backward(self) -> None:
        """On the worker thread, after each step's gradient is in ``flat.grad``."""

    async def before(self, steps: int) -> None:
        """On the loop, before a run of steps (a pull is due?)."""

    async def after(self, steps: int, samples: int) -> None:
        """On the loop, after a run of steps (a push is due?)."""


class _Downpour:
    """Pull every ``n_fetch`` steps, push every ``n_push`` (the data-parallel DistBelief replica)."""

    def __init__(self, spec: PSLinkSpec, model: torch.nn.Module, replica: str, incarnation: int) -> None:
        buffer = flatten_parameters(model)
        self.flat = FlatModel(model, buffer)
        bounds = [*spec.offsets, self.flat.n]
        ranges = [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(len(spec.ps))]
        self.link = ShardLink(buffer, ranges, spec.ps, replica=replica, incarnation=incarnation,
                              codec=spec.codec.name, tau=spec.codec.tau, block=spec.codec.block,  # type: ignore[arg-type]
                              delta_tau=spec.codec.delta_tau)
        self.n_fetch, self.n_push = spec.n_fetch, spec.n_push
        self.samples_pending = 0

    def steps_per_call(self, steps: int) -> int:
        # a thread hop costs ~0.1 ms: run every step up to the next pull or push in one
        return min(self.n_push - steps % self.n_push, self.n_fetch - steps % self.n_fetch)

    def after_backward(self) -> None:
        self.flat.accumulate_grad()

    async def before(self, steps: int) -> None:
        if steps % self.n_fetch == 0:  # steps == 0 too: never push before the first pull (warm start)
            await self.link.pull()

    async def after(self, steps: int, samples: int) -> None:
        self.samples_pending += samples
        if steps % self.n_push == 0:
            await self.link.push(self.flat.grad.numpy(), self.samples_pending)
            self.flat.grad.zero_()
            self.samples_pending = 0


class _Hogwild:
    """Every step applied in place to the shared store: nothing to send."""

    def __init__(self, spec: SharedStoreSpec, model: torch.nn.Module, replica: ReplicaSpec) -> None:
        n = sum(p.numel() for p in model.parameters())
        self.store = replica.optimizer.attach(spec.name, [(HOGWILD_SEGMENT, n)])
        self.flat = FlatModel(model, self.store.view(HOGWILD_SEGMENT))
        self.lr = replica.optimizer.lr

    def steps_per_call(self, steps: int) -> int:
        return HOGWILD_STEPS_PER_CALL

    def after_backward(self) -> None:
        self.flat.accumulate_grad()
        self.store.step(HOGWILD_SEGMENT, self.flat.grad.numpy(), self.lr)
        self.flat.grad.zero_()

    async def before(self, steps: int) -> None:
        return

    async def after(self, steps: int, samples: int) -> None:
        return


class Replica(Actor):
    """A model replica (Downpour) or a lock-free worker (Hogwild), spawned by a host from its spec."""

    mailbox_size = 0  # it tells itself to step; an unbounded mailbox cannot deadlock that

    def __init__(self, spec: ReplicaSpec, *, incarnation: int | None = None, progress_every_s: float = 0.25) -> None:
        self.spec = spec
        self.incarnation = incarnation if incarnation is not None else time.time_ns() // 1000
        self.progress_every_s = progress_every_s
        self.running = False
        self.cursors: dict[int, DataCursor] = {}
        self._turn = 0
        self.steps = 0
        self.samples = 0
        self._loss_sum = 0.0
        self._loss_n = 0
        self._last_loss = float("nan")
        self._reporter: asyncio.Task[None] | None = None
        self.schedule = make_schedule(spec.data.schedule)
        """The batch-size schedule (None: data.batch_size throughout); a dynamic one grows on this replica's tests."""
        self._batches = 0
        self._epoch = 0.0

    async def on_start(self) -> None:
        self.coordinator: ActorRef = self.system.ref(self.spec.coordinator)
        await self.run_blocking(self._setup)
        track_replica(self.system, self)
        self.running = True
        log.info("replica %s: training shards %s", self.name, sorted(self.cursors))
        # reports go on a clock of their own: a step waiting on a frozen PS shard must not look like death
        self._reporter = asyncio.create_task(self._report_forever(), name=f"{self.name}-progress")
        self._next_step()

    def _setup(self) -> None:
        torch.set_num_threads(1)
        spec = self.spec
        self.x, self.y, _, _ = spec.data.load_split()
        self.shard_plan = spec.data.shard_plan()
        self._set_cursors(spec.cursors)
        model = spec.model.build()
        self.sync: _Sync = (
            _Downpour(spec.sync, model, self.name, self.incarnation) if isinstance(spec.sync, PSLinkSpec)
            else _Hogwild(spec.sync, model, spec)
        )
        self.flat = self.sync.flat

    # -- what the metrics read --------------------------------------------------
    @property
    def loss(self) -> float:
        """Mean training loss over the steps before the last progress report (NaN before it)."""
        return self._last_loss

    def _link(self) -> ShardLink | None:
        return self.sync.link if isinstance(self.sync, _Downpour) else None

    @property
    def pushes(self) -> int:
        link = self._link()
        return link.pushes if link else 0

    @property
    def pulls(self) -> int:
        link = self._link()
        return link.pulls if link else 0

    @property
    def bytes_pushed(self) -> int:
        link = self._link()
        return link.bytes_pushed if link else 0

    @property
    def bytes_pulled(self) -> int:
        link = self._link()
        return link.bytes_pulled if link else 0

    @property
    def dense_bytes_pushed(self) -> int:
        link = self._link()
        return link.dense_bytes_pushed if link else 0

    def _set_cursors(self, triples: list[list[int]]) -> None:
        self.cursors = {s: DataCursor(s, e, p) for s, e, p in triples}

    # -- training -----------------------------------------------------------
    @handler
    async def step(self, msg: _Step) -> None:
        if not self.running or not self.cursors:
            return  # nothing to train on until the runner hands a shard over
        await self.sync.before(self.steps)
        batches = [self._next_indices() for _ in range(self.sync.steps_per_call(self.steps))]
        losses = await self.run_blocking(self._compute_many, batches)
        samples = sum(len(b) for b in batches)
        self.steps += len(batches)
        self.samples += samples
        self._loss_sum += sum(losses)
        self._loss_n += len(losses)
        await self.sync.after(self.steps, samples)
        if self.running:
            self._next_step()

    def _next_step(self) -> None:
        try:
            self.ref.tell_nowait(_Step())
        except ActorError:
            self.running = False  # stopping: no more steps

    def _next_indices(self) -> np.ndarray:
        shard = sorted(self.cursors)[self._turn % len(self.cursors)]
        self._turn += 1
        cursor, size = self.cursors[shard], self.spec.data.batch_size
        if self.schedule is not None:  # the batch grows with the epoch or on the norm test (train/schedules.py)
            self._epoch = cursor.epoch + cursor.position / self.shard_plan.shard_size(shard)
            size = self.schedule.batch_size(self._epoch)
        indices, self.cursors[shard] = self.shard_plan.next_batch(cursor, size)
        return indices

    @property
    def batch_size(self) -> int:
        """The size of its next mini-batch."""
        return self.spec.data.batch_size if self.schedule is None else self.schedule.batch_size(self._epoch)

    def _compute_many(self, batches: list[np.ndarray]) -> list[float]:
        losses = []
        for indices in batches:
            tested = self.schedule is not None and self.schedule.test_due(self._batches)
            self._batches += 1
            losses.append(self._compute_tested(indices) if tested else self._compute(indices))
        return losses

    def _compute(self, indices: np.ndarray) -> float:
        idx = torch.from_numpy(indices)
        model = self.flat.model
        loss = F.cross_entropy(model(self.x[idx]), self.y[idx])
        loss.backward()  # type: ignore[no-untyped-call]
        clip = self.spec.optimizer.clip_norm
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        self.sync.after_backward()
        return float(loss.detach())

    def _compute_tested(self, indices: np.ndarray) -> float:
        """:meth:`_compute` with the gradient taken in ``chunks`` parts: the same gradient (their weighted sum),
        and the spread of the parts' gradients feeds the dynamic schedule's norm test."""
        assert self.schedule is not None
        parts = [p for p in np.array_split(indices, self.schedule.spec.chunks) if len(p)]
        if len(parts) < 2:
            return self._compute(indices)
        model, flat = self.flat.model, self.flat
        flat.accumulate_grad()  # nothing pending in the parameters' .grad: flat.grad is what came before
        start = flat.grad.clone()
        last, loss_sum, part_grads = start, 0.0, []
        for part in parts:
            idx = torch.from_numpy(part)
            weight = len(part) / len(indices)
            loss = F.cross_entropy(model(self.x[idx]), self.y[idx])
            (loss * weight).backward()  # type: ignore[no-untyped-call]
            flat.accumulate_grad()
            now = flat.grad.clone()
            part_grads.append(((now - last) / weight).numpy())
            last, loss_sum = now, loss_sum + weight * float(loss.detach())
        clip = self.spec.optimizer.clip_norm
        if clip is not None:  # clip this batch's gradient, as _compute does
            batch = flat.grad - start
            norm = float(torch.linalg.vector_norm(batch))
            if norm > clip:
                flat.grad.copy_(start + batch * (clip / (norm + 1e-6)))
        before = self.schedule.batch_size(self._epoch)
        after = self.schedule.observe(self._epoch, part_grads, len(parts[-1]))
        if after != before:
            log.info("replica %s: the norm test failed at epoch %.2f, batch size %d -> %d", self.name, self._epoch,
                     before, after)
        self.sync.after_backward()
        return loss_sum

    async def on_stop(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
            await asyncio.gather(self._reporter, return_exceptions=True)

    async def _report_forever(self) -> None:
        while self.running:
            await asyncio.sleep(self.progress_every_s)
            await self._report()

    async def _report(self) -> None:
        if self._loss_n:
            self._last_loss = self._loss_sum / self._loss_n
            self._loss_sum, self._loss_n = 0.0, 0
        progress = Progress(
            self.name, self.incarnation, self.samples, self.steps, self._last_loss,
            [[c.shard, c.epoch, c.position] for c in self.cursors.values()],
            self.bytes_pushed, self.bytes_pulled, self.pushes, self.dense_bytes_pushed,
            list(link.versions) if (link := self._link()) else [], self.batch_size,
        )
        try:
            await self.coordinator.tell(progress)
        except ActorError as exc:
            log.warning("replica %s: progress report failed: %s", self.name, exc)

    # -- control ------------------------------------------------------------
    @handler
    def shards(self, msg: Shards) -> None:
        """The runner changed which data shards this replica trains."""
        idle = not self.cursors
        self._set_cursors(msg.cursors)
        log.info("replica %s: now training shards %s", self.name, sorted(self.cursors))
        if idle and self.cursors and self.running:
            self._next_step()

    @handler
    async def stop_training(self, msg: StopTraining) -> None:
        if self.running:
            self.running = False
            await self._report()
        log.info("replica %s: stopped training (%s)", self.name, msg.reason)
