"""Epoch sharding of a training set and cursors that say how far a shard was read.

Data-parallel training splits the training set into ``n_shards`` disjoint
shards that together hold every example exactly once per epoch; the order is
reshuffled every epoch from ``(seed, epoch)`` alone, so any process computes
the same shards. A :class:`DataCursor` (shard, epoch, position: three ints)
says how far a shard has been read, so a checkpoint can store it and another
replica can take over a dead one's shard exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, NamedTuple

import numpy as np

from .readers import Dataset, DatasetError, FloatArray, IndexArray

__all__ = ["Batch", "DataCursor", "ShardPlan", "iter_batches", "shard_indices"]

# The shards' random stream from the job seed, apart from the split's (readers._SPLIT_STREAM).
_SHARD_STREAM: Final = 1


def shard_indices(n: int, n_shards: int, shard: int, epoch: int, seed: int) -> IndexArray:
    """Indices of ``shard`` in ``epoch``: a contiguous slice of that epoch's permutation.

    Shards of one epoch are disjoint, differ in size by at most one, and
    together hold each of ``range(n)`` exactly once.
    """
    return ShardPlan(n, n_shards, seed).indices(shard, epoch)


@dataclass(frozen=True)
class DataCursor:
    """How far one shard has been read: ``position`` examples into ``epoch``."""

    shard: int
    epoch: int = 0
    position: int = 0

    def __post_init__(self) -> None:
        for field in ("shard", "epoch", "position"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise DatasetError(f"cursor {field} must be an int >= 0, got {value!r}")

    def to_dict(self) -> dict[str, int]:
        """Plain ints, for checkpoints and messages."""
        return {"shard": self.shard, "epoch": self.epoch, "position": self.position}

    @classmethod
    def from_dict(cls, data: dict[str, int]) -> DataCursor:
        """Inverse of :meth:`to_dict`; rejects missing or extra fields."""
        if set(data) != {"shard", "epoch", "position"}:
            raise DatasetError(f"cursor needs exactly shard, epoch, position; got {sorted(data)}")
        return cls(data["shard"], data["epoch"], data["position"])


@dataclass(frozen=True)
class ShardPlan:
    """``n`` training examples in ``n_shards`` shards, reshuffled per epoch from ``seed``."""

    n: int
    n_shards: int
    seed: int

    def __post_init__(self) -> None:
        if self.n < 1:
            raise DatasetError(f"cannot shard {self.n} examples")
        if not 1 <= self.n_shards <= self.n:
            raise DatasetError(f"n_shards must be between 1 and {self.n} (examples), got {self.n_shards}")

    def _check_shard(self, shard: int) -> None:
        if not 0 <= shard < self.n_shards:
            raise DatasetError(f"shard {shard} out of range for {self.n_shards} shards")

    def shard_size(self, shard: int) -> int:
        """Examples in ``shard`` (the same every epoch)."""
        self._check_shard(shard)
        return (shard + 1) * self.n // self.n_shards - shard * self.n // self.n_shards

    def indices(self, shard: int, epoch: int) -> IndexArray:
        """See :func:`shard_indices`."""
        self._check_shard(shard)
        if epoch < 0:
            raise DatasetError(f"epoch must be >= 0, got {epoch}")
        order = np.random.default_rng([self.seed, _SHARD_STREAM, epoch]).permutation(self.n)
        lo, hi = shard * self.n // self.n_shards, (shard + 1) * self.n // self.n_shards
        return order[lo:hi].astype(np.int64)

    def normalize(self, cursor: DataCursor) -> DataCursor:
        """``cursor`` checked against this plan; one at the end of an epoch moves to the next."""
        size = self.shard_size(cursor.shard)
        if cursor.position > size:
            raise DatasetError(f"cursor position {cursor.position} past shard size {size}")
        if cursor.position == size:
            return DataCursor(cursor.shard, cursor.epoch + 1, 0)
        return cursor

    def remaining(self, cursor: DataCursor) -> IndexArray:
        """Indices not yet read in the cursor's epoch (all of the next one at an epoch's end)."""
        cursor = self.normalize(cursor)
        return self.indices(cursor.shard, cursor.epoch)[cursor.position :]

    def next_batch(self, cursor: DataCursor, batch_size: int) -> tuple[IndexArray, DataCursor]:
        """Up to ``batch_size`` indices from ``cursor`` and the cursor after them.

        The last batch of an epoch is short rather than spilling into the next,
        so each epoch visits each example of the shard exactly once; the
        returned cursor then points at the start of the next epoch.
        """
        if batch_size < 1:
            raise DatasetError(f"batch_size must be >= 1, got {batch_size}")
        cursor = self.normalize(cursor)
        size = self.shard_size(cursor.shard)
        end = min(cursor.position + batch_size, size)
        idx = self.indices(cursor.shard, cursor.epoch)[cursor.position : end]
        after = (
            DataCursor(cursor.shard, cursor.epoch + 1, 0)
            if end == size
            else DataCursor(cursor.shard, cursor.epoch, end)
        )
        return idx, after


class Batch(NamedTuple):
    """One mini-batch and the cursor to resume from after it."""

    indices: IndexArray
    x: FloatArray
    y: IndexArray
    cursor: DataCursor


def iter_batches(
    ds: Dataset,
    plan: ShardPlan,
    cursor: DataCursor,
    batch_size: int,
    *,
    until_epoch: int | None = None,
) -> Iterator[Batch]:
    """Mini-batches of the cursor's shard from where it points.

    Runs forever, or stops once the cursor reaches ``until_epoch``. Each
    batch carries the cursor after it, so a reader that dies after batch k
    is resumed with batch k's cursor and sees exactly the examples it had not.
    """
    if plan.n != len(ds):
        raise DatasetError(f"shard plan is for {plan.n} examples but {ds.name} has {len(ds)}")
    cursor = plan.normalize(cursor)
    while until_epoch is None or cursor.epoch < until_epoch:
        idx, cursor = plan.next_batch(cursor, batch_size)
        yield Batch(idx, ds.x[idx], ds.y[idx], cursor)
