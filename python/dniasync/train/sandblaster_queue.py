"""Sandblaster's coordinator: the L-BFGS driver and the work queue of portions.

:class:`PortionQueue` hands out the portions of one batch (many, far smaller
than ``1/replicas`` of it, so faster replicas take more). Once every portion
has been handed out and ``backup_threshold`` of them are committed, an idle
replica gets a copy of a portion still outstanding elsewhere (a backup task).
The first commit of a portion wins; a commit that names a portion already
committed is refused whole, and its other portions go back to the queue, so
no portion is ever summed twice. A replica that dies (its node gone, or
silent too long) loses its portions to the queue.

:class:`SandblasterCoordinator` runs :class:`~dniasync.train.lbfgs.VectorFreeLBFGS`
over the shards (it is the driver's :class:`~dniasync.train.lbfgs.ShardGroup`):
a function evaluation is one batch of the work queue.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..actors import Actor, ActorRef, handler
from .lbfgs import LBFGSResult, LBFGSSettings, VectorFreeLBFGS, combine_accept, combine_direction
from .sandblaster import (IDLE, STOP, Accept, Assign, Commit, Direction, Reduce, Scalars, Trial, Work)
from .schedules import ScheduleSpec, make_schedule
from .telemetry import track_sandblaster

__all__ = ["Board", "PortionQueue", "SandblasterCoordinator"]

log = logging.getLogger("dniasync.train.sandblaster")

COMMAND_TIMEOUT_S = 60.0
WAIT_TICK_S = 0.2


class PortionQueue:
    """The portions of one batch: who holds which, which are committed (by which push)."""

    def __init__(self, n_portions: int, backup_threshold: float) -> None:
        self.n = n_portions
        self.backup_threshold = backup_threshold
        self.batch = -1
        self.active = False
        self.reissued = 0
        """Portions handed out more than once (backups, and reissues after a death or a refused commit)."""
        self.backups = 0
        self.duplicates_dropped = 0
        """Computed portions not counted because another copy was committed first."""
        self.commits_refused = 0
        self._reset()

    def _reset(self) -> None:
        self.pending: deque[int] = deque(range(self.n))
        self.holders: dict[int, set[str]] = {p: set() for p in range(self.n)}
        self.issued: set[int] = set()
        self.committed: dict[int, tuple[str, int]] = {}
        self.losses: dict[int, float] = {}
        self.grad_sq: dict[int, float] = {}
        self.pushes: list[tuple[int, str, int]] = []

    def start(self, batch: int, n_portions: int | None = None) -> None:
        """Open ``batch`` (of ``n_portions`` portions, when the sample changed size)."""
        self.batch = batch
        self.active = True
        if n_portions is not None:
            self.n = n_portions
        self._reset()

    @property
    def complete(self) -> bool:
        return len(self.committed) == self.n

    def _give(self, p: int, replica: str) -> int:
        if p in self.issued:
            self.reissued += 1
        self.issued.add(p)
        self.holders[p].add(replica)
        return p

    def next_for(self, replica: str) -> tuple[int, bool]:
        """(portion or :data:`IDLE`, flush): the next portion for ``replica``; flush once the queue is empty."""
        if not self.active:
            return IDLE, True
        while self.pending:
            p = self.pending.popleft()
            if p not in self.committed:
                return self._give(p, replica), not self.pending
        if len(self.committed) >= self.backup_threshold * self.n:
            outstanding = [p for p in range(self.n) if p not in self.committed and replica not in self.holders[p]]
            if outstanding:
                p = min(outstanding, key=lambda q: (len(self.holders[q]), q))
                self.backups += 1
                return self._give(p, replica), True
        return IDLE, True

    def keep(self, replica: str, p: int) -> bool:
        """Whether ``replica``'s result for portion ``p`` may still count (nobody committed ``p``)."""
        if not (0 <= p < self.n) or p in self.committed:
            if 0 <= p < self.n:
                self.duplicates_dropped += 1
                self.holders[p].discard(replica)
            return False
        return True

    def commit(self, replica: str, seq: int, portions: list[int], losses: list[float],
               grad_sq: list[float] | None = None) -> bool:
        """Count push ``(replica, seq)`` if none of its portions is counted yet; else refuse it whole."""
        valid = all(0 <= p < self.n for p in portions) and len(set(portions)) == len(portions)
        if not valid or any(p in self.committed for p in portions):
            self.commits_refused += 1
            for p in portions:
                if 0 <= p < self.n and p not in self.committed:
                    self.holders[p].discard(replica)
                    if not self.holders[p] and p not in self.pending:
                        self.pending.append(p)
                elif 0 <= p < self.n:
                    self.duplicates_dropped += 1
            return False
        for p, loss in zip(portions, losses):
            self.committed[p] = (replica, seq)
            self.losses[p] = loss
            if grad_sq:
                self.grad_sq[p] = grad_sq[portions.index(p)]
            self.holders[p].discard(replica)
        self.pushes.append((min(portions), replica, seq))
        return True

    def drop(self, replica: str) -> int:
        """``replica`` is gone: the portions only it held go back to the queue; returns how many."""
        returned = 0
        for p, holders in self.holders.items():
            if replica in holders and p not in self.committed:
                holders.discard(replica)
                if not holders and p not in self.pending:
                    self.pending.append(p)
                    returned += 1
        return returned

    def keys(self) -> tuple[list[str], list[int]]:
        """The committed pushes, ordered by their first portion (the order the shards sum them in)."""
        ordered = sorted(self.pushes)
        return [r for _, r, _ in ordered], [s for _, _, s in ordered]

    def loss_sum(self) -> float:
        return math.fsum(self.losses[p] for p in range(self.n))

    def grad_sq_sum(self) -> tuple[float, int]:
        """Σ‖g_p‖² over the batch's portions and how many there are (0 unless every commit carried them)."""
        if not all(p in self.grad_sq for p in range(self.n)):
            return 0.0, 0
        return math.fsum(self.grad_sq[p] for p in range(self.n)), self.n


