"""The converted on-disk format: Arrow IPC files, memory-mapped, plus ``manifest.json``.

A converted data set is a directory::

    manifest.json          format, version, rows, columns (dtype, shape), scale, files (rows, bytes, sha256)
    part-00000.arrow       Arrow IPC *file* format: record batches of rows, columns ``x`` and ``y``
    part-00001.arrow ...
    tokenizer.json         (text sets) the tokenizer the tokens were made with

``x`` is a fixed-size list of the features of one row, flattened, in the
source's own narrow type (uint8 pixels stay one byte: the scale to [0, 1] is
applied per batch, as the in-memory readers apply it to the whole set); token
sets hold int32 token ids padded with 0. ``y`` is int64.

Why Arrow IPC and not Parquet: an IPC file is the in-memory Arrow layout
written out, so ``pa.memory_map`` + ``pa.ipc.open_file`` give arrays whose
buffers *are* pages of the file: no decoding, no copy, and the OS page cache
is the only cache (pages a process never touches are never read, and under
memory pressure clean pages are dropped instead of swapped or OOM-killed).
Parquet is encoded and compressed per column chunk, so reading any row means
decoding its whole page into fresh memory; it is the better archive format,
and the converter reads it, but training reads at random rows every batch.

A :class:`ConvertedDataset` opens the manifest, checks every file's footer,
schema, row count and size against it (cheap: the footers only) and, when
asked, each file's sha256; it maps a file only when a row of it is first
read, so a process that reads one shard maps and touches only that shard's
files and pages (:attr:`ConvertedDataset.rows_read`, :meth:`ConvertedDataset.mapped`).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from ... import _core
from .readers import DatasetError, IndexArray

__all__ = [
    "FORMAT",
    "MANIFEST",
    "ConvertedDataset",
    "ConvertedWriter",
    "FileEntry",
    "Manifest",
    "is_converted",
]

FORMAT: Final = "dniasync.converted"
VERSION: Final = 1
MANIFEST: Final = "manifest.json"
X, Y = "x", "y"
#: dtypes a features column may hold (numpy names).
FEATURE_DTYPES: Final = ("uint8", "int8", "int16", "int32", "int64", "float16", "float32")
KINDS: Final = ("dense", "tokens")


def is_converted(spec: str) -> bool:
    """Whether ``spec`` is a directory holding a converted data set's manifest."""
    return (Path(spec) / MANIFEST).is_file()


