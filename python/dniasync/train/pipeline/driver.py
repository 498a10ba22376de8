"""Driving a pipeline of stages: the schedule, the monitor, training, evaluation, drain and rewire.

:class:`PipelineDriver` feeds mini-batches to the first
:class:`~dniasync.train.pipeline.stage.Stage` as its :class:`Schedule` says,
evaluates the whole model through the stages' current weights and records a
history. It uses only refs and messages (the stages may live on other
nodes); the one actor it spawns, its :class:`PipelineMonitor`, lives beside
it and receives completions, losses and failure notices from the stages.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TypeVar

import torch
import torch.nn.functional as F

from ...actors import Actor, ActorRef, ActorStopped, ActorSystem, AskTimeout, handler
from ..data import TrainRows
from .protocol import (
    AdoptLayers,
    Connect,
    Done,
    EvalForward,
    EvalOutput,
    NormProbe,
    NormProbeReply,
    Forward,
    LayerBundle,
    LossReport,
    RawInput,
    ReleaseLayers,
    StageDown,
    StageState,
    StageStats,
    StateRequest,
    StatsRequest,
    Trace,
    TraceRequest,
)
from .schedule import LrDecay, Schedule, batch_order

__all__ = [
    "EvalPoint",
    "Move",
    "PipelineBroken",
    "PipelineDriver",
    "PipelineMonitor",
    "TrainResult",
]

T = TypeVar("T")


class PipelineBroken(RuntimeError):
    """A stage died, stopped, became unreachable, or the pipeline stalled."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"pipeline broken at {address}: {reason}")
        self.address = address
        self.reason = reason


@dataclass
class EvalPoint:
    """One evaluation during training.

    ``sg_losses`` and ``input_losses``: per stage, the mean loss of its SG model
    and of its synthetic-input model since the previous point (NaN: none).
    """

    wall_s: float
    samples: int
    epoch: float
    accuracy: float
    eval_loss: float
    train_loss: float
    sg_losses: list[float] = field(default_factory=list)
    input_losses: list[float] = field(default_factory=list)


@dataclass
class TrainResult:
    """What a training run produced; ``wall_s`` excludes time spent evaluating."""

    method: str
    history: list[EvalPoint]
    samples: int
    wall_s: float
    stats: list[StageStats] = field(default_factory=list)

    @property
    def final_accuracy(self) -> float:
        return self.history[-1].accuracy if self.history else float("nan")

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else float("nan")


@dataclass
class Move:
    """Layers that crossed one boundary in a regrouping: from stage ``source`` to its neighbour ``target``."""

    layers: list[int]
    source: int
    target: int
    bytes: int
    seconds: float


class _Progress:
    """Shared by a driver and its monitor (always on the same node)."""

    def __init__(self) -> None:
        self.in_flight: dict[int, int] = {}
        """batch id -> stages that have not sent ``Done`` for it yet"""
        self.changed = asyncio.Event()
        self.failure: PipelineBroken | None = None
        self.loss_sum = 0.0
        self.loss_count = 0
        self.correct = 0
        self.seen = 0


class PipelineMonitor(Actor):
    """Receives :class:`Done`, :class:`LossReport` and :class:`StageDown` for a driver.

    Unbounded mailbox: stages must never wait on it (the driver's window bounds it).
    """

    mailbox_size = 0

    def __init__(self, progress: _Progress) -> None:
        self.progress = progress

    @handler
    def done(self, msg: Done) -> None:
        in_flight = self.progress.in_flight
        left = in_flight.get(msg.batch_id)
        if left is None:
            return
        if left > 1:
            in_flight[msg.batch_id] = left - 1
        else:
            del in_flight[msg.batch_id]
            self.progress.changed.set()

    @handler
    def loss(self, msg: LossReport) -> None:
        p = self.progress
        p.loss_sum += msg.loss
        p.loss_count += 1
        p.correct += msg.correct
        p.seen += msg.count

    @handler
    def stage_down(self, msg: StageDown) -> None:
        if self.progress.failure is None:
            self.progress.failure = PipelineBroken(msg.address, msg.reason)
        self.progress.changed.set()


