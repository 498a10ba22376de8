"""Sandblaster L-BFGS (Dean et al. 2012): the PS shard that runs vector commands, and the replica.

A :class:`SandblasterShard` holds one contiguous slice of every L-BFGS vector
(:class:`~dniasync.train.lbfgs.ShardVectors`, float64) and runs the
coordinator's commands on it, answering with scalars. Replicas push the
gradients of the portions they computed to every shard, where they are
*staged* under ``(replica, seq)``; only the pushes the coordinator names in
:class:`Reduce` are summed into the trial gradient, so a portion computed twice
(a backup task, a reissue after a failure) is counted once.

A :class:`SandblasterReplica` asks the coordinator's work queue for portions
of the batch (:class:`Work` / :class:`Assign`), fetches the batch's parameters
once, accumulates the gradients of its portions, and every ``push_every``
portions (at once near the end of a batch) stages them on the shards and
commits them (:class:`Commit`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

import numpy as np

from ..actors import Actor, ActorError, ActorRef, handler, message
from .lbfgs import ShardVectors
from .messages import StopTraining
from .specs import DataSpec, ModelSpec

__all__ = [
    "Accept",
    "Assign",
    "Commit",
    "Direction",
    "Fetch",
    "IDLE",
    "Reduce",
    "SandblasterReplica",
    "SandblasterReplicaSpec",
    "SandblasterShard",
    "SandblasterShardSpec",
    "Scalars",
    "Slice",
    "STOP",
    "Stage",
    "Trial",
    "Work",
]

log = logging.getLogger("dniasync.train.sandblaster")

IDLE = -1
"""An :class:`Assign` with no portion: ask again shortly."""
STOP = -2
"""An :class:`Assign` that ends the replica's work."""
IDLE_WAIT_S = 0.01
ASK_TIMEOUT_S = 30.0


# -- specs ------------------------------------------------------------------------------------------
@message("dniasync.train.sandblaster.ShardSpec")
@dataclass(frozen=True)
class SandblasterShardSpec:
    """Parameters ``[offset, offset + len(values))`` of the flat float64 vector."""

    shard: int
    offset: int
    values: np.ndarray


@message("dniasync.train.sandblaster.ReplicaSpec")
@dataclass(frozen=True)
class SandblasterReplicaSpec:
    """What a Sandblaster replica needs: the model, the data, the shards, the work queue."""

    model: ModelSpec
    data: DataSpec
    shards: list[ActorRef]
    offsets: list[int]
    coordinator: str
    """The work queue's address."""
    portion_size: int
    push_every: int


# -- coordinator -> shard ---------------------------------------------------------------------------
@message("dniasync.train.sandblaster.Trial")
@dataclass(frozen=True)
class Trial:
    """Batch ``batch`` evaluates ``xt = x + t·d``; staged pushes of earlier batches are dropped."""

    batch: int
    t: float


@message("dniasync.train.sandblaster.Reduce")
@dataclass(frozen=True)
class Reduce:
    """``gt = scale · Σ`` the staged pushes ``keys`` (``[replica, seq]``), summed in that order."""

    batch: int
    replicas: list[str]
    seqs: list[int]
    scale: float


@message("dniasync.train.sandblaster.Accept")
@dataclass(frozen=True)
class Accept:
    """Move to the trial point (storing pair ``k`` first unless ``k < 0``); answer the dots of ``pairs``."""

    t: float
    k: int
    pairs: list[list[str]]


@message("dniasync.train.sandblaster.Direction")
@dataclass(frozen=True)
class Direction:
    """Forget pairs ``drop``; ``d = Σ coeffs[i] · names[i]``; answer ``[g · d, max |d|]``."""

    names: list[str]
    coeffs: list[float]
    drop: list[int]


@message("dniasync.train.sandblaster.Scalars")
@dataclass(frozen=True)
class Scalars:
    """A shard's partial sums (the coordinator adds them over shards)."""

    values: list[float]


# -- replica <-> shard ------------------------------------------------------------------------------
@message("dniasync.train.sandblaster.Fetch")
@dataclass(frozen=True)
class Fetch:
    """Ask for the trial point of ``batch`` (``-1``: the current parameters ``x``)."""

    batch: int


@message("dniasync.train.sandblaster.Slice")
@dataclass(frozen=True)
class Slice:
    shard: int
    batch: int
    values: np.ndarray


@message("dniasync.train.sandblaster.Stage")
@dataclass(frozen=True)
class Stage:
    """The summed gradient of some portions of ``batch``, this shard's slice, kept until :class:`Reduce`."""

    batch: int
    replica: str
    seq: int
    grad: np.ndarray


