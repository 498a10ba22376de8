"""Epoch sharding of a training set and cursors that say how far a shard was read.

Data-parallel training splits the training set into ``n_shards`` disjoint
shards that together hold every example exactly once per epoch; the order is
reshuffled every epoch from ``(seed, epoch)`` alone, so any process computes
the same shards. A :class:`DataCursor` (shard, epoch, position: three ints)
says how far a shard has been read, so a checkpoint can store it and another
replica can take over a dead one's shard exactly where it stopped.

Two orders (``shuffle``): ``"global"`` permutes all ``n`` training positions
every epoch, so a shard's examples change from epoch to epoch (needs the
whole set at hand); ``"blocks"`` gives each shard a fixed contiguous range of
positions and every epoch permutes that range's blocks of ``block`` rows,
then the rows within each window of ``window`` consecutive blocks. With
:class:`RowOrder`'s block split (training positions are whole blocks of rows
in a seeded order) a shard's rows are a fixed set of contiguous row runs, so a
reader that maps a file on disk touches only its shard's pages.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final, Literal, NamedTuple

import numpy as np

from .readers import _SPLIT_STREAM, Dataset, DatasetError, FloatArray, IndexArray

__all__ = ["SHUFFLES", "Batch", "DataCursor", "RowOrder", "ShardPlan", "Shuffle", "iter_batches", "shard_indices"]

# The shards' random stream from the job seed, apart from the split's (readers._SPLIT_STREAM).
_SHARD_STREAM: Final = 1

Shuffle = Literal["global", "blocks"]
SHUFFLES: Final[tuple[str, ...]] = ("global", "blocks")


class RowOrder:
    """Which row of a set of ``n_rows`` each training and held-out position is.

    ``"global"``: the order of :func:`~dniasync.train.data.split` (one seeded
    permutation of every row; ``n_rows`` int64 in memory). ``"blocks"``: rows
    cut into blocks of ``block`` consecutive rows, the blocks in a seeded order
    (``n_rows / block`` ints in memory); positions ``[0, n_train)`` are the
    training split and the next ``n_test`` the held-out one, both as before
    disjoint and seeded.
    """

    def __init__(self, n_rows: int, seed: int, shuffle: str = "global", block: int = 64) -> None:
        if shuffle not in SHUFFLES:
            raise DatasetError(f"unknown shuffle {shuffle!r}; choose one of {', '.join(SHUFFLES)}")
        if block < 1:
            raise DatasetError(f"block must be >= 1, got {block}")
        self.n_rows, self.shuffle, self.block = n_rows, shuffle, block
        if shuffle == "global":
            self._perm = np.random.default_rng([seed, _SPLIT_STREAM]).permutation(n_rows).astype(np.int64)
            return
        n_blocks = -(-n_rows // block)
        self._blocks = np.random.default_rng([seed, _SPLIT_STREAM, 1]).permutation(n_blocks).astype(np.int64)
        sizes = np.minimum(block, n_rows - self._blocks * block)
        self._starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        # row = position + shift of its block (the block's first row minus its first position)
        self._shift = self._blocks * block - self._starts[:-1]

    def rows(self, positions: IndexArray) -> IndexArray:
        """The rows at ``positions`` (in the split's order: train first, then held-out)."""
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= self.n_rows):
            raise DatasetError(f"positions outside [0, {self.n_rows})")
        if self.shuffle == "global":
            return self._perm[positions]
        return positions + self._shift[np.searchsorted(self._starts, positions, side="right") - 1]

    def runs(self) -> tuple[IndexArray, IndexArray]:
        """``"blocks"``: the position each block starts at (and the end), and the row it starts at; a block's
        positions are consecutive rows from there."""
        if self.shuffle != "blocks":
            raise DatasetError(f"shuffle {self.shuffle!r} has no runs of rows")
        return self._starts, self._blocks * self.block


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
    """``n`` training examples in ``n_shards`` shards, reshuffled per epoch from ``seed``.

    ``shuffle="global"`` (the default): each epoch one permutation of all ``n``;
    ``"blocks"``: each shard keeps its contiguous range of positions and each
    epoch permutes its blocks of ``block`` positions, then the positions within
    every ``window`` consecutive blocks (see the module's docstring). Shard
    sizes, disjointness and cursors are the same in both.
    """

    n: int
    n_shards: int
    seed: int
    shuffle: str = "global"
    block: int = 64
    window: int = 16
    _last: dict[tuple[int, int], IndexArray] = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        if self.n < 1:
            raise DatasetError(f"cannot shard {self.n} examples")
        if not 1 <= self.n_shards <= self.n:
            raise DatasetError(f"n_shards must be between 1 and {self.n} (examples), got {self.n_shards}")
        if self.shuffle not in SHUFFLES:
            raise DatasetError(f"unknown shuffle {self.shuffle!r}; choose one of {', '.join(SHUFFLES)}")
        if self.block < 1 or self.window < 1:
            raise DatasetError(f"block and window must be >= 1, got {self.block} and {self.window}")

    def bounds(self, shard: int) -> tuple[int, int]:
        """``[lo, hi)``: with ``shuffle="blocks"`` the positions ``shard`` holds in every epoch."""
        self._check_shard(shard)
        return shard * self.n // self.n_shards, (shard + 1) * self.n // self.n_shards

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
        cached = self._last.get((shard, epoch))
        if cached is not None:  # next_batch asks once per batch: one permutation per epoch, not per batch
            return cached
        lo, hi = self.bounds(shard)
        if self.shuffle == "global":
            order = np.random.default_rng([self.seed, _SHARD_STREAM, epoch]).permutation(self.n)
            out = order[lo:hi].astype(np.int64)
        else:
            out = self._block_order(shard, epoch, lo, hi)
        for key in [k for k in self._last if k[0] == shard]:
            del self._last[key]
        self._last[(shard, epoch)] = out
        return out

    def _block_order(self, shard: int, epoch: int, lo: int, hi: int) -> IndexArray:
        """The shard's positions, blocks permuted, then the positions within each window of blocks."""
        rng = np.random.default_rng([self.seed, _SHARD_STREAM, epoch, shard])
        n_blocks = -(-(hi - lo) // self.block)
        starts = lo + rng.permutation(n_blocks).astype(np.int64) * self.block
        lengths = np.minimum(self.block, hi - starts)
        first = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # where each block begins in the output
        out = np.repeat(starts - first, lengths) + np.arange(hi - lo, dtype=np.int64)
        windows = np.repeat(np.arange(n_blocks) // self.window, lengths)
        return out[np.lexsort((rng.random(hi - lo), windows))]

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
        return self.indices(cursor.shard, cursor.epoch)[cursor.position :].copy()

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
        idx = self.indices(cursor.shard, cursor.epoch)[cursor.position : end].copy()
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
