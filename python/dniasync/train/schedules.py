"""Batch-size schedules: fixed, stepwise growth, and Byrd et al.'s dynamic sampling.

A schedule answers one question, at the data cursor: how many examples go into
the next mini-batch (and with which learning rate), given how far training
has gone (``epoch``, fractional). Every mode reads its batches through a
cursor, so one schedule object serves Downpour, Hogwild, the pipelines and
Sandblaster (where the "batch" is the sample L-BFGS works on).

- ``fixed``: ``start`` throughout.
- ``stepwise`` (Keskar et al. 2017 warm-start the large batch with small ones;
  Smith et al. 2018 "don't decay the learning rate, increase the batch size"):
  ``start · factor^⌊epoch / every_epochs⌋``, capped at ``end``. The learning
  rate stays **unchanged** by default: growing the batch at a fixed lr lowers
  the gradient noise (∝ lr / batch) as training proceeds, which is the
  annealing effect the schedule is for; scaling lr with the batch
  (``lr_scaling = "linear"`` or ``"sqrt"``, offered) keeps the noise constant,
  removes that effect, and with Adagrad or plain SGD at lr·16 tends to diverge
  early in the large-batch phase.
- ``dynamic`` (Byrd, Chin, Nocedal & Wu 2012, the "norm test"): keep the
  batch while ``Var(∇ℓ_i)/|S| ≤ θ²‖∇f_S‖²``; when the test fails, grow it to
  ``Var(∇ℓ_i) / (θ²‖∇f_S‖²)`` (at most ``end``). The per-example variance is
  estimated from the gradients of ``chunks`` equal parts of the batch
  (``Var(∇ℓ_i) ≈ m·Var(chunk means)`` for chunks of ``m`` examples), so no
  per-example gradient is ever formed. A Downpour or Hogwild worker takes
  every ``test_every``-th batch's gradient in ``chunks`` parts (the same
  gradient, summed) and grows its own batch; Sandblaster runs the test on
  scalars only, its portions being the parts: each portion's ``‖g_p‖²`` comes
  with its commit and ``g·g`` from the shards (``Σ‖g_p − ḡ‖² = Σ‖g_p‖² −
  P‖ḡ‖²``), before each iteration. A pipeline's driver sends every
  ``test_every``-th batch forward through its stages beside the training and
  the last stage, the one with the true loss, takes its parameters' gradient
  in parts: the pipeline's test is on that stage's share of the gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..actors import message

__all__ = ["BatchSchedule", "CursorSizes", "NormTest", "ScheduleSpec", "make_schedule"]

Kind = Literal["fixed", "stepwise", "dynamic"]
LrScaling = Literal["none", "linear", "sqrt"]


@message("dniasync.train.ScheduleSpec")
@dataclass(frozen=True)
class ScheduleSpec:
    """The ``[schedule]`` of a job, as workers receive it."""

    kind: str = "fixed"
    start: int = 32
    end: int = 512
    every_epochs: float = 1.0
    factor: float = 2.0
    lr_scaling: str = "none"
    theta: float = 0.5
    """Dynamic sampling: the norm test's θ (larger: a noisier gradient is tolerated)."""
    chunks: int = 4
    """Dynamic sampling: parts of a batch whose gradients estimate the per-example variance."""
    test_every: int = 10
    """Dynamic sampling: run the norm test on every this many batches (its batch's gradient is taken in parts)."""

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "stepwise", "dynamic"):
            raise ValueError(f"schedule kind must be fixed, stepwise or dynamic, got {self.kind!r}")
        if self.lr_scaling not in ("none", "linear", "sqrt"):
            raise ValueError(f"lr_scaling must be none, linear or sqrt, got {self.lr_scaling!r}")
        if not 1 <= self.start <= self.end:
            raise ValueError(f"need 1 <= start <= end, got start={self.start} end={self.end}")
        if self.every_epochs <= 0 or self.factor < 1 or self.theta <= 0 or self.chunks < 2 or self.test_every < 1:
            raise ValueError("every_epochs and theta must be > 0, factor >= 1, chunks >= 2, test_every >= 1")