# -- replica <-> coordinator ------------------------------------------------------------------------
@message("dniasync.train.sandblaster.Work")
@dataclass(frozen=True)
class Work:
    """Ask for a portion; ``done`` (``-1`` for none) is the portion of ``batch`` just computed."""

    replica: str
    batch: int
    done: int


@message("dniasync.train.sandblaster.Assign")
@dataclass(frozen=True)
class Assign:
    """``keep``: add ``done``'s gradient (nobody committed it yet); then compute ``portion`` of ``batch``.

    ``flush``: push what is accumulated now (the batch is near its end).
    """

    batch: int
    portion: int
    keep: bool
    flush: bool


@message("dniasync.train.sandblaster.Commit")
@dataclass(frozen=True)
class Commit:
    """Push ``seq`` (staged on every shard) holds ``portions`` with their summed losses."""

    replica: str
    batch: int
    seq: int
    portions: list[int]
    losses: list[float]
    grad_sq: list[float]
    """Under dynamic sampling, ‖mean gradient‖² of each portion (the norm test's spread); else empty."""


# -- the shard --------------------------------------------------------------------------------------
class SandblasterShard(Actor):
    """One slice of Sandblaster's vectors; runs the coordinator's commands on it."""

    mailbox_size = 256

    def __init__(self, spec: SandblasterShardSpec) -> None:
        self.shard = spec.shard
        self.vectors = ShardVectors(spec.values)
        self.batch = -1
        self.staged: dict[tuple[str, int], np.ndarray] = {}
        self.bytes_in = 0
        self.stages = 0

    @handler
    def trial(self, msg: Trial) -> bool:
        self.vectors.trial(msg.t)
        self.batch = msg.batch
        self.staged.clear()
        return True

    @handler
    def stage(self, msg: Stage) -> bool:
        if msg.batch != self.batch:
            return False  # a late push of a finished batch
        grad = np.ascontiguousarray(msg.grad, dtype=np.float64).reshape(-1)
        if grad.size != self.vectors.n:
            raise ValueError(f"shard {self.shard}: a push of {grad.size} values, expected {self.vectors.n}")
        self.staged[(msg.replica, msg.seq)] = grad
        self.bytes_in += int(grad.nbytes)
        self.stages += 1
        return True

    @handler
    async def reduce(self, msg: Reduce) -> bool:
        if msg.batch != self.batch:
            raise ValueError(f"shard {self.shard}: reduce of batch {msg.batch}, it holds batch {self.batch}")
        parts = [self.staged[key] for key in zip(msg.replicas, msg.seqs)]
        await self.run_blocking(self.vectors.set_gradient, parts, msg.scale)
        self.staged.clear()
        return True

    @handler
    async def accept(self, msg: Accept) -> Scalars:
        pairs = [(a, b) for a, b in msg.pairs]
        dots, g_sum, g_max = await self.run_blocking(self.vectors.accept, msg.t, msg.k if msg.k >= 0 else None, pairs)
        return Scalars([*dots, g_sum, g_max])

    @handler
    async def direction(self, msg: Direction) -> Scalars:
        gd, d_max = await self.run_blocking(self.vectors.direction, list(zip(msg.names, msg.coeffs)), msg.drop)
        return Scalars([gd, d_max])

    @handler
    def fetch(self, msg: Fetch) -> Slice:
        if msg.batch < 0:
            return Slice(self.shard, self.batch, self.vectors.x.copy())
        return Slice(self.shard, self.batch, self.vectors.xt.copy())


