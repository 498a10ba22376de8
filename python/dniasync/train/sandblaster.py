"""Sandblaster L-BFGS (Dean et al. 2012): the PS shard that runs vector commands, and the replica.

A :class:`SandblasterShard` holds one contiguous slice of every L-BFGS vector
(:class:`~dniasync.train.lbfgs.ShardVectors`, float64) and runs the
coordinator's commands on it, answering with scalars. Replicas push the
gradients of the portions they computed to every shard, where they are
*staged* under ``(replica, seq)``; only the pushes the coordinator names in
:class:`Reduce` are summed into the trial gradient, so a portion computed twice
(a backup task, a reissue after a failure) is counted once.

With ``[sandblaster] ps_replicas = R > 1`` a shard has R copies, each a
:class:`SandblasterShard` in a PS process of its own: the coordinator sends
every command to every copy it holds in step (the sequencer:
:mod:`~dniasync.train.sandblaster_queue`), replicas stage each push on every
such copy (the coordinator names them in each new batch's :class:`Assign`)
and say where in their :class:`Commit`. A restarted copy (``joining``) holds
no state: it refuses commands, stages and fetches (:class:`Refused`, False)
until the coordinator gives it a live copy's (:class:`ShardState`).

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
from dataclasses import dataclass, field

import hashlib
from typing import Any

import numpy as np

from ..actors import Actor, ActorError, ActorRef, handler, message
from .chain import ChainView
from .lbfgs import ShardVectors
from .messages import ShardStats, StopTraining
from .specs import DataSpec, ModelSpec

__all__ = [
    "Accept",
    "Assign",
    "Commit",
    "Direction",
    "Fetch",
    "GetShardState",
    "IDLE",
    "Reduce",
    "Refused",
    "SandblasterReplica",
    "SandblasterReplicaSpec",
    "SandblasterShard",
    "SandblasterShardSpec",
    "Scalars",
    "ShardState",
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
    """Parameters ``[offset, offset + len(values))`` of the flat float64 vector; copy ``copy`` of that shard.
    ``joining``: a restarted copy, which serves nothing until the coordinator gave it a live copy's state."""

    shard: int
    offset: int
    values: np.ndarray
    copy: int = 0
    joining: bool = False


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


@message("dniasync.train.sandblaster.Refused")
@dataclass(frozen=True)
class Refused:
    """A copy could not run a command (it holds no state yet, or lacks a staged push): the coordinator stops
    commanding it until it gave it a live copy's state."""

    reason: str


@message("dniasync.train.sandblaster.GetShardState")
@dataclass(frozen=True)
class GetShardState:
    """Ask a copy for its :class:`ShardState` (the coordinator does, between two commands)."""


