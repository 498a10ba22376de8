"""What the job runner writes to disk at each checkpoint, and reads back on ``--resume``.

A checkpoint holds one part per PS shard (``ps-<k>``: parameters and optimizer
state as tensors; version, push ledger and fenced replicas as meta) and the
job's own state as meta: the mode's (data cursors, samples), the evaluation
history, the events, the bytes counted, the wall time. The config it belongs
to is stored with it; a resume under another config fails naming each key
that differs, except the sections a resumed run may change (``[stop]``,
``[eval]``, ``[checkpoint]``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Final

import numpy as np

from ..train.checkpoint import CheckpointState, CheckpointStore, LoadedCheckpoint, Part
from ..train.messages import ShardSnapshot
from ..train.specs import ShardResume, ShardSpec
from .config import Config
from .report import RunReport

__all__ = ["EPOCH_FILE", "RESUMABLE_SECTIONS", "checkpoint_store", "claim_epoch", "epoch_now", "job_state",
           "restore_report", "resumed_specs", "shard_parts"]

log = logging.getLogger("dniasync.cluster.durable")

RESUMABLE_SECTIONS: Final = ("stop", "eval", "checkpoint")
EPOCH_FILE: Final = "coordinator.epoch"
"""In the job's output directory: the epoch of the coordinator that runs the job (a standby that takes over
writes the next); a coordinator that reads a higher one than its own is fenced and writes nothing more."""
"""Sections a resumed run may change: how long it goes on, how often it evaluates and saves."""


def checkpoint_store(config: Config) -> CheckpointStore:
    root = Path(config.checkpoint.dir or Path(config.output_dir) / "checkpoints")
    identity = {k: v for k, v in config.to_dict().items() if k not in RESUMABLE_SECTIONS}
    identity["job"] = {k: v for k, v in identity.get("job", {}).items() if k != "output_dir"}
    return CheckpointStore(root, config.job.name, identity, keep=config.checkpoint.keep)


def shard_parts(snapshots: dict[int, ShardSnapshot]) -> dict[str, Part]:
    """One part per PS shard snapshot."""
    parts = {}
    for k, snap in snapshots.items():
        tensors = {"values": snap.values, **{f"state{slot}": s for slot, s in enumerate(snap.state, start=1)}}
        parts[f"ps-{k}"] = Part(tensors, {"version": snap.version, "ledger": snap.ledger, "fenced": snap.fenced,
                                          "slots": len(snap.state), "steps": snap.steps})
    return parts


def job_state(report: RunReport, wall_s: float, samples: int, mode: dict[str, Any]) -> dict[str, Any]:
    return {
        "wall_s": wall_s, "samples": samples, "mode": mode,
        "history": [p.to_dict() for p in report.history], "events": [e.to_dict() for e in report.events],
        "bytes_pushed": report.bytes_pushed, "bytes_pulled": report.bytes_pulled,
    }


def write(store: CheckpointStore, parts: dict[str, Part], meta: dict[str, Any]) -> Path:
    return store.write(CheckpointState(parts, meta, wall_time_s=float(meta["wall_s"])))


def resumed_specs(specs: list[ShardSpec], loaded: LoadedCheckpoint) -> list[ShardSpec]:
    """The PS shards' specs continuing from ``loaded`` (a shard it lacks starts afresh)."""
    out = []
    for spec in specs:
        part = f"ps-{spec.shard}"
        if part not in loaded.parts:
            log.warning("the checkpoint has no %s: it starts from its initial values", part)
            out.append(spec)
            continue
        meta, tensors = loaded.part_meta(part), loaded.tensors(part)
        state = [np.asarray(tensors[f"state{slot}"]) for slot in range(1, int(meta["slots"]) + 1)]
        # a checkpoint written before shards saved their step count: its version counts at least every step
        steps = int(meta.get("steps", meta["version"]))
        resume = ShardResume(int(meta["version"]) + 1, state, dict(meta["ledger"]), list(meta["fenced"]), steps)
        out.append(ShardSpec(spec.shard, spec.offset, np.asarray(tensors["values"]), spec.optimizer, spec.codec,
                             spec.staleness, spec.max_staleness, resume))
    return out


def restore_report(report: RunReport, meta: dict[str, Any]) -> None:
    """Put the saved history, events and byte counts back into a fresh report."""
    for p in meta["history"]:
        loss = p["loss"] if p["loss"] is not None else float("nan")
        report.record_eval(p["wall_s"], p["samples"], p["accuracy"], loss)
    for e in meta["events"]:
        details = {k: v for k, v in e.items() if k not in ("wall_s", "kind")}
        report.record_event(e["wall_s"], e["kind"], **details)
    report.add_bytes(pushed=int(meta["bytes_pushed"]), pulled=int(meta["bytes_pulled"]))


def _epoch_path(config: Config) -> Path:
    return Path(config.output_dir) / EPOCH_FILE


def epoch_now(config: Config) -> int:
    """The epoch of the coordinator that runs the job now (0: none written)."""
    try:
        return int(_epoch_path(config).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def claim_epoch(config: Config, epoch: int, address: str, *, fresh: bool = False) -> bool:
    """Record that the coordinator at ``address`` runs the job as ``epoch``; False if one of this epoch or
    a later one already does (another standby took over first). ``fresh``: a new run of the job, whatever an
    earlier run left. Written to a temporary file, then renamed."""
    path = _epoch_path(config)
    if not fresh and epoch_now(config) >= epoch:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{EPOCH_FILE}.{epoch}.tmp")
    tmp.write_text(f"{epoch} {address}\n")
    tmp.replace(path)
    return True