# -- the replica ------------------------------------------------------------------------------------
class SandblasterReplica(Actor):
    """Computes portions of each batch's gradient for the work queue; stages them on the shards."""

    mailbox_size = 0

    def __init__(self, spec: SandblasterReplicaSpec, *, incarnation: int = 0) -> None:
        self.spec = spec
        self.incarnation = incarnation
        self.running = True
        self.batch = -1
        self.seq = 0
        self.portions_done = 0
        self.pushes = 0
        self.bytes_pushed = 0
        self._task: asyncio.Task[None] | None = None

    async def on_start(self) -> None:
        await self.run_blocking(self._setup)
        self.coordinator: ActorRef = self.system.ref(self.spec.coordinator)
        self._task = asyncio.create_task(self._work_forever(), name=f"{self.name}-work")

    async def on_stop(self) -> None:
        self.running = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @handler
    def stop_training(self, msg: StopTraining) -> None:
        self.running = False

    def _setup(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.model = self.spec.model.build().double()
        self.params = list(self.model.parameters())
        x, y, _, _ = self.spec.data.load_split()
        self.x, self.y = x.double(), y
        self.n = sum(p.numel() for p in self.params)
        self.flat = np.zeros(self.n, dtype=np.float64)
        self.acc = np.zeros(self.n, dtype=np.float64)
        bounds = [*self.spec.offsets, self.n]
        self.ranges = [(bounds[i], bounds[i + 1]) for i in range(len(self.spec.shards))]

    def _load(self) -> None:
        import torch

        torch.nn.utils.vector_to_parameters(torch.from_numpy(self.flat), self.params)

    def _portion(self, portion: int, norm: bool) -> tuple[np.ndarray, float, float]:
        """The summed loss of portion ``portion``, its gradient (float64) and, with ``norm``, the squared norm of
        its mean gradient (dynamic sampling's norm test; else NaN)."""
        import torch
        from torch.nn import functional as F

        a = portion * self.spec.portion_size
        b = min(a + self.spec.portion_size, len(self.x))
        loss = F.cross_entropy(self.model(self.x[a:b]), self.y[a:b], reduction="sum")
        grads = torch.autograd.grad(loss, self.params)
        grad = torch.cat([g.reshape(-1) for g in grads]).numpy()
        return grad, float(loss.detach()), float(grad @ grad) / (b - a) ** 2 if norm else math.nan

    async def _fetch(self, batch: int) -> bool:
        replies = await asyncio.gather(*(s.ask(Fetch(batch), timeout=ASK_TIMEOUT_S) for s in self.spec.shards))
        for (a, b), reply in zip(self.ranges, replies):
            assert isinstance(reply, Slice)
            if reply.batch != batch:
                return False
            self.flat[a:b] = reply.values
        await self.run_blocking(self._load)
        return True

    async def _work_forever(self) -> None:
        done, held, losses, norms = -1, list[int](), list[float](), list[float]()
        grad, loss, norm = np.zeros(0), 0.0, math.nan
        schedule = self.spec.data.schedule
        norm_test = schedule is not None and schedule.kind == "dynamic"
        while self.running:
            try:
                reply = await self.coordinator.ask(Work(self.name, self.batch, done), timeout=ASK_TIMEOUT_S)
            except (ActorError, TimeoutError) as exc:
                log.info("%s: work queue unreachable (%r); asking again", self.name, exc)
                await asyncio.sleep(0.5)
                continue
            assert isinstance(reply, Assign)
            if reply.batch == self.batch and done >= 0 and reply.keep:
                self.acc += grad
                held.append(done)
                losses.append(loss)
                if norm_test:
                    norms.append(norm)
            done = -1
            if reply.portion == STOP:
                return
            if reply.batch != self.batch:  # a new batch: what was accumulated belongs to a finished one
                held, losses, norms = [], [], []
                self.acc.fill(0.0)
                try:
                    fetched = await self._fetch(reply.batch)
                except (ActorError, TimeoutError) as exc:  # a shard unreachable for now: ask the queue again
                    log.warning("%s: parameters of batch %d not fetched: %r", self.name, reply.batch, exc)
                    fetched = False
                if not fetched:
                    self.batch = -1
                    await asyncio.sleep(IDLE_WAIT_S)
                    continue
                self.batch = reply.batch
            if held and (reply.flush or len(held) >= self.spec.push_every or reply.portion == IDLE):
                await self._push(held, losses, norms)
                held, losses, norms = [], [], []
            if reply.portion == IDLE:
                await asyncio.sleep(IDLE_WAIT_S)
                continue
            grad, loss, norm = await self.run_blocking(self._portion, reply.portion, norm_test)
            done = reply.portion
            self.portions_done += 1

    async def _push(self, portions: list[int], losses: list[float], norms: list[float]) -> None:
        self.seq += 1
        seq, batch = self.seq, self.batch
        stages = [s.ask(Stage(batch, self.name, seq, self.acc[a:b].copy()), timeout=ASK_TIMEOUT_S)
                  for s, (a, b) in zip(self.spec.shards, self.ranges)]
        self.acc.fill(0.0)
        try:
            staged = await asyncio.gather(*stages)
            if all(staged):
                await self.coordinator.ask(Commit(self.name, batch, seq, portions, losses, norms), timeout=ASK_TIMEOUT_S)
                self.pushes += 1
                self.bytes_pushed += self.n * 8
        except (ActorError, TimeoutError) as exc:  # uncommitted: the queue hands these portions out again
            log.warning("%s: push %d of batch %d not committed: %r", self.name, seq, batch, exc)
