"""The training split as a trainer reads it: by position, a batch at a time, prefetched off the event loop.

:func:`open_split` gives the training rows as a :class:`TrainRows` and the
held-out rows as arrays. An in-memory source (built-ins, IDX, npz, CSV) is
loaded and split as before (``shuffle="global"``: exactly
:func:`~dniasync.train.data.split`); a converted set is never loaded: its
training rows are a :class:`MappedRows` that gathers a batch's rows from the
memory-mapped files when asked, on a prefetching thread of its own, and only
the ``n_test`` held-out rows are read at start. Both give the same batches for
the same seed and shuffle (:class:`~dniasync.train.data.RowOrder`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from ... import _core
from .converted import ConvertedDataset, is_converted
from .readers import DatasetError, IndexArray, load_dataset, split
from .sharding import RowOrder

__all__ = ["MappedRows", "MemoryRows", "TrainRows", "open_split"]

_PENDING: Final = 4  # batches a prefetcher holds ahead at most
_RESIDENT_ROW_S: Final = 3e-6
"""A read taking less than this per row found its pages in memory (a page read from disk takes ~100 us)."""
_RESIDENT_STREAK: Final = 8
"""Reads in a row that fast before prefetching stops handing reads to the thread."""


class TrainRows:
    """Training examples by position ``[0, n)``: :meth:`take` gives a batch as numpy arrays."""

    name: str = "train"
    n_features: int = 0
    n_classes: int = 0

    def __len__(self) -> int:
        raise NotImplementedError

    def take(self, positions: IndexArray) -> tuple[NDArray[Any], IndexArray]:
        """Features and labels at ``positions`` (in that order); a prefetched batch is taken from the prefetcher."""
        raise NotImplementedError

    def prefetch(self, positions: IndexArray) -> None:
        """Start reading ``positions`` in the background (a no-op for rows in memory)."""

    async def take_async(self, positions: IndexArray) -> tuple[NDArray[Any], IndexArray]:
        """:meth:`take` for the event loop: the reading happens on the prefetching thread."""
        return self.take(positions)

    def close(self) -> None:
        """Stop the prefetching thread."""


class MemoryRows(TrainRows):
    """Rows already in memory (the in-memory readers' split)."""

    def __init__(self, x: NDArray[Any], y: IndexArray, name: str = "train") -> None:
        self.x, self.y, self.name = x, y, name
        self.n_features = int(x.shape[1])
        self.n_classes = int(y.max()) + 1 if y.size else 0

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def take(self, positions: IndexArray) -> tuple[NDArray[Any], IndexArray]:
        return self.x[positions], self.y[positions]


class _Runs:
    """Where a :class:`MappedRows`' blocks of positions lie in the files, so that a batch's byte offsets are three
    array operations: the block of each position (one search), then ``base[block] + position * width``.

    One entry per block (``"blocks"`` order), cut to ``[0, n)``, and a last one for positions outside it. A block
    whose rows cross from one record batch into the next has no file (-1): batches that touch it, or positions
    outside ``[0, n)``, take the general path (:meth:`ConvertedDataset.gather`, which also says what is wrong).
    """

    def __init__(self, data: ConvertedDataset, order: RowOrder, n: int, offset: int) -> None:
        starts, first_row = order.runs()
        lo = max(int(np.searchsorted(starts, offset, side="right")) - 1, 0)
        hi = int(np.searchsorted(starts, offset + n, side="left"))  # blocks [lo, hi) hold [offset, offset + n)
        begin, end, row = starts[lo:hi] - offset, starts[lo + 1:hi + 1] - offset, first_row[lo:hi]
        batch_first, batch_file, x_at, y_at = data.record_batches()
        g = np.searchsorted(batch_first, row, side="right") - 1  # the record batch of each block's first row
        inside = row + (end - begin) <= batch_first[g + 1]
        self.bounds = np.concatenate([np.clip(begin, 0, n), [n]])
        self.file = np.concatenate([np.where(inside, batch_file[g], -1), [-1]])
        # position p of a block is row (row - begin + p), at x_at[g] + (row - begin + p - batch_first[g]) * width
        self.x = np.concatenate([x_at[g] + (row - begin - batch_first[g]) * data.row_bytes, [0]])
        self.y = np.concatenate([y_at[g] + (row - begin - batch_first[g]) * 8, [0]])
        self.row_bytes = data.row_bytes


class MappedRows(TrainRows):
    """Positions ``[offset, offset + n)`` of a :class:`RowOrder` over a memory-mapped converted set.

    Reads happen on one thread of its own (``prefetch``) while they fault pages in from disk; once
    :data:`_RESIDENT_STREAK` reads in a row found their pages in memory, ``prefetch`` does nothing and
    ``take`` reads in place (a hand-over between threads costs more than such a read), until a read is
    slow again. :attr:`rows_touched` counts the rows it gathered and :meth:`rows_of` says which rows
    positions are.
    """

    def __init__(self, data: ConvertedDataset, order: RowOrder, n: int, offset: int = 0) -> None:
        if offset < 0 or n < 0 or offset + n > order.n_rows or order.n_rows != len(data):
            raise DatasetError(f"{data.name}: positions [{offset}, {offset + n}) of an order over {order.n_rows} "
                               f"rows, the set has {len(data)}")
        self.data, self.order, self.n, self.offset = data, order, n, offset
        self.name = f"{data.name}[train]"
        self.n_features, self.n_classes = data.n_features, data.n_classes
        self._runs = _Runs(data, order, n, offset) if order.shuffle == "blocks" else None
        self._mapped: set[int] = set()
        """Files the Rust reader serves: those a batch has needed so far (each mapped on first use)."""
        self._blocks = self._block_rows()
        """uint8 sets: the Rust reader a batch goes through in one call (None: numpy's path)."""
        self._pool: ThreadPoolExecutor | None = None
        self._pending: OrderedDict[bytes, Future[tuple[NDArray[Any], IndexArray]]] = OrderedDict()
        self._lock = threading.Lock()
        self.resident_reads = 0
        """Reads in a row that found their pages in memory."""

    def __len__(self) -> int:
        return self.n

    def rows_of(self, positions: IndexArray) -> IndexArray:
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= self.n):
            raise DatasetError(f"{self.name}: positions outside [0, {self.n})")
        return self.order.rows(positions + self.offset)

    @property
    def rows_touched(self) -> int:
        return self.data.rows_read

    def _read(self, positions: IndexArray) -> tuple[NDArray[Any], IndexArray]:
        positions = np.ascontiguousarray(positions, dtype=np.int64)
        if self._blocks is not None and positions.size:
            x = np.empty((positions.size, self.n_features), dtype=np.float32)
            y = np.empty(positions.size, dtype=np.int64)
            if self._blocks.take(positions, x, y) or (self._map_files_of(positions)
                                                       and self._blocks.take(positions, x, y)):
                self.data.rows_read += int(positions.size)
                return x, y
        runs = self._runs
        if runs is not None and positions.size:
            j = np.searchsorted(runs.bounds, positions, side="right") - 1
            files = runs.file[j]
            k, last = int(files.min()), int(files.max())
            if k >= 0:  # in [0, n), no block across record batches: every batch but a rare few
                x_at, y_at = runs.x[j] + positions * runs.row_bytes, runs.y[j] + positions * 8
                if k == last:
                    return self.data.gather_at(k, x_at, y_at)
                return self.data.gather_files(files, x_at, y_at)
        return self.data.gather(self.rows_of(positions))

    def _block_rows(self) -> _core.BlockRows | None:
        runs = self._runs
        if runs is None:
            return None
        return self.data.block_rows(runs.bounds.tolist(), runs.file.tolist(), runs.x.tolist(), runs.y.tolist(),
                                    self._mapped)

    def _map_files_of(self, positions: IndexArray) -> bool:
        """Map the files ``positions`` lie in that the Rust reader does not serve yet; True if there were any."""
        runs = self._runs
        assert runs is not None
        j = np.clip(np.searchsorted(runs.bounds, positions, side="right") - 1, 0, runs.file.size - 1)
        new = {int(f) for f in np.unique(runs.file[j]) if f >= 0} - self._mapped
        if not new:
            return False
        with self._lock:
            self._mapped |= new
            self._blocks = self._block_rows()
        return True

    def _timed_read(self, positions: IndexArray) -> tuple[NDArray[Any], IndexArray]:
        t0 = time.perf_counter()
        batch = self._read(positions)
        fast = time.perf_counter() - t0 < _RESIDENT_ROW_S * max(len(batch[1]), 1)
        self.resident_reads = self.resident_reads + 1 if fast else 0
        return batch

    def _submit(self, positions: IndexArray) -> Future[tuple[NDArray[Any], IndexArray]]:
        key = np.asarray(positions, dtype=np.int64).tobytes()
        with self._lock:
            future = self._pending.get(key)
            if future is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"prefetch-{self.data.name}")
                future = self._pending[key] = self._pool.submit(self._timed_read,
                                                                np.array(positions, dtype=np.int64))
                while len(self._pending) > _PENDING:
                    self._pending.popitem(last=False)
            return future

    def _claim(self, positions: IndexArray) -> Future[tuple[NDArray[Any], IndexArray]] | None:
        with self._lock:
            return self._pending.pop(np.asarray(positions, dtype=np.int64).tobytes(), None)

    def prefetch(self, positions: IndexArray) -> None:
        if self.resident_reads < _RESIDENT_STREAK:
            self._submit(positions)

    def take(self, positions: IndexArray) -> tuple[NDArray[Any], IndexArray]:
        future = self._claim(positions)
        return future.result() if future is not None else self._timed_read(positions)

    async def take_async(self, positions: IndexArray) -> tuple[NDArray[Any], IndexArray]:
        future = self._claim(positions) or self._submit(positions)
        self._claim(positions)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        with self._lock:
            self._pending.clear()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def open_split(dataset: str, reader: dict[str, Any], n_train: int, n_test: int, seed: int, *,
               shuffle: str = "global", block: int = 64, verify_checksums: bool = False, held_out: bool = True
               ) -> tuple[TrainRows, NDArray[Any], IndexArray]:
    """(training rows, held-out features, held-out labels) of ``dataset`` split by ``seed``.

    A converted set is opened, not loaded; ``reader`` applies to the in-memory sources only. ``held_out=False``
    (a trainer, which never evaluates): a converted set's held-out rows are not read (empty arrays), so a
    trainer's start does not read rows from every file.
    """
    if n_train < 1 or n_test < 0:
        raise DatasetError(f"split needs n_train >= 1 and n_test >= 0, got {n_train} and {n_test}")
    if is_converted(dataset):
        data = ConvertedDataset(dataset, verify_checksums=verify_checksums)
        if n_train + n_test > len(data):
            raise DatasetError(f"{data.name} has {len(data)} examples, fewer than n_train + n_test = "
                               f"{n_train + n_test}")
        order = RowOrder(len(data), seed, shuffle, block)
        x_test, y_test = data.gather(order.rows(np.arange(n_train, n_train + n_test if held_out else n_train)))
        data.rows_read = 0  # the counter is the training rows'
        return MappedRows(data, order, n_train), x_test, y_test
    ds = load_dataset(dataset, **reader)
    if shuffle == "global":
        train, test = split(ds, n_train, n_test, seed)
        return MemoryRows(train.x, train.y, train.name), test.x, test.y
    if n_train + n_test > len(ds):
        raise DatasetError(f"{ds.name} has {len(ds)} examples, fewer than n_train + n_test = {n_train + n_test}")
    order = RowOrder(len(ds), seed, shuffle, block)
    train = ds.subset(order.rows(np.arange(n_train)), f"{ds.name}[train]")
    test = ds.subset(order.rows(np.arange(n_train, n_train + n_test)), f"{ds.name}[held-out]")
    return MemoryRows(train.x, train.y, train.name), test.x, test.y
