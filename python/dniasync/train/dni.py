"""Decoupled Neural Interfaces (Jaderberg et al. 2016): layer groups that update at once.

A model (an ``nn.Sequential``) is cut into contiguous layer groups, each hosted
by a :class:`LayerGroup` actor. Group k receives ``h_{k-1}``, computes ``h_k``,
sends it downstream at once and updates itself with the synthetic gradient
``M_k(h_k)`` (update unlocking). The gradient with respect to its input goes
upstream, where it is the regression target of ``M_{k-1}``; because group k
itself was driven by ``M_k``, that target is bootstrapped. The last group uses
the real loss. With ``mode="sync"`` the same actors form the synchronous
pipeline baseline: a group keeps the graph of each batch and updates only once
the true gradient has come back (GPipe-style micro-batches accumulate).

Groups talk only through :class:`~dniasync.actors.ActorRef` and the wire
messages declared here (tensors, ints, floats, strings, refs), so they can be
placed on any node.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from ..actors import Actor, ActorRef, ActorStopped, handler, message
from .telemetry import track_layer_group

__all__ = [
    "Connect",
    "DNISettings",
    "Done",
    "EvalForward",
    "EvalOutput",
    "Forward",
    "Gradient",
    "GroupConfigError",
    "GroupDown",
    "GroupSpec",
    "GroupState",
    "GroupStats",
    "LayerGroup",
    "LossReport",
    "RawInput",
    "StateRequest",
    "StatsRequest",
    "SyntheticGradient",
    "SyntheticInput",
    "Trace",
    "TraceRequest",
    "build_layer_groups",
    "split_sequential",
    "validate_groups",
]


# -- wire messages --------------------------------------------------------------


@message("dniasync.dni.Connect")
@dataclass(frozen=True)
class Connect:
    """Wires a group to its neighbours; empty lists mean first / last group."""

    upstream: list[ActorRef]
    downstream: list[ActorRef]
    monitor: ActorRef


@message("dniasync.dni.Forward")
@dataclass(frozen=True)
class Forward:
    """Activations of one (micro-)batch travelling downstream.

    ``step_id`` and ``parts`` group micro-batches into one optimizer step in the
    synchronous pipeline (DNI sends ``parts=1``); ``weight`` is this part's
    share of the step's loss (its size over the mini-batch size).
    """

    batch_id: int
    step_id: int
    parts: int
    weight: float
    activations: torch.Tensor
    labels: torch.Tensor


@message("dniasync.dni.RawInput")
@dataclass(frozen=True)
class RawInput:
    """The raw inputs of a batch, for a group that predicts its own input."""

    batch_id: int
    inputs: torch.Tensor
    labels: torch.Tensor


@message("dniasync.dni.Gradient")
@dataclass(frozen=True)
class Gradient:
    """``dL/dh`` for a batch's activations, travelling upstream."""

    batch_id: int
    gradient: torch.Tensor


@message("dniasync.dni.Done")
@dataclass(frozen=True)
class Done:
    """A group has finished with ``batch_id``: nothing more of it will be sent or kept there.

    The last group sends it after its forward; the others once the batch's
    gradient has come back (and was used, or found its batch evicted).
    """

    batch_id: int


@message("dniasync.dni.LossReport")
@dataclass(frozen=True)
class LossReport:
    """The last group's real loss on one batch."""

    batch_id: int
    loss: float
    correct: int
    count: int


@message("dniasync.dni.GroupDown")
@dataclass(frozen=True)
class GroupDown:
    """A group failed, stopped, or found a neighbour stopped."""

    address: str
    reason: str


@message("dniasync.dni.EvalForward")
@dataclass(frozen=True)
class EvalForward:
    """Ask: forward ``activations`` through the group's current weights, eval mode."""

    activations: torch.Tensor


@message("dniasync.dni.EvalOutput")
@dataclass(frozen=True)
class EvalOutput:
    """Reply to :class:`EvalForward`."""

    activations: torch.Tensor


