"""Supervision as in Erlang/OTP: directives, schemes and restart intensity."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Directive", "SupervisorStrategy", "one_for_all", "one_for_one"]


class Directive(enum.Enum):
    """What a supervisor does with a child whose handler raised."""

    RESTART = "restart"
    """Replace the child's instance with a fresh one; its ref and mailbox stay."""
    STOP = "stop"
    """Stop the child for good; pending asks fail with ``ActorStopped``."""
    ESCALATE = "escalate"
    """Fail the supervisor itself, handing the decision to its own supervisor."""


def _always_restart(_: BaseException) -> Directive:
    return Directive.RESTART


@dataclass(frozen=True)
class SupervisorStrategy:
    """How a parent (or the system root) supervises its children.

    ``scheme`` is ``"one_for_one"`` (only the failed child is restarted) or
    ``"one_for_all"`` (every child of this parent is restarted when one fails).
    At most ``max_restarts`` restarts within ``within_s`` seconds; one more
    escalates: the supervisor stops its children and fails itself.
    """

    scheme: Literal["one_for_one", "one_for_all"] = "one_for_one"
    max_restarts: int = 3
    within_s: float = 5.0
    decide: Callable[[BaseException], Directive] = field(default=_always_restart)

    def __post_init__(self) -> None:
        if self.scheme not in ("one_for_one", "one_for_all"):
            raise ValueError(f"unknown supervision scheme {self.scheme!r}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if self.within_s <= 0:
            raise ValueError(f"within_s must be > 0, got {self.within_s}")


def one_for_one(
    max_restarts: int = 3,
    within_s: float = 5.0,
    decide: Callable[[BaseException], Directive] = _always_restart,
) -> SupervisorStrategy:
    """Restart only the child that failed."""
    return SupervisorStrategy("one_for_one", max_restarts, within_s, decide)


def one_for_all(
    max_restarts: int = 3,
    within_s: float = 5.0,
    decide: Callable[[BaseException], Directive] = _always_restart,
) -> SupervisorStrategy:
    """Restart every child of the parent when one fails."""
    return SupervisorStrategy("one_for_all", max_restarts, within_s, decide)


class RestartIntensity:
    """Sliding-window restart counter: may another restart happen now?"""

    __slots__ = ("_limit", "_window", "_times")

    def __init__(self, max_restarts: int, within_s: float) -> None:
        self._limit = max_restarts
        self._window = within_s
        self._times: deque[float] = deque()

    def allow(self, now: float) -> bool:
        """Record a restart at ``now`` if the intensity allows it."""
        while self._times and now - self._times[0] >= self._window:
            self._times.popleft()
        if len(self._times) >= self._limit:
            return False
        self._times.append(now)
        return True
