"""Driving a pipeline of layer groups: DNI, the synchronous baseline, plain backprop.

:class:`PipelineDriver` feeds mini-batches to the first :class:`LayerGroup`,
bounds the batches in flight, evaluates the whole model through the groups'
current weights and records a history. It uses only refs and messages (the
groups may live on other nodes); the one actor it spawns, its
:class:`PipelineMonitor`, lives beside it and receives completions, losses and
failure notices from the groups.

:func:`train_backprop` is the sequential single-process reference, and
:func:`run_pipeline` spawns groups in one :class:`ActorSystem` and drives them.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import torch
import torch.nn.functional as F
from torch import nn

from ..actors import Actor, ActorRef, ActorStopped, ActorSystem, AskTimeout, Directive, handler
from .dni import (
    Connect,
    DNISettings,
    Done,
    EvalForward,
    EvalOutput,
    Forward,
    GroupDown,
    GroupState,
    GroupStats,
    LayerGroup,
    LossReport,
    RawInput,
    StateRequest,
    StatsRequest,
    Trace,
    TraceRequest,
    build_layer_groups,
)

__all__ = [
    "EvalPoint",
    "PipelineBroken",
    "PipelineDriver",
    "PipelineMonitor",
    "TrainResult",
    "batch_order",
    "evaluate_model",
    "run_pipeline",
    "spawn_layer_groups",
    "train_backprop",
]


class PipelineBroken(RuntimeError):
    """A layer group died, stopped, became unreachable, or the pipeline stalled."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"pipeline broken at {address}: {reason}")
        self.address = address
        self.reason = reason


@dataclass
class EvalPoint:
    """One evaluation during training.

    ``sg_losses`` and ``input_losses``: per group, the mean loss of its SG model
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
    stats: list[GroupStats] = field(default_factory=list)

    @property
    def final_accuracy(self) -> float:
        return self.history[-1].accuracy if self.history else float("nan")

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else float("nan")


def batch_order(n: int, batch_size: int, epochs: int, seed: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(epoch, indices)`` of every mini-batch: a fresh permutation per epoch, last batch partial."""
    if batch_size < 1 or epochs < 0 or n < 1:
        raise ValueError(f"need n >= 1, batch_size >= 1, epochs >= 0 (got {n}, {batch_size}, {epochs})")
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n, batch_size):
            yield epoch, perm[start : start + batch_size]


class _Progress:
    """Shared by a driver and its monitor (always on the same node)."""

    def __init__(self, n_groups: int) -> None:
        self.n_groups = n_groups
        self.in_flight: dict[int, int] = {}
        """batch id -> groups that have not sent ``Done`` for it yet"""
        self.changed = asyncio.Event()
        self.failure: PipelineBroken | None = None
        self.loss_sum = 0.0
        self.loss_count = 0
        self.correct = 0
        self.seen = 0