@dataclass(frozen=True)
class FileEntry:
    name: str
    rows: int
    bytes: int
    sha256: str
    layout: list[list[int]] | None = None
    """Where its record batches are, as the writer left them: their first rows (and the end), the byte offsets of
    their features and of their labels. A reader then opens the file without reading a record batch (an older
    set without it is scanned)."""


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` says; :meth:`load` checks every field and names the one that is wrong."""

    rows: int
    dtype: str
    """Of the features column ``x``."""
    shape: list[int]
    """Of one row's features (``x`` holds them flattened)."""
    files: list[FileEntry]
    kind: str = "dense"
    scale: float = 1.0
    """Features are divided by this when read (``dense`` sets)."""
    n_classes: int = 0
    source: str = ""
    tokenizer: str | None = None
    """File name of the tokenizer beside the manifest (``tokens`` sets)."""
    vocab_size: int = 0
    text: dict[str, Any] = field(default_factory=dict)
    """How a text set was made (fields, max length, tokenizer kind), for the record."""

    @property
    def n_features(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1

    def to_json(self) -> str:
        doc = {"format": FORMAT, "version": VERSION, **asdict(self)}
        return json.dumps(doc, indent=2) + "\n"

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        path = directory / MANIFEST
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise DatasetError(f"{directory}: no {MANIFEST} (not a converted data set)") from None
        except (OSError, ValueError) as e:
            raise DatasetError(f"{path}: not readable JSON: {e}") from None

        def need(key: str, kind: type | tuple[type, ...], where: dict[str, Any] = doc, prefix: str = "") -> Any:
            if key not in where:
                raise DatasetError(f"{path}: missing field {prefix}{key!r}")
            value = where[key]
            if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
                raise DatasetError(f"{path}: field {prefix}{key!r} has the wrong type ({type(value).__name__})")
            return value

        if need("format", str) != FORMAT:
            raise DatasetError(f"{path}: format {doc['format']!r}, expected {FORMAT!r}")
        if need("version", int) != VERSION:
            raise DatasetError(f"{path}: version {doc['version']}, this reader knows {VERSION}")
        dtype = need("dtype", str)
        if dtype not in FEATURE_DTYPES:
            raise DatasetError(f"{path}: field 'dtype' is {dtype!r}; one of {', '.join(FEATURE_DTYPES)}")
        kind = doc.get("kind", "dense")
        if kind not in KINDS:
            raise DatasetError(f"{path}: field 'kind' is {kind!r}; one of {', '.join(KINDS)}")
        files = []
        for i, entry in enumerate(need("files", list)):
            if not isinstance(entry, dict):
                raise DatasetError(f"{path}: files[{i}] is not an object")
            layout = entry.get("layout")
            if layout is not None and not (
                    isinstance(layout, list) and len(layout) == 3 and all(isinstance(a, list) for a in layout)
                    and len(layout[0]) == len(layout[1]) + 1 == len(layout[2]) + 1
                    and all(isinstance(v, int) and not isinstance(v, bool) for a in layout for v in a)):
                raise DatasetError(f"{path}: field files[{i}].layout must be [starts, x offsets, y offsets] of ints, "
                                   "one start more than offsets")
            at = f"files[{i}]."
            files.append(FileEntry(need("name", str, entry, at), need("rows", int, entry, at),
                                   need("bytes", int, entry, at), need("sha256", str, entry, at), layout))
        m = cls(rows=need("rows", int), dtype=dtype, shape=[int(d) for d in need("shape", list)], files=files,
                kind=kind, scale=float(doc.get("scale", 1.0)), n_classes=int(doc.get("n_classes", 0)),
                source=str(doc.get("source", "")), tokenizer=doc.get("tokenizer"),
                vocab_size=int(doc.get("vocab_size", 0)), text=dict(doc.get("text", {})))
        if sum(f.rows for f in files) != m.rows:
            raise DatasetError(f"{path}: field 'rows' is {m.rows} but its files hold {sum(f.rows for f in files)}")
        if not m.scale > 0:
            raise DatasetError(f"{path}: field 'scale' must be > 0, got {m.scale}")
        return m


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _layout(source: Any, reader: Any, path: Path, row_bytes: int) -> tuple[IndexArray, IndexArray, IndexArray]:
    """Where a mapped file's record batches are: their first rows (and the end), the byte offsets of their
    features and of their labels in the file. Fails naming the file if a batch is not stored as it is read."""
    source.seek(0)
    base = np.frombuffer(source.read_buffer(), dtype=np.uint8)  # the mapping itself: no page is read
    starts, x_at, y_at = [0], [], []
    for i in range(reader.num_record_batches):
        batch = reader.get_batch(i)
        x_at.append(batch.column(X).values.to_numpy(zero_copy_only=True).ctypes.data - base.ctypes.data)
        y_at.append(batch.column(Y).to_numpy(zero_copy_only=True).ctypes.data - base.ctypes.data)
        starts.append(starts[-1] + batch.num_rows)
    first = np.asarray(starts, dtype=np.int64)
    xa, ya = np.asarray(x_at, dtype=np.int64), np.asarray(y_at, dtype=np.int64)
    sizes = np.diff(first)
    outside = (xa < 0) | (ya < 0) | (xa + sizes * row_bytes > base.size) | (ya + sizes * 8 > base.size)
    if bool(outside[sizes > 0].any()):
        raise DatasetError(f"{path}: record batches not stored in the file as they are read (compressed?)")
    return first, xa, ya


def _stated_layout(stated: list[list[int]], batches: int, size: int, path: Path,
                   row_bytes: int) -> tuple[IndexArray, IndexArray, IndexArray]:
    """A manifest's layout of a file (:attr:`FileEntry.layout`), checked against the file's record batch count and
    size."""
    first, xa, ya = (np.asarray(a, dtype=np.int64) for a in stated)
    sizes = np.diff(first)
    if xa.size != batches or first[0] != 0 or bool((sizes < 0).any()) or bool(
            ((xa < 0) | (ya < 0) | (xa + sizes * row_bytes > size) | (ya + sizes * 8 > size))[sizes > 0].any()):
        raise DatasetError(f"{path}: the manifest's layout does not fit the file ({batches} record batches, "
                           f"{size} bytes)")
    return first, xa, ya


def _rows_at_every_byte(whole: NDArray[np.uint8], width: int) -> NDArray[np.uint8]:
    """``whole`` seen as rows of ``width`` bytes starting at every byte: row ``i`` is ``whole[i:i + width]``."""
    n = max(whole.size - width + 1, 0)
    return np.lib.stride_tricks.as_strided(whole, shape=(n, width), strides=(1, 1), writeable=False)


class _Part:
    """One mapped file, its rows addressed by byte offset in the mapping (nothing is copied until a batch is taken).

    Arrow keeps each record batch's buffers contiguous but puts headers between batches, so the file is not one
    array of rows; a row is a byte offset in the mapping, whatever its record batch. A batch of uint8 rows is then
    one pass of the Rust gather (:func:`~dniasync._core.gather_rows_u8`: copied, converted and scaled at once, the
    GIL released); other dtypes index a view of the whole mapping with a row starting at every byte.
    """

    def __init__(self, path: Path, row_bytes: int, layout: tuple[IndexArray, IndexArray, IndexArray]) -> None:
        import pyarrow as pa

        self.source = pa.memory_map(str(path), "r")
        self.whole = np.frombuffer(self.source.read_buffer(), dtype=np.uint8)
        """The mapping, as bytes."""
        self.x, self.y = _rows_at_every_byte(self.whole, row_bytes), _rows_at_every_byte(self.whole, 8)
        self.row_bytes = row_bytes
        self.starts, x_at, y_at = layout
        # local row r of record batch b is at base[b] + r * width
        self._x_base = x_at - self.starts[:-1] * row_bytes
        self._y_base = y_at - self.starts[:-1] * 8
        sizes = np.diff(self.starts)
        # record batches of one size (the writer's, all but the last): a row's batch is a division
        uniform = sizes.size > 1 and sizes[0] > 0 and bool((sizes[:-1] == sizes[0]).all())
        self._batch_rows = int(sizes[0]) if uniform else 0

    def offsets(self, local: IndexArray) -> tuple[IndexArray, IndexArray]:
        """Where rows ``local`` of this file are: the byte offsets of their features and of their labels."""
        if self._batch_rows:
            b = np.minimum(local // self._batch_rows, self._x_base.size - 1)
        else:
            b = np.searchsorted(self.starts, local, side="right") - 1
        return self._x_base[b] + local * self.row_bytes, self._y_base[b] + local * 8


class ConvertedDataset:
    """A converted data set, read by rows straight from its memory-mapped files.

    Opening checks each file against the manifest (footer, columns and dtypes,
    rows, size; ``verify_checksums``: sha256 too) and fails naming the file and
    the field. Files are mapped on first use. Thread-safe: a prefetching thread
    may read while another trains.
    """

    def __init__(self, path: str | Path, *, verify_checksums: bool = False) -> None:
        self.path = Path(path)
        self.manifest = m = Manifest.load(self.path)
        self.name = self.path.name
        self._file_starts = np.cumsum([0, *(f.rows for f in m.files)]).astype(np.int64)
        self._starts: list[int] = self._file_starts.tolist()
        self.row_bytes = self.n_features * np.dtype(m.dtype).itemsize
        """Bytes of one row's features in the files."""
        self._layouts = [self._check_file(entry, verify_checksums) for entry in m.files]
        self._fused = m.dtype == "uint8" and not self.tokens
        """uint8 features: batches come from the Rust gather (``_core.gather_rows_u8``)."""
        self._parts: dict[int, _Part] = {}
        self._lock = threading.Lock()
        self.rows_read = 0
        """Rows gathered so far (counted per row asked, repeats included)."""

    def __len__(self) -> int:
        return self.manifest.rows

    @property
    def n_features(self) -> int:
        return self.manifest.n_features

    @property
    def n_classes(self) -> int:
        return self.manifest.n_classes

    @property
    def tokens(self) -> bool:
        return self.manifest.kind == "tokens"

    def _check_file(self, entry: FileEntry, verify_checksums: bool) -> tuple[IndexArray, IndexArray, IndexArray]:
        """Check one file against the manifest; its record batches' layout (:func:`_layout`)."""
        import pyarrow as pa
        import pyarrow.ipc as ipc

        path = self.path / entry.name
        if not path.is_file():
            raise DatasetError(f"{path}: missing (listed in {self.path / MANIFEST})")
        expected = {X: pa.list_(pa.from_numpy_dtype(np.dtype(self.manifest.dtype)), self.n_features), Y: pa.int64()}
        try:
            # with the layout in the manifest only the footer is read (no mapping: a page fault in it would read
            # megabytes around it on a cold cache); an older set's record batches are scanned through a mapping
            with pa.OSFile(str(path), "r") if entry.layout else pa.memory_map(str(path), "r") as source:
                reader = ipc.open_file(source)
                for column, arrow_type in expected.items():
                    if column not in reader.schema.names:
                        raise DatasetError(f"{path}: no column {column!r} (has {reader.schema.names})")
                    got = reader.schema.field(column).type
                    if got != arrow_type:
                        raise DatasetError(f"{path}: column {column!r} is {got}, the manifest says {arrow_type}")
                if entry.layout:
                    layout = _stated_layout(entry.layout, reader.num_record_batches, path.stat().st_size, path,
                                            self.row_bytes)
                else:
                    layout = _layout(source, reader, path, self.row_bytes)
        except (pa.ArrowInvalid, OSError) as e:
            size = path.stat().st_size
            raise DatasetError(f"{path}: not a readable Arrow IPC file ({size} bytes, the manifest says "
                               f"{entry.bytes}: truncated?): {e}") from None
        rows = int(layout[0][-1])
        if rows != entry.rows:
            raise DatasetError(f"{path}: {rows} rows, the manifest says {entry.rows}")
        size = path.stat().st_size
        if size != entry.bytes:
            raise DatasetError(f"{path}: {size} bytes, the manifest says {entry.bytes}")
        if verify_checksums and _sha256(path) != entry.sha256:
            raise DatasetError(f"{path}: sha256 does not match the manifest's (the file changed after conversion)")
        return layout

    def verify(self) -> None:
        """Check every file's sha256 against the manifest."""
        for entry in self.manifest.files:
            self._check_file(entry, True)

    def _part(self, k: int) -> _Part:
        part = self._parts.get(k)
        if part is None:
            with self._lock:
                part = self._parts.get(k)
                if part is None:
                    part = self._parts[k] = _Part(self.path / self.manifest.files[k].name, self.row_bytes,
                                                  self._layouts[k])
        return part

    def record_batches(self) -> tuple[IndexArray, IndexArray, IndexArray, IndexArray]:
        """Every record batch of the set, in row order: its first row (and the set's end), its file, and the byte
        offsets of its features and labels in that file (what :meth:`gather_at` takes)."""
        first = [self._file_starts[k] + layout[0][:-1] for k, layout in enumerate(self._layouts)]
        files = [np.full(layout[1].size, k, dtype=np.int64) for k, layout in enumerate(self._layouts)]
        none = np.empty(0, dtype=np.int64)
        return (np.concatenate([*first, [len(self)]]).astype(np.int64), np.concatenate([none, *files]),
                np.concatenate([none, *(layout[1] for layout in self._layouts)]),
                np.concatenate([none, *(layout[2] for layout in self._layouts)]))

    def mapped(self) -> list[str]:
        """Names of the files this process has mapped so far."""
        return [self.manifest.files[k].name for k in sorted(self._parts)]

    def gather(self, rows: IndexArray) -> tuple[NDArray[Any], IndexArray]:
        """Features and labels of ``rows`` (in that order), copied out of the mapping.

        Dense sets give float32 ``[k, D]`` divided by the scale (as the in-memory
        readers compute it: bit for bit the same values); token sets give int64.
        """
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return self._values(np.empty((0, self.n_features), dtype=np.dtype(self.manifest.dtype))), \
                np.empty(0, dtype=np.int64)
        lo, hi = int(rows.min()), int(rows.max())
        if lo < 0 or hi >= len(self):
            raise DatasetError(f"{self.name}: rows outside [0, {len(self)})")
        k = bisect.bisect_right(self._starts, lo) - 1
        if hi < self._starts[k + 1]:  # one file: nearly every batch, since a file holds many blocks
            x, y = self._rows(k, *self._part(k).offsets(rows - self._starts[k]))
        else:
            x = np.empty((rows.size, self.n_features), dtype=np.int64 if self.tokens else np.float32)
            y = np.empty(rows.size, dtype=np.int64)
            files = np.searchsorted(self._file_starts, rows, side="right") - 1
            for k in np.unique(files).tolist():
                sel = np.flatnonzero(files == k)
                x[sel], y[sel] = self._rows(k, *self._part(k).offsets(rows[sel] - self._starts[k]))
        self.rows_read += int(rows.size)
        return x, y

    def gather_at(self, file: int, x_offsets: IndexArray, y_offsets: IndexArray) -> tuple[NDArray[Any], IndexArray]:
        """:meth:`gather` for rows of one file located by the caller: their byte offsets (:meth:`record_batches`)."""
        x, y = self._rows(file, x_offsets, y_offsets)
        self.rows_read += int(y.size)
        return x, y

    def block_rows(self, bounds: list[int], file: list[int], x: list[int], y: list[int],
                   files: set[int]) -> _core.BlockRows | None:
        """A Rust reader of uint8 rows by position (:class:`~dniasync._core.BlockRows`, what
        :class:`~dniasync.train.data.source.MappedRows` reads through) over the files ``files`` (mapped here;
        the others are not served); None for other dtypes."""
        if not self._fused:
            return None
        srcs = [self._part(k).whole if k in files else None for k in range(len(self.manifest.files))]
        return _core.BlockRows(srcs, bounds, file, x, y, self.row_bytes, float(self.manifest.scale))

    def gather_files(self, files: IndexArray, x_offsets: IndexArray, y_offsets: IndexArray
                     ) -> tuple[NDArray[Any], IndexArray]:
        """:meth:`gather_at` for rows of several files: row ``i`` of file ``files[i]``."""
        x = np.empty((files.size, self.n_features), dtype=np.int64 if self.tokens else np.float32)
        y = np.empty(files.size, dtype=np.int64)
        order = np.argsort(files, kind="stable")
        sorted_files = files[order]
        cuts = np.flatnonzero(np.diff(sorted_files)) + 1
        for sel in np.split(order, cuts):
            x[sel], y[sel] = self._rows(int(files[sel[0]]), x_offsets[sel], y_offsets[sel])
        self.rows_read += int(files.size)
        return x, y

    def _rows(self, file: int, x_offsets: IndexArray, y_offsets: IndexArray) -> tuple[NDArray[Any], IndexArray]:
        """The values and labels of the rows of file ``file`` at these byte offsets."""
        part = self._part(file)
        y = part.y[y_offsets].view(np.int64).reshape(-1)
        if self._fused:  # gathered and scaled in one pass from the mapping, bit for bit what _values gives
            x_offsets = np.ascontiguousarray(x_offsets, dtype=np.int64)
            x = np.empty((x_offsets.size, self.n_features), dtype=np.float32)
            _core.gather_rows_u8(part.whole, x_offsets, self.row_bytes, float(self.manifest.scale), x)
            return x, y
        return self._values(part.x[x_offsets].view(np.dtype(self.manifest.dtype))), y

    def _values(self, x: NDArray[Any]) -> NDArray[Any]:
        if self.tokens:
            return x.astype(np.int64)
        if self.manifest.scale == 1.0:
            return x.astype(np.float32)
        # one pass: each element cast to float32, then divided in float32, as the in-memory readers do it
        scaled: NDArray[np.float32] = np.divide(x, np.float32(self.manifest.scale), dtype=np.float32)
        return scaled


class ConvertedWriter:
    """Writes a converted data set: rows appended in chunks, files rolled every ``rows_per_file`` rows.

    Everything goes to a temporary directory beside ``dest``, renamed to ``dest``
    by :meth:`finish` (a crash leaves no half-written data set under the name).
    """

    def __init__(self, dest: str | Path, *, dtype: str, shape: Sequence[int], kind: str = "dense",
                 rows_per_file: int = 1 << 16, batch_rows: int = 4096) -> None:
        import pyarrow as pa

        if dtype not in FEATURE_DTYPES:
            raise DatasetError(f"features of dtype {dtype} cannot be stored; one of {', '.join(FEATURE_DTYPES)}")
        self.dest = Path(dest)
        self.tmp = self.dest.with_name(f".{self.dest.name}.tmp-{os.getpid()}")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self.dtype, self.shape, self.kind = dtype, list(shape), kind
        self.n_features = int(np.prod(self.shape)) if self.shape else 1
        self.rows_per_file, self.batch_rows = rows_per_file, batch_rows
        self.schema = pa.schema([(X, pa.list_(pa.from_numpy_dtype(np.dtype(dtype)), self.n_features)),
                                 (Y, pa.int64())])
        self.files: list[FileEntry] = []
        self.rows = 0
        self.max_label = -1
        self._writer: Any = None
        self._file_rows = 0

    def _roll(self) -> None:
        import pyarrow as pa
        import pyarrow.ipc as ipc

        self._close_file()
        name = f"part-{len(self.files):05d}.arrow"
        self._sink = pa.OSFile(str(self.tmp / name), "wb")
        self._writer = ipc.new_file(self._sink, self.schema)
        self._name, self._file_rows = name, 0

    def _close_file(self) -> None:
        import pyarrow as pa
        import pyarrow.ipc as ipc

        if self._writer is None:
            return
        self._writer.close()
        self._sink.close()
        path = self.tmp / self._name
        with pa.memory_map(str(path), "r") as source:  # just written: its pages are in memory
            row_bytes = self.n_features * np.dtype(self.dtype).itemsize
            first, xa, ya = _layout(source, ipc.open_file(source), path, row_bytes)
        self.files.append(FileEntry(self._name, self._file_rows, path.stat().st_size, _sha256(path),
                                    [first.tolist(), xa.tolist(), ya.tolist()]))
        self._writer = None

    def write(self, x: NDArray[Any], y: NDArray[Any]) -> None:
        """Append rows ``x [k, ...]`` (cast to the set's dtype, which must hold them) and labels ``y [k]``."""
        import pyarrow as pa

        x = np.ascontiguousarray(x.reshape(x.shape[0], -1), dtype=np.dtype(self.dtype))
        if x.shape[1] != self.n_features:
            raise DatasetError(f"rows of {x.shape[1]} features, the set has {self.n_features}")
        y = np.asarray(y, dtype=np.int64)
        if y.size:
            self.max_label = max(self.max_label, int(y.max()))
        start = 0
        while start < x.shape[0]:
            if self._writer is None or self._file_rows >= self.rows_per_file:
                self._roll()
            end = min(x.shape[0], start + self.batch_rows, start + self.rows_per_file - self._file_rows)
            values = pa.array(x[start:end].reshape(-1))
            batch = pa.record_batch([pa.FixedSizeListArray.from_arrays(values, self.n_features),
                                     pa.array(y[start:end])], schema=self.schema)
            self._writer.write_batch(batch)
            self._file_rows += end - start
            self.rows += end - start
            start = end

    def finish(self, *, scale: float = 1.0, source: str = "", n_classes: int | None = None,
               extra_files: Sequence[Path] = (), **fields: Any) -> Manifest:
        """Close the last file, write the manifest, move ``extra_files`` in, rename into place."""
        self._close_file()
        if self.rows == 0:
            self.abort()
            raise DatasetError(f"{source}: no rows to convert")
        manifest = Manifest(rows=self.rows, dtype=self.dtype, shape=self.shape, files=self.files, kind=self.kind,
                            scale=scale, n_classes=self.max_label + 1 if n_classes is None else n_classes,
                            source=source, **fields)
        for extra in extra_files:
            shutil.move(str(extra), self.tmp / extra.name)
        (self.tmp / MANIFEST).write_text(manifest.to_json())
        for entry in os.scandir(self.tmp):
            with open(entry.path, "rb") as f:
                os.fsync(f.fileno())
        if self.dest.exists():
            shutil.rmtree(self.dest)
        os.rename(self.tmp, self.dest)
        return manifest

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._sink.close()
            self._writer = None
        shutil.rmtree(self.tmp, ignore_errors=True)
