"""How a trainer's weights are shared: one registered plug-in axis (see :mod:`.base`).

Importing this package registers every sync: each implementation module calls
:func:`~.base.register` once. Adding a sync = one module + one import line here.
"""

from __future__ import annotations

from . import local, ps, shm  # noqa: F401 - each registers its kind
from . import p2p  # noqa: F401 - registers the p2p kind
from .base import SYNCS, Clock, SyncContext, SyncKind, SyncStats, WeightSync, build_sync, register, sync_kind
from .local import LocalOptimizer, load_optimizer_tensors, make_optimizer, optimizer_tensors, set_lr
from .ps import CollapsedWarnings, PSSync, ShardLink
from .shm import HOGWILD_SEGMENT, SharedStoreSync

__all__ = [
    "HOGWILD_SEGMENT",
    "SYNCS",
    "Clock",
    "CollapsedWarnings",
    "LocalOptimizer",
    "PSSync",
    "SharedStoreSync",
    "ShardLink",
    "SyncContext",
    "SyncKind",
    "SyncStats",
    "WeightSync",
    "build_sync",
    "load_optimizer_tensors",
    "make_optimizer",
    "optimizer_tensors",
    "register",
    "set_lr",
    "sync_kind",
]
