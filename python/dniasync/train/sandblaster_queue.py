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

Replicated shards (``[sandblaster] ps_replicas = R > 1``): primary-backup
with the coordinator as the sequencer. Why not the chain Downpour's shards
use: here every write that matters is already a command from one place (the
coordinator), so sending it to each copy in the same order keeps the copies
equal with no forwarding and no extra round trip, and the commands are
deterministic (the same command on the same state gives the same scalars),
so any copy's answer is the answer: the first copy's is used and a copy that
answers otherwise is counted (``copy_disagreements``) and logged. The
coordinator commands the copies it knows to hold the shard's state
(``commanded``); the copies that are live come from the job runner's
:class:`~dniasync.cluster.chains.ChainKeeper` (each shard's view, whose
copies its transport has not declared down; ``copies``, with each copy's
incarnation). A commanded copy that fails a command, refuses it (it lacks a
staged push) or is cut out of the view while the command waits on it is
dropped. A live copy not commanded (restarted by the launcher, a spare in a
dead copy's place, one that was cut out while frozen) is given the state of
a commanded copy just before the next :class:`~dniasync.train.sandblaster.Trial`
and commanded from then on: a trial drops the staged pushes, so the vectors
are the whole state there, and copies join only there, so a replica learns
a new batch's copies from the :class:`~dniasync.train.sandblaster.Assign`
that opens it for it and stages its pushes on every one; a commit whose push
some commanded copy did not stage is refused (its portions go back to the
queue). A shard with no commanded copy left ends the job: its L-BFGS state
is gone.
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

from ..actors import Actor, ActorError, ActorRef, handler
from .lbfgs import LBFGSResult, LBFGSSettings, VectorFreeLBFGS, combine_accept, combine_direction
from .sandblaster import (IDLE, STOP, Accept, Assign, Commit, Direction, GetShardState, Reduce, Refused, Scalars,
                          ShardState, Trial, Work)
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
                if 0 <= p < self.n and p in self.committed:
                    self.duplicates_dropped += 1
            self.refuse(replica, portions)
            return False
        for p, loss in zip(portions, losses):
            self.committed[p] = (replica, seq)
            self.losses[p] = loss
            if grad_sq:
                self.grad_sq[p] = grad_sq[portions.index(p)]
            self.holders[p].discard(replica)
        self.pushes.append((min(portions), replica, seq))
        return True

    def refuse(self, replica: str, portions: list[int]) -> None:
        """A push of ``portions`` is not counted: those nobody committed go back to the queue."""
        for p in portions:
            if 0 <= p < self.n and p not in self.committed:
                self.holders[p].discard(replica)
                if not self.holders[p] and p not in self.pending:
                    self.pending.append(p)

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
    commanded: list[list[ActorRef]] = field(default_factory=list)
    """Each shard's copies the coordinator commands (they hold its state): evaluations fetch from them."""
    copy_transfers: int = 0
    """States given to a copy that was not commanded (restarted, a spare, back from a freeze)."""
    copies_dropped: int = 0
    """Copies no longer commanded (they failed a command or were cut out of their shard's view)."""
    copy_disagreements: int = 0
    """Commands a copy answered otherwise than the first copy of its shard."""
    commits_refused_copies: int = 0
    """Commits refused because a commanded copy had not staged the push."""


class SandblasterCoordinator(Actor):
    """Drives L-BFGS on the shards with scalars only, and hands out portions of each batch."""

    mailbox_size = 0

    def __init__(self, shards: list[ActorRef], settings: LBFGSSettings, n_train: int, portion_size: int,
                 backup_threshold: float, board: Board, measure: Callable[[Any, bool], int] | None = None,
                 schedule: ScheduleSpec | None = None,
                 copies: Callable[[], list[list[tuple[ActorRef, int]]]] | None = None) -> None:
        """``copies()``: each shard's live copies now, each with its incarnation (default: ``shards``, one each)."""
        self.shards = shards
        self.copies = copies if copies is not None else (lambda: [[(ref, 0)] for ref in shards])
        self.commanded: list[list[tuple[ActorRef, int]]] = self.copies()
        board.commanded = [[ref for ref, _ in row] for row in self.commanded]
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

    # -- commands to every commanded copy of every shard -------------------------------------------
    def _drop(self, k: int, ref: ActorRef, incarnation: int, why: str) -> None:
        row = self.commanded[k]
        if (ref, incarnation) in row:
            row.remove((ref, incarnation))
            self.board.copies_dropped += 1
            self.board.commanded[k] = [r for r, _ in row]
            log.warning("PS shard %d: the copy at %s is no longer commanded (%s); %d left", k, ref.address, why,
                        len(row))

    def _prune(self) -> list[list[tuple[ActorRef, int]]]:
        """Drop the commanded copies cut out of their shard's view (or restarted since); the live copies now."""
        live = self.copies()
        for k, row in enumerate(self.commanded):
            here = {(ref.address, inc) for ref, inc in live[k]}
            for ref, inc in list(row):
                if (ref.address, inc) not in here:
                    self._drop(k, ref, inc, "cut out of the shard's copies, or restarted")
        return live

    async def _join_copies(self) -> None:
        """Give every live copy not commanded a commanded copy's state; command it from now on (before a trial)."""
        live = self._prune()
        for k, row in enumerate(self.commanded):
            if not row:
                raise RuntimeError(f"every copy of PS shard {k} is lost, and its L-BFGS state with it")
            known = {(ref.address, inc) for ref, inc in row}
            joining = [(ref, inc) for ref, inc in live[k] if (ref.address, inc) not in known]
            if not joining:
                continue
            state = await self._state_of(k)
            for ref, inc in joining:
                try:
                    taken = await ref.ask(state, timeout=COMMAND_TIMEOUT_S)
                except (ActorError, TimeoutError) as exc:
                    log.warning("PS shard %d: the copy at %s did not take the state: %r", k, ref.address, exc)
                    continue
                if taken is True:
                    row.append((ref, inc))
                    self.board.copy_transfers += 1
                    log.warning("PS shard %d: the copy at %s took the state of %s (batch %d); commanded again, %d "
                                "copies", k, ref.address, row[0][0].address, state.batch, len(row))
            self.board.commanded[k] = [r for r, _ in row]

    async def _state_of(self, k: int) -> ShardState:
        for ref, inc in list(self.commanded[k]):
            try:
                state = await ref.ask(GetShardState(), timeout=COMMAND_TIMEOUT_S)
            except (ActorError, TimeoutError) as exc:
                self._drop(k, ref, inc, f"its state could not be taken: {exc!r}")
                continue
            if isinstance(state, ShardState):
                return state
            self._drop(k, ref, inc, f"it gave no state: {state!r}")
        raise RuntimeError(f"every copy of PS shard {k} is lost, and its L-BFGS state with it")

    async def _command(self, k: int, msg: Any) -> tuple[Any, int]:
        """``msg`` to every commanded copy of shard ``k``: the first one's answer, and how many copies were asked.

        A copy that fails or refuses is dropped; one still silent once another answered is dropped as soon as it
        is cut out of the shard's view (its node declared down), not only at the command's timeout."""
        asks = {asyncio.create_task(ref.ask(msg, timeout=COMMAND_TIMEOUT_S)): (ref, inc)
                for ref, inc in self.commanded[k]}
        answers: dict[tuple[ActorRef, int], Any] = {}
        pending = set(asks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, timeout=WAIT_TICK_S)
                for task in done:
                    ref, inc = asks[task]
                    exc = task.exception()
                    if exc is not None or isinstance(task.result(), Refused):
                        self._drop(k, ref, inc, repr(exc) if exc is not None else task.result().reason)
                    else:
                        answers[(ref, inc)] = task.result()
                if answers and pending:
                    live = {(ref.address, inc) for ref, inc in self.copies()[k]}
                    for task in list(pending):
                        ref, inc = asks[task]
                        if (ref.address, inc) not in live:
                            task.cancel()
                            pending.discard(task)
                            self._drop(k, ref, inc, f"cut out of the shard's copies while {type(msg).__name__} waited")
        finally:
            for task in pending:
                task.cancel()
        order = [key for key in asks.values() if key in answers]
        if not order:
            raise RuntimeError(f"no copy of PS shard {k} answered {type(msg).__name__}: every copy is lost, and its "
                               "L-BFGS state with it")
        first = answers[order[0]]
        for key in order[1:]:
            if answers[key] != first:
                self.board.copy_disagreements += 1
                log.error("PS shard %d: the copy at %s answered %s %r, the copy at %s %r", k, key[0].address,
                          type(msg).__name__, answers[key], order[0][0].address, first)
        return first, len(asks)

    async def _all(self, msg: Any) -> list[Any]:
        results = await asyncio.gather(*(self._command(k, msg) for k in range(len(self.commanded))))
        replies = [reply for reply, _ in results]
        if self.measure is not None:
            asked = sum(n for _, n in results)
            self.board.command_bytes += (self.measure(msg, False) * asked
                                         + sum(self.measure(r, True) * n for r, n in results))
        self.board.command_scalars += sum(len(r.values) for r in replies if isinstance(r, Scalars))
        return replies

    async def evaluate(self, t: float) -> float:
        batch, m = self.queue.batch + 1, self.board.sample_size
        await self._join_copies()
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
        if msg.batch == q.batch:
            return Assign(q.batch, portion, keep, flush)
        # another batch for this replica: the copies it stages on and fetches from (they join only at a trial)
        rows = self.board.commanded
        return Assign(q.batch, portion, keep, flush, [ref for row in rows for ref in row], [len(row) for row in rows])

    @handler
    def commit(self, msg: Commit) -> bool:
        self.board.last_seen[msg.replica] = time.monotonic()
        if msg.batch != self.queue.batch or not self.queue.active:
            self.queue.commits_refused += 1
            return False
        self._prune()
        staged = set(msg.copies)
        missing = [ref.address for row in self.commanded for ref, _ in row if ref.address not in staged]
        if missing:  # a copy the push did not reach could not reduce the batch: its portions are computed again
            self.queue.commits_refused += 1
            self.board.commits_refused_copies += 1
            self.queue.refuse(msg.replica, list(msg.portions))
            log.info("push %d of %s refused: not staged on %s", msg.seq, msg.replica, missing)
            return False
        accepted = self.queue.commit(msg.replica, msg.seq, list(msg.portions), list(msg.losses), list(msg.grad_sq))
        if self.queue.complete:
            self._batch_done.set()
        return accepted