@message("dniasync.train.sandblaster.ShardState")
@dataclass(frozen=True)
class ShardState:
    """Everything a copy holds between two commands: its batch and every vector of its slice (``pairs[i]``
    the number of ``s[i]``, ``y[i]``). Taken before a :class:`Trial`, which drops the staged pushes anyway."""

    shard: int
    batch: int
    x: np.ndarray
    g: np.ndarray
    d: np.ndarray
    xt: np.ndarray
    gt: np.ndarray
    pairs: list[int]
    s: list[np.ndarray]
    y: list[np.ndarray]


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

    ``flush``: push what is accumulated now (the batch is near its end). ``copies``, ``counts``: when the replica
    was on another batch, the copies of the shards it stages on and fetches from for this one (``counts[k]`` of
    shard ``k``, shard-major); empty: the ones it has.
    """

    batch: int
    portion: int
    keep: bool
    flush: bool
    copies: list[ActorRef] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)


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
    copies: list[str] = field(default_factory=list)
    """The addresses of the copies that staged the push (the coordinator refuses it unless every copy it commands
    is among them)."""


# -- the shard --------------------------------------------------------------------------------------
class SandblasterShard(Actor):
    """One slice of Sandblaster's vectors (one copy of it); runs the coordinator's commands on it."""

    mailbox_size = 256

    def __init__(self, spec: SandblasterShardSpec) -> None:
        self.shard = spec.shard
        self.copy = spec.copy
        self.vectors = ShardVectors(spec.values)
        self.batch = -1
        self.staged: dict[tuple[str, int], np.ndarray] = {}
        self.bytes_in = 0
        self.stages = 0
        self.commands = 0
        self.transfers = 0
        """States taken from another copy."""
        self.has_state = not spec.joining
        self.view = 0
        """The number of the last view of this shard's copies the job runner sent (informational)."""

    def _refusal(self, what: str) -> Refused | None:
        if self.has_state:
            self.commands += 1
            return None
        return Refused(f"shard {self.shard} copy {self.copy} holds no state yet: {what} refused")

    @handler
    def trial(self, msg: Trial) -> bool | Refused:
        if (refused := self._refusal("trial")) is not None:
            return refused
        self.vectors.trial(msg.t)
        self.batch = msg.batch
        self.staged.clear()
        return True

    @handler
    def stage(self, msg: Stage) -> bool:
        if msg.batch != self.batch or not self.has_state:
            return False  # a late push of a finished batch
        grad = np.ascontiguousarray(msg.grad, dtype=np.float64).reshape(-1)
        if grad.size != self.vectors.n:
            raise ValueError(f"shard {self.shard}: a push of {grad.size} values, expected {self.vectors.n}")
        self.staged[(msg.replica, msg.seq)] = grad
        self.bytes_in += int(grad.nbytes)
        self.stages += 1
        return True

    @handler
    async def reduce(self, msg: Reduce) -> bool | Refused:
        if (refused := self._refusal("reduce")) is not None:
            return refused
        if msg.batch != self.batch:
            raise ValueError(f"shard {self.shard}: reduce of batch {msg.batch}, it holds batch {self.batch}")
        keys = list(zip(msg.replicas, msg.seqs))
        missing = [key for key in keys if key not in self.staged]
        if missing:  # a copy the push did not reach: the coordinator gives it a live copy's state
            self.has_state = False
            return Refused(f"shard {self.shard} copy {self.copy}: staged pushes {missing[:3]} missing")
        parts = [self.staged[key] for key in keys]
        await self.run_blocking(self.vectors.set_gradient, parts, msg.scale)
        self.staged.clear()
        return True

    @handler
    async def accept(self, msg: Accept) -> Scalars | Refused:
        if (refused := self._refusal("accept")) is not None:
            return refused
        pairs = [(a, b) for a, b in msg.pairs]
        dots, g_sum, g_max = await self.run_blocking(self.vectors.accept, msg.t, msg.k if msg.k >= 0 else None, pairs)
        return Scalars([*dots, g_sum, g_max])

    @handler
    async def direction(self, msg: Direction) -> Scalars | Refused:
        if (refused := self._refusal("direction")) is not None:
            return refused
        gd, d_max = await self.run_blocking(self.vectors.direction, list(zip(msg.names, msg.coeffs)), msg.drop)
        return Scalars([gd, d_max])

    @handler
    def fetch(self, msg: Fetch) -> Slice | Refused:
        if not self.has_state:
            return Refused(f"shard {self.shard} copy {self.copy} holds no state yet")
        if msg.batch < 0:
            return Slice(self.shard, self.batch, self.vectors.x.copy())
        return Slice(self.shard, self.batch, self.vectors.xt.copy())

    # -- replicated copies ---------------------------------------------------------------
    @handler
    def chain_view(self, msg: ChainView) -> bool:
        """The job runner names the shard's live copies (its :class:`~dniasync.cluster.chains.ChainKeeper`); the
        coordinator, not the copies, acts on them."""
        self.view = max(self.view, msg.number)
        return True

    @handler
    def get_shard_state(self, msg: GetShardState) -> ShardState | Refused:
        if not self.has_state:
            return Refused(f"shard {self.shard} copy {self.copy} holds no state to give")
        v = self.vectors
        pairs = sorted(v.s)
        return ShardState(self.shard, self.batch, v.x.copy(), v.g.copy(), v.d.copy(), v.xt.copy(), v.gt.copy(), pairs,
                          [v.s[k].copy() for k in pairs], [v.y[k].copy() for k in pairs])

    @handler
    def shard_state(self, msg: ShardState) -> bool:
        """Take another copy's state (the coordinator sends it between two commands, before a trial)."""
        if msg.shard != self.shard or msg.x.size != self.vectors.n:
            raise ValueError(f"shard {self.shard}: the state of shard {msg.shard} ({msg.x.size} values), expected "
                             f"{self.vectors.n} values")
        v = self.vectors

        def own(a: np.ndarray) -> np.ndarray:
            return np.array(a, dtype=np.float64).reshape(-1)

        v.x, v.g, v.d, v.xt, v.gt = own(msg.x), own(msg.g), own(msg.d), own(msg.xt), own(msg.gt)
        v.s = {k: own(a) for k, a in zip(msg.pairs, msg.s)}
        v.y = {k: own(a) for k, a in zip(msg.pairs, msg.y)}
        self.batch = msg.batch
        self.staged.clear()
        self.has_state = True
        self.transfers += 1
        log.info("shard %d copy %d: took a live copy's state (batch %d, %d pairs)", self.shard, self.copy, msg.batch,
                 len(msg.pairs))
        return True

    @handler
    def stats(self, msg: ShardStats) -> dict[str, Any]:
        """This copy's counters, and a digest of its parameters (equal on copies that hold the same state)."""
        return {"shard": self.shard, "copy": self.copy, "batch": self.batch, "stages": self.stages,
                "bytes_in": self.bytes_in, "commands": self.commands, "transfers": self.transfers,
                "has_state": self.has_state, "x_sha256": hashlib.sha256(self.vectors.x.tobytes()).hexdigest()}


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
        self.copies: list[list[ActorRef]] = [[ref] for ref in spec.shards]
        """Each shard's copies this replica stages on and fetches from (every one the coordinator commands)."""
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

    async def _fetch_slice(self, copies: list[ActorRef], batch: int) -> Slice | None:
        """Shard's slice of ``batch`` from the first of its ``copies`` that has it (None: none has)."""
        error: Exception | None = None
        for ref in copies:
            try:
                reply = await ref.ask(Fetch(batch), timeout=ASK_TIMEOUT_S)
            except (ActorError, TimeoutError) as exc:
                error = exc
                continue
            if isinstance(reply, Slice) and reply.batch == batch:
                return reply
        if error is not None and not any(ref.is_alive for ref in copies):
            raise error
        return None

    async def _fetch(self, batch: int) -> bool:
        replies = await asyncio.gather(*(self._fetch_slice(copies, batch) for copies in self.copies))
        for (a, b), reply in zip(self.ranges, replies):
            if reply is None:
                return False
            self.flat[a:b] = reply.values
        await self.run_blocking(self._load)
        return True

    def _take_copies(self, reply: Assign) -> None:
        """The copies of each shard the coordinator commands for ``reply.batch`` (shard-major, ``counts`` each)."""
        if not reply.counts:
            return
        it = iter(reply.copies)
        self.copies = [[next(it) for _ in range(n)] for n in reply.counts]

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
                self._take_copies(reply)
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
        stages = [(ref, ref.ask(Stage(batch, self.name, seq, self.acc[a:b].copy()), timeout=ASK_TIMEOUT_S))
                  for copies, (a, b) in zip(self.copies, self.ranges) for ref in copies]
        self.acc.fill(0.0)
        answers = await asyncio.gather(*(ask for _, ask in stages), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, Exception):
                raise answer  # a cancellation
        # the coordinator refuses the commit (its portions go back to the queue) unless every copy it commands took it
        staged = [ref.address for (ref, _), answer in zip(stages, answers) if answer is True]
        if len(staged) < len(stages):
            log.info("%s: push %d of batch %d staged on %d of %d copies: %s", self.name, seq, batch, len(staged),
                     len(stages), [repr(a) for a in answers if isinstance(a, Exception)][:3])
        try:
            committed = await self.coordinator.ask(Commit(self.name, batch, seq, portions, losses, norms, staged),
                                                   timeout=ASK_TIMEOUT_S)
        except (ActorError, TimeoutError) as exc:  # uncommitted: the queue hands these portions out again
            log.warning("%s: push %d of batch %d not committed: %r", self.name, seq, batch, exc)
            return
        if committed:
            self.pushes += 1
            self.bytes_pushed += self.n * 8
