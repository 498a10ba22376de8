"""What a pipeline is fed, and how: the seeded batch order, the driver's :class:`Schedule` and :class:`LrDecay`."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from .rules import get_rule

__all__ = ["LrDecay", "Schedule", "batch_order"]


def batch_order(n: int, batch_size: int, epochs: int, seed: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(epoch, indices)`` of every mini-batch: a fresh permutation per epoch, last batch partial."""
    if batch_size < 1 or epochs < 0 or n < 1:
        raise ValueError(f"need n >= 1, batch_size >= 1, epochs >= 0 (got {n}, {batch_size}, {epochs})")
    gen = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n, batch_size):
            yield epoch, perm[start : start + batch_size]


@dataclass(frozen=True)
class Schedule:
    """How a driver feeds its pipeline.

    Before each mini-batch it waits until fewer than ``max_in_flight``
    (micro-)batches are in flight; it splits the mini-batch into
    ``micro_batches`` parts (one optimizer step); with ``flush`` it then waits
    until the pipeline is empty (GPipe). At most :attr:`in_flight_bound`
    micro-batches are in flight at once.
    """

    max_in_flight: int = 8
    micro_batches: int = 1
    flush: bool = False

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or self.micro_batches < 1:
            raise ValueError("max_in_flight and micro_batches must be >= 1")

    @classmethod
    def for_rule(cls, rule: str, *, max_in_flight: int = 8, micro_batches: int = 1) -> Schedule:
        """What rule ``rule`` trains under: a flushing rule gets micro-batches and a flush, the others neither."""
        if get_rule(rule).flush:
            return cls(max_in_flight, micro_batches, flush=True)
        return cls(max_in_flight)

    @property
    def in_flight_bound(self) -> int:
        return self.micro_batches if self.flush else self.max_in_flight + self.micro_batches - 1

    def stage_mailbox_size(self) -> int:
        """A stage mailbox that never fills: <= 3 messages per batch in flight, and room for asks."""
        return 3 * max(self.max_in_flight, self.in_flight_bound) + 4


@dataclass(frozen=True)
class LrDecay:
    """The learning rate over a run: full until ``start`` of training, then down to ``final`` of it at the end.

    ``kind``: ``"none"`` (constant), ``"linear"`` or ``"cosine"`` (half a
    cosine wave). ``start`` and the argument of :meth:`scale` are fractions of
    the run's samples. The driver stamps each batch with the scale at the
    samples fed before it, and every stage steps its layers, and its SG and
    input models, with its lr times that scale (SpecTrain predicts with the
    scaled lr). Late in a run the weights settle instead of wandering around
    the optimum at a constant step: that ends runs near their best accuracy.
    """

    kind: Literal["none", "linear", "cosine"] = "none"
    start: float = 0.5
    final: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("none", "linear", "cosine"):
            raise ValueError(f"kind must be 'none', 'linear' or 'cosine', got {self.kind!r}")
        if not 0.0 <= self.start < 1.0:
            raise ValueError(f"start must be in [0, 1), got {self.start}")
        if not 0.0 <= self.final <= 1.0:
            raise ValueError(f"final must be in [0, 1], got {self.final}")

    def scale(self, progress: float) -> float:
        """The lr's multiplier at ``progress`` (fraction of the run's samples done, clamped to [0, 1])."""
        done = (min(max(progress, 0.0), 1.0) - self.start) / (1.0 - self.start)
        if self.kind == "none" or done <= 0.0:
            return 1.0
        falling = 1.0 - done if self.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
        return self.final + (1.0 - self.final) * falling