class NormTest:
    """Byrd et al.'s norm test on the gradients of the parts of one batch."""

    def __init__(self, theta: float) -> None:
        self.theta = theta

    def wanted(self, chunk_grads: Sequence[np.ndarray], chunk_size: int) -> float:
        """The batch size the test asks for (≤ the current one when it passes)."""
        g = np.stack([np.asarray(c, dtype=np.float64).reshape(-1) for c in chunk_grads])
        mean = g.mean(axis=0)
        # the variance of one example's gradient (summed over coordinates), from the spread of the chunk means
        per_example = chunk_size * float(((g - mean) ** 2).sum(axis=1).sum()) / (len(g) - 1)
        return self._size(per_example, float(mean @ mean))

    def wanted_from_norms(self, sum_sq: float, norm2: float, count: int, chunk_size: int) -> float:
        """The same from scalars only: ``sum_sq`` = Σ‖g_j‖² over ``count`` parts of ``chunk_size`` examples and
        ``norm2`` = ‖mean g_j‖² (Σ‖g_j − ḡ‖² = Σ‖g_j‖² − count·‖ḡ‖²), for whoever never holds the vectors."""
        if count < 2:
            return 0.0
        per_example = chunk_size * max(0.0, sum_sq - count * norm2) / (count - 1)
        return self._size(per_example, norm2)

    def _size(self, per_example: float, norm2: float) -> float:
        if norm2 == 0.0:
            return math.inf
        return per_example / (self.theta ** 2 * norm2)


class BatchSchedule:
    """Batch size and learning-rate factor as training proceeds (one per replica or driver)."""

    def __init__(self, spec: ScheduleSpec) -> None:
        self.spec = spec
        self._dynamic = spec.start
        self.test = NormTest(spec.theta)
        self.grown: list[tuple[float, int]] = []
        """(epoch, new size) of every growth of a dynamic schedule."""

    def batch_size(self, epoch: float) -> int:
        s = self.spec
        if s.kind == "fixed":
            return s.start
        if s.kind == "stepwise":
            steps = math.floor(epoch / s.every_epochs + 1e-9)
            return int(min(s.end, round(s.start * s.factor ** steps)))
        return self._dynamic

    def lr_factor(self, epoch: float) -> float:
        """What multiplies the base lr at this batch size (1 unless ``lr_scaling`` says otherwise)."""
        ratio = self.batch_size(epoch) / self.spec.start
        if self.spec.lr_scaling == "linear":
            return ratio
        if self.spec.lr_scaling == "sqrt":
            return math.sqrt(ratio)
        return 1.0

    def observe(self, epoch: float, chunk_grads: Sequence[np.ndarray], chunk_size: int) -> int:
        """Dynamic sampling: run the norm test on this batch's parts; returns the batch size from now on."""
        if self.spec.kind != "dynamic":
            return self.batch_size(epoch)
        return self._grow(epoch, self.test.wanted(chunk_grads, chunk_size))

    def observe_norms(self, epoch: float, sum_sq: float, norm2: float, count: int, chunk_size: int) -> int:
        """:meth:`observe` from the parts' squared norms (see :meth:`NormTest.wanted_from_norms`)."""
        if self.spec.kind != "dynamic":
            return self.batch_size(epoch)
        return self._grow(epoch, self.test.wanted_from_norms(sum_sq, norm2, count, chunk_size))

    def _grow(self, epoch: float, wanted: float) -> int:
        current = self._dynamic
        if wanted > current:
            self._dynamic = int(min(self.spec.end, max(current + 1, math.ceil(min(wanted, 1e12)))))
            if self._dynamic != current:
                self.grown.append((epoch, self._dynamic))
        return self._dynamic

    def test_due(self, batches: int) -> bool:
        """Whether the ``batches``-th batch (from 0) is one whose gradient is taken in parts for the norm test."""
        return self.spec.kind == "dynamic" and batches % self.spec.test_every == 0

    @property
    def needs_chunks(self) -> bool:
        return self.spec.kind == "dynamic"


def make_schedule(spec: ScheduleSpec | None) -> BatchSchedule | None:
    return None if spec is None else BatchSchedule(spec)


class CursorSizes:
    """The batch size for the next read of a data cursor: ``default`` without a schedule, else the schedule's at
    the cursor's fractional epoch. ``changed`` says whether the last :meth:`at` gave a new size (the first
    read counts as a change only under a schedule), so a driver can report every growth once."""

    def __init__(self, spec: ScheduleSpec | None, default: int) -> None:
        self.schedule = make_schedule(spec)
        self.default = default
        self.current: int | None = None
        self.changed = False

    def at(self, epoch: int, position: int, shard_size: int) -> int:
        if self.schedule is None:
            self.changed = False
            return self.default
        size = self.schedule.batch_size(epoch + position / shard_size)
        self.changed, self.current = size != self.current, size
        return size
