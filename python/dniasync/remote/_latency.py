"""Round-trip times of remote asks, kept as plain numbers (``dniasync.metrics`` exports them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

__all__ = ["ASK_LATENCY_BUCKETS", "AskLatency"]

ASK_LATENCY_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
"""Upper bounds in seconds; one more bucket above the last is open."""


class AskLatency:
    """A histogram of ask round trips per message class: a few list increments per reply."""

    __slots__ = ("bounds", "by_type")

    def __init__(self, bounds: Sequence[float] = ASK_LATENCY_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        self.by_type: dict[type, list[float]] = {}
        """message class -> [count per bucket ..., count above the last bound, sum of seconds]."""

    def observe(self, msg_type: type, seconds: float) -> None:
        counts = self.by_type.get(msg_type)
        if counts is None:
            counts = self.by_type[msg_type] = [0.0] * (len(self.bounds) + 2)
        i = 0
        for bound in self.bounds:  # most asks stop in the first few buckets
            if seconds <= bound:
                break
            i += 1
        counts[i] += 1
        counts[-1] += seconds
