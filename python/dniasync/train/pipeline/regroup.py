"""Dynamic layer regrouping: where the split between stages should be, and moving layers to get there.

Three parts, each usable on its own:

- **Estimates** (:class:`StageCosts`): every stage reports, per batch, the
  time each of its layers took (forward plus backward, measured per layer on
  the stage) and its whole *busy* time (everything it did for the batch: the
  layers, the optimizer step, SpecTrain's prediction, SG work, sends). The
  calibration gives each layer a *cost*: its own time scaled by its stage's
  busy-to-layers ratio, so what a stage spends around its layers moves with
  them. Afterwards a stage's busy time over the calibrated cost of its layers
  is that stage's *slowness* (1.0 as calibrated, 2.0 on a process that now
  runs at half speed, whatever part of the work the slowdown hits). A split's
  predicted stage time is ``slowness × Σ cost`` over its layers, smoothed by an
  exponential moving average so one noisy batch does not move a layer.
- **Policy** (:class:`RegroupPolicy`, :data:`POLICIES`): given the estimates,
  propose new groups or nothing. ``balance`` (the default) picks the split that
  minimises the slowest stage's predicted time (the pipeline's throughput is
  one batch per slowest stage) and proposes it when the predicted gain passes
  ``min_gain``.
- **Transfer** (:func:`pack_layers`, :func:`unpack_layers`): a layer's weights,
  buffers and optimizer state as a flat ``{name: tensor}`` bundle, what travels
  between two stages over the wire, and its inverse on the receiving stage.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn

from .cut import example_input

__all__ = [
    "POLICIES",
    "BalancePolicy",
    "LayerClock",
    "Proposal",
    "RegroupPolicy",
    "Regrouper",
    "StageCosts",
    "best_split",
    "bottleneck",
    "drop_from_optimizer",
    "get_policy",
    "moved_layers",
    "pack_layers",
    "profile_layers",
    "unpack_layers",
]

Groups = tuple[tuple[int, ...], ...]


def _as_groups(groups: Iterable[Iterable[int]]) -> Groups:
    return tuple(tuple(g) for g in groups)


def bottleneck(groups: Sequence[Sequence[int]], costs: Sequence[float], slowness: Sequence[float]) -> float:
    """The slowest stage's predicted time per batch: ``max_s slowness[s] × Σ costs`` of its layers."""
    return max(slowness[s] * sum(costs[i] for i in group) for s, group in enumerate(groups))


