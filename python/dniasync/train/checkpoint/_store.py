"""CheckpointStore: numbered checkpoint directories under one root, finalized by rename."""

from __future__ import annotations

import datetime
import logging
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import safetensors.numpy

from ._format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMismatch,
    PartRecord,
    canonical_json,
    config_diff,
    config_hash,
    fsync_dir,
    parse_parts,
    read_manifest,
    seal,
    verify_files,
    write_bytes_durably,
    write_part,
)

__all__ = ["CheckpointState", "CheckpointStore", "LoadedCheckpoint", "Part", "PendingCheckpoint"]

log = logging.getLogger("dniasync.train.checkpoint")

_FINAL = re.compile(r"ckpt-(\d{8,})")
_PENDING = re.compile(r"\.tmp-(\d{8,})-[0-9a-f]{32}")
_TRASH_PREFIX: Final = ".trash-"


@dataclass(frozen=True)
class Part:
    """One part's tensors (numpy arrays, any shape) and its plain-JSON meta (versions, incarnation...)."""

    tensors: Mapping[str, np.ndarray]
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointState:
    """Everything one checkpoint holds: named parts and the job-level meta (cursors, history...)."""

    parts: Mapping[str, Part]
    meta: Mapping[str, Any] = field(default_factory=dict)
    wall_time_s: float = 0.0


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint whose manifest and every file verified; tensors are read on demand."""

    path: Path
    seq: int
    wall_time_s: float
    created_at: str
    meta: dict[str, Any]
    records: dict[str, PartRecord]

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(sorted(self.records))

    def part_meta(self, part: str) -> dict[str, Any]:
        return self._record(part).meta

    def tensors(self, part: str) -> dict[str, np.ndarray]:
        """The part's arrays, read from its (already verified) file."""
        return safetensors.numpy.load_file(self.path / self._record(part).file)

    def _record(self, part: str) -> PartRecord:
        try:
            return self.records[part]
        except KeyError:
            raise KeyError(f"{self.path.name} has no part {part!r}; it has {list(self.parts)}") from None