@message("dniasync.dni.StatsRequest")
@dataclass(frozen=True)
class StatsRequest:
    """Ask: counters of a group, and its SG loss since the previous request."""


@message("dniasync.dni.GroupStats")
@dataclass(frozen=True)
class GroupStats:
    """Reply to :class:`StatsRequest`. Mean losses are NaN when nothing was recorded."""

    address: str
    steps: int
    sg_steps: int
    sg_loss: float
    input_steps: int
    input_loss: float
    evictions: int
    late_gradients: int
    sg_staleness_total: int = 0
    """Sum over SG fits of this group's own updates between the batch's forward and the fit (mean: / sg_steps)."""
    bytes_pushed: int = 0
    """Payload bytes of the gradients this group pushed to its PS shard (DNI x Downpour; else 0)."""
    bytes_pulled: int = 0
    """Payload bytes of the parameters this group pulled from its PS shard."""


@message("dniasync.dni.StateRequest")
@dataclass(frozen=True)
class StateRequest:
    """Ask: a copy of the group's parameters (tensors only, never pickled)."""


@message("dniasync.dni.GroupState")
@dataclass(frozen=True)
class GroupState:
    """Reply to :class:`StateRequest`: ``names[i]`` is the parameter of ``tensors[i]``."""

    names: list[str]
    tensors: list[torch.Tensor]


@message("dniasync.dni.TraceRequest")
@dataclass(frozen=True)
class TraceRequest:
    """Ask: the events this group recorded, in the order it handled them."""


@message("dniasync.dni.Trace")
@dataclass(frozen=True)
class Trace:
    """Reply to :class:`TraceRequest`: ``events[i]`` happened to ``batch_ids[i]``."""

    events: list[str]
    batch_ids: list[int]


# -- cutting a model into groups -------------------------------------------------


class GroupConfigError(ValueError):
    """A cut of a model into layer groups is invalid; the message names the problem."""


def validate_groups(groups: Sequence[Sequence[int]], n_layers: int) -> list[list[int]]:
    """Check that ``groups`` cut layers ``0..n_layers-1`` into contiguous, ordered groups.

    Returns the groups as lists. Raises :class:`GroupConfigError` naming the
    first problem found: no groups, an empty group, a non-integer or
    out-of-range index, a layer in two groups, a non-contiguous or out-of-order
    group, or layers left out.
    """
    if n_layers <= 0:
        raise GroupConfigError(f"the model has no layers to group (n_layers={n_layers})")
    if len(groups) == 0:
        raise GroupConfigError("no layer groups given")
    owner: dict[int, int] = {}
    result: list[list[int]] = []
    for gi, group in enumerate(groups):
        members = list(group)
        if not members:
            raise GroupConfigError(f"group {gi} is empty")
        for idx in members:
            if not isinstance(idx, int) or isinstance(idx, bool):
                raise GroupConfigError(f"group {gi}: layer index {idx!r} is not an integer")
            if not 0 <= idx < n_layers:
                raise GroupConfigError(
                    f"group {gi}: layer {idx} is out of range (the model has layers 0..{n_layers - 1})"
                )
            if idx in owner:
                where = "twice in group" if owner[idx] == gi else f"in group {owner[idx]} and in group"
                raise GroupConfigError(f"layer {idx} is {where} {gi}")
            owner[idx] = gi
        if members != list(range(members[0], members[0] + len(members))):
            raise GroupConfigError(f"group {gi} {members} is not a contiguous ascending run of layers")
        result.append(members)
    missing = sorted(set(range(n_layers)) - owner.keys())
    if missing:
        raise GroupConfigError(f"layers {missing} are in no group (the model has {n_layers} layers)")
    for gi in range(1, len(result)):
        if result[gi][0] != result[gi - 1][-1] + 1:
            raise GroupConfigError(
                f"groups are out of order: group {gi} {result[gi]} does not follow group {gi - 1} {result[gi - 1]}"
            )
    return result


