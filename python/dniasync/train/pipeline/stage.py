"""One pipeline stage: a group of layers as an actor, whatever update rule it trains by.

A :class:`Stage` receives ``h_{k-1}``, computes ``h_k`` and sends it
downstream; gradients travel back upstream. What happens to a batch in
between (update now from a synthetic gradient, keep the graph until the true
gradient returns, ...) is its :class:`~dniasync.train.pipeline.rules.UpdateRule`'s
decision; how the parameters are stepped and shared (a local optimizer, or push and
pull to PS shards shared with other replicas, ...) is its
:class:`~dniasync.train.sync.WeightSync`'s. The stage holds the layers,
the wiring, the cache of batches awaiting their gradient, the counters, the
trace, and answers evaluation, state and stats requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from ...actors import Actor, ActorRef, ActorStopped, handler
from .. import telemetry
from ..specs import LocalSpec, OptimizerSpec
from ..sync import SyncContext, WeightSync, build_sync
from .protocol import (
    AdoptLayers,
    Connect,
    FlushParams,
    Done,
    EvalForward,
    EvalOutput,
    NormProbe,
    NormProbeReply,
    Forward,
    Gradient,
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
from .cut import probe_shapes
from .regroup import LayerClock, drop_from_optimizer, pack_layers, unpack_layers
from .rules import Kept, Outcome, UpdateRule, make_rule
from .rules.real import forward_with
from .settings import StageSettings, StageShape
from .stage_state import FetchHeld, Held, HoldStage, RestoreStage, StageCheckpoint, load_stage, save_stage

__all__ = ["Stage"]

V = TypeVar("V")


class Stage(Actor):
    """One stage of a pipeline, wired to its neighbours and the driver's monitor by :class:`Connect`.

    Spawned with its layers, the pipeline's settings and its shape (see
    :func:`~dniasync.train.pipeline.cut.build_stages`); ``rule`` defaults to
    the one ``settings.rule`` names, ``params`` to the sync ``sync`` (a spec and
    its context, built with this stage as the owning actor) or a local optimizer. Handles
    :class:`Forward`, :class:`Gradient`, :class:`RawInput` (tells) and
    :class:`EvalForward`, :class:`StatsRequest`, :class:`StateRequest`,
    :class:`TraceRequest` (asks). Torch work runs on the system's blocking
    threads so the event loop keeps serving other actors.

    Regrouping: the stage times each of its layers (:class:`LayerClock`,
    reported in its stats) and, with the pipeline drained, gives layers to a
    neighbour (:class:`ReleaseLayers`) or takes them (:class:`AdoptLayers`)
    with their weights and optimizer state. Adopted layers are loaded into the
    modules of ``spare`` (every layer of the model, by index: the host builds
    the whole model anyway); a stage spawned without it cannot adopt. A stage
    whose layers change starts a fresh rule for its new shape (empty caches,
    and for DNI a new synthetic-gradient model whose last layer is zero, so it
    predicts no gradient until it has fit a few true ones).

    Its mailbox bounds the batches queued at it. A batch is in flight until
    every stage has sent :class:`Done` for it; each in-flight batch puts at
    most one forward, one gradient and one raw input in a stage's mailbox, so
    a driver keeping at most W batches in flight never blocks a stage on a full
    mailbox (and no cycle of full mailboxes can deadlock) when
    ``mailbox_size >= 2 * W`` (``3 * W`` with synthetic inputs).
    """

    mailbox_size = 64

    def __init__(
        self,
        layers: nn.Sequential,
        settings: StageSettings,
        shape: StageShape,
        *,
        rule: UpdateRule | None = None,
        params: WeightSync | None = None,
        sync: tuple[object, SyncContext] | None = None,
        spare: Sequence[nn.Module] | None = None,
        first_layer: int = 0,
    ) -> None:
        self.layers = layers
        self.settings = settings
        self.shape = shape
        self.last = shape.last
        self.spare = list(spare) if spare is not None else None
        self.first_layer = first_layer
        self.clock = LayerClock(layers, first_layer)
        self._clock_before = (0.0, 0)  # what earlier clocks (before the layers last changed) measured
        self.layers_in = 0
        self.layers_out = 0
        self.rule = rule if rule is not None else make_rule(settings, shape)
        if self.rule.urgent_gradients:
            self.urgent_messages = (Gradient,)
        if params is None:  # a sync built here gets this stage as its actor (p2p's inbox is a child of it)
            spec, ctx = sync if sync is not None else (LocalSpec(), SyncContext(
                f"stage-{shape.index}", time.time_ns() // 1000,
                OptimizerSpec(settings.optimizer, settings.lr, momentum=settings.momentum)))
            params = build_sync(spec, layers, dataclasses.replace(ctx, actor=self))
        self.params: WeightSync = params
        self.sg = self.rule.sg
        self.upstream: ActorRef | None = None
        self.downstream: ActorRef | None = None
        self.monitor: ActorRef | None = None
        self._kept: OrderedDict[int, Kept] = OrderedDict()
        self._parts_done: dict[int, int] = {}
        self._held: tuple[int, StageCheckpoint] | None = None
        """A capture kept by :class:`HoldStage` until :class:`FetchHeld` takes it."""
        self.steps = 0
        self.evictions = 0
        self.late_gradients = 0
        self.staleness_sum = 0
        """Updates between each batch's forward and the return of its gradient, summed over the returns."""
        self.forwards = 0
        self.forward_seconds = 0.0
        self._sg_seen = 0
        self._input_seen = 0
        self._events: list[str] = []
        self._event_batches: list[int] = []

    # -- wiring and reporting ----------------------------------------------------
    @handler
    def connect(self, msg: Connect) -> None:
        self.upstream = msg.upstream[0] if msg.upstream else None
        self.downstream = msg.downstream[0] if msg.downstream else None
        self.monitor = msg.monitor
        self.rule.connect(self.upstream is not None)

    def trace(self, event: str, batch_id: int) -> None:
        """Record ``event`` for ``batch_id`` (with ``settings.trace``)."""
        if self.settings.trace:
            self._events.append(event)
            self._event_batches.append(batch_id)

    def _report_down(self, address: str, reason: str) -> None:
        if self.monitor is None:
            return
        try:
            self.monitor.tell_nowait(StageDown(address, reason))
        except Exception:  # the monitor is gone or full: the driver's liveness check still sees it
            pass

    async def _send(self, ref: ActorRef | None, msg: object) -> bool:
        if ref is None:
            return False
        try:
            async with asyncio.timeout(self.settings.send_timeout_s):
                await ref.tell(msg)
        except ActorStopped as exc:
            self._report_down(ref.address, f"unreachable from {self.ref.address}: {exc}")
            return False
        except TimeoutError:
            # a full mailbox that never drains: a stalled neighbour or mailboxes too small for the window
            self._report_down(
                self.ref.address,
                f"could not deliver to {ref.address} for {self.settings.send_timeout_s:g} s (mailbox full)",
            )
            return False
        return True

    async def on_start(self) -> None:
        telemetry.track_stage(self.system, self)

    async def on_failure(self, exc: BaseException) -> None:
        self._report_down(self.ref.address, f"failed: {exc!r}")

    async def on_stop(self) -> None:
        self._report_down(self.ref.address, "stopped")
        await self.params.close()

    def keep(self, cache: OrderedDict[int, V], batch_id: int, value: V) -> None:
        """``cache[batch_id] = value``, evicting the oldest beyond the rule's ``cache_size`` (counted)."""
        cache[batch_id] = value
        while len(cache) > self.rule.cache_size:
            cache.popitem(last=False)
            self.evictions += 1

    def count_part(self, step_id: int, parts: int) -> tuple[bool, bool]:
        """Count one micro-batch of ``step_id``: (is it the first, is it the last)."""
        part = self._parts_done.get(step_id, 0) + 1
        if part >= parts:
            self._parts_done.pop(step_id, None)
        else:
            self._parts_done[step_id] = part
        return part == 1, part >= parts

    # -- torch work (runs on a blocking thread) ------------------------------------
    def _forward(
        self, x: torch.Tensor, weights: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h_in = x.detach().requires_grad_(self.upstream is not None)
        return h_in, forward_with(self.layers, weights, h_in)

    def step_with(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Step the layers with these gradients (by parameter name), as :meth:`backward` with ``step`` would."""
        self.params.zero_grad()
        for name, p in self.layers.named_parameters():
            g = grads.get(name)
            if g is not None:
                p.grad = g.detach()
        self.params.step()
        self.steps += 1

    def backward(
        self, h_in: torch.Tensor, h_out: torch.Tensor, grad: torch.Tensor, *, zero: bool, step: bool,
        lr_scale: float = 1.0,
    ) -> torch.Tensor | None:
        """Back-propagate ``grad`` at ``h_out``; ``zero`` the gradients first, ``step`` after (with the lr times
        ``lr_scale``, wherever the optimizer runs); ``dL/dh_in``."""
        if zero:
            self.params.zero_grad()
        torch.autograd.backward(h_out, grad)
        self.clock.backward_done()
        if step:
            self.params.step(lr_scale)
            self.steps += 1
        return h_in.grad.detach() if h_in.grad is not None else None

    def gradients(
        self, h_out: torch.Tensor, inputs: Sequence[torch.Tensor], grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        """``grad`` at ``h_out`` back-propagated to ``inputs`` only (``None`` where one is unused); nothing steps."""
        grads = torch.autograd.grad(h_out, list(inputs), grad, allow_unused=True)
        self.clock.backward_done()
        return tuple(grads)

    def loss_backward(
        self, h_in: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, weight: float, *, zero: bool, step: bool
    ) -> tuple[torch.Tensor | None, float, int]:
        """Back-propagate ``weight`` times the cross-entropy; (``dL/dh_in``, loss, correct predictions)."""
        loss = F.cross_entropy(logits, labels.long())
        if zero:
            self.params.zero_grad()
        (loss * weight).backward()  # type: ignore[no-untyped-call]
        self.clock.backward_done()
        if step:
            self.params.step()
            self.steps += 1
        correct = int((logits.detach().argmax(dim=1) == labels).sum())
        grad_in = h_in.grad.detach() if h_in.grad is not None else None
        return grad_in, float(loss.detach()), correct

    def _eval(self, x: torch.Tensor) -> torch.Tensor:
        self.layers.eval()
        try:
            with torch.no_grad():
                out: torch.Tensor = self.layers(x)
        finally:
            self.layers.train()
        return out

    # -- handlers ----------------------------------------------------------------
    @handler
    async def forward(self, msg: Forward) -> None:
        b = msg.batch_id
        await self.params.ready()
        started = time.perf_counter()
        self.trace("forward", b)
        # every forward: a restored optimizer state or a new input model carries the lr it was built or saved with
        self.params.scale_lr(msg.lr_scale)
        self.rule.scale_lr(msg.lr_scale)
        await self.rule.before_forward(self, msg)
        weights = await self.rule.forward_weights(self, msg)
        h_in, h_out = await self.run_blocking(self._forward, msg.activations, weights)
        if self.last:
            await self._loss_step(msg, h_in, h_out)
        else:
            out = Forward(b, msg.step_id, msg.parts, msg.weight, h_out.detach(), msg.labels, msg.lr_scale)
            if await self._send(self.downstream, out):
                self.trace("sent_downstream", b)
            await self._apply(b, await self.rule.after_forward(self, msg, h_in, h_out))
        self.forwards += 1
        elapsed = time.perf_counter() - started
        self.forward_seconds += elapsed
        self.clock.busy_seconds += elapsed
        await self.params.sync(0)  # the shards count no samples for a stage

    async def _loss_step(self, msg: Forward, h_in: torch.Tensor, logits: torch.Tensor) -> None:
        """The last stage: the loss gives the true gradient at once (a step's micro-batches accumulate)."""
        b = msg.batch_id
        first, last = self.count_part(msg.step_id, msg.parts)
        grad_in, loss, correct = await self.run_blocking(
            self.loss_backward, h_in, logits, msg.labels, msg.weight, zero=first, step=last
        )
        self.trace("update" if last else "accumulate", b)
        await self._send(self.monitor, LossReport(b, loss, correct, int(msg.labels.shape[0])))
        await self._pass_upstream(b, grad_in)
        await self._send(self.monitor, Done(b))

    async def _apply(self, batch_id: int, outcome: Outcome) -> None:
        if outcome.event is not None:
            self.trace(outcome.event, batch_id)
        if outcome.keep is not None:
            self.keep(self._kept, batch_id, outcome.keep)
        await self._pass_upstream(batch_id, outcome.upstream)
        if outcome.done:
            await self._send(self.monitor, Done(batch_id))

    async def _pass_upstream(self, batch_id: int, grad_in: torch.Tensor | None) -> None:
        if self.upstream is None or grad_in is None:
            return
        if await self._send(self.upstream, Gradient(batch_id, grad_in)):
            self.trace("sent_upstream", batch_id)

    @handler
    async def gradient(self, msg: Gradient) -> None:
        b = msg.batch_id
        started = time.perf_counter()
        self.trace("gradient", b)
        kept = self._kept.pop(b, None)
        if kept is None:
            self.late_gradients += 1
            outcome = self.rule.on_late_gradient(b)
        else:
            self.staleness_sum += self.steps - kept.at_step
            outcome = await self.rule.on_gradient(self, kept, msg)
        await self._apply(b, outcome)
        self.clock.busy_seconds += time.perf_counter() - started
        await self.params.sync(0)

    @handler
    async def raw_input(self, msg: RawInput) -> None:
        await self.params.ready()
        started = time.perf_counter()
        await self._apply(msg.batch_id, await self.rule.on_raw_input(self, msg))
        self.clock.busy_seconds += time.perf_counter() - started
        await self.params.sync(0)

    @handler
    async def evaluate(self, msg: EvalForward) -> EvalOutput:
        return EvalOutput(await self.run_blocking(self._eval, msg.activations))

    @handler
    async def norm_probe(self, msg: NormProbe) -> NormProbeReply:
        if self.downstream is not None:
            raise ValueError(f"{self.ref.address}: the norm test runs at the last stage (this one has a downstream)")
        return await self.run_blocking(self._norm_probe, msg.activations, msg.labels, msg.chunks)

    def _norm_probe(self, h: torch.Tensor, labels: torch.Tensor, chunks: int) -> NormProbeReply:
        """The last stage's share of the norm test: its parameters' gradient on each part of a batch."""
        params = [p for p in self.layers.parameters() if p.requires_grad]
        parts = [idx for idx in torch.arange(len(labels)).tensor_split(chunks) if len(idx)]
        grads = []
        for idx in parts:
            loss = F.cross_entropy(self.layers(h[idx]), labels[idx].long())
            grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]).double())
        mean = torch.stack(grads).mean(dim=0)
        return NormProbeReply(float(sum(float(g @ g) for g in grads)), float(mean @ mean), len(parts),
                              len(parts[-1]))

    @handler
    def stats(self, msg: StatsRequest) -> StageStats:
        sg, inputs = self.rule.sg, self.rule.input_model
        measured = self.rule.diagnostics()
        params = self.params.stats()
        sg_loss, self._sg_seen = sg.mean_loss_since(self._sg_seen) if sg is not None else (float("nan"), 0)
        input_loss, self._input_seen = (
            inputs.mean_loss_since(self._input_seen) if inputs is not None else (float("nan"), 0)
        )
        return StageStats(
            self.ref.address,
            self.steps,
            sg.steps if sg is not None else 0,
            sg_loss,
            inputs.steps if inputs is not None else 0,
            input_loss,
            self.evictions,
            self.late_gradients,
            self.staleness_sum,
            params.bytes_pushed,
            params.bytes_pulled,
            *self.rule.stash_bytes(),
            self.first_layer,
            *self.clock.totals(),
            measured.get("estimate_error_ratio", math.nan),
            measured.get("prediction_error", math.nan),
            self.clock.busy_seconds,
            self.params.lr_now(),
            params.pushes,
            params.pusher,
        )

    @handler
    def state(self, msg: StateRequest) -> StageState:
        names, tensors = [], []
        for name, tensor in self.layers.state_dict().items():
            names.append(name)
            tensors.append(tensor.detach().clone())
        return StageState(names, tensors)

    # -- regrouping -------------------------------------------------------------------
    @property
    def compute_seconds(self) -> float:
        """Seconds spent in this stage's layers (forward and backward) since it started, whatever they were."""
        return self._clock_before[0] + sum(self.clock.totals()[0])

    @property
    def compute_batches(self) -> int:
        return self._clock_before[1] + self.clock.totals()[1]

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def _reshape(self, layers: list[nn.Module], first_layer: int, in_dims: tuple[int, ...]) -> None:
        """Take ``layers`` (model indices from ``first_layer``) with inputs of ``in_dims`` as this stage's own."""
        self.layers = nn.Sequential(*layers)
        self.first_layer = first_layer
        out_dims = probe_shapes(self.layers, in_dims)[-1]
        self.shape = dataclasses.replace(
            self.shape, in_features=math.prod(in_dims), out_features=math.prod(out_dims),
            in_shape=in_dims if len(in_dims) > 1 else (), out_shape=out_dims if len(out_dims) > 1 else (),
        )
        self.rule = make_rule(self.settings, self.shape)
        self.rule.connect(self.upstream is not None)
        self.sg = self.rule.sg
        self._sg_seen = self._input_seen = 0  # positions in the old models' loss records
        seconds, batches = self.clock.totals()
        self._clock_before = (self._clock_before[0] + sum(seconds), self._clock_before[1] + batches)
        self.clock.close()
        self.clock = LayerClock(self.layers, first_layer)
        self._kept.clear()
        self._parts_done.clear()
        self.params = self.params.relinked(self.layers)  # with PS shards: pulls the new slice before the next batch

    def _check_idle(self, what: str) -> None:
        if self._kept or self._parts_done:
            raise RuntimeError(f"{self.ref.address}: cannot {what} with {len(self._kept)} batches in flight "
                               "(drain the pipeline first)")

    def _release(self, count: int, side: str) -> LayerBundle:
        layers = list(self.layers)
        if side not in ("front", "back") or not 0 < count < len(layers):
            raise ValueError(f"{self.ref.address}: cannot release {count} of its {len(layers)} layers at {side!r} "
                             "(a stage keeps at least one)")
        optimizer = self.params.optimizer
        shapes = probe_shapes(self.layers, self.shape.in_dims)
        start = len(layers) - count if side == "back" else 0
        moving = {self.first_layer + j: layers[j] for j in range(start, start + count)}
        moving_in = shapes[start - 1] if start > 0 else self.shape.in_dims
        bundle = pack_layers(moving, optimizer)
        if optimizer is not None:
            drop_from_optimizer(optimizer, [p for module in moving.values() for p in module.parameters()])
        if side == "back":
            self._reshape(layers[:start], self.first_layer, self.shape.in_dims)
        else:
            self._reshape(layers[count:], self.first_layer + count, shapes[count - 1])
        return LayerBundle(sorted(moving), list(moving_in), list(shapes[start + count - 1]),
                           list(bundle), list(bundle.values()))

    def _adopt(self, bundle: LayerBundle, side: str) -> None:
        if self.spare is None:
            raise RuntimeError(f"{self.ref.address} was spawned without the model's other layers: it cannot adopt")
        edge = self.first_layer - 1 if side == "front" else self.first_layer + len(self.layers)
        if side not in ("front", "back") or not bundle.indices or edge not in bundle.indices:
            raise ValueError(f"{self.ref.address}: layers {bundle.indices} do not border it at {side!r}")
        optimizer = self.params.optimizer
        modules = {i: self.spare[i] for i in bundle.indices}
        unpack_layers(dict(zip(bundle.names, bundle.tensors)), modules, optimizer)
        adopted = [modules[i] for i in bundle.indices]
        if side == "front":
            self._reshape([*adopted, *self.layers], bundle.indices[0], tuple(bundle.in_shape))
        else:
            self._reshape([*self.layers, *adopted], self.first_layer, self.shape.in_dims)

    @handler
    async def flush_params(self, msg: FlushParams) -> StageStats:
        """Push the gradients accumulated since the last push (PS shards; a local optimizer has none)."""
        await self.params.flush()
        return self.stats(StatsRequest())

    @handler
    async def release_layers(self, msg: ReleaseLayers) -> LayerBundle:
        self._check_idle("give layers away")
        bundle = await self.run_blocking(self._release, msg.count, msg.side)
        self.layers_out += len(bundle.indices)
        self.trace("released", -1)
        return bundle

    @handler
    async def adopt_layers(self, msg: AdoptLayers) -> StageStats:
        self._check_idle("take layers")
        await self.run_blocking(self._adopt, msg.bundle, msg.side)
        self.layers_in += len(msg.bundle.indices)
        self.trace("adopted", -1)
        return self.stats(StatsRequest())

    @handler
    def events(self, msg: TraceRequest) -> Trace:
        return Trace(list(self._events), list(self._event_batches))

    # -- checkpoints (see stage_state) ----------------------------------------------------
    @handler
    async def hold(self, msg: HoldStage) -> Held:
        self._check_idle("save its state")
        state = await self.run_blocking(save_stage, self)
        self._held = (msg.capture, state)
        return Held(msg.capture, sum(t.numel() * t.element_size() for t in state.tensors))

    @handler
    def fetch_held(self, msg: FetchHeld) -> StageCheckpoint:
        held, self._held = self._held, None
        if held is None or held[0] != msg.capture:
            have = "none" if held is None else f"capture {held[0]}"
            self._held = held
            raise ValueError(f"{self.ref.address}: capture {msg.capture} is not held here (it holds {have})")
        return held[1]

    @handler
    async def restore(self, msg: RestoreStage) -> bool:
        await self.run_blocking(load_stage, self, msg.first_layer, msg.names, msg.tensors)
        self.trace("restored", -1)
        return True