@dataclass
class Board:
    """What the coordinator shares with the job (same process): figures, replica liveness, the end."""

    replica_refs: dict[str, ActorRef] = field(default_factory=dict)
    last_seen: dict[str, float] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    silence_limit_s: float = 20.0
    iterations: int = 0
    evaluations: int = 0
    loss: float = math.nan
    line_search_evals: int = 0
    losses: list[float] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    """Seconds since the coordinator started, at the end of each iteration (``losses[i + 1]``)."""
    batch_seconds: list[float] = field(default_factory=list)
    """How long each batch (one gradient over the training set) took, from opening the queue to its last commit."""
    batch_ends_unix: list[float] = field(default_factory=list)
    """When each batch's last portion was committed (``time.time()``: comparable across processes)."""
    started: float = 0.0
    command_bytes: int = 0
    """Bytes of every command to the shards and of their replies."""
    command_scalars: int = 0
    sample_size: int = 0
    """Examples the loss is taken on now (the training set, or the first examples of it under a schedule)."""
    sample_sizes: list[tuple[int, int]] = field(default_factory=list)
    """(iteration, sample size) of every change of the sample (iteration 0: the first)."""
    examples: int = 0
    """Examples every batch gradient so far was taken over, summed (epochs = examples / n_train)."""
    stop_reason: str | None = None
    error: str | None = None
    stopping: bool = False
    queue: PortionQueue | None = None
    on_dead: Callable[[str, int], None] | None = None


