"""The on-disk format: canonical JSON, the manifest, part files and their checks.

A checkpoint is a directory ``ckpt-<seq:08d>/`` holding one safetensors file
per part (``<part>.safetensors``) and ``manifest.json``. The manifest carries
its own sha256 (over its canonical JSON without that field), so a flipped
digit in a version number is caught like a flipped byte in a tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import safetensors.numpy

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointMismatch",
    "PartRecord",
    "canonical_json",
    "config_diff",
    "config_hash",
    "write_part",
]

FORMAT: Final = "dniasync-checkpoint"
FORMAT_VERSION: Final = 1
MANIFEST: Final = "manifest.json"
SUFFIX: Final = ".safetensors"
_PART_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK: Final = 1 << 20


class CheckpointError(Exception):
    """A checkpoint could not be written or no usable one could be read."""


class CheckpointCorrupt(CheckpointError):
    """One checkpoint fails its checks (a file's size or sha256, or its manifest)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class CheckpointMismatch(CheckpointError):
    """A checkpoint is intact but not this job's: job name, config or a newer format."""


def canonical_json(obj: Any) -> bytes:
    """One byte string per JSON value: sorted keys, no spaces, UTF-8.

    NaN and infinities are kept (as Python's json writes them) so a diverged
    loss in the history does not make the checkpoint unwritable.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def config_hash(config: Mapping[str, Any]) -> str:
    """sha256 (hex) of the config's canonical JSON."""
    try:
        return hashlib.sha256(canonical_json(config)).hexdigest()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"config is not plain JSON data: {exc}") from exc


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value


_ABSENT: Final = object()


