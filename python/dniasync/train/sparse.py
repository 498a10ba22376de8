"""Sparse pushes of embedding tables: only the rows a gradient touched travel to the PS shards (#29).

The gradient of an ``nn.Embedding`` or ``nn.EmbeddingBag`` weight is zero in every row whose token
did not occur in the batches accumulated since the last push; a text model's table is mostly such
rows. A sparse push sends a PS shard its slice of the pushed vector as **spans**: ``(start, length)``
pairs (uint32, ascending, disjoint, within the slice, as a ``[k, 2]`` array) and the float32 values
they cover, one span after the other. The spans cover the touched rows of the tables pushed sparsely
and every other parameter whole; adjacent rows (and a table's neighbouring parameters) merge into one
span. A row is touched when any of its values is not zero, so what a sparse push leaves out is zero.

:func:`touched` decides, per table and per push, which rows go (:data:`SPARSE_MODES`: ``"auto"``
pushes a table sparsely when fewer than half its rows are touched, ``"always"`` whenever the model has
one, ``"never"`` not at all); :func:`spans_of` cuts a shard's slice of the mask into spans.

The PS shard steps its store with the spans' values alone (``ParamStore.step_spans``, in the Rust core):
with SGD or Adagrad and no weight decay, where a zero gradient changes nothing, only the spans are read
and written, so the shard's work per push is the touched rows', not the table's, and a Hogwild worker's
step does not write back rows another worker is updating; with momentum, Nesterov, Adam or weight decay,
which move untouched rows too, the store steps the scattered gradient densely. Either way the weights are
those a dense push leaves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:  # a PS shard applies sparse pushes without importing torch
    from torch import nn

__all__ = ["SPARSE_MODES", "EmbeddingTable", "embedding_tables", "span_array", "span_values", "sparse_mode", "spans_of",
           "touched"]

SPARSE_MODES: Final = ("auto", "always", "never")
"""``auto``: a table goes sparse when fewer than half its rows are touched; ``always``; ``never``."""


def sparse_mode(setting: str | bool) -> str:
    """A config's ``sparse`` key (``"auto"``, ``true``, ``false``) as one of :data:`SPARSE_MODES`."""
    if setting is True:
        return "always"
    if setting is False:
        return "never"
    if setting != "auto":
        raise ValueError(f"sparse must be 'auto', true or false, got {setting!r}")
    return "auto"


@dataclass(frozen=True)
class EmbeddingTable:
    """An embedding weight in the flat parameter vector: ``rows`` x ``dim`` float32 from ``offset``."""

    offset: int
    rows: int
    dim: int

    @property
    def size(self) -> int:
        return self.rows * self.dim


def embedding_tables(model: nn.Module) -> list[EmbeddingTable]:
    """Every ``nn.Embedding`` / ``nn.EmbeddingBag`` weight of ``model``, placed as :func:`flatten_parameters` lays
    the parameters out (``model.parameters()`` order)."""
    from torch import nn

    offsets: dict[int, int] = {}
    offset = 0
    for p in model.parameters():
        offsets[id(p)] = offset
        offset += p.numel()
    tables = []
    for module in model.modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag) and id(module.weight) in offsets:
            rows, dim = module.weight.shape
            tables.append(EmbeddingTable(offsets[id(module.weight)], int(rows), int(dim)))
    return sorted(set(tables), key=lambda t: t.offset)


def touched(grad: NDArray[np.float32], tables: list[EmbeddingTable], mode: str) -> NDArray[np.bool_] | None:
    """Which elements of the flat vector ``grad`` a sparse push carries: every element outside the tables pushed
    sparsely, and their rows with a value that is not zero; None where no table goes sparse (push densely)."""
    if mode not in SPARSE_MODES:
        raise ValueError(f"unknown sparse push mode {mode!r}; expected one of {', '.join(SPARSE_MODES)}")
    if mode == "never":
        return None
    mask: NDArray[np.bool_] | None = None
    for table in tables:
        rows = grad[table.offset:table.offset + table.size].reshape(table.rows, table.dim).any(axis=1)
        if mode == "auto" and 2 * int(np.count_nonzero(rows)) >= table.rows:
            continue
        if mask is None:
            mask = np.ones(grad.size, dtype=np.bool_)
        mask[table.offset:table.offset + table.size] = np.repeat(rows, table.dim)
    return mask


def spans_of(mask: NDArray[np.bool_]) -> NDArray[np.uint32]:
    """``[k, 2]`` (start, length) of each run of True in ``mask``, ascending (uint32)."""
    edges = np.diff(mask.view(np.int8), prepend=np.int8(0), append=np.int8(0))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    return np.stack([starts, ends - starts], axis=1).astype(np.uint32)


def span_values(payload: NDArray[np.uint8]) -> NDArray[np.float32]:
    """A sparse push's payload as float32 (copied only when misaligned)."""
    flat = np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1)
    if flat.nbytes % 4:
        raise ValueError(f"a sparse push's payload of {flat.nbytes} bytes is not a whole number of float32")
    if flat.ctypes.data % 4:
        flat = flat.copy()
    return flat.view(np.float32)


def span_array(spans: NDArray[np.uint32]) -> NDArray[np.uint32]:
    """A sparse push's spans as the store takes them: contiguous and aligned (copied only when they are not)."""
    if isinstance(spans, np.ndarray) and (not spans.flags.c_contiguous or spans.ctypes.data % spans.itemsize):
        return spans.copy()
    return spans
