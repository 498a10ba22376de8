"""Data sets as numpy arrays, a seeded train/held-out split, and epoch sharding.

:mod:`.readers` loads a :class:`Dataset` (``x: float32 [N, D]``, ``y: int64 [N]``)
from a built-in name or a local IDX, npz or CSV file and splits it reproducibly;
:mod:`.sharding` cuts the training set into per-epoch shards (:class:`ShardPlan`)
read through resumable :class:`DataCursor` positions.
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
from .sharding import Batch, DataCursor, ShardPlan, iter_batches, shard_indices

__all__ = [
    "BUILTIN_DATASETS",
    "Batch",
    "count_examples",
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