class SandblasterCoordinator(Actor):
    """Drives L-BFGS on the shards with scalars only, and hands out portions of each batch."""

    mailbox_size = 0

    def __init__(self, shards: list[ActorRef], settings: LBFGSSettings, n_train: int, portion_size: int,
                 backup_threshold: float, board: Board, measure: Callable[[Any, bool], int] | None = None,
                 schedule: ScheduleSpec | None = None) -> None:
        self.shards = shards
        self.settings = settings
        self.n_train = n_train
        self.portion_size = portion_size
        self.schedule = make_schedule(schedule)
        """A batch-size schedule: the sample grows (whole portions, the first examples) between iterations."""
        self.board = board
        board.sample_size = self._sample_at(0.0)
        board.sample_sizes.append((0, board.sample_size))
        self.queue = PortionQueue(-(-board.sample_size // portion_size), backup_threshold)
        board.queue = self.queue
        self.measure = measure
        self._batch_done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._lbfgs: VectorFreeLBFGS | None = None
        self._tested: tuple[float, int] = (0.0, 0)

    async def on_start(self) -> None:
        self.board.started = time.monotonic()
        track_sandblaster(self.system, self)
        self._task = asyncio.create_task(self._drive(), name=f"{self.name}-lbfgs")

    async def on_stop(self) -> None:
        self.board.stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _drive(self) -> None:
        try:
            resample = self._resample if self.schedule is not None else None
            self._lbfgs = VectorFreeLBFGS(self, self.settings, on_iteration=self._iterated, resample=resample,
                                          grad_norm=self.schedule is not None and self.schedule.needs_chunks)
            result = await self._lbfgs.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the job fails, naming why
            log.exception("Sandblaster L-BFGS failed")
            self.board.error = repr(exc)
            return
        self.board.stop_reason = f"L-BFGS stopped: {result.stop}"
        log.info("Sandblaster L-BFGS: %s after %d iterations, loss %.6g", result.stop, result.iterations,
                 result.losses[-1])

    async def _iterated(self, n_iter: int, result: LBFGSResult) -> None:
        b = self.board
        b.iterations, b.loss, b.losses = n_iter, result.losses[-1], list(result.losses)
        b.walls.append(time.monotonic() - b.started)
        b.line_search_evals = sum(result.line_search_evals)
        log.info("L-BFGS iteration %d: loss %.6g, step %.3g (%d evaluations)", n_iter, b.loss, result.steps[-1],
                 result.line_search_evals[-1])

    def _sample_at(self, epoch: float) -> int:
        if self.schedule is None:
            return self.n_train
        size = -(-self.schedule.batch_size(epoch) // self.portion_size) * self.portion_size
        return min(self.n_train, size)

    async def _resample(self, n_iter: int) -> bool:
        b = self.board
        epoch = b.examples / self.n_train
        if self.schedule is not None and self.schedule.needs_chunks:  # dynamic sampling: the norm test, on scalars
            sum_sq, count = self._tested  # count 0 (a portion's norm missing): the test asks for nothing
            norm2 = self._lbfgs.grad_norm2 if self._lbfgs is not None else None
            if norm2 is not None:
                self.schedule.observe_norms(epoch, sum_sq, norm2, count, self.portion_size)
        size = self._sample_at(epoch)
        if size == b.sample_size:
            return False
        log.info("L-BFGS sample: %d -> %d examples before iteration %d", b.sample_size, size, n_iter)
        b.sample_size = size
        b.sample_sizes.append((n_iter, size))
        return True

    # -- commands to every shard ----------------------------------------------------------------
    async def _all(self, msg: Any) -> list[Any]:
        replies = await asyncio.gather(*(s.ask(msg, timeout=COMMAND_TIMEOUT_S) for s in self.shards))
        if self.measure is not None:
            self.board.command_bytes += (self.measure(msg, False) * len(self.shards)
                                         + sum(self.measure(r, True) for r in replies))
        self.board.command_scalars += sum(len(r.values) for r in replies if isinstance(r, Scalars))
        return replies

    async def evaluate(self, t: float) -> float:
        batch, m = self.queue.batch + 1, self.board.sample_size
        await self._all(Trial(batch, t))
        self._batch_done.clear()
        self.queue.start(batch, -(-m // self.portion_size))
        opened = time.monotonic()
        while not self.queue.complete:
            try:
                await asyncio.wait_for(self._batch_done.wait(), WAIT_TICK_S)
            except TimeoutError:
                self._check_replicas()
        # a replica that died holding nothing this batch needed: reported now, not at the next wait that times out
        self._check_replicas(silence=False)
        self.queue.active = False
        self.board.batch_seconds.append(time.monotonic() - opened)
        self.board.batch_ends_unix.append(time.time())
        replicas, seqs = self.queue.keys()
        await self._all(Reduce(batch, replicas, seqs, 1.0 / m))
        self.board.evaluations += 1
        self.board.examples += m
        self._tested = self.queue.grad_sq_sum()  # the portions' spread at the point evaluated last
        return self.queue.loss_sum() / m

    async def accept(self, t: float, k: int | None, pairs: list[tuple[str, str]]) -> tuple[list[float], float, float]:
        replies = await self._all(Accept(t, -1 if k is None else k, [list(p) for p in pairs]))
        return combine_accept([(r.values[:-2], r.values[-2], r.values[-1]) for r in replies])

    async def direction(self, coeffs: list[tuple[str, float]], drop: list[int]) -> tuple[float, float]:
        replies = await self._all(Direction([n for n, _ in coeffs], [c for _, c in coeffs], drop))
        return combine_direction([(r.values[0], r.values[1]) for r in replies])

    # -- replicas ---------------------------------------------------------------------------------
    def _check_replicas(self, *, silence: bool = True) -> None:
        """Declare dead the replicas whose process is gone (one that never asked for work too), and with ``silence``
        those that asked and then fell silent too long."""
        now = time.monotonic()
        for name in sorted(set(self.board.last_seen) | set(self.board.replica_refs)):
            ref, seen = self.board.replica_refs.get(name), self.board.last_seen.get(name)
            gone = (ref is not None and not ref.is_alive) or (
                silence and seen is not None and now - seen > self.board.silence_limit_s)
            if gone and name not in self.board.dead:
                self.board.dead.add(name)
                returned = self.queue.drop(name)
                log.warning("replica %s is gone: %d portions of batch %d go back to the queue", name, returned,
                            self.queue.batch)
                if self.board.on_dead is not None:
                    self.board.on_dead(name, returned)

    @handler
    def work(self, msg: Work) -> Assign:
        self.board.last_seen[msg.replica] = time.monotonic()
        self.board.dead.discard(msg.replica)  # back from a freeze: it may take work again
        q = self.queue
        if self.board.stopping or self.board.stop_reason is not None or self.board.error is not None:
            return Assign(q.batch, STOP, False, True)
        keep = msg.done >= 0 and msg.batch == q.batch and q.keep(msg.replica, msg.done)
        portion, flush = q.next_for(msg.replica)
        return Assign(q.batch, portion, keep, flush)

    @handler
    def commit(self, msg: Commit) -> bool:
        self.board.last_seen[msg.replica] = time.monotonic()
        if msg.batch != self.queue.batch or not self.queue.active:
            self.queue.commits_refused += 1
            return False
        accepted = self.queue.commit(msg.replica, msg.seq, list(msg.portions), list(msg.losses), list(msg.grad_sq))
        if self.queue.complete:
            self._batch_done.set()
        return accepted