class PendingCheckpoint:
    """A checkpoint being written in ``root/.tmp-<seq>-<uuid>/``; invisible until :meth:`commit`."""

    def __init__(self, store: CheckpointStore, seq: int, path: Path) -> None:
        self.store = store
        self.seq = seq
        self.path = path
        self._records: dict[str, PartRecord] = {}

    def write_part(
        self, part: str, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None
    ) -> PartRecord:
        """Write one part here (another process may instead call ``write_part(pending.path, ...)``)."""
        if part in self._records:
            raise CheckpointError(f"part {part!r} was already written to {self.path}")
        record = write_part(self.path, part, tensors, meta)
        self._records[part] = record
        return record

    def commit(
        self,
        meta: Mapping[str, Any] | None = None,
        wall_time_s: float = 0.0,
        records: Iterable[PartRecord] = (),
    ) -> Path:
        """Write the manifest, fsync, rename to ``ckpt-<seq>``, then prune to the last K.

        ``records`` are parts written by other processes into :attr:`path`;
        each one's file must be there with the size its record gives.
        """
        parts = dict(self._records)
        for record in records:
            if record.part in parts:
                raise CheckpointError(f"part {record.part!r} given twice")
            path = self.path / record.file
            size = path.stat().st_size if path.exists() else None
            if size != record.size:
                found = "missing" if size is None else f"{size} bytes"
                raise CheckpointError(f"{path}: {found}, record says {record.size}")
            parts[record.part] = record
        if not parts:
            raise CheckpointError("a checkpoint needs at least one part")
        meta_dict = dict(meta or {})
        try:
            canonical_json(meta_dict)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"job meta is not plain JSON data: {exc}") from exc
        body = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "job": self.store.job,
            "config_hash": self.store.config_hash,
            "config": self.store.config,
            "seq": self.seq,
            "wall_time_s": float(wall_time_s),
            "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
            "parts": {part: record.to_dict() for part, record in sorted(parts.items())},
            "meta": meta_dict,
        }
        listed = {record.file for record in parts.values()}
        for entry in self.path.iterdir():
            if entry.name not in listed:  # a part writer's leftovers (a .partial file it was killed writing)
                entry.unlink()
        write_bytes_durably(self.path / MANIFEST, seal(body))
        fsync_dir(self.path)
        final = self.store.root / f"ckpt-{self.seq:08d}"
        os.rename(self.path, final)
        fsync_dir(self.store.root)
        self.path = final
        self.store.prune()
        return final

    def abandon(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class CheckpointStore:
    """Numbered checkpoints of one job under ``root``, the last ``keep`` good ones kept.

    One process (the job runner) begins and commits checkpoints, one at a
    time (:meth:`begin` clears what an earlier, interrupted one left); any process
    may write parts into a pending checkpoint and any may read (reading never
    changes the directory). ``config`` is the part of the job's config a
    resume must match: its sha256 is checked on load and its canonical JSON
    is stored so a mismatch names the dotted keys that differ.
    """

    def __init__(self, root: Path, job: str, config: Mapping[str, Any], keep: int = 3) -> None:
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.job = job
        self.config_hash = config_hash(config)
        self.config: dict[str, Any] = dict(config)
        self.keep = keep

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Finalized checkpoint directories (verified or not), oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _FINAL.fullmatch(entry.name)
            if match and entry.is_dir():
                found.append((int(match.group(1)), entry))
        return sorted(found)

    def begin(self) -> PendingCheckpoint:
        """Start checkpoint number max(seen)+1; removes temp dirs a crashed writer left."""
        self.root.mkdir(parents=True, exist_ok=True)
        seqs = [seq for seq, _ in self.checkpoints()]
        for entry in self.root.iterdir():
            pending = _PENDING.fullmatch(entry.name)
            if pending:
                seqs.append(int(pending.group(1)))
            if pending or entry.name.startswith(_TRASH_PREFIX):
                log.info("checkpoint: removing %s left by an interrupted writer", entry)
                shutil.rmtree(entry, ignore_errors=True)
        seq = max(seqs, default=0) + 1
        path = self.root / f".tmp-{seq:08d}-{uuid.uuid4().hex}"
        path.mkdir()
        return PendingCheckpoint(self, seq, path)

    def write(self, state: CheckpointState) -> Path:
        """Write every part and the manifest, finalize by rename, prune; returns the checkpoint's path."""
        pending = self.begin()
        try:
            for part, content in state.parts.items():
                pending.write_part(part, content.tensors, content.meta)
            return pending.commit(state.meta, state.wall_time_s)
        except BaseException:
            if pending.path.name.startswith(".tmp-"):
                pending.abandon()
            raise

    def load(self, path: Path) -> LoadedCheckpoint:
        """Verify one checkpoint: manifest, format, job, config, then every file's size and sha256.

        Raises CheckpointCorrupt naming the bad file, or CheckpointMismatch if
        it is intact but written by another job, config or a newer format.
        """
        doc = read_manifest(path)
        if doc["job"] != self.job:
            raise CheckpointMismatch(f"{path} belongs to job {doc['job']!r}, not {self.job!r}")
        if doc["config_hash"] != self.config_hash:
            diff = config_diff(doc["config"], self.config)
            if config_hash(doc["config"]) != doc["config_hash"]:
                raise CheckpointCorrupt(path / MANIFEST, "config does not match its config_hash")
            raise CheckpointMismatch(
                f"{path} was written with a different config: " + "; ".join(diff or ["(same keys, different hash)"])
            )
        records = parse_parts(path, doc)
        verify_files(path, records)
        return LoadedCheckpoint(path, doc["seq"], doc["wall_time_s"], doc["created_at"], doc["meta"], records)

    def latest(self) -> LoadedCheckpoint | None:
        """The newest checkpoint that verifies, or None if there is none at all.

        A corrupt checkpoint is skipped with a warning naming the file and
        reason; CheckpointMismatch is raised (a resume with another config is
        a decision, not a fallback); CheckpointError if checkpoints exist but
        none verifies.
        """
        failures = []
        for _, path in reversed(self.checkpoints()):
            try:
                return self.load(path)
            except CheckpointCorrupt as exc:
                log.warning("checkpoint %s skipped: %s", path.name, exc)
                failures.append(str(exc))
        if failures:
            raise CheckpointError("no checkpoint verifies: " + "; ".join(failures))
        return None

    def prune(self) -> None:
        """Remove checkpoints older than the ``keep`` newest intact ones (sizes checked, not hashes)."""
        intact = 0
        for _, path in reversed(self.checkpoints()):
            if intact >= self.keep:
                trash = self.root / f"{_TRASH_PREFIX}{path.name}-{uuid.uuid4().hex}"
                # Rename first: a crash mid-delete leaves a name latest() never looks at.
                os.rename(path, trash)
                shutil.rmtree(trash, ignore_errors=True)
                continue
            try:
                doc = read_manifest(path)
                for record in parse_parts(path, doc).values():
                    if (path / record.file).stat().st_size != record.size:
                        raise CheckpointCorrupt(path / record.file, "size differs")
            except (CheckpointError, OSError):
                continue
            intact += 1
        fsync_dir(self.root)
