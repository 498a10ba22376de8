"""Checkpoints: safetensors files plus a JSON manifest, finalized by rename, the last K kept.

Layout under a store's root::

    ckpt-00000007/
        manifest.json        format, job, config (+ sha256), wall time, per part:
                             file, sha256, size, tensor dtypes/shapes, meta
        ps-0.safetensors     one file per part, named by the caller
        stage-1.safetensors
    .tmp-00000008-<uuid>/    a checkpoint being written (ignored by readers)

Writing: parts go into the temp directory (each file written, read back for
its sha256, fsynced, renamed into its name), then the manifest (fsynced), the
directory is fsynced, renamed to ``ckpt-<seq>``, and the root fsynced. A
writer killed at any point leaves either the previous checkpoints alone or a
complete new one. No Python object serialization anywhere: tensors are safetensors, the rest JSON.

Several processes may write parts of one checkpoint when they share the
filesystem: the job runner calls :meth:`CheckpointStore.begin`, sends
``pending.path`` to each part owner, which calls :func:`write_part` and
returns its :class:`PartRecord` (``to_dict()``, plain JSON) to the runner,
which passes them to :meth:`PendingCheckpoint.commit`. Without a shared
filesystem the runner gathers parts over the wire and writes them itself.
"""

from ._format import (
    FORMAT_VERSION,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    PartRecord,
    config_diff,
    config_hash,
    write_part,
)
from ._store import CheckpointState, CheckpointStore, LoadedCheckpoint, Part, PendingCheckpoint

__all__ = [
    "FORMAT_VERSION",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointMismatch",
    "CheckpointState",
    "CheckpointStore",
    "LoadedCheckpoint",
    "Part",
    "PartRecord",
    "PendingCheckpoint",
    "config_diff",
    "config_hash",
    "write_part",
]
