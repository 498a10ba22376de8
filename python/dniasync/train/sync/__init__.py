"""How a trainer's weights are shared: one registered plug-in axis (see :mod:`.base`).

Importing this package registers every sync: each implementation module calls
:func:`~.base.register` once. Adding a sync = one module + one import line here.
"""

from __future__ import annotations

from .base import SYNCS, Clock, SyncContext, SyncKind, SyncStats, WeightSync, build_sync, register, sync_kind

__all__ = [
    "SYNCS",
    "Clock",
    "SyncContext",
    "SyncKind",
    "SyncStats",
    "WeightSync",
    "build_sync",
    "register",
    "sync_kind",
]