def best_split(costs: Sequence[float], slowness: Sequence[float]) -> tuple[Groups, float]:
    """The contiguous split of ``len(costs)`` layers into ``len(slowness)`` non-empty stages with the
    smallest bottleneck, and that bottleneck.

    Dynamic programming over (stages, layers): ``O(stages × layers²)``, exact;
    ties go to the split that moves the boundaries least far right (stable).
    """
    n, k = len(costs), len(slowness)
    if k < 1 or n < k:
        raise ValueError(f"cannot split {n} layers into {k} non-empty stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[s][j]: smallest bottleneck of the first j layers in stages 0..s; cut[s][j]: where stage s starts
    best = [[math.inf] * (n + 1) for _ in range(k)]
    cut = [[0] * (n + 1) for _ in range(k)]
    for j in range(1, n + 1):
        best[0][j] = slowness[0] * prefix[j]
    for s in range(1, k):
        for j in range(s + 1, n + 1):
            for start in range(s, j):
                value = max(best[s - 1][start], slowness[s] * (prefix[j] - prefix[start]))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, start
    bounds = [n]
    for s in range(k - 1, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    return tuple(tuple(range(bounds[s], bounds[s + 1])) for s in range(k)), best[k - 1][n]


def moved_layers(old: Sequence[Sequence[int]], new: Sequence[Sequence[int]]) -> dict[int, tuple[int, int]]:
    """Every layer whose stage changes: ``{layer: (old stage, new stage)}``."""
    where_old = {i: s for s, g in enumerate(old) for i in g}
    return {i: (where_old[i], s) for s, g in enumerate(new) for i in g if where_old[i] != s}


@dataclass
class StageCosts:
    """Smoothed per-layer costs and per-stage slowness, from the times stages report.

    ``smoothing`` is the weight of a new report in the moving average (1.0:
    only the latest counts).
    """

    n_layers: int
    smoothing: float = 0.3
    costs: list[float] | None = None
    """Calibrated cost per layer (seconds per batch on an unloaded stage); ``None`` until calibrated."""
    slowness: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")

    def calibrate(self, layer_seconds: Mapping[int, float], overhead: Mapping[int, float] | None = None) -> None:
        """Set every layer's cost from one measurement of all of them (the stages' calibration reports).

        ``overhead[i]`` scales layer ``i``'s time: its stage's busy time over its layers' times when it was
        measured (1.0 where not given), so a layer's cost carries its share of the optimizer step, the
        prediction and the messaging around it.
        """
        missing = sorted(set(range(self.n_layers)) - layer_seconds.keys())
        if missing:
            raise ValueError(f"no time measured for layers {missing}")
        factor = overhead or {}
        floor = max(max(layer_seconds.values()) * 1e-6, 1e-9)  # a layer never costs nothing: keeps slowness finite
        self.costs = [max(float(layer_seconds[i]) * factor.get(i, 1.0), floor) for i in range(self.n_layers)]

    def report(self, stage: int, layer_seconds: Mapping[int, float], busy_s: float | None = None) -> None:
        """A stage's measured time per batch for each of its layers, and its whole busy time per batch (when
        measured; else the sum of its layers' is used, as the calibration must have been)."""
        if self.costs is None:
            return
        expected = sum(self.costs[i] for i in layer_seconds)
        if expected <= 0.0:
            return
        measured = busy_s if busy_s is not None and busy_s > 0.0 else sum(layer_seconds.values())
        ratio = measured / expected
        old = self.slowness.get(stage)
        self.slowness[stage] = ratio if old is None else old + self.smoothing * (ratio - old)

    def stage_slowness(self, n_stages: int) -> list[float]:
        return [self.slowness.get(s, 1.0) for s in range(n_stages)]

    def forget_slowness(self) -> None:
        """After a move a stage's slowness is measured afresh (its layers changed under it)."""
        self.slowness.clear()


@dataclass(frozen=True)
class Proposal:
    """New groups, and why: the bottleneck now and the one predicted after the move."""

    groups: Groups
    bottleneck_now_s: float
    bottleneck_after_s: float

    @property
    def gain(self) -> float:
        """Predicted throughput gain: ``now / after − 1`` (0.25 = 25 % more batches per second)."""
        return self.bottleneck_now_s / self.bottleneck_after_s - 1.0 if self.bottleneck_after_s > 0 else 0.0


class RegroupPolicy(Protocol):
    """Decides whether and where to move the split; the job runner applies the cool-down and move budget."""

    @property
    def name(self) -> str: ...

    def propose(self, groups: Sequence[Sequence[int]], estimates: StageCosts) -> Proposal | None: ...


@dataclass(frozen=True)
class BalancePolicy:
    """Propose the split with the smallest predicted bottleneck when it beats today's by ``min_gain``."""

    min_gain: float = 0.1
    name: str = "balance"

    def propose(self, groups: Sequence[Sequence[int]], estimates: StageCosts) -> Proposal | None:
        if estimates.costs is None:
            return None
        slowness = estimates.stage_slowness(len(groups))
        now = bottleneck(groups, estimates.costs, slowness)
        split, after = best_split(estimates.costs, slowness)
        proposal = Proposal(split, now, after)
        if split == _as_groups(groups) or proposal.gain < self.min_gain:
            return None
        return proposal


POLICIES: dict[str, type[BalancePolicy]] = {"balance": BalancePolicy}
"""Regrouping policies by their ``[regroup] policy`` name."""


def get_policy(name: str, *, min_gain: float) -> RegroupPolicy:
    """The policy ``name`` with its threshold; unknown names fail listing the known ones."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown regroup policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return cls(min_gain=min_gain)


@dataclass
class Regrouper:
    """The job runner's side of regrouping: smoothed estimates in, at most one move per cool-down out.

    Stages :meth:`observe` their per-layer and busy times; the runner asks
    :meth:`decide` on its tick. Each stage's first ``warmup_reports`` after the
    start and after every move are ignored (those batches pay for allocation
    and caches). The mean of the next ``calibration_reports`` of every stage
    calibrates the layers' costs, every stage's slowness being 1.0 by
    definition then, and the policy may act at once. ``max_moves`` bounds the moves of a whole run (0: no bound). After
    a move the slowness is measured afresh and the cool-down starts from the
    moment the move was applied.
    """

    groups: Groups
    policy: RegroupPolicy
    cooldown_s: float
    max_moves: int = 0
    smoothing: float = 0.3
    warmup_reports: int = 1
    calibration_reports: int = 2
    moves: int = 0
    _estimates: StageCosts = field(init=False)
    _reports: dict[int, int] = field(init=False, default_factory=dict)
    _pending: dict[int, dict[int, list[float]]] = field(init=False, default_factory=dict)
    _pending_overhead: dict[int, list[float]] = field(init=False, default_factory=dict)
    _quiet_until: float = field(init=False, default=-math.inf)

    def __post_init__(self) -> None:
        self.groups = _as_groups(self.groups)
        self._estimates = StageCosts(sum(len(g) for g in self.groups), self.smoothing)

    @property
    def estimates(self) -> StageCosts:
        return self._estimates

    def observe(self, stage: int, layer_seconds: Mapping[int, float], busy_s: float | None = None) -> None:
        """A stage's latest per-layer seconds per batch and, when measured, its whole busy seconds per batch
        (reports naming layers the stage no longer has are stale, from before a move, and ignored)."""
        if not layer_seconds or set(layer_seconds) != set(self.groups[stage]):
            return
        self._reports[stage] = self._reports.get(stage, 0) + 1
        if self._reports[stage] <= self.warmup_reports:
            return
        if self._estimates.costs is not None:
            self._estimates.report(stage, layer_seconds, busy_s)
            return
        pending = self._pending.setdefault(stage, {})
        for i, t in layer_seconds.items():
            pending.setdefault(i, []).append(t)
        layers = sum(layer_seconds.values())
        self._pending_overhead.setdefault(stage, []).append(
            busy_s / layers if busy_s is not None and busy_s > 0.0 and layers > 0.0 else 1.0)
        rounds = [min((len(ts) for ts in self._pending.get(k, {}).values()), default=0)
                  for k in range(len(self.groups))]
        if min(rounds) < self.calibration_reports:
            return
        overhead = {i: sum(self._pending_overhead[k]) / len(self._pending_overhead[k])
                    for k, group in enumerate(self.groups) for i in group}
        self._estimates.calibrate({i: sum(ts) / len(ts) for times in self._pending.values()
                                   for i, ts in times.items()}, overhead)
        self._estimates.slowness = dict.fromkeys(range(len(self.groups)), 1.0)
        self._pending.clear()
        self._pending_overhead.clear()

    def decide(self, now: float) -> Proposal | None:
        """A move to make now, or ``None``: cooling down, out of moves, not every stage measured since the
        calibration or the last move, or no gain worth it."""
        if now < self._quiet_until or (self.max_moves and self.moves >= self.max_moves):
            return None
        if len(self._estimates.slowness) < len(self.groups):
            return None
        return self.policy.propose(self.groups, self._estimates)

    def applied(self, groups: Sequence[Sequence[int]], now: float) -> None:
        """The move to ``groups`` is done (or a split was set by hand): count it and start the cool-down."""
        self.groups = _as_groups(groups)
        self.moves += 1
        self._estimates.forget_slowness()
        self._reports.clear()
        self._quiet_until = now + self.cooldown_s

    def hold(self, now: float) -> None:
        """Start a cool-down without a move (e.g. when a proposed split cannot be applied)."""
        self._quiet_until = now + self.cooldown_s


# ---- measuring ---------------------------------------------------------------------------------------------------


class LayerClock:
    """Per-layer forward and backward time of a stage's layers, measured with hooks, whatever the update rule.

    Forward: a pre-hook and a hook on every layer (in training mode only, so
    evaluations do not count). Backward: a hook on each layer's output
    gradient marks when that layer's backward starts, which is when the layer
    below it finished; the stage calls :meth:`backward_done` after each
    backward, which ends the first layer's. Rules that recompute a batch's
    forward pay for it twice, and that is counted: :meth:`take` gives the
    seconds per *trained* batch of each layer.
    """

    def __init__(self, layers: nn.Sequential, first_index: int, *, clock: Callable[[], float] = time.perf_counter):
        self.first_index = first_index
        self._clock = clock
        self._seconds = [0.0] * len(layers)
        self._batches = 0
        self._started = 0.0
        self._last: tuple[int, float] | None = None  # (layer whose backward is running, since when)
        self.busy_seconds = 0.0
        """Wall seconds the stage spent handling training messages with these layers (it adds them)."""
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        for k, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._before))
            self._handles.append(layer.register_forward_hook(partial(self._after, k)))

    def _before(self, module: nn.Module, args: Any) -> None:
        self._started = self._clock()

    def _after(self, k: int, module: nn.Module, args: Any, output: Any) -> None:
        if not module.training:
            return
        self._seconds[k] += self._clock() - self._started
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(partial(self._grad_at, k))  # type: ignore[no-untyped-call]

    def _grad_at(self, k: int, grad: torch.Tensor) -> None:
        now = self._clock()
        if self._last is not None and self._last[0] == k + 1:
            self._seconds[k + 1] += now - self._last[1]
        self._last = (k, now)

    def backward_done(self) -> None:
        """One batch's backward through these layers has returned (ignored once closed)."""
        if not self._handles:
            return
        if self._last is not None and self._last[0] == 0:
            self._seconds[0] += self._clock() - self._last[1]
        self._last = None
        self._batches += 1

    def totals(self) -> tuple[list[float], int]:
        """Seconds spent on each layer (first to last) since the clock started, and the batches trained."""
        return list(self._seconds), self._batches

    def take(self) -> dict[int, float]:
        """Seconds per trained batch of each layer (by model index) since the last take; empty if none trained."""
        if self._batches == 0:
            return {}
        out = {self.first_index + k: s / self._batches for k, s in enumerate(self._seconds)}
        self._seconds = [0.0] * len(self._seconds)
        self._batches = 0
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def profile_layers(
    model: nn.Sequential, in_shape: Sequence[int], batch_size: int, *, batches: int = 20, warmup: int = 3,
    num_classes: int | None = None,
) -> dict[int, float]:
    """Every layer's forward + backward seconds per batch of ``batch_size``, measured in this process on random
    inputs (the one-shot profile that picks a first split before training). The model's weights are left as they
    were (no optimizer step); its gradients are cleared."""
    gen = torch.Generator().manual_seed(0)
    x = example_input(model, batch_size, in_shape, generator=gen)
    clock = LayerClock(model, 0)
    was_training = model.training
    model.train()
    try:
        for i in range(warmup + batches):
            if i == warmup:
                clock.take()
            out = model(x)
            if num_classes is not None:
                labels = torch.randint(0, num_classes, (batch_size,), generator=gen)
                nn.functional.cross_entropy(out, labels).backward()  # type: ignore[no-untyped-call]
            else:
                out.sum().backward()
            clock.backward_done()
        return clock.take()
    finally:
        clock.close()
        model.zero_grad(set_to_none=True)
        model.train(was_training)


# ---- moving layers between stages -------------------------------------------------------------------------------

_STATE = "@"
"""Separates a parameter's name from one of its optimizer-state entries in a bundle key."""


def pack_layers(layers: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """The weights, buffers and optimizer state of ``layers`` (by model index) as ``{name: tensor}`` copies.

    Keys: ``"3/weight"`` for layer 3's state-dict entry ``weight``;
    ``"3/weight@exp_avg"`` for its optimizer state (non-tensor state such as a
    step count becomes a 0-d tensor). The bundle holds copies: the sending
    stage may drop the layers at once.
    """
    bundle: dict[str, torch.Tensor] = {}
    for index, module in layers.items():
        for name, value in module.state_dict().items():
            bundle[f"{index}/{name}"] = value.detach().clone()
        if optimizer is None:
            continue
        for name, param in module.named_parameters():
            for key, value in optimizer.state.get(param, {}).items():
                tensor = value.detach().clone() if isinstance(value, torch.Tensor) else torch.tensor(value)
                bundle[f"{index}/{name}{_STATE}{key}"] = tensor
    return bundle


def unpack_layers(
    bundle: Mapping[str, torch.Tensor], layers: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer | None
) -> None:
    """Load ``bundle`` into ``layers`` (fresh modules of the same kind) and register their parameters, with
    their optimizer state, in ``optimizer``'s first parameter group.

    Raises ``ValueError`` naming the first key the bundle lacks or has too many of.
    """
    known: set[str] = set()
    for index, module in layers.items():
        own = {name: bundle[f"{index}/{name}"] for name in module.state_dict() if f"{index}/{name}" in bundle}
        missing = sorted(set(module.state_dict()) - own.keys())
        if missing:
            raise ValueError(f"the bundle lacks layer {index}'s {missing[0]!r}")
        module.load_state_dict(own)
        known.update(f"{index}/{name}" for name in own)
        if optimizer is None:
            continue
        params = []
        for name, param in module.named_parameters():
            prefix = f"{index}/{name}{_STATE}"
            state = {key[len(prefix):]: value.clone() for key, value in bundle.items() if key.startswith(prefix)}
            known.update(prefix + key for key in state)
            if state:
                optimizer.state[param] = state
            params.append(param)
        optimizer.param_groups[0]["params"].extend(params)
    extra = sorted(set(bundle) - known)
    if extra:
        raise ValueError(f"the bundle holds {extra[0]!r}, which belongs to none of layers {sorted(layers)}")


def drop_from_optimizer(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> None:
    """Forget ``params`` (of layers that moved away) in ``optimizer``: their state and their group slots."""
    gone = {id(p) for p in params}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in gone]
    for param in [p for p in optimizer.state if id(p) in gone]:
        del optimizer.state[param]