def config_diff(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """Dotted keys whose values differ, as ``"optimizer.lr: 0.01 in the checkpoint, 0.02 now"``."""
    # Compare through JSON so tuples and lists, or 1 and 1.0 written as 1.0, agree with the hash.
    flat_saved: dict[str, Any] = {}
    flat_now: dict[str, Any] = {}
    _flatten(json.loads(canonical_json(saved)), "", flat_saved)
    _flatten(json.loads(canonical_json(now)), "", flat_now)
    lines = []
    for key in sorted(flat_saved.keys() | flat_now.keys()):
        a, b = flat_saved.get(key, _ABSENT), flat_now.get(key, _ABSENT)
        if a is _ABSENT or b is _ABSENT or canonical_json(a) != canonical_json(b):
            shown_a = "absent" if a is _ABSENT else json.dumps(a)
            shown_b = "absent" if b is _ABSENT else json.dumps(b)
            lines.append(f"{key or '(config)'}: {shown_a} in the checkpoint, {shown_b} now")
    return lines


def check_part_name(part: str) -> None:
    if not _PART_NAME.fullmatch(part) or part.endswith(SUFFIX) or part == MANIFEST:
        raise CheckpointError(
            f"part name {part!r} must be 1-128 of [A-Za-z0-9_.-], start alphanumeric, and not be a file name"
        )


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hash_file(path: Path, *, fsync: bool = False) -> tuple[str, int]:
    """sha256 and size of a file, read in 1 MiB chunks into one reused buffer."""
    digest = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            digest.update(view[:n])
            size += n
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest(), size


def write_bytes_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class PartRecord:
    """What writing one part produced; plain JSON (``to_dict``) so it can travel to the committer."""

    part: str
    file: str
    sha256: str
    size: int
    tensors: dict[str, dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "sha256": self.sha256,
            "size": self.size,
            "tensors": self.tensors,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, part: str, data: Mapping[str, Any]) -> PartRecord:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` naming what is wrong."""
        check_part_name(part)
        if set(data) != {"file", "sha256", "size", "tensors", "meta"}:
            raise ValueError(f"part {part!r} needs file, sha256, size, tensors, meta; got {sorted(data)}")
        file, digest, size = data["file"], data["sha256"], data["size"]
        if file != part + SUFFIX:
            raise ValueError(f"part {part!r} names file {file!r}, expected {part + SUFFIX!r}")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ValueError(f"part {part!r}: sha256 {digest!r} is not 64 hex digits")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"part {part!r}: size {size!r} is not an int >= 0")
        if not isinstance(data["tensors"], dict) or not isinstance(data["meta"], dict):
            raise ValueError(f"part {part!r}: tensors and meta must be objects")
        return cls(part, file, digest, size, data["tensors"], data["meta"])


def write_part(
    directory: Path,
    part: str,
    tensors: Mapping[str, np.ndarray],
    meta: Mapping[str, Any] | None = None,
) -> PartRecord:
    """Write ``<part>.safetensors`` into a pending checkpoint directory, durably.

    Usable from any process that sees ``directory`` (a part writer need not
    own the store). The file appears under its final name only once complete
    and fsynced; the sha256 is of the bytes read back, so it describes the
    file even if the arrays were being updated (Hogwild) while they were written.
    """
    check_part_name(part)
    meta_dict = dict(meta or {})
    try:
        canonical_json(meta_dict)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"meta of part {part!r} is not plain JSON data: {exc}") from exc
    arrays: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        if not isinstance(array, np.ndarray):
            raise CheckpointError(f"tensor {part}/{name} is a {type(array).__name__}, not a numpy array")
        # safetensors writes array.nbytes from the data pointer: a strided view would be saved wrong.
        # (Not np.ascontiguousarray: it turns a 0-d array into shape (1,).)
        arrays[name] = array if array.flags.c_contiguous else array.copy(order="C")
    final = directory / (part + SUFFIX)
    partial = directory / f".{part}.{uuid.uuid4().hex}.partial"
    try:
        safetensors.numpy.save_file(arrays, partial)
        digest, size = hash_file(partial, fsync=True)
        os.rename(partial, final)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    fsync_dir(directory)
    listing = {
        name: {"dtype": str(a.dtype), "shape": list(a.shape)} for name, a in sorted(arrays.items())
    }
    return PartRecord(part, final.name, digest, size, listing, meta_dict)


def seal(body: dict[str, Any]) -> bytes:
    """The manifest's bytes: its body plus a sha256 over the body's canonical JSON."""
    sealed = dict(body, manifest_sha256=hashlib.sha256(canonical_json(body)).hexdigest())
    return json.dumps(sealed, sort_keys=True, indent=1, ensure_ascii=False).encode() + b"\n"


def read_manifest(directory: Path) -> dict[str, Any]:
    """Parse and check ``manifest.json`` (its own checksum and shape); raises CheckpointCorrupt."""
    path = directory / MANIFEST
    try:
        doc = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointCorrupt(path, "missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointCorrupt(path, f"unreadable: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointCorrupt(path, f"not a {FORMAT} manifest")
    # The version comes first: it says how the rest (the seal included) is to be read.
    # A newer one is refused, not skipped: falling back would lose its progress and prune it.
    version = doc.get("format_version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise CheckpointMismatch(
            f"{path}: format version {version} is newer than this dniasync reads ({FORMAT_VERSION}); "
            "resume with the dniasync that wrote it"
        )
    if version != FORMAT_VERSION:
        raise CheckpointCorrupt(path, f"format version {version!r} is not {FORMAT_VERSION}")
    sealed = doc.pop("manifest_sha256", None)
    if sealed != hashlib.sha256(canonical_json(doc)).hexdigest():
        raise CheckpointCorrupt(path, "manifest_sha256 does not match its contents")
    expected = {"job": str, "config_hash": str, "config": dict, "seq": int, "parts": dict, "meta": dict,
                "wall_time_s": float, "created_at": str}
    for key, kind in expected.items():
        if not isinstance(doc.get(key), kind):
            raise CheckpointCorrupt(path, f"{key} is missing or not {kind.__name__}")
    return doc


def verify_files(directory: Path, parts: Mapping[str, PartRecord]) -> None:
    """Every part file has the size and sha256 the manifest gives; raises CheckpointCorrupt naming it."""
    for record in parts.values():
        path = directory / record.file
        try:
            size = path.stat().st_size
            if size != record.size:
                raise CheckpointCorrupt(path, f"size {size} bytes, manifest says {record.size}")
            digest, _ = hash_file(path)
        except FileNotFoundError:
            raise CheckpointCorrupt(path, "missing") from None
        except OSError as exc:
            raise CheckpointCorrupt(path, f"unreadable: {exc}") from None
        if digest != record.sha256:
            raise CheckpointCorrupt(
                path, f"sha256 {digest[:12]}... differs from the manifest's {record.sha256[:12]}..."
            )


def parse_parts(directory: Path, doc: Mapping[str, Any]) -> dict[str, PartRecord]:
    try:
        return {part: PartRecord.from_dict(part, data) for part, data in doc["parts"].items()}
    except (ValueError, TypeError, CheckpointError) as exc:
        raise CheckpointCorrupt(directory / MANIFEST, str(exc)) from None
