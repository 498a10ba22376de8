"""Data sets as numpy arrays, a seeded train/held-out split, and epoch sharding.

:mod:`.readers` loads a :class:`Dataset` (``x: float32 [N, D]``, ``y: int64 [N]``)
from a built-in name or a local IDX, npz or CSV file and splits it reproducibly;
:mod:`.sharding` cuts the training set into per-epoch shards (:class:`ShardPlan`)
read through resumable :class:`DataCursor` positions.

:mod:`.converted` is the on-disk format (Arrow IPC files, memory-mapped, and a
manifest) that :mod:`.convert` writes (``python -m dniasync.data convert``);
:func:`open_split` (:mod:`.source`) gives a trainer its training rows by
position, from memory or mapped from disk, prefetched on a thread.
"""

from .readers import (
    BUILTIN_DATASETS,
    Dataset,
    DatasetError,
    count_examples,
    dataset_kind,
    load_csv,
    load_dataset,
    load_digits,
    load_idx,
    load_mnist5k,
    load_npz,
    read_idx,
    split,
)
from .converted import ConvertedDataset, Manifest, is_converted
from .sharding import SHUFFLES, Batch, DataCursor, RowOrder, ShardPlan, iter_batches, shard_indices
from .source import MappedRows, MemoryRows, TrainRows, open_split

__all__ = [
    "BUILTIN_DATASETS",
    "SHUFFLES",
    "Batch",
    "ConvertedDataset",
    "Manifest",
    "MappedRows",
    "MemoryRows",
    "RowOrder",
    "TrainRows",
    "count_examples",
    "is_converted",
    "open_split",
    "DataCursor",
    "Dataset",
    "DatasetError",
    "ShardPlan",
    "dataset_kind",
    "iter_batches",
    "load_csv",
    "load_dataset",
    "load_digits",
    "load_idx",
    "load_mnist5k",
    "load_npz",
    "read_idx",
    "shard_indices",
    "split",
]