class PipelineMonitor(Actor):
    """Receives :class:`Done`, :class:`LossReport` and :class:`GroupDown` for a driver.

    Unbounded mailbox: groups must never wait on it (the driver's window bounds it).
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
    def group_down(self, msg: GroupDown) -> None:
        if self.progress.failure is None:
            self.progress.failure = PipelineBroken(msg.address, msg.reason)
        self.progress.changed.set()


class PipelineDriver:
    """Feeds a pipeline of layer groups, given only their refs (first to last).

    ``mode="dni"`` keeps up to ``max_in_flight`` batches in the pipeline;
    ``mode="sync"`` splits each mini-batch into ``micro_batches`` parts,
    sends them all, and waits until the first group has applied the step
    (GPipe-style flush). With ``synthetic_inputs`` the raw batch also goes to
    every group after the first. A group that fails, stops or disappears, or a
    pipeline that completes nothing for ``stall_timeout_s``, raises
    :class:`PipelineBroken`; it never hangs. A batch is in flight until every
    group has sent :class:`Done` for it. Groups' mailboxes should hold
    ``2 * max_in_flight`` messages, ``3 *`` with synthetic inputs (see
    :class:`LayerGroup`).
    """

    def __init__(
        self,
        system: ActorSystem,
        groups: Sequence[ActorRef],
        *,
        mode: str = "dni",
        max_in_flight: int = 8,
        micro_batches: int = 1,
        synthetic_inputs: bool = False,
        liveness_interval_s: float = 0.5,
        stall_timeout_s: float = 60.0,
        ask_timeout_s: float = 60.0,
        name: str = "pipeline-monitor",
    ) -> None:
        if not groups:
            raise ValueError("a pipeline needs at least one layer group")
        if mode not in ("dni", "sync"):
            raise ValueError(f"mode must be 'dni' or 'sync', got {mode!r}")
        if max_in_flight < 1 or micro_batches < 1:
            raise ValueError("max_in_flight and micro_batches must be >= 1")
        self.system = system
        self.groups = list(groups)
        self.mode = mode
        self.max_in_flight = max_in_flight
        self.micro_batches = micro_batches
        self.synthetic_inputs = synthetic_inputs
        self.liveness_interval_s = liveness_interval_s
        self.stall_timeout_s = stall_timeout_s
        self.ask_timeout_s = ask_timeout_s
        self._name = name
        self._progress = _Progress(len(self.groups))
        self._monitor: ActorRef | None = None
        self._next_batch = 0

    @property
    def samples_done(self) -> int:
        """Examples the last group has trained on so far (counted from its loss reports)."""
        return self._progress.seen

    async def __aenter__(self) -> PipelineDriver:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Spawn the monitor and wire every group to its neighbours and to it."""
        self._monitor = await self.system.spawn(PipelineMonitor, self._progress, name=self._name)
        for k, ref in enumerate(self.groups):
            up = self.groups[k - 1 : k] if k > 0 else []
            down = self.groups[k + 1 : k + 2]
            await self._guard(ref, ref.ask(Connect(up, down, self._monitor), timeout=self.ask_timeout_s))

    async def close(self) -> None:
        """Stop the monitor (the groups belong to whoever spawned them)."""
        if self._monitor is not None:
            await self.system.stop(self._monitor)
            self._monitor = None

    # -- failure handling ----------------------------------------------------
    def _check(self) -> None:
        if self._progress.failure is not None:
            raise self._progress.failure
        for ref in self.groups:
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
                self._check()  # a remote group's node may die without a word: poll liveness
                if loop.time() - last_change > self.stall_timeout_s:
                    raise PipelineBroken(
                        self.groups[0].address, f"no batch completed in {self.stall_timeout_s:g} s"
                    ) from None

    # -- training ------------------------------------------------------------
    async def _feed(self, x: torch.Tensor, y: torch.Tensor, step_id: int, parts: int, weight: float) -> None:
        batch_id = self._next_batch
        self._next_batch += 1
        if self.synthetic_inputs:
            for ref in self.groups[1:]:
                await self._guard(ref, ref.tell(RawInput(batch_id, x, y)))
        self._progress.in_flight[batch_id] = len(self.groups)
        first = self.groups[0]
        await self._guard(first, first.tell(Forward(batch_id, step_id, parts, weight, x, y)))

    async def train(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        *,
        epochs: int,
        batch_size: int,
        seed: int = 0,
        eval_x: torch.Tensor | None = None,
        eval_y: torch.Tensor | None = None,
        evals_per_epoch: int = 1,
        method: str | None = None,
    ) -> TrainResult:
        """Train for ``epochs`` over ``(x, y)``; evaluate on ``(eval_x, eval_y)`` as it goes.

        Each evaluation first drains the pipeline and is not counted in wall time.
        """
        n = int(x.shape[0])
        batches_per_epoch = math.ceil(n / batch_size)
        eval_every = max(1, batches_per_epoch // max(1, evals_per_epoch))
        history: list[EvalPoint] = []
        wall = 0.0
        samples = 0
        started = time.perf_counter()
        for step_id, (epoch, idx) in enumerate(batch_order(n, batch_size, epochs, seed)):
            bx, by = x[idx], y[idx]
            if self.mode == "dni":
                await self._wait_until(lambda: len(self._progress.in_flight) < self.max_in_flight)
                await self._feed(bx, by, step_id, 1, 1.0)
            else:
                parts = list(zip(bx.tensor_split(self.micro_batches), by.tensor_split(self.micro_batches)))
                parts = [(px, py) for px, py in parts if px.shape[0] > 0]
                for px, py in parts:
                    await self._feed(px, py, step_id, len(parts), px.shape[0] / bx.shape[0])
                await self._wait_until(lambda: not self._progress.in_flight)
            samples += int(idx.shape[0])
            if eval_x is not None and eval_y is not None and (step_id + 1) % eval_every == 0:
                await self._wait_until(lambda: not self._progress.in_flight)
                wall += time.perf_counter() - started
                history.append(await self._eval_point(wall, samples, samples / n, eval_x, eval_y))
                started = time.perf_counter()
        await self._wait_until(lambda: not self._progress.in_flight)
        wall += time.perf_counter() - started
        if eval_x is not None and eval_y is not None and (not history or history[-1].samples != samples):
            history.append(await self._eval_point(wall, samples, samples / n, eval_x, eval_y))
        return TrainResult(method or self.mode, history, samples, wall, await self.stats())

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

    # -- asking the groups -----------------------------------------------------
    async def evaluate(self, x: torch.Tensor, y: torch.Tensor, chunk: int = 1000) -> tuple[float, float]:
        """Held-out (accuracy, mean cross-entropy) through every group's current weights."""
        correct, loss_sum = 0, 0.0
        for start in range(0, int(x.shape[0]), chunk):
            h = x[start : start + chunk]
            for ref in self.groups:
                reply = await self._guard(ref, ref.ask(EvalForward(h), timeout=self.ask_timeout_s))
                assert isinstance(reply, EvalOutput)
                h = reply.activations
            labels = y[start : start + chunk].long()
            loss_sum += float(F.cross_entropy(h, labels, reduction="sum"))
            correct += int((h.argmax(dim=1) == labels).sum())
        n = int(x.shape[0])
        return correct / n, loss_sum / n

    async def stats(self) -> list[GroupStats]:
        """Each group's counters and SG loss since the previous call."""
        out = []
        for ref in self.groups:
            reply = await self._guard(ref, ref.ask(StatsRequest(), timeout=self.ask_timeout_s))
            assert isinstance(reply, GroupStats)
            out.append(reply)
        return out

    async def states(self) -> list[dict[str, torch.Tensor]]:
        """A copy of each group's parameters, first group first."""
        out = []
        for ref in self.groups:
            reply = await self._guard(ref, ref.ask(StateRequest(), timeout=self.ask_timeout_s))
            assert isinstance(reply, GroupState)
            out.append(dict(zip(reply.names, reply.tensors)))
        return out

    async def traces(self) -> list[Trace]:
        """Each group's recorded events (needs ``DNISettings(trace=True)``)."""
        out = []
        for ref in self.groups:
            reply = await self._guard(ref, ref.ask(TraceRequest(), timeout=self.ask_timeout_s))
            assert isinstance(reply, Trace)
            out.append(reply)
        return out


# -- one-call runs --------------------------------------------------------------


async def spawn_layer_groups(
    system: ActorSystem,
    model: nn.Sequential,
    groups: Sequence[Sequence[int]],
    settings: DNISettings,
    in_features: int,
    *,
    seed: int = 0,
    mailbox_size: int = 64,
    prefix: str = "layer-group",
) -> list[ActorRef]:
    """Cut ``model`` and spawn one :class:`LayerGroup` per group, named ``{prefix}-{k}``.

    Groups are not restarted on failure (a fresh instance would have lost its
    wiring and optimizer state): they stop, and the driver reports it.
    """
    specs = build_layer_groups(model, groups, settings, in_features, seed=seed)
    return [
        await system.spawn(
            LayerGroup, *spec.args(), name=f"{prefix}-{k}", mailbox_size=mailbox_size, supervision=Directive.STOP
        )
        for k, spec in enumerate(specs)
    ]


async def run_pipeline(
    model: nn.Sequential,
    groups: Sequence[Sequence[int]],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    settings: DNISettings,
    epochs: int,
    batch_size: int,
    seed: int = 0,
    max_in_flight: int = 8,
    micro_batches: int = 1,
    eval_x: torch.Tensor | None = None,
    eval_y: torch.Tensor | None = None,
    evals_per_epoch: int = 1,
    method: str | None = None,
) -> TrainResult:
    """Train ``model`` as a pipeline of layer groups in one in-process :class:`ActorSystem`."""
    async with ActorSystem() as system:
        refs = await spawn_layer_groups(
            system,
            model,
            groups,
            settings,
            int(x.shape[1]),
            seed=seed,
            mailbox_size=3 * max(max_in_flight, micro_batches) + 4,
        )
        async with PipelineDriver(
            system,
            refs,
            mode=settings.mode,
            max_in_flight=max_in_flight,
            micro_batches=micro_batches,
            synthetic_inputs=settings.synthetic_inputs,
        ) as driver:
            return await driver.train(
                x,
                y,
                epochs=epochs,
                batch_size=batch_size,
                seed=seed,
                eval_x=eval_x,
                eval_y=eval_y,
                evals_per_epoch=evals_per_epoch,
                method=method,
            )


def evaluate_model(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of a whole model, in eval mode."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(x)
    finally:
        model.train(was_training)
    labels = y.long()
    return float((logits.argmax(dim=1) == labels).float().mean()), float(F.cross_entropy(logits, labels))


def train_backprop(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    seed: int = 0,
    lr: float = 1e-3,
    optimizer: str = "adam",
    eval_x: torch.Tensor | None = None,
    eval_y: torch.Tensor | None = None,
    evals_per_epoch: int = 1,
) -> TrainResult:
    """Sequential backprop in this thread: the reference the pipelines are measured against.

    Same batch order as :class:`PipelineDriver` for the same ``seed``.
    """
    params = list(model.parameters())
    opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=lr) if optimizer == "adam" else torch.optim.SGD(params, lr=lr)
    n = int(x.shape[0])
    eval_every = max(1, math.ceil(n / batch_size) // max(1, evals_per_epoch))
    history: list[EvalPoint] = []
    wall, samples, loss_sum, loss_count = 0.0, 0, 0.0, 0
    started = time.perf_counter()
    for step, (_, idx) in enumerate(batch_order(n, batch_size, epochs, seed)):
        loss = F.cross_entropy(model(x[idx]), y[idx].long())
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        samples += int(idx.shape[0])
        loss_sum += float(loss.detach())
        loss_count += 1
        if eval_x is not None and eval_y is not None and (step + 1) % eval_every == 0:
            wall += time.perf_counter() - started
            accuracy, eval_loss = evaluate_model(model, eval_x, eval_y)
            history.append(EvalPoint(wall, samples, samples / n, accuracy, eval_loss, loss_sum / loss_count))
            loss_sum, loss_count = 0.0, 0
            started = time.perf_counter()
    wall += time.perf_counter() - started
    if eval_x is not None and eval_y is not None and (not history or history[-1].samples != samples):
        accuracy, eval_loss = evaluate_model(model, eval_x, eval_y)
        history.append(
            EvalPoint(wall, samples, samples / n, accuracy, eval_loss, loss_sum / loss_count if loss_count else float("nan"))
        )
    return TrainResult("backprop", history, samples, wall)