def split_sequential(model: nn.Sequential, groups: Sequence[Sequence[int]]) -> list[nn.Sequential]:
    """Cut ``model`` into one ``nn.Sequential`` per group (sharing the layer objects)."""
    layers = list(model)
    checked = validate_groups(groups, len(layers))
    return [nn.Sequential(*(layers[i] for i in group)) for group in checked]


def _output_features(module: nn.Module, in_features: int) -> int:
    with torch.no_grad():
        out = module(torch.zeros(1, in_features))
    if out.dim() != 2:
        raise GroupConfigError(f"a layer group must output (batch, features), got shape {tuple(out.shape)}")
    return int(out.shape[1])


# -- settings and the small predictor networks -----------------------------------


@dataclass(frozen=True)
class DNISettings:
    """How layer groups train.

    ``mode``: ``"dni"`` (update at once from the synthetic gradient) or
    ``"sync"`` (the synchronous pipeline baseline: wait for the true gradient).
    ``conditioned`` feeds one-hot labels to the SG model (cDNI).
    ``synthetic_inputs``: groups after the first also learn to predict their
    input from the raw data and train on it before the real input arrives.
    ``cache_size`` bounds the batches a group keeps while their gradient is
    on its way back (DNI: outputs for SG training; sync: graphs).
    ``sg_fit_rows``: fit the SG model on the first this many rows of each
    returning batch (0: all). Batches are shuffled, so the rows are a random
    sample; fitting on half a batch of 128 halves the SG model's training cost
    for a small loss in accuracy (see ``benchmarks/bench_dni.py``).
    """

    mode: Literal["dni", "sync"] = "dni"
    lr: float = 1e-3
    optimizer: Literal["adam", "sgd"] = "adam"
    num_classes: int = 10
    conditioned: bool = False
    sg_hidden_layers: int = 1
    sg_hidden_width: int = 0
    """0: as wide as the activations."""
    sg_lr: float = 1e-4
    sg_fit_rows: int = 0
    synthetic_inputs: bool = False
    input_lr: float = 1e-3
    cache_size: int = 64
    trace: bool = False
    send_timeout_s: float = 30.0
    """A send that waits this long on a full mailbox is dropped and reported."""

    def __post_init__(self) -> None:
        if self.mode not in ("dni", "sync"):
            raise ValueError(f"mode must be 'dni' or 'sync', got {self.mode!r}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")
        if self.sg_hidden_layers < 0 or self.sg_hidden_width < 0 or self.sg_fit_rows < 0:
            raise ValueError("sg_hidden_layers, sg_hidden_width and sg_fit_rows must be >= 0")
        if self.send_timeout_s <= 0:
            raise ValueError(f"send_timeout_s must be > 0, got {self.send_timeout_s}")
        if self.cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {self.cache_size}")
        if self.conditioned and self.num_classes < 2:
            raise ValueError("cDNI needs num_classes >= 2")
        if self.synthetic_inputs and self.mode != "dni":
            raise ValueError("synthetic inputs need mode='dni'")


def _make_optimizer(params: list[nn.Parameter], kind: str, lr: float, *, fused: bool = False) -> torch.optim.Optimizer:
    """torch's Adam or SGD; ``fused``: its single-kernel Adam (same update, less time on small models)."""
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, fused=fused or None)
    return torch.optim.SGD(params, lr=lr)


def _mlp(in_features: int, out_features: int, hidden_layers: int, width: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    d = in_features
    for _ in range(hidden_layers):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, out_features))
    return nn.Sequential(*layers)


class _Regressor(nn.Module):
    """A small MLP fitted by MSE with its own optimizer; records its losses."""

    def __init__(self, net: nn.Sequential, lr: float, optimizer: str, history: int) -> None:
        super().__init__()
        self.net = net
        # an SG or input model is DNI's own overhead: its Adam runs fused (the layers' optimizer is torch's default,
        # as in the single-process backprop it is compared with)
        self.optimizer = _make_optimizer(list(net.parameters()), optimizer, lr, fused=True)
        self.losses: deque[float] = deque(maxlen=history)
        """The most recent training losses (bounded)."""
        self.steps = 0

    def _fit(self, x: torch.Tensor, target: torch.Tensor) -> float:
        pred = self.net(x)
        loss = F.mse_loss(pred, target.detach())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        value = float(loss.detach())
        self.losses.append(value)
        self.steps += 1
        return value