class PipelineDriver:
    """Feeds a pipeline of stages, given only their refs (first to last).

    With ``synthetic_inputs`` the raw batch also goes to every stage after the
    first. A stage that fails, stops or disappears, or a pipeline that
    completes nothing for ``stall_timeout_s``, raises :class:`PipelineBroken`;
    it never hangs. A batch is in flight until every stage has sent
    :class:`Done` for it. Stages' mailboxes should hold
    :meth:`Schedule.stage_mailbox_size` messages (see :class:`~dniasync.train.pipeline.stage.Stage`).
    """

    def __init__(
        self,
        system: ActorSystem,
        stages: Sequence[ActorRef],
        schedule: Schedule | None = None,
        *,
        synthetic_inputs: bool = False,
        liveness_interval_s: float = 0.5,
        stall_timeout_s: float = 60.0,
        ask_timeout_s: float = 60.0,
        name: str = "pipeline-monitor",
    ) -> None:
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        self.system = system
        self.stages = list(stages)
        self.schedule = schedule or Schedule()
        self.synthetic_inputs = synthetic_inputs
        self.liveness_interval_s = liveness_interval_s
        self.stall_timeout_s = stall_timeout_s
        self.ask_timeout_s = ask_timeout_s
        self._name = name
        self._progress = _Progress()
        self._monitor: ActorRef | None = None
        self._next_batch = 0
        self.lr_scale = 1.0
        """What the stages multiply their learning rates by from the next batch fed on (:class:`LrDecay`)."""

    @property
    def samples_done(self) -> int:
        """Examples the last stage has trained on so far (counted from its loss reports)."""
        return self._progress.seen

    @property
    def in_flight(self) -> int:
        """Batches sent that some stage has not finished with yet."""
        return len(self._progress.in_flight)

    async def __aenter__(self) -> PipelineDriver:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Spawn the monitor and wire every stage to its neighbours and to it."""
        self._monitor = await self.system.spawn(PipelineMonitor, self._progress, name=self._name)
        await self._connect()

    async def _connect(self) -> None:
        assert self._monitor is not None, "start() the driver first"
        for k, ref in enumerate(self.stages):
            up = self.stages[k - 1 : k] if k > 0 else []
            down = self.stages[k + 1 : k + 2]
            await self._guard(ref, ref.ask(Connect(up, down, self._monitor), timeout=self.ask_timeout_s))

    async def rewire(self, stages: Sequence[ActorRef]) -> None:
        """Drive ``stages`` (first to last) from now on, each wired anew; :meth:`drain` first."""
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        if self._progress.in_flight:
            raise RuntimeError(f"{self.in_flight} batches are in flight: drain() before rewiring")
        self.stages = list(stages)
        await self._connect()

    async def regroup(self, old: Sequence[Sequence[int]], new: Sequence[Sequence[int]]) -> list[Move]:
        """Move layers between neighbouring stages until the split is ``new`` (both splits cover the same layers
        with one group per stage): drains the pipeline, then moves layers across one boundary at a time, each
        stage keeping at least one layer. Returns the moves made."""
        if len(old) != len(self.stages) or len(new) != len(self.stages):
            raise ValueError(f"a split of {len(self.stages)} stages is needed, got {len(old)} and {len(new)} groups")
        await self.drain()
        starts = [g[0] for g in old]  # the first layer of every stage; boundary b is starts[b + 1]
        target = [g[0] for g in new]
        ends = old[-1][-1] + 1
        moves: list[Move] = []
        while starts != target:
            progressed = False
            for b in range(len(self.stages) - 1):
                here, there = starts[b + 1], target[b + 1]
                if here == there:
                    continue
                if there < here:  # stage b gives layers from its back to stage b + 1
                    count = min(here - there, here - starts[b] - 1)
                    source, side_out, side_in = b, "back", "front"
                else:  # stage b + 1 gives layers from its front to stage b
                    limit = (starts[b + 2] if b + 2 < len(starts) else ends) - here - 1
                    count = min(there - here, limit)
                    source, side_out, side_in = b + 1, "front", "back"
                if count <= 0:
                    continue
                receiver = b + 1 if source == b else b
                moves.append(await self._move(source, receiver, count, side_out, side_in))
                starts[b + 1] += -count if source == b else count
                progressed = True
            if not progressed:
                raise RuntimeError(f"cannot regroup {list(map(list, old))} into {list(map(list, new))}")
        return moves

    async def _move(self, source: int, target: int, count: int, side_out: str, side_in: str) -> Move:
        started = time.perf_counter()
        giver, taker = self.stages[source], self.stages[target]
        bundle = await self._guard(giver, giver.ask(ReleaseLayers(count, side_out), timeout=self.ask_timeout_s))
        assert isinstance(bundle, LayerBundle)
        try:
            await self._guard(taker, taker.ask(AdoptLayers(bundle, side_in), timeout=self.ask_timeout_s))
        except BaseException:
            # the receiver is gone or refused: the layers go back where they were, so the giver's part of the
            # model stays whole (if the giver is gone too, the pipeline is broken either way)
            try:
                await self._guard(giver, giver.ask(AdoptLayers(bundle, side_out), timeout=self.ask_timeout_s))
            except Exception:  # the original failure is the one to report
                pass
            raise
        return Move(list(bundle.indices), source, target, bundle.nbytes, time.perf_counter() - started)

    async def drain(self) -> None:
        """Return once no batch is in flight (every stage has finished with every batch sent)."""
        await self._wait_until(lambda: not self._progress.in_flight)

    async def close(self) -> None:
        """Stop the monitor (the stages belong to whoever spawned them)."""
        if self._monitor is not None:
            await self.system.stop(self._monitor)
            self._monitor = None

    # -- failure handling ----------------------------------------------------
    def _check(self) -> None:
        if self._progress.failure is not None:
            raise self._progress.failure
        for ref in self.stages:
            if not ref.is_alive:
                raise PipelineBroken(ref.address, "not alive")

    async def _guard(self, ref: ActorRef, send: object) -> object:
        """Await a send or ask to ``ref``, turning runtime errors into ``PipelineBroken``.

        A tell that waits ``stall_timeout_s`` on a full mailbox counts as a stall.
        """
        assert asyncio.iscoroutine(send)
        try:
            async with asyncio.timeout(self.stall_timeout_s):
                return await send
        except (ActorStopped, AskTimeout) as exc:
            self._check()
            raise PipelineBroken(ref.address, str(exc)) from exc
        except TimeoutError:
            self._check()
            raise PipelineBroken(ref.address, f"mailbox full for {self.stall_timeout_s:g} s") from None

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        """Wait for completions until ``ready()``; raise ``PipelineBroken`` on failure or stall."""
        loop = asyncio.get_running_loop()
        last_change = loop.time()
        progress = self._progress
        while True:
            if progress.failure is not None:
                raise progress.failure
            if ready():
                return
            progress.changed.clear()
            try:
                async with asyncio.timeout(self.liveness_interval_s):
                    await progress.changed.wait()
                last_change = loop.time()
            except TimeoutError:
                self._check()  # a remote stage's node may die without a word: poll liveness
                if loop.time() - last_change > self.stall_timeout_s:
                    raise PipelineBroken(
                        self.stages[0].address, f"no batch completed in {self.stall_timeout_s:g} s"
                    ) from None

    # -- training ------------------------------------------------------------
    async def _feed(self, x: torch.Tensor, y: torch.Tensor, step_id: int, parts: int, weight: float) -> None:
        batch_id = self._next_batch
        self._next_batch += 1
        if self.synthetic_inputs:
            for ref in self.stages[1:]:
                await self._guard(ref, ref.tell(RawInput(batch_id, x, y)))
        self._progress.in_flight[batch_id] = len(self.stages)
        first = self.stages[0]
        await self._guard(first, first.tell(Forward(batch_id, step_id, parts, weight, x, y, self.lr_scale)))

    async def _feed_batch(self, bx: torch.Tensor, by: torch.Tensor, step_id: int) -> None:
        m = self.schedule.micro_batches
        if m == 1:
            await self._feed(bx, by, step_id, 1, 1.0)
            return
        parts = [(px, py) for px, py in zip(bx.tensor_split(m), by.tensor_split(m)) if px.shape[0] > 0]
        for px, py in parts:
            await self._feed(px, py, step_id, len(parts), px.shape[0] / bx.shape[0])

    async def train(
        self,
        x: torch.Tensor | TrainRows,
        y: torch.Tensor | None,
        batches: Iterable[torch.Tensor] | None = None,
        *,
        epochs: int | None = None,
        batch_size: int | None = None,
        seed: int = 0,
        eval_x: torch.Tensor | None = None,
        eval_y: torch.Tensor | None = None,
        evals_per_epoch: int = 1,
        eval_every: int | None = None,
        method: str = "pipeline",
        between: Callable[[], Awaitable[None]] | None = None,
        lr_decay: LrDecay | None = None,
    ) -> TrainResult:
        """Train on ``batches`` (index tensors into ``(x, y)``, e.g. from a resumable data cursor), or
        without them on ``epochs`` passes in :func:`batch_order` (seeded, as :func:`train_backprop`'s).

        Evaluates on ``(eval_x, eval_y)`` every ``eval_every`` mini-batches
        (default: ``evals_per_epoch`` times per epoch of ``batch_size``
        batches; neither given: once at the end). Each evaluation first drains
        the pipeline and is not counted in wall time. ``between`` is awaited
        after each mini-batch is fed (a regrouping policy may drain and move
        layers there). ``lr_decay`` (with ``epochs``): each batch is fed with
        :attr:`lr_scale` at the fraction of the run's samples fed before it;
        without, :attr:`lr_scale` is the caller's. ``x`` may be :class:`~dniasync.train.data.TrainRows`
        (``y`` None): each batch is then read from them on their prefetching thread, off the event loop.
        """
        n = len(x) if isinstance(x, TrainRows) else int(x.shape[0])
        if lr_decay is not None and epochs is None:
            raise ValueError("lr_decay needs epochs (the run's length)")
        if batches is None:
            if epochs is None or batch_size is None:
                raise ValueError("give the batches, or epochs and batch_size")
            batches = (idx for _, idx in batch_order(n, batch_size, epochs, seed))
        if eval_every is None:
            eval_every = max(1, math.ceil(n / batch_size) // max(1, evals_per_epoch)) if batch_size else 0
        evaluating = eval_x is not None and eval_y is not None
        history: list[EvalPoint] = []
        wall = 0.0
        samples = 0
        started = time.perf_counter()
        for step_id, idx in enumerate(batches):
            await self._wait_until(lambda: len(self._progress.in_flight) < self.schedule.max_in_flight)
            if lr_decay is not None and epochs:
                self.lr_scale = lr_decay.scale(samples / (n * epochs))
            if isinstance(x, TrainRows):
                bx, by = await x.take_async(idx.numpy())
                await self._feed_batch(torch.from_numpy(bx), torch.from_numpy(by), step_id)
            else:
                assert y is not None
                await self._feed_batch(x[idx], y[idx], step_id)
            if self.schedule.flush:
                await self.drain()
            if between is not None:
                await between()
            samples += int(idx.shape[0])
            if evaluating and eval_every and (step_id + 1) % eval_every == 0:
                assert eval_x is not None and eval_y is not None
                await self.drain()
                wall += time.perf_counter() - started
                history.append(await self._eval_point(wall, samples, samples / n, eval_x, eval_y))
                started = time.perf_counter()
        await self.drain()
        wall += time.perf_counter() - started
        if eval_x is not None and eval_y is not None and (not history or history[-1].samples != samples):
            history.append(await self._eval_point(wall, samples, samples / n, eval_x, eval_y))
        return TrainResult(method, history, samples, wall, await self.stats())

    async def _eval_point(
        self, wall: float, samples: int, epoch: float, eval_x: torch.Tensor, eval_y: torch.Tensor
    ) -> EvalPoint:
        accuracy, eval_loss = await self.evaluate(eval_x, eval_y)
        p = self._progress
        train_loss = p.loss_sum / p.loss_count if p.loss_count else float("nan")
        p.loss_sum, p.loss_count = 0.0, 0
        stats = await self.stats()
        return EvalPoint(
            wall, samples, epoch, accuracy, eval_loss, train_loss, [s.sg_loss for s in stats], [s.input_loss for s in stats]
        )

    # -- asking the stages -----------------------------------------------------
    async def _ask_each(self, msg: object, reply_type: type[T]) -> list[T]:
        out: list[T] = []
        for ref in self.stages:
            reply = await self._guard(ref, ref.ask(msg, timeout=self.ask_timeout_s))
            if not isinstance(reply, reply_type):
                raise TypeError(f"{ref.address} answered {type(msg).__name__} with {type(reply).__name__}")
            out.append(reply)
        return out

    async def evaluate(self, x: torch.Tensor, y: torch.Tensor, chunk: int = 1000) -> tuple[float, float]:
        """Held-out (accuracy, mean cross-entropy) through every stage's current weights."""
        correct, loss_sum = 0, 0.0
        for start in range(0, int(x.shape[0]), chunk):
            h = x[start : start + chunk]
            for ref in self.stages:
                reply = await self._guard(ref, ref.ask(EvalForward(h), timeout=self.ask_timeout_s))
                assert isinstance(reply, EvalOutput)
                h = reply.activations
            labels = y[start : start + chunk].long()
            loss_sum += float(F.cross_entropy(h, labels, reduction="sum"))
            correct += int((h.argmax(dim=1) == labels).sum())
        n = int(x.shape[0])
        return correct / n, loss_sum / n

    async def norm_probe(self, x: torch.Tensor, y: torch.Tensor, chunks: int) -> NormProbeReply:
        """Byrd's norm test on one batch (dynamic sampling): ``x`` forward through every stage but the last, whose
        parameters' gradient is taken in ``chunks`` parts. Beside the training; nothing is updated."""
        h = x
        for ref in self.stages[:-1]:
            reply = await self._guard(ref, ref.ask(EvalForward(h), timeout=self.ask_timeout_s))
            assert isinstance(reply, EvalOutput)
            h = reply.activations
        last = self.stages[-1]
        probe = await self._guard(last, last.ask(NormProbe(h, y, chunks), timeout=self.ask_timeout_s))
        assert isinstance(probe, NormProbeReply)
        return probe

    async def stats(self) -> list[StageStats]:
        """Each stage's counters and SG loss since the previous call."""
        return await self._ask_each(StatsRequest(), StageStats)

    async def states(self) -> list[dict[str, torch.Tensor]]:
        """A copy of each stage's parameters, first stage first."""
        return [dict(zip(r.names, r.tensors)) for r in await self._ask_each(StateRequest(), StageState)]

    async def traces(self) -> list[Trace]:
        """Each stage's recorded events (needs ``StageSettings(trace=True)``)."""
        return await self._ask_each(TraceRequest(), Trace)
