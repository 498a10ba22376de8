"""Exponential backoff with optional jitter: the one retry clock every layer uses.

A dialer, a joiner, a host asking for work and a PS link all wait the same
way after a failure: ``initial_s``, doubling per failure up to ``max_s``,
drawn from ``[delay * (1 - jitter), delay]`` so many clients that failed at
once do not retry in step.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

__all__ = ["Backoff"]


class Backoff:
    """After a failure wait ``initial_s``, doubling per failure up to ``max_s`` (``jitter``: the fraction drawn off)."""

    def __init__(self, initial_s: float = 0.05, max_s: float = 2.0, *, jitter: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"jitter must be in [0, 1), got {jitter}")
        if not 0.0 < initial_s <= max_s:
            raise ValueError(f"need 0 < initial_s <= max_s, got {initial_s} and {max_s}")
        self.initial_s = initial_s
        self.max_s = max_s
        self.jitter = jitter
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self._delay = initial_s
        self._next_try = -math.inf
        self.failures = 0
        """Failures since the last success."""

    def ready(self) -> bool:
        """Whether the next attempt may go now."""
        return self._clock() >= self._next_try

    def failed(self) -> float:
        """Record a failure; returns the seconds to wait before the next attempt."""
        delay = self._delay
        if self.jitter:
            delay = self._rng.uniform(delay * (1.0 - self.jitter), delay)
        self._next_try = self._clock() + delay
        self._delay = min(2 * self._delay, self.max_s)
        self.failures += 1
        return delay

    def succeeded(self) -> None:
        """The operation worked: the next failure waits ``initial_s`` again."""
        self._delay = self.initial_s
        self._next_try = -math.inf
        self.failures = 0
