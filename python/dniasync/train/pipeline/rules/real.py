"""Asynchronous pipelines with real gradients (1F1B): a stage updates as soon as a batch's true gradient is back.

Many batches are in flight and no stage waits, so between a batch's forward
at a stage and its backward there the stage updates ``gap`` times (its
*version gap*; the stage counts it for every batch as its staleness). The
rules differ in the weights a batch meets:

- ``async`` (:class:`AsyncRule`): no correction. The forward meets the
  weights of its moment; the backward (the forward run again on the kept
  input) those of the gradient's return: the gradient of another function
  than the one that went forward.
- ``stash`` (:class:`StashRule`, PipeDream's weight stashing, Narayanan et al.
  2019): the weights the forward met are kept, one copy per weight version
  shared by the batches that met it, and the batch's own graph is
  back-propagated: a consistent but stale gradient, applied to the current
  weights. The copies cost memory, reported per stage.
- ``spectrain`` (:class:`SpecTrainRule`, Chen et al. 2018): the forward meets
  the weights predicted for its gradient's return, ``Ŵ = W − s·lr·v``; the
  backward meets the current weights (the forward runs again on them).
- ``spectrain_stash`` (:class:`SpecTrainStashRule`, ours): the same forward
  on ``Ŵ``, and the batch's own graph back-propagated, as ``stash`` does: the
  gradient at the predicted weights rather than at the current ones, which
  differ by the prediction error, for no second forward. Each batch in flight
  keeps its ``Ŵ`` (reported as stash bytes).

SpecTrain measures its prediction on one batch in :data:`PROBE_EVERY` (two
weight copies while it is in flight): when the batch's gradient is back it
compares the weights predicted for it, ``Ŵ``, and those its forward would
have met unpredicted, ``W_fwd``, with the weights actually there, ``W``:
``|Ŵ − W|`` (the prediction error) and ``|W_fwd − W|`` (the error without
prediction, async's), means over the probes in :meth:`SpecTrainRule.diagnostics`.

SpecTrain's version gap, here. A stage steps the moment a gradient is back,
so the backward's gap is 0 (the reference implementation's ``⌊r/2⌋`` for the
backward, and the same term in its forward gap ``⌊r/2⌋ + N − r − 1``, count
the round-robin delay of its own schedule before an update lands, which this
pipeline does not have). The forward's gap is the number of updates the stage
makes while the batch is downstream: ``s`` is the mean gap the stage measured
over its last :data:`GAP_WINDOW` batches, so it follows the in-flight count
the driver actually runs (``max_in_flight``) and where the queues form. Until
a gap is measured it is the 1F1B count: ``W − 1`` at the first stage (the
driver admits a batch when one of the ``W`` finished, and the first stage is
the last to finish with each), ``min(W − 1, N − r − 1)`` at stage ``r`` of
``N``, 0 at the last (its loss gives the gradient at once).

``v``: with SGD, torch's momentum buffer (``buf = μ·buf + g``; each step
moves ``lr·buf``, so ``s`` steps move about ``s·lr·buf``: the paper's
smoothed gradient in torch's convention). With Adam, the current Adam step
direction ``m̂ / (√v̂ + ε)`` (our extension; the paper predicts for momentum
SGD only).

With PS shards (replicated pipelines, SpecTrain x Downpour; our extension) the
stage steps no optimizer: it pushes its gradients and pulls the weights, which
move by every replica's pushes and the shards' optimizer, whatever it is. It
predicts from the weights' own velocity instead (:class:`WeightVelocity`):
``Ŵ = W + s·u``, ``u`` the change of the weights per step of the stage, seen
at each pull and smoothed, and ``s`` the same measured gap, in the stage's
own steps.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import ClassVar, Final

import torch
from torch import nn
from torch.func import functional_call

from ..protocol import Forward, Gradient
from ..settings import StageSettings, StageShape
from .base import Kept, Outcome, StageContext, TrueGradientRule

__all__ = [
    "GAP_WINDOW",
    "PROBE_EVERY",
    "AsyncRule",
    "SpecTrainRule",
    "SpecTrainStashRule",
    "StashRule",
    "VELOCITY_SMOOTHING",
    "WeightVelocity",
    "predict_weights",
    "prior_gap",
]

GAP_WINDOW: Final = 32
"""SpecTrain predicts with the mean version gap of this many recent batches."""
PROBE_EVERY: Final = 16
"""SpecTrain measures its prediction error on one batch in this many."""
VELOCITY_SMOOTHING: Final = 0.9
"""The weight of the past in :class:`WeightVelocity`'s moving average of the observed velocities (see there)."""


