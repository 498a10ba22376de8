"""Staleness policies and the push ledger of a parameter-server shard.

Staleness of a push = the shard's version now minus the version the gradient
was computed on. Policies:

- ``none``: plain Downpour; every push is applied with the configured lr.
- ``inverse``: staleness-aware async SGD (Zhang et al. 2016): lr / staleness,
  with staleness 0 and 1 both applying the full lr.
- ``bound``: pushes staler than ``max_staleness`` are dropped (and counted);
  the rest are applied with the full lr.

The ledger makes pushes idempotent per (replica, incarnation, seq) and fences
zombies: once a replica id has pushed with incarnation k, pushes from an
older incarnation are refused.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["Decision", "PushLedger", "PushVerdict", "StalenessPolicy"]


@dataclass(frozen=True)
class Decision:
    """What to do with one push."""

    apply: bool
    lr: float
    staleness: int


@dataclass(frozen=True)
class StalenessPolicy:
    kind: str = "none"
    max_staleness: int = 0

    KINDS = ("none", "inverse", "bound")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"unknown staleness policy {self.kind!r}; choose one of {', '.join(self.KINDS)}")
        if self.kind == "bound" and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    def decide(self, lr: float, version_now: int, computed_on: int) -> Decision:
        """Apply the policy to a push computed on ``computed_on`` at shard version ``version_now``."""
        if computed_on > version_now:
            raise ValueError(f"push claims version {computed_on}, newer than the shard's {version_now}")
        staleness = version_now - computed_on
        if self.kind == "inverse":
            return Decision(True, lr / max(1, staleness), staleness)
        if self.kind == "bound" and staleness > self.max_staleness:
            return Decision(False, 0.0, staleness)
        return Decision(True, lr, staleness)


class PushVerdict(enum.Enum):
    NEW = "new"
    DUPLICATE = "duplicate"
    ZOMBIE = "zombie"


@dataclass
class PushLedger:
    """Highest (incarnation, seq) seen per replica id: each push applied at most once."""

    _seen: dict[str, tuple[int, int]] = field(default_factory=dict)

    def check(self, replica: str, incarnation: int, seq: int) -> PushVerdict:
        """Classify a push without recording it."""
        last = self._seen.get(replica)
        if last is None:
            return PushVerdict.NEW
        if incarnation < last[0]:
            return PushVerdict.ZOMBIE
        if incarnation == last[0] and seq <= last[1]:
            return PushVerdict.DUPLICATE
        return PushVerdict.NEW

    def record(self, replica: str, incarnation: int, seq: int) -> None:
        """Remember that this push was applied."""
        self._seen[replica] = (incarnation, seq)

    def snapshot(self) -> dict[str, list[int]]:
        """Plain-typed state for checkpoints."""
        return {replica: [inc, seq] for replica, (inc, seq) in self._seen.items()}

    @classmethod
    def restore(cls, state: dict[str, list[int]]) -> PushLedger:
        return cls({replica: (int(v[0]), int(v[1])) for replica, v in state.items()})
