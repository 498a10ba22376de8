"""Model replicas: Downpour replicas and Hogwild workers.

A replica trains a torch model on the data shards its
:class:`~dniasync.train.specs.ReplicaSpec` names and shares its parameters
through the weight sync the spec's ``sync`` names (:mod:`dniasync.train.sync`),
e.g. :class:`~dniasync.train.specs.PSLinkSpec` (Downpour: pull from the PS
shards every ``n_fetch`` steps, push the accumulated gradient every
``n_push``) or :class:`~dniasync.train.specs.SharedStoreSpec` (Hogwild: every
step applied in place, without locks, to the job's shared-memory store).

Training advances by ``_Step`` messages the replica sends itself, so between
steps it still handles new shard assignments and stop requests. Torch work
runs on the system's worker threads, off the event loop. Its training rows
come from :meth:`~dniasync.train.specs.DataSpec.open_split`: a converted data
set stays on disk, and the next step's first batch is read on the rows'
prefetching thread while this step computes (the cursor moves only when a
batch is drawn for training, so checkpoints still name the next row to train). It reports its
counters to the job runner (:class:`~dniasync.train.messages.Progress`),
which is also its liveness signal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from ..actors import Actor, ActorError, ActorRef, handler, message
from .data import DataCursor
from .flat import FlatModel
from .schedules import make_schedule
from .messages import CoordinatorEpoch, Progress, Shards, StopTraining, fenced
from .specs import ReplicaSpec
from .sync import SyncContext, WeightSync, build_sync
from .telemetry import track_replica

__all__ = ["Replica"]

log = logging.getLogger("dniasync.train.replica")


@message("dniasync.train.replica.Step")
@dataclass(frozen=True)
class _Step:
    pass


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
        self._reported_samples = 0
        self._reporter: asyncio.Task[None] | None = None
        self.schedule = make_schedule(spec.data.schedule)
        """The batch-size schedule (None: data.batch_size throughout); a dynamic one grows on this replica's tests."""
        self._batches = 0
        self._epoch = 0.0
        self._sync_built = False
        self.epoch = 0
        """The highest coordinator epoch heard from: orders from a lower one are refused."""

    async def on_start(self) -> None:
        self.coordinator: ActorRef = self.system.ref(self.spec.coordinator)
        await self.run_blocking(self._setup)
        if not self.cursors and not self.sync.pulls_params:
            # no data yet (a p2p peer waiting for the others to start together): the sync gets ready now, so what
            # reaches it meanwhile finds it (the peers' membership, told at each peer's start: without it a peer
            # trained alone until the next repeat, a second later); a sync that pulls waits for its first step
            await self.sync.ready()
        track_replica(self.system, self)
        self.running = True
        log.info("replica %s: training shards %s", self.name, self._where())
        # reports go on a clock of their own: a step waiting on a frozen PS shard must not look like death
        self._reporter = asyncio.create_task(self._report_forever(), name=f"{self.name}-progress")
        self._next_step()

    def _setup(self) -> None:
        torch.set_num_threads(1)
        spec = self.spec
        self.rows, _, _ = spec.data.open_split(held_out=False)
        self.shard_plan = spec.data.shard_plan()
        self._set_cursors(spec.cursors)
        model = spec.model.build()
        self.sync: WeightSync = build_sync(spec.sync, model, SyncContext(self.name, self.incarnation, spec.optimizer,
                                                                         actor=self))
        if self.sync.flat is None:
            raise ValueError(f"replica {self.name}: a {type(spec.sync).__name__} sync has no flat parameter buffer")
        self.flat: FlatModel = self.sync.flat
        self._sync_built = True

    # -- what the metrics read --------------------------------------------------
    @property
    def loss(self) -> float:
        """Mean training loss over the steps before the last progress report (NaN before it)."""
        return self._last_loss

    @property
    def pushes(self) -> int:
        return self.sync.stats().pushes

    @property
    def pulls(self) -> int:
        return self.sync.stats().pulls

    @property
    def bytes_pushed(self) -> int:
        return self.sync.stats().bytes_pushed

    @property
    def bytes_pulled(self) -> int:
        return self.sync.stats().bytes_pulled

    @property
    def dense_bytes_pushed(self) -> int:
        return self.sync.stats().dense_bytes_pushed

    def _where(self) -> str:
        """Its data shards and where in each it starts, for the log (tests read the positions there)."""
        return f"{sorted(self.cursors)} from " + ", ".join(
            f"shard {c.shard} epoch {c.epoch} position {c.position}" for _, c in sorted(self.cursors.items()))

    def _set_cursors(self, triples: list[list[int]]) -> None:
        self.cursors = {s: DataCursor(s, e, p) for s, e, p in triples}

    # -- training -----------------------------------------------------------
    @handler
    async def step(self, msg: _Step) -> None:
        if not self.running or not self.cursors:
            return  # nothing to train on until the runner hands a shard over
        await self.sync.ready()
        batches = [self._next_indices() for _ in range(self.sync.steps_per_call(self.steps))]
        for indices in batches:
            self.rows.prefetch(indices)
        self._prefetch_next()
        losses = await self.run_blocking(self._compute_many, batches)
        samples = sum(len(b) for b in batches)
        self.steps += len(batches)
        self.samples += samples
        self._loss_sum += sum(losses)
        self._loss_n += len(losses)
        every = self.spec.report_every_samples
        if every and self.samples - self._reported_samples >= every:
            await self._report()
        await self.sync.sync(samples)
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

    def _prefetch_next(self) -> None:
        """Start reading the batch the next step will draw (drawn, not taken: the cursor stays)."""
        if not self.cursors:
            return
        shard = sorted(self.cursors)[self._turn % len(self.cursors)]
        indices, _ = self.shard_plan.next_batch(self.cursors[shard], self.batch_size)
        self.rows.prefetch(indices)

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
        x, y = self.rows.take(indices)
        model = self.flat.model
        loss = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()  # type: ignore[no-untyped-call]
        clip = self.spec.optimizer.clip_norm
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        self.sync.step()
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
        bx, by = self.rows.take(indices)
        for part in np.array_split(np.arange(len(indices)), len(parts)):
            weight = len(part) / len(indices)
            loss = F.cross_entropy(model(torch.from_numpy(bx[part])), torch.from_numpy(by[part]))
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
        self.sync.step()
        return loss_sum

    async def on_stop(self) -> None:
        if self._reporter is not None:
            self._reporter.cancel()
            await asyncio.gather(self._reporter, return_exceptions=True)
        if self._sync_built:
            await self.sync.close()
        rows = getattr(self, "rows", None)
        if rows is not None:
            await asyncio.to_thread(rows.close)

    async def _report_forever(self) -> None:
        while self.running:
            await asyncio.sleep(self.progress_every_s)
            await self._report()

    async def _report(self) -> None:
        if self._loss_n:
            self._last_loss = self._loss_sum / self._loss_n
            self._loss_sum, self._loss_n = 0.0, 0
        stats = self.sync.stats()
        self._reported_samples = self.samples
        progress = Progress(
            self.name, self.incarnation, self.samples, self.steps, self._last_loss,
            [[c.shard, c.epoch, c.position] for c in self.cursors.values()],
            stats.bytes_pushed, stats.bytes_pulled, stats.pushes, stats.dense_bytes_pushed, stats.versions,
            self.batch_size,
        )
        try:
            await self.coordinator.tell(progress)
        except ActorError as exc:
            log.warning("replica %s: progress report failed: %s", self.name, exc)

    # -- control ------------------------------------------------------------
    @handler
    def coordinator_epoch(self, msg: CoordinatorEpoch) -> None:
        """A standby coordinator took the job over: report to it, refuse the orders of the one before."""
        if fenced(msg.epoch, self.epoch):
            return
        self.epoch = msg.epoch
        self.coordinator = self.system.ref(msg.runner)
        log.info("replica %s: coordinator epoch %d at %s", self.name, msg.epoch, msg.runner)

    def _refused(self, what: str, epoch: int) -> bool:
        if fenced(epoch, self.epoch):
            log.warning("replica %s: refused %s from coordinator epoch %d (now %d)", self.name, what, epoch,
                        self.epoch)
            return True
        return False

    @handler
    def shards(self, msg: Shards) -> None:
        """The runner changed which data shards this replica trains."""
        if self._refused("new data shards", msg.epoch):
            return
        idle = not self.cursors
        self._set_cursors(msg.cursors)
        log.info("replica %s: now training shards %s", self.name, self._where())
        if idle and self.cursors and self.running:
            self._next_step()

    @handler
    async def stop_training(self, msg: StopTraining) -> None:
        if self._refused(f"a stop ({msg.reason})", msg.epoch):
            return
        if self.running:
            self.running = False
            try:  # what the sync set aside goes now (no step runs: one message at a time)
                await self.sync.flush()
            except ActorError as exc:
                log.warning("replica %s: what it set aside could not be shared at the stop: %s", self.name, exc)
            await self._report()
        log.info("replica %s: stopped training (%s)", self.name, msg.reason)