@contextmanager
def _frozen_running_stats(layers: nn.Module) -> Iterator[None]:
    """Normalisation layers use their batch statistics but leave the running ones alone (a recomputed forward)."""
    norms = [m for m in layers.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    saved = [(m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()) for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(norms, saved):
            m.momentum = momentum
            if tracked is not None and m.num_batches_tracked is not None:
                m.num_batches_tracked.copy_(tracked)


def _input(stage: StageContext, h_in: torch.Tensor) -> torch.Tensor:
    return h_in.detach().requires_grad_(stage.upstream is not None)


class _RealGradientRule(TrueGradientRule):
    """Keep what the batch's backward needs; back-propagate its true gradient and step at once (1F1B)."""

    # 1F1B: a returning gradient goes before the forwards queued at the stage
    urgent_gradients: ClassVar[bool] = True

    async def after_forward(
        self, stage: StageContext, msg: Forward, h_in: torch.Tensor, h_out: torch.Tensor
    ) -> Outcome:
        # the input only: the weights will have moved when the gradient is back, the forward runs again
        return Outcome(keep=Kept(h_in.detach(), h_out.detach(), msg.labels, msg.step_id, msg.parts, stage.steps))

    async def on_gradient(self, stage: StageContext, kept: Kept, msg: Gradient) -> Outcome:
        assert kept.h_in is not None
        grad_in = await stage.run_blocking(self._recompute_backward, stage, kept.h_in, msg.gradient)
        return Outcome("update", upstream=grad_in, done=True)

    @staticmethod
    def _recompute_backward(stage: StageContext, h_in: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
        """The forward again on the current weights, back-propagated and stepped."""
        x = _input(stage, h_in)
        with _frozen_running_stats(stage.layers):
            out: torch.Tensor = stage.layers(x)
        return stage.backward(x, out, grad, zero=True, step=True)


class AsyncRule(_RealGradientRule):
    """No correction: forward on the weights of its moment, backward on those of the gradient's return."""

    recomputes: ClassVar[bool] = True


class StashRule(_RealGradientRule):
    """PipeDream weight stashing: a batch's backward runs on the very weights (and graph) of its forward.

    One copy per weight version, shared by every batch that met it, freed when
    the last of them is back. :meth:`stash_bytes` gives the bytes held now and
    at most so far.
    """

    def __init__(self, settings: StageSettings, shape: StageShape) -> None:
        super().__init__(settings, shape)
        self._current: tuple[int, dict[str, torch.Tensor]] | None = None
        self._versions: dict[int, tuple[dict[str, torch.Tensor], int]] = {}
        """version -> (its weights, batches that met it and are not back)"""
        self._batch_version: dict[int, int] = {}
        self._bytes = 0
        self._peak_bytes = 0

    async def forward_weights(self, stage: StageContext, msg: Forward) -> Mapping[str, torch.Tensor] | None:
        if stage.last:  # its loss gives the gradient at once: no version gap
            return None
        version = stage.steps
        if self._current is None or self._current[0] != version:
            with torch.no_grad():
                weights = {n: p.detach().clone().requires_grad_(True) for n, p in stage.layers.named_parameters()}
            self._current = (version, weights)
        weights = self._current[1]
        held, users = self._versions.get(version, (weights, 0))
        if users == 0:
            self._bytes += sum(t.numel() * t.element_size() for t in held.values())
            self._peak_bytes = max(self._peak_bytes, self._bytes)
        self._versions[version] = (held, users + 1)
        self._batch_version[msg.batch_id] = version
        return held

    def stashed(self, batch_id: int) -> Mapping[str, torch.Tensor]:
        """The weights batch ``batch_id``'s forward met (while its gradient is on its way)."""
        return self._versions[self._batch_version[batch_id]][0]

    def _release(self, batch_id: int) -> None:
        version = self._batch_version.pop(batch_id, None)
        if version is None:
            return
        held, users = self._versions[version]
        if users > 1:
            self._versions[version] = (held, users - 1)
            return
        del self._versions[version]
        self._bytes -= sum(t.numel() * t.element_size() for t in held.values())

    def stash_bytes(self) -> tuple[int, int]:
        return self._bytes, self._peak_bytes

    # the graph itself is kept: it holds the stashed weights, which no step touches
    after_forward = TrueGradientRule.after_forward

    async def on_gradient(self, stage: StageContext, kept: Kept, msg: Gradient) -> Outcome:
        assert kept.h_in is not None
        weights = self.stashed(msg.batch_id)
        grad_in = await stage.run_blocking(self._stashed_backward, stage, kept, weights, msg.gradient)
        self._release(msg.batch_id)
        return Outcome("update", upstream=grad_in, done=True)

    def on_late_gradient(self, batch_id: int) -> Outcome:
        self._release(batch_id)
        return Outcome(done=True)

    @staticmethod
    def _stashed_backward(
        stage: StageContext, kept: Kept, weights: Mapping[str, torch.Tensor], grad: torch.Tensor
    ) -> torch.Tensor | None:
        assert kept.h_in is not None
        names = list(weights)
        inputs = [weights[n] for n in names]
        with_input = kept.h_in.requires_grad
        if with_input:
            inputs.append(kept.h_in)
        grads = stage.gradients(kept.h_out, inputs, grad)
        stage.step_with({n: g for n, g in zip(names, grads) if g is not None})
        return grads[-1].detach() if with_input and grads[-1] is not None else None


def prior_gap(index: int, stages: int, max_in_flight: int) -> int:
    """A stage's version gap in a 1F1B pipeline before it has measured one (see the module's docstring)."""
    if index == stages - 1:
        return 0
    if index == 0:
        return max_in_flight - 1
    return min(max_in_flight - 1, stages - index - 1)


def predict_weights(
    layers: nn.Module, optimizer: torch.optim.Optimizer, gap: float, out: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """SpecTrain's prediction ``W − gap·lr·v`` of every parameter of ``layers`` (by name).

    ``v``: SGD's momentum buffer, or Adam's current step direction
    ``m̂ / (√v̂ + ε)``; a parameter not yet stepped is predicted unchanged.
    ``out``: buffers to write the prediction into (filled on first use), so
    a stage predicting every batch allocates no weight-sized tensors.
    """
    group = optimizer.param_groups[0]
    lr = float(group["lr"])
    predicted = out if out is not None else {}
    with torch.no_grad():
        for name, p in layers.named_parameters():
            state = optimizer.state.get(p, {})
            direction: torch.Tensor | None = None
            if isinstance(optimizer, torch.optim.SGD):
                direction = state.get("momentum_buffer")
            elif isinstance(optimizer, torch.optim.Adam) and "exp_avg" in state:
                step = float(state["step"])
                beta1, beta2 = group["betas"]
                m_hat = state["exp_avg"] / (1 - beta1**step)
                v_hat = state["exp_avg_sq"] / (1 - beta2**step)
                direction = m_hat / (v_hat.sqrt() + group["eps"])
            buf = predicted.get(name)
            if buf is None or buf.shape != p.shape:
                buf = predicted[name] = torch.empty_like(p, requires_grad=False)
            if direction is None:
                buf.copy_(p)
            else:
                torch.add(p.detach(), direction, alpha=-gap * lr, out=buf)
    return predicted


class WeightVelocity:
    """The velocity of a stage's weights per step of the stage, observed rather than read from an optimizer.

    With PS shards a stage's weights change only when a pull lands, by
    whatever every replica pushed since and the shards' optimizer made of it.
    :meth:`observe` keeps, per parameter, the weights seen at their last change
    and the stage's step count then; when they have changed, the velocity
    observed is ``(W_now − W_then) / (steps_now − steps_then)`` and ``u``
    becomes its moving average, ``u ← β·u + (1 − β)·observed`` (the first
    observation taken as it is).

    ``β`` (:data:`VELOCITY_SMOOTHING`, 0.9) is the paper's momentum, in the same
    role: an average over about ``1 / (1 − β) = 10`` changes, long enough that
    the uneven count of other replicas' pushes landing between two pulls (none,
    one or several) averages out, short enough to follow the weights' drift as
    the loss surface and the shards' own momentum turn it over tens of steps.

    Observing costs one comparison of the weights per step of the stage, and a
    few in-place passes when they changed; the weights seen and the velocity are
    two copies of them, allocated when the layers are first seen (or change,
    after a regroup), never per batch.
    """

    def __init__(self, smoothing: float = VELOCITY_SMOOTHING) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.smoothing = smoothing
        self._params: tuple[nn.Parameter, ...] = ()
        self._then: dict[str, torch.Tensor] = {}
        self._then_steps: dict[str, int] = {}
        self._velocity: dict[str, torch.Tensor] = {}
        self._moving: set[str] = set()
        """Parameters with a velocity (seen to change at least once)."""
        self.steps_seen: int | None = None
        """The stage's step count at the last observation (None: nothing seen yet)."""
        self.changes = 0
        """Parameter changes observed so far."""

    def observe(self, layers: nn.Module, steps: int) -> None:
        """Look at ``layers``' weights, the stage having taken ``steps`` steps: update the velocity of those that
        changed. New layers (a regroup) start over: their velocity is unknown until they change."""
        params = tuple(layers.parameters())
        if len(params) != len(self._params) or any(
            a is not b or a.shape != self._then[name].shape
            for (name, a), b in zip(layers.named_parameters(), self._params)
        ):
            self._reset(layers, params, steps)
            return
        if steps == self.steps_seen:
            return
        self.steps_seen = steps
        beta = self.smoothing
        with torch.no_grad():
            for name, p in layers.named_parameters():
                then, w = self._then[name], p.detach()
                if torch.equal(then, w):
                    continue
                elapsed = steps - self._then_steps[name]
                if elapsed <= 0:  # a step count set back (not a stage's own): start this parameter over
                    then.copy_(w)
                    self._then_steps[name] = steps
                    self._moving.discard(name)
                    continue
                observed = then.sub_(w).mul_(-1.0 / elapsed)  # (W_now − W_then) / Δsteps, in the buffer of W_then
                v = self._velocity[name]
                if name in self._moving:
                    v.mul_(beta).add_(observed, alpha=1.0 - beta)
                else:
                    v.copy_(observed)
                    self._moving.add(name)
                then.copy_(w)
                self._then_steps[name] = steps
                self.changes += 1

    def _reset(self, layers: nn.Module, params: tuple[nn.Parameter, ...], steps: int) -> None:
        self._params = params
        with torch.no_grad():
            self._then = {n: p.detach().clone() for n, p in layers.named_parameters()}
            self._velocity = {n: torch.zeros_like(p, requires_grad=False) for n, p in layers.named_parameters()}
        self._then_steps = dict.fromkeys(self._then, steps)
        self._moving = set()
        self.steps_seen = steps

    def predict(
        self, layers: nn.Module, gap: float, out: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """``W + gap·u`` for every parameter of ``layers`` (by name); unchanged for one without a velocity yet.
        ``out``: buffers to write into, as :func:`predict_weights`'s."""
        tracked = len(self._params) == sum(1 for _ in layers.parameters()) and all(
            a is b for a, b in zip(layers.parameters(), self._params))
        predicted = out if out is not None else {}
        with torch.no_grad():
            for name, p in layers.named_parameters():
                buf = predicted.get(name)
                if buf is None or buf.shape != p.shape:
                    buf = predicted[name] = torch.empty_like(p, requires_grad=False)
                if tracked and name in self._moving:
                    torch.add(p.detach(), self._velocity[name], alpha=gap, out=buf)
                else:
                    buf.copy_(p)
        return predicted


def _observes(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether SpecTrain predicts from the weights' observed velocity: no optimizer of the stage's own (PS shards),
    or one that keeps no step direction to predict with (Adagrad: its accumulated squares scale the gradient, the
    gradient itself is not kept)."""
    return optimizer is None or isinstance(optimizer, torch.optim.Adagrad)


class SpecTrainRule(_RealGradientRule):
    """SpecTrain: the forward meets the weights predicted for the gradient's return; the backward the current ones.

    Predicts from the stage's own optimizer, SGD with momentum (the paper) or
    Adam; with none (PS shards apply it), or one that keeps no step direction
    (Adagrad), from the weights' observed velocity (:attr:`velocity`).
    :attr:`gap` is the version gap predicted with now.
    """

    recomputes: ClassVar[bool] = True

    def __init__(self, settings: StageSettings, shape: StageShape) -> None:
        super().__init__(settings, shape)
        self._gaps: deque[int] = deque(maxlen=GAP_WINDOW)
        self.prior = prior_gap(shape.index, shape.stages, settings.max_in_flight)
        self._forwards = 0
        self._predicted: dict[str, torch.Tensor] = {}
        self.velocity = WeightVelocity()
        """The weights' own velocity, for a stage without an optimizer (PS shards) or with Adagrad."""
        self._probe: tuple[int, Mapping[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
        """(batch id, the weights predicted for it, those its forward would have met unpredicted)"""
        self._probes = 0
        self._error_sum = 0.0
        self._unpredicted_sum = 0.0

    @classmethod
    def check(cls, settings: StageSettings) -> None:
        super().check(settings)
        if not settings.optimizer_on_ps and settings.optimizer == "sgd" and settings.momentum <= 0.0:
            raise ValueError("spectrain with the optimizer 'sgd' needs momentum > 0 (it predicts with the momentum)")

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {**super().state_tensors(), "version_gaps": torch.tensor(list(self._gaps), dtype=torch.float64)}

    def load_state_tensors(self, saved: Mapping[str, torch.Tensor]) -> None:
        super().load_state_tensors(saved)
        if "version_gaps" in saved:
            self._gaps.extend(int(v) for v in saved["version_gaps"])

    @property
    def gap(self) -> float:
        return sum(self._gaps) / len(self._gaps) if self._gaps else float(self.prior)

    async def forward_weights(self, stage: StageContext, msg: Forward) -> Mapping[str, torch.Tensor] | None:
        gap = self.gap
        if stage.last or gap == 0.0:
            return None
        optimizer = stage.params.optimizer
        if _observes(optimizer):
            predicted = await stage.run_blocking(self._predict_from_velocity, stage.layers, stage.steps, gap,
                                                 self._buffers(msg))
        else:
            assert optimizer is not None
            predicted = await stage.run_blocking(predict_weights, stage.layers, optimizer, gap, self._buffers(msg))
        self._forwards += 1
        if self._probe is None and self._forwards % PROBE_EVERY == 0:
            with torch.no_grad():
                now = {n: p.detach().clone() for n, p in stage.layers.named_parameters()}
                kept = {n: t.clone() for n, t in predicted.items()}
            self._probe = (msg.batch_id, kept, now)
        return predicted

    def _predict_from_velocity(
        self, layers: nn.Module, steps: int, gap: float, out: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        self.velocity.observe(layers, steps)
        return self.velocity.predict(layers, gap, out)

    async def _observe(self, stage: StageContext) -> None:
        """Before a returning gradient steps: see what the pulls (or, with Adagrad, the stage's own steps) since the
        last step did to the weights, at the step count they landed at (a stage whose optimizer gives the step
        direction has nothing to observe)."""
        if _observes(stage.params.optimizer) and self.velocity.steps_seen != stage.steps:
            await stage.run_blocking(self.velocity.observe, stage.layers, stage.steps)

    def _buffers(self, msg: Forward) -> dict[str, torch.Tensor]:
        """Where batch ``msg``'s prediction goes: one set of buffers, since a batch's forward is done with its
        prediction before the next one's is made."""
        return self._predicted

    def _returned(self, stage: StageContext, kept: Kept, batch_id: int) -> None:
        self._gaps.append(stage.steps - kept.at_step)
        if self._probe is not None and self._probe[0] == batch_id:
            self._measure(stage.layers, *self._probe[1:])

    async def on_gradient(self, stage: StageContext, kept: Kept, msg: Gradient) -> Outcome:
        self._returned(stage, kept, msg.batch_id)
        await self._observe(stage)
        return await super().on_gradient(stage, kept, msg)

    def on_late_gradient(self, batch_id: int) -> Outcome:
        if self._probe is not None and self._probe[0] == batch_id:
            self._probe = None
        return super().on_late_gradient(batch_id)

    def _measure(
        self, layers: nn.Module, predicted: Mapping[str, torch.Tensor], unpredicted: dict[str, torch.Tensor]
    ) -> None:
        with torch.no_grad():
            actual = dict(layers.named_parameters())
            error = sum(float((predicted[n] - p).pow(2).sum()) for n, p in actual.items())
            stale = sum(float((unpredicted[n] - p).pow(2).sum()) for n, p in actual.items())
        self._probe = None
        self._probes += 1
        self._error_sum += math.sqrt(error)
        self._unpredicted_sum += math.sqrt(stale)

    def diagnostics(self) -> dict[str, float]:
        """``version_gap``: the gap predicted with now; ``prediction_error``: mean ``|Ŵ − W|`` over the probes,
        ``unpredicted_error``: mean ``|W_fwd − W|`` (NaN before any probe)."""
        n = self._probes
        ratio = self._error_sum / self._unpredicted_sum if self._unpredicted_sum else math.nan
        return {"version_gap": self.gap, "prediction_error": self._error_sum / n if n else math.nan,
                "unpredicted_error": self._unpredicted_sum / n if n else math.nan, "estimate_error_ratio": ratio}


def forward_with(layers: nn.Module, weights: Mapping[str, torch.Tensor] | None, x: torch.Tensor) -> torch.Tensor:
    """``layers(x)``, on ``weights`` (by parameter name) instead of the layers' own when given."""
    if weights is None:
        out: torch.Tensor = layers(x)
    else:
        out = functional_call(layers, dict(weights), (x,))
    return out


class SpecTrainStashRule(SpecTrainRule):
    """SpecTrain's forward on the predicted weights, and that forward's own graph back-propagated (no recompute).

    Each batch gets its own copy of ``Ŵ`` (the graph holds it until the
    gradient is back), so the gradient is the one at the weights predicted
    for its return; the step applies it to the current weights. The last
    stage, whose loss gives the gradient at once, runs on its own weights.
    """

    recomputes: ClassVar[bool] = False

    def __init__(self, settings: StageSettings, shape: StageShape) -> None:
        super().__init__(settings, shape)
        self._held: dict[int, dict[str, torch.Tensor]] = {}
        self._bytes = 0
        self._peak_bytes = 0

    def _buffers(self, msg: Forward) -> dict[str, torch.Tensor]:
        return {}  # fresh: the batch's graph keeps them

    async def forward_weights(self, stage: StageContext, msg: Forward) -> Mapping[str, torch.Tensor] | None:
        if stage.last:
            return None
        predicted = await super().forward_weights(stage, msg)
        if predicted is None:  # no gap measured: the current weights, copied, since steps may come before the return
            with torch.no_grad():
                predicted = {n: p.detach().clone() for n, p in stage.layers.named_parameters()}
        weights = {n: t.requires_grad_(True) for n, t in predicted.items()}
        self._held[msg.batch_id] = weights
        self._bytes += sum(t.numel() * t.element_size() for t in weights.values())
        self._peak_bytes = max(self._peak_bytes, self._bytes)
        return weights

    after_forward = TrueGradientRule.after_forward  # the graph is kept: it holds the batch's own Ŵ

    def _release(self, batch_id: int) -> None:
        weights = self._held.pop(batch_id, None)
        if weights is not None:
            self._bytes -= sum(t.numel() * t.element_size() for t in weights.values())

    async def on_gradient(self, stage: StageContext, kept: Kept, msg: Gradient) -> Outcome:
        self._returned(stage, kept, msg.batch_id)
        await self._observe(stage)
        weights = self._held.get(msg.batch_id)
        if weights is None:  # a stage that kept no prediction (the last) has no gradient coming back
            raise RuntimeError(f"spectrain_stash: no predicted weights kept for batch {msg.batch_id}")
        grad_in = await stage.run_blocking(StashRule._stashed_backward, stage, kept, weights, msg.gradient)
        self._release(msg.batch_id)
        return Outcome("update", upstream=grad_in, done=True)

    def on_late_gradient(self, batch_id: int) -> Outcome:
        self._release(batch_id)
        return super().on_late_gradient(batch_id)

    def stash_bytes(self) -> tuple[int, int]:
        return self._bytes, self._peak_bytes