class SyntheticGradient(_Regressor):
    """``M(h) ≈ dL/dh``: predicts the gradient of the loss at a group's output.

    ``hidden_layers`` ReLU layers of ``hidden_width`` units (0 hidden layers:
    linear); with ``num_classes > 0`` the labels, one-hot, are appended to ``h``
    (cDNI). The output layer is zero-initialised, so before any training the
    synthetic gradient is exactly zero. Trained by :meth:`fit` (MSE, its own
    optimizer) on the gradient that arrives later from downstream.
    """

    def __init__(
        self,
        features: int,
        *,
        num_classes: int = 0,
        hidden_layers: int = 1,
        hidden_width: int = 0,
        lr: float = 1e-4,
        optimizer: str = "adam",
        history: int = 10_000,
    ) -> None:
        net = _mlp(features + num_classes, features, hidden_layers, hidden_width or features)
        last = net[-1]
        assert isinstance(last, nn.Linear)
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        super().__init__(net, lr, optimizer, history)
        self.features = features
        self.num_classes = num_classes

    def _inputs(self, h: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        if not self.num_classes:
            return h
        if labels is None:
            raise ValueError("a label-conditioned synthetic gradient (cDNI) needs the labels")
        onehot = F.one_hot(labels.long(), self.num_classes).to(h.dtype)
        return torch.cat([h, onehot], dim=1)

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The synthetic gradient for activations ``h`` (shape of ``h``)."""
        out: torch.Tensor = self.net(self._inputs(h, labels))
        return out

    def fit(self, h: torch.Tensor, labels: torch.Tensor | None, target: torch.Tensor) -> float:
        """One optimizer step of MSE regression of ``M(h)`` onto ``target``; returns the loss."""
        return self._fit(self._inputs(h.detach(), labels), target)


class SyntheticInput(_Regressor):
    """Predicts a group's input activations from the raw data (synthetic inputs)."""

    def __init__(
        self,
        raw_features: int,
        features: int,
        *,
        hidden_layers: int = 1,
        hidden_width: int = 0,
        lr: float = 1e-3,
        optimizer: str = "adam",
        history: int = 10_000,
    ) -> None:
        super().__init__(_mlp(raw_features, features, hidden_layers, hidden_width or features), lr, optimizer, history)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The predicted input activations for raw inputs ``x``."""
        out: torch.Tensor = self.net(x)
        return out

    def fit(self, x: torch.Tensor, target: torch.Tensor) -> float:
        """One MSE step towards the real activations ``target``; returns the loss."""
        return self._fit(x, target)


# -- building groups ---------------------------------------------------------------


@dataclass
class GroupSpec:
    """What a :class:`LayerGroup` is spawned with: ``spawn(LayerGroup, *spec.args())``."""

    layers: nn.Sequential
    settings: DNISettings
    in_features: int
    out_features: int
    raw_features: int
    last: bool
    seed: int
    sg: SyntheticGradient | None = field(default=None)

    def args(self) -> tuple[nn.Sequential, DNISettings, int, int, int, bool, int, SyntheticGradient | None]:
        return (
            self.layers,
            self.settings,
            self.in_features,
            self.out_features,
            self.raw_features,
            self.last,
            self.seed,
            self.sg,
        )


def build_layer_groups(
    model: nn.Sequential,
    groups: Sequence[Sequence[int]],
    settings: DNISettings,
    in_features: int,
    *,
    seed: int = 0,
) -> list[GroupSpec]:
    """Cut ``model`` and describe each group; raises :class:`GroupConfigError`."""
    parts = split_sequential(model, groups)
    specs = []
    features = in_features
    for k, part in enumerate(parts):
        out = _output_features(part, features)
        specs.append(GroupSpec(part, settings, features, out, in_features, k == len(parts) - 1, seed + 1000 * k))
        features = out
    return specs


V = TypeVar("V")


@dataclass
class _Kept:
    """What a group keeps of a batch until its gradient returns (``h_in`` only in sync mode)."""

    h_in: torch.Tensor | None
    h_out: torch.Tensor
    labels: torch.Tensor
    step_id: int
    parts: int
    at_step: int = 0
    """The group's update count when the batch went forward (DNI: the SG fit's staleness is measured from it)."""


# -- the actor ---------------------------------------------------------------------


class LayerGroup(Actor):
    """One layer group of a DNI (or synchronous) pipeline.

    Constructed with its layers and settings; wired to its neighbours and to
    the pipeline's monitor by a :class:`Connect` message. Handles
    :class:`Forward`, :class:`Gradient`, :class:`RawInput` (tells) and
    :class:`EvalForward`, :class:`StatsRequest`, :class:`StateRequest`,
    :class:`TraceRequest` (asks). Torch work runs on the system's blocking
    threads so the event loop keeps serving other actors.

    Its mailbox bounds the batches queued at it. A batch is in flight until
    every group has sent :class:`Done` for it; each in-flight batch puts at
    most one forward, one gradient and one raw input in a group's mailbox, so
    a driver keeping at most W batches in flight never blocks a group on a full
    mailbox (and no cycle of full mailboxes can deadlock) when
    ``mailbox_size >= 2 * W`` (``3 * W`` with synthetic inputs).
    """

    mailbox_size = 64

    def __init__(
        self,
        layers: nn.Sequential,
        settings: DNISettings,
        in_features: int,
        out_features: int,
        raw_features: int,
        last: bool,
        seed: int = 0,
        sg: SyntheticGradient | None = None,
    ) -> None:
        self.layers = layers
        self.settings = settings
        self.last = last
        if settings.mode == "dni":
            # A true gradient is the SG model's training target: the sooner it is fitted, the fresher the
            # synthetic gradients of the forwards queued behind it. The synchronous pipeline keeps arrival
            # order (all forwards of a step, then their backwards, as GPipe does).
            self.urgent_messages = (Gradient,)
        self.optimizer = _make_optimizer(list(layers.parameters()), settings.optimizer, settings.lr)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.sg: SyntheticGradient | None = None
            if not last and settings.mode == "dni":
                self.sg = sg or SyntheticGradient(
                    out_features,
                    num_classes=settings.num_classes if settings.conditioned else 0,
                    hidden_layers=settings.sg_hidden_layers,
                    hidden_width=settings.sg_hidden_width,
                    lr=settings.sg_lr,
                    optimizer=settings.optimizer,
                )
        self.input_model: SyntheticInput | None = None
        self._input_features = in_features
        self._raw_features = raw_features
        self._seed = seed
        self.upstream: ActorRef | None = None
        self.downstream: ActorRef | None = None
        self.monitor: ActorRef | None = None
        # batches whose gradient is on its way back: DNI keeps outputs for SG training, sync the graphs
        self._outputs: OrderedDict[int, _Kept] = OrderedDict()
        self._raw: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._parts_done: dict[int, int] = {}
        self.steps = 0
        self.evictions = 0
        self.late_gradients = 0
        self.staleness_sum = 0
        """Updates between each batch's forward and its SG fit, summed over the fits (their count: ``sg.steps``)."""
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
        if self.settings.synthetic_inputs and self.upstream is not None and self.input_model is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self._seed + 1)
                self.input_model = SyntheticInput(
                    self._raw_features,
                    self._input_features,
                    lr=self.settings.input_lr,
                    optimizer=self.settings.optimizer,
                )

    def _trace(self, event: str, batch_id: int) -> None:
        if self.settings.trace:
            self._events.append(event)
            self._event_batches.append(batch_id)

    def _report_down(self, address: str, reason: str) -> None:
        if self.monitor is None:
            return
        try:
            self.monitor.tell_nowait(GroupDown(address, reason))
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
        track_layer_group(self.system, self)

    async def on_failure(self, exc: BaseException) -> None:
        self._report_down(self.ref.address, f"failed: {exc!r}")

    async def on_stop(self) -> None:
        self._report_down(self.ref.address, "stopped")

    def _keep(self, cache: OrderedDict[int, V], batch_id: int, value: V) -> None:
        cache[batch_id] = value
        while len(cache) > self.settings.cache_size:
            cache.popitem(last=False)
            self.evictions += 1

    def _count_part(self, step_id: int, parts: int) -> tuple[bool, bool]:
        """Count one micro-batch of ``step_id``: (is it the first, is it the last)."""
        part = self._parts_done.get(step_id, 0) + 1
        if part >= parts:
            self._parts_done.pop(step_id, None)
        else:
            self._parts_done[step_id] = part
        return part == 1, part >= parts

    # -- torch work (runs on a blocking thread) ------------------------------------
    def _forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h_in = x.detach().requires_grad_(self.upstream is not None)
        h_out: torch.Tensor = self.layers(h_in)
        return h_in, h_out

    def _backward(self, h_in: torch.Tensor, h_out: torch.Tensor, grad: torch.Tensor, *, zero: bool, step: bool) -> torch.Tensor | None:
        if zero:
            self.optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(h_out, grad)
        if step:
            self.optimizer.step()
            self.steps += 1
        return h_in.grad.detach() if h_in.grad is not None else None

    def _synthetic_update(self, h_in: torch.Tensor, h_out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        assert self.sg is not None
        with torch.no_grad():
            grad = self.sg(h_out.detach(), labels)
        return self._backward(h_in, h_out, grad, zero=True, step=True)

    def _loss_update(
        self, h_in: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, weight: float, zero: bool, step: bool
    ) -> tuple[torch.Tensor | None, float, int]:
        loss = F.cross_entropy(logits, labels.long())
        if zero:
            self.optimizer.zero_grad(set_to_none=True)
        (loss * weight).backward()  # type: ignore[no-untyped-call]
        if step:
            self.optimizer.step()
            self.steps += 1
        correct = int((logits.detach().argmax(dim=1) == labels).sum())
        grad_in = h_in.grad.detach() if h_in.grad is not None else None
        return grad_in, float(loss.detach()), correct

    def _synthetic_input_step(self, x: torch.Tensor, labels: torch.Tensor) -> None:
        assert self.input_model is not None
        with torch.no_grad():
            h_in = self.input_model(x)
        h_out: torch.Tensor = self.layers(h_in)
        if self.last:
            self._loss_update(h_in, h_out, labels, 1.0, True, True)
        else:
            self._synthetic_update(h_in, h_out, labels)

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
        started = time.perf_counter()
        self._trace("forward", b)
        if self.input_model is not None:
            raw = self._raw.pop(b, None)
            if raw is not None:
                await self.run_blocking(self.input_model.fit, raw, msg.activations)
        h_in, h_out = await self.run_blocking(self._forward, msg.activations)
        if not self.last:
            out = Forward(b, msg.step_id, msg.parts, msg.weight, h_out.detach(), msg.labels)
            if await self._send(self.downstream, out):
                self._trace("sent_downstream", b)
        if self.last:
            first, done = self._count_part(msg.step_id, msg.parts)
            grad_in, loss, correct = await self.run_blocking(
                self._loss_update, h_in, h_out, msg.labels, msg.weight, first, done
            )
            self._trace("update" if done else "accumulate", b)
            await self._send(self.monitor, LossReport(b, loss, correct, int(msg.labels.shape[0])))
            await self._pass_upstream(b, grad_in)
            await self._send(self.monitor, Done(b))
        elif self.settings.mode == "dni":
            grad_in = await self.run_blocking(self._synthetic_update, h_in, h_out, msg.labels)
            self._trace("update", b)
            kept = _Kept(None, h_out.detach(), msg.labels, msg.step_id, msg.parts, self.steps)
            self._keep(self._outputs, b, kept)
            await self._pass_upstream(b, grad_in)
        else:
            # sync: keep the graph until the true gradient comes back
            self._keep(self._outputs, b, _Kept(h_in, h_out, msg.labels, msg.step_id, msg.parts))
        self.forwards += 1
        self.forward_seconds += time.perf_counter() - started

    async def _pass_upstream(self, batch_id: int, grad_in: torch.Tensor | None) -> None:
        if self.upstream is None:
            return
        assert grad_in is not None
        if await self._send(self.upstream, Gradient(batch_id, grad_in)):
            self._trace("sent_upstream", batch_id)

    @handler
    async def gradient(self, msg: Gradient) -> None:
        b = msg.batch_id
        self._trace("gradient", b)
        entry = self._outputs.pop(b, None)
        if entry is None:
            self.late_gradients += 1
            if self.settings.mode == "sync":  # the graph is gone: this step can never complete
                raise RuntimeError(
                    f"batch {b}: graph evicted before its gradient came back (cache_size={self.settings.cache_size} "
                    "is smaller than the micro-batches in flight)"
                )
            await self._send(self.monitor, Done(b))
            return
        if entry.h_in is None:  # DNI: the gradient is the SG model's target
            assert self.sg is not None
            self.staleness_sum += self.steps - entry.at_step
            rows = self.settings.sg_fit_rows or None
            await self.run_blocking(self.sg.fit, entry.h_out[:rows], entry.labels[:rows], msg.gradient[:rows])
            self._trace("sg_step", b)
            await self._send(self.monitor, Done(b))
            return
        first, done = self._count_part(entry.step_id, entry.parts)
        grad_in = await self.run_blocking(self._backward, entry.h_in, entry.h_out, msg.gradient, zero=first, step=done)
        self._trace("update" if done else "accumulate", b)
        await self._pass_upstream(b, grad_in)
        await self._send(self.monitor, Done(b))

    @handler
    async def raw_input(self, msg: RawInput) -> None:
        if self.input_model is None:
            return
        self._trace("synthetic_input", msg.batch_id)
        self._keep(self._raw, msg.batch_id, msg.inputs)
        await self.run_blocking(self._synthetic_input_step, msg.inputs, msg.labels)
        self._trace("update", msg.batch_id)

    @handler
    async def evaluate(self, msg: EvalForward) -> EvalOutput:
        return EvalOutput(await self.run_blocking(self._eval, msg.activations))

    @handler
    def stats(self, msg: StatsRequest) -> GroupStats:
        sg_loss, self._sg_seen = _mean_since(self.sg, self._sg_seen)
        input_loss, self._input_seen = _mean_since(self.input_model, self._input_seen)
        return GroupStats(
            self.ref.address,
            self.steps,
            self.sg.steps if self.sg is not None else 0,
            sg_loss,
            self.input_model.steps if self.input_model is not None else 0,
            input_loss,
            self.evictions,
            self.late_gradients,
            self.staleness_sum,
        )

    @handler
    def state(self, msg: StateRequest) -> GroupState:
        names, tensors = [], []
        for name, tensor in self.layers.state_dict().items():
            names.append(name)
            tensors.append(tensor.detach().clone())
        return GroupState(names, tensors)

    @handler
    def trace(self, msg: TraceRequest) -> Trace:
        return Trace(list(self._events), list(self._event_batches))


def _mean_since(model: _Regressor | None, seen: int) -> tuple[float, int]:
    """Mean of the losses ``model`` recorded after step ``seen``; NaN if none."""
    if model is None or model.steps == seen:
        return float("nan"), seen
    fresh = min(model.steps - seen, len(model.losses))
    recent = list(model.losses)[-fresh:]
    return sum(recent) / len(recent), model.steps
