"""``python -m dniasync.data convert SRC DEST``: any supported source to the converted format.

Sources: a built-in name, MNIST IDX (a file or a directory), ``.npz``, CSV
(``.csv[.gz]``, streamed), Parquet (streamed by row group) and JSON Lines
(``.jsonl[.gz]``: ``{"x": [...], "y": 3}`` per line, or text with ``--text``,
see :mod:`.text`). Bad input stops the conversion with exit status 2 and a
message naming the file, the row (1-based, as an editor counts lines; the
header is row 1 of a CSV that has one) and the column or field; nothing is
left under DEST. ``verify DEST`` checks a converted set's checksums.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final, TextIO

import numpy as np
from numpy.typing import NDArray

from .converted import FEATURE_DTYPES, ConvertedDataset, ConvertedWriter
from .readers import (
    BUILTIN_DATASETS,
    DatasetError,
    _builtin_file,
    _find_idx_pair,
    _idx_labels_for,
    _open_maybe_gzip,
    read_idx,
)

__all__ = ["ConvertOptions", "Progress", "convert", "main"]

_CHUNK_ROWS: Final = 4096


class Progress:
    """A one-line progress bar on stderr, redrawn at most every 0.2 s: done / total (bytes or rows)."""

    def __init__(self, what: str, total: int, out: IO[str] | None = None, width: int = 28) -> None:
        self.what, self.total, self.width = what, max(1, total), width
        self.out = out if out is not None else sys.stderr
        self.rows = 0
        self._last = 0.0
        self._started = time.monotonic()

    def update(self, done: int, rows: int) -> None:
        self.rows = rows
        now = time.monotonic()
        if now - self._last >= 0.2:
            self._last = now
            self._draw(done)

    def _draw(self, done: int) -> None:
        frac = min(1.0, done / self.total)
        filled = int(frac * self.width)
        rate = self.rows / max(1e-9, time.monotonic() - self._started)
        print(f"\r{self.what} [{'#' * filled}{'.' * (self.width - filled)}] {frac:4.0%} "
              f"{self.rows:,} rows ({rate:,.0f}/s)", end="", file=self.out, flush=True)

    def close(self, rows: int | None = None) -> None:
        if rows is not None:
            self.rows = rows
        self._draw(self.total)
        print(file=self.out, flush=True)


@dataclass(frozen=True)
class ConvertOptions:
    label: str | int | None = None
    """The label column (CSV: index or header name, default 0; Parquet/JSON Lines: field, default ``y``)."""
    features: str = "x"
    """Parquet/JSON Lines/npz: the features column, field or array."""
    header: bool | None = None
    dtype: str | None = None
    """The stored features' dtype (default: the source's, float64 stored as float32; CSV: float32)."""
    scale: float | None = None
    """Divide features by this when read (default 255 for uint8, else 1)."""
    rows_per_file: int = 1 << 16
    text: dict[str, Any] | None = None
    """With text options (:func:`.text.convert_text`): the source is text to tokenize."""


class _Chunks:
    """A source read in chunks of rows: ``(x, y)`` pairs, plus progress (bytes or rows of a known total)."""

    def __init__(self, it: Iterator[tuple[NDArray[Any], NDArray[Any]]], total: int, done: Any, dtype: str,
                 shape: list[int], scale: float | None) -> None:
        self.it, self.total, self.done, self.dtype, self.shape, self.scale = it, total, done, dtype, shape, scale


def _store_dtype(source: np.dtype[Any], asked: str | None, where: str) -> str:
    if asked is not None:
        if asked not in FEATURE_DTYPES:
            raise DatasetError(f"--dtype {asked!r}: one of {', '.join(FEATURE_DTYPES)}")
        return asked
    if source == np.float64:
        return "float32"
    name = np.dtype(source.newbyteorder("=")).name
    if name not in FEATURE_DTYPES:
        raise DatasetError(f"{where}: features of dtype {name} cannot be stored ({', '.join(FEATURE_DTYPES)})")
    return name


def _fits(x: NDArray[Any], dtype: str, where: str, first_row: int, columns: Sequence[str] | None = None) -> None:
    """Refuse values the stored dtype cannot hold exactly (integer types) or at all (float16 overflow)."""
    target = np.dtype(dtype)
    if np.issubdtype(x.dtype, np.integer) and np.issubdtype(target, np.integer):
        info = np.iinfo(target)
        bad = (x < info.min) | (x > info.max)
    elif np.issubdtype(target, np.integer):
        info = np.iinfo(target)
        bad = ~np.isfinite(x) | (x != np.round(x)) | (x < info.min) | (x > info.max)
    else:
        bad = ~np.isfinite(x.astype(target)) if np.issubdtype(x.dtype, np.floating) else np.zeros(x.shape, bool)
    if bad.any():
        r, c = (int(v) for v in np.argwhere(bad.reshape(x.shape[0], -1))[0])
        col = columns[c] if columns is not None else f"feature {c}"
        value = x.reshape(x.shape[0], -1)[r, c]
        raise DatasetError(f"{where}: row {first_row + r}, column {col}: {value!r} does not fit {dtype}")


def _labels(y: NDArray[Any], where: str, first_row: int, field: str) -> NDArray[np.int64]:
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if not (np.issubdtype(y.dtype, np.number) or y.dtype == np.bool_) or y.ndim != 1:
        raise DatasetError(f"{where}: field {field}: labels must be one number per row, got {y.dtype} {list(y.shape)}")
    yf = y.astype(np.float64)
    bad = ~np.isfinite(yf) | (yf != np.round(yf)) | (yf < 0)
    if bad.any():
        r = int(np.argmax(bad))
        raise DatasetError(f"{where}: row {first_row + r}, field {field}: label {y[r]!r} is not a whole number >= 0")
    return yf.astype(np.int64)


def _in_memory(x: NDArray[Any], y: NDArray[Any], opts: ConvertOptions, where: str, label_field: str) -> _Chunks:
    if x.ndim < 2 or y.ndim < 1 or x.shape[0] != y.shape[0]:
        raise DatasetError(f"{where}: features {list(x.shape)} and labels {list(y.shape)} must be [N, ...] and [N]")
    dtype = _store_dtype(x.dtype, opts.dtype, where)
    labels = _labels(y, where, 1, label_field)
    state = {"done": 0}

    def chunks() -> Iterator[tuple[NDArray[Any], NDArray[Any]]]:
        for lo in range(0, x.shape[0], _CHUNK_ROWS):
            part = x[lo:lo + _CHUNK_ROWS]
            _fits(part, dtype, where, lo + 1)
            state["done"] = lo + part.shape[0]
            yield part, labels[lo:lo + _CHUNK_ROWS]

    return _Chunks(chunks(), x.shape[0], lambda: state["done"], dtype, list(x.shape[1:]), None)


def _idx_source(path: Path, opts: ConvertOptions) -> _Chunks:
    if path.is_dir():
        pairs = [p for p in (_find_idx_pair(path, "train"), _find_idx_pair(path, "t10k")) if p]
        if not pairs:
            raise DatasetError(f"{path}: no train-images-idx3-ubyte[.gz] or t10k-images-idx3-ubyte[.gz]")
    else:
        labels = _idx_labels_for(path)
        if labels == path or not labels.is_file():
            raise DatasetError(f"IDX images {path}: label file not found (looked for {labels})")
        pairs = [(path, labels)]
    xs, ys = [], []
    for images, labels in pairs:
        x, y = read_idx(images), read_idx(labels)
        if x.shape[0] != y.shape[0]:
            raise DatasetError(f"{images} has {x.shape[0]} images but {labels} has {y.shape[0]} labels")
        xs.append(x)
        ys.append(y)
    return _in_memory(np.concatenate(xs), np.concatenate(ys), opts, str(path), "label")


def _npz_source(path: Path, opts: ConvertOptions) -> _Chunks:
    y_key = opts.label if isinstance(opts.label, str) else "y"
    try:
        archive = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path}: not a readable .npz archive: {e}") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DatasetError(f"{path}: holds a single array, expected an .npz archive")
    with archive:
        for key in (opts.features, y_key):
            if key not in archive.files:
                raise DatasetError(f"{path}: no array {key!r} (has {sorted(archive.files)})")
        try:
            x, y = archive[opts.features], archive[y_key]
        except ValueError as e:
            raise DatasetError(f"{path}: {e}") from None
    return _in_memory(x, y, opts, str(path), y_key)


class _CountingReader(io.RawIOBase):
    """Counts the compressed bytes read from a file, for the progress bar."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw, self.count = raw, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self.raw.readinto(b)  # type: ignore[attr-defined]
        self.count += n or 0
        return n or 0


def _open_counted_text(path: Path) -> tuple[TextIO, _CountingReader]:
    with _open_maybe_gzip(path) as probe:
        compressed = isinstance(probe, gzip.GzipFile)
    counter = _CountingReader(path.open("rb"))
    buffered = io.BufferedReader(counter)
    stream: Any = gzip.GzipFile(fileobj=buffered) if compressed else buffered
    return io.TextIOWrapper(stream, encoding="utf-8", newline=""), counter


def _csv_source(path: Path, opts: ConvertOptions) -> _Chunks:
    text, counter = _open_counted_text(path)
    rows = csv.reader(text)
    try:
        first = next(rows)
    except StopIteration:
        raise DatasetError(f"{path}: empty CSV file") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise DatasetError(f"{path}: row 1: {e}") from None

    def is_number(s: str) -> bool:
        try:
            float(s)
        except ValueError:
            return False
        return True

    header = opts.header if opts.header is not None else not all(is_number(s) for s in first)
    names = [s.strip() for s in first] if header else [f"column {i}" for i in range(len(first))]
    label = 0 if opts.label is None else opts.label
    if isinstance(label, str):
        if not header:
            raise DatasetError(f"{path}: label column {label!r} named but no header row")
        if label not in names:
            raise DatasetError(f"{path}: no column {label!r} in header {names[:8]}...")
        label_index = names.index(label)
    else:
        label_index = label
    if not -len(names) <= label_index < len(names):
        raise DatasetError(f"{path}: label column {label_index} out of range for {len(names)} columns")
    label_index %= len(names)
    feature_names = [n for i, n in enumerate(names) if i != label_index]
    if not feature_names:
        raise DatasetError(f"{path}: no feature columns besides the label")
    dtype = opts.dtype or "float32"
    if dtype not in FEATURE_DTYPES:
        raise DatasetError(f"--dtype {dtype!r}: one of {', '.join(FEATURE_DTYPES)}")

    def parse(block: list[list[str]], first_row: int) -> tuple[NDArray[Any], NDArray[Any]]:
        for r, fields in enumerate(block):
            if len(fields) != len(names):
                raise DatasetError(f"{path}: row {first_row + r}: {len(fields)} columns, the first row has {len(names)}")
        try:
            table = np.array(block, dtype=np.float64)
        except ValueError:
            for r, fields in enumerate(block):
                for c, value in enumerate(fields):
                    if not is_number(value):
                        raise DatasetError(f"{path}: row {first_row + r}, column {names[c]}: {value!r} is not a "
                                           "number") from None
            raise
        y = _labels(table[:, label_index], str(path), first_row, names[label_index])
        x = np.delete(table, label_index, axis=1)
        _fits(x, dtype, str(path), first_row, feature_names)
        return x, y

    def chunks() -> Iterator[tuple[NDArray[Any], NDArray[Any]]]:
        row = 2 if header else 1
        block = [] if header else [first]
        try:
            for fields in rows:
                if not fields or all(not f.strip() for f in fields):
                    continue
                block.append(fields)
                if len(block) >= _CHUNK_ROWS:
                    yield parse(block, row)
                    row += len(block)
                    block = []
        except (UnicodeDecodeError, csv.Error, EOFError, OSError) as e:
            raise DatasetError(f"{path}: after row {row + len(block) - 1}: {e}") from None
        if block:
            yield parse(block, row)
        text.close()

    return _Chunks(chunks(), path.stat().st_size, lambda: counter.count, dtype, [len(feature_names)], None)


def _parquet_source(path: Path, opts: ConvertOptions) -> _Chunks:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DatasetError(f"{path}: not a readable Parquet file: {e}") from None
    label = opts.label if isinstance(opts.label, str) else "y"
    schema = pf.schema_arrow
    if label not in schema.names:
        raise DatasetError(f"{path}: no label field {label!r} (fields {schema.names})")
    if opts.features in schema.names and pa.types.is_list(schema.field(opts.features).type) or \
            opts.features in schema.names and pa.types.is_fixed_size_list(schema.field(opts.features).type):
        columns = [opts.features]
        value_type = schema.field(opts.features).type.value_type
    else:
        columns = [n for n in schema.names if n != label]
        bad = [n for n in columns if not (pa.types.is_integer(schema.field(n).type)
                                          or pa.types.is_floating(schema.field(n).type))]
        if bad:
            raise DatasetError(f"{path}: column {bad[0]} is {schema.field(bad[0]).type}, not a number")
        value_type = schema.field(columns[0]).type if columns else pa.float32()
    if not columns:
        raise DatasetError(f"{path}: no feature columns besides the label {label!r}")
    dtype = _store_dtype(np.dtype(value_type.to_pandas_dtype()), opts.dtype, str(path))
    state = {"done": 0}

    def to_matrix(batch: Any, first_row: int) -> NDArray[Any]:
        if len(columns) == 1 and columns[0] == opts.features:
            col = batch.column(opts.features)
            if col.null_count:
                r = int(np.argmax(col.is_null().to_numpy(zero_copy_only=False)))
                raise DatasetError(f"{path}: row {first_row + r}, field {opts.features}: null")
            lengths = col.value_lengths().to_numpy(zero_copy_only=False) if pa.types.is_list(col.type) else None
            width = int(lengths[0]) if lengths is not None and len(lengths) else col.type.list_size \
                if pa.types.is_fixed_size_list(col.type) else 0
            if lengths is not None and (lengths != width).any():
                r = int(np.argmax(lengths != width))
                raise DatasetError(f"{path}: row {first_row + r}, field {opts.features}: {int(lengths[r])} values, "
                                   f"row {first_row} has {width}")
            return np.asarray(col.flatten().to_numpy(zero_copy_only=False)).reshape(len(col), -1)
        mats = []
        for name in columns:
            col = batch.column(name)
            if col.null_count:
                r = int(np.argmax(col.is_null().to_numpy(zero_copy_only=False)))
                raise DatasetError(f"{path}: row {first_row + r}, column {name}: null")
            mats.append(col.to_numpy(zero_copy_only=False))
        return np.stack(mats, axis=1)

    def chunks() -> Iterator[tuple[NDArray[Any], NDArray[Any]]]:
        row = 1
        for batch in pf.iter_batches(batch_size=_CHUNK_ROWS, columns=[*columns, label]):
            x = to_matrix(batch, row)
            ycol = batch.column(label)
            if ycol.null_count:
                r = int(np.argmax(ycol.is_null().to_numpy(zero_copy_only=False)))
                raise DatasetError(f"{path}: row {row + r}, field {label}: null")
            y = _labels(ycol.to_numpy(zero_copy_only=False), str(path), row, label)
            _fits(x, dtype, str(path), row, columns if len(columns) > 1 else None)
            row += batch.num_rows
            state["done"] = row - 1
            yield x, y

    width = 0
    if pf.num_row_groups:
        first = pf.read_row_group(0, columns=columns).slice(0, 1).combine_chunks().to_batches()
        if first:
            width = to_matrix(first[0], 1).shape[1]
    return _Chunks(chunks(), pf.metadata.num_rows, lambda: state["done"], dtype, [width], None)


def _jsonl_source(path: Path, opts: ConvertOptions) -> _Chunks:
    text, counter = _open_counted_text(path)
    label = opts.label if isinstance(opts.label, str) else "y"
    dtype = opts.dtype or "float32"
    shape: list[int] = []

    def records() -> Iterator[tuple[int, dict[str, Any]]]:
        with text:
            for line_no, line in enumerate(text, 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)
                except ValueError as e:
                    raise DatasetError(f"{path}: row {line_no}: not JSON: {e}") from None
                if not isinstance(doc, dict):
                    raise DatasetError(f"{path}: row {line_no}: not a JSON object")
                yield line_no, doc

    it = records()
    try:
        first_no, first = next(it)
    except StopIteration:
        raise DatasetError(f"{path}: no rows") from None
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: {e}") from None
    if opts.features not in first:
        raise DatasetError(f"{path}: row {first_no}: no field {opts.features!r}")
    shape = list(np.asarray(first[opts.features]).shape)

    def chunks() -> Iterator[tuple[NDArray[Any], NDArray[Any]]]:
        xs: list[Any] = []
        ys: list[Any] = []
        start = first_no

        def flush() -> tuple[NDArray[Any], NDArray[Any]]:
            x = np.asarray(xs, dtype=np.float64)
            _fits(x, dtype, str(path), start)
            return x, np.asarray(ys, dtype=np.int64)

        for line_no, doc in _chain(first_no, first, it):
            for key in (opts.features, label):
                if key not in doc:
                    raise DatasetError(f"{path}: row {line_no}: no field {key!r}")
            value, y = doc[opts.features], doc[label]
            try:
                arr = np.asarray(value, dtype=np.float64)
            except (TypeError, ValueError):
                raise DatasetError(f"{path}: row {line_no}, field {opts.features}: not an array of numbers") from None
            if list(arr.shape) != shape:
                raise DatasetError(f"{path}: row {line_no}, field {opts.features}: shape {list(arr.shape)}, row "
                                   f"{first_no} has {shape}")
            if isinstance(y, bool) or not isinstance(y, (int, float)) or y != int(y) or y < 0:
                raise DatasetError(f"{path}: row {line_no}, field {label}: label {y!r} is not a whole number >= 0")
            if not xs:
                start = line_no
            xs.append(arr)
            ys.append(int(y))
            if len(xs) >= _CHUNK_ROWS:
                yield flush()
                xs.clear()
                ys.clear()
        if xs:
            yield flush()

    return _Chunks(chunks(), path.stat().st_size, lambda: counter.count, dtype, shape, None)


def _chain(first_no: int, first: dict[str, Any], rest: Iterator[tuple[int, dict[str, Any]]]
           ) -> Iterator[tuple[int, dict[str, Any]]]:
    yield first_no, first
    yield from rest


def source_kind(src: str) -> str:
    """builtin, idx, npz, csv, parquet or jsonl, from the name (a directory: IDX files)."""
    if src in BUILTIN_DATASETS:
        return "builtin"
    lower = src.lower()
    for kind, suffixes in (("npz", (".npz",)), ("csv", (".csv", ".csv.gz", ".tsv")),
                           ("parquet", (".parquet", ".pq")), ("jsonl", (".jsonl", ".jsonl.gz", ".json", ".json.gz")),
                           ("idx", ("idx3-ubyte", "idx3-ubyte.gz"))):
        if lower.endswith(suffixes):
            return kind
    if Path(src).is_dir():
        return "idx"
    raise DatasetError(f"{src}: not a built-in name ({', '.join(BUILTIN_DATASETS)}) nor a path ending in .npz, "
                       ".csv[.gz], .parquet, .jsonl[.gz], idx3-ubyte[.gz], nor a directory of IDX files")


def _source(src: str, opts: ConvertOptions) -> _Chunks:
    kind = source_kind(src)
    if kind == "builtin":
        path, scale = _builtin_file(src)
        chunks = _csv_source(path, ConvertOptions(label=-1, header=False, dtype="uint8"))
        chunks.scale = scale
        return chunks
    path = Path(src)
    if not path.exists():
        raise DatasetError(f"no such file: {path}")
    return {"idx": _idx_source, "npz": _npz_source, "csv": _csv_source, "parquet": _parquet_source,
            "jsonl": _jsonl_source}[kind](path, opts)


def convert(src: str, dest: str | Path, opts: ConvertOptions = ConvertOptions(), *,
            progress: IO[str] | None = None, quiet: bool = False) -> ConvertedDataset:
    """Convert ``src`` into a converted data set at ``dest`` (replaced if it exists); returns it opened."""
    if opts.text is not None:
        from .text import convert_text

        convert_text(Path(src), Path(dest), opts, progress=None if quiet else progress or sys.stderr)
        return ConvertedDataset(dest)
    chunks = _source(src, opts)
    writer = ConvertedWriter(dest, dtype=chunks.dtype, shape=chunks.shape, rows_per_file=opts.rows_per_file)
    bar = None if quiet else Progress(f"converting {Path(src).name}", chunks.total, progress)
    try:
        for x, y in chunks.it:
            writer.write(x, y)
            if bar is not None:
                bar.update(chunks.done(), writer.rows)
        scale = opts.scale or chunks.scale or (255.0 if chunks.dtype == "uint8" else 1.0)
        writer.finish(scale=scale, source=str(src))
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close(writer.rows)
    return ConvertedDataset(dest)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dniasync.data", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="convert SRC into the memory-mapped format at DEST")
    c.add_argument("src", help="a built-in name or a path: IDX, .npz, .csv[.gz], .parquet, .jsonl[.gz]")
    c.add_argument("dest", help="the directory to write (replaced if it is a converted set; refused otherwise)")
    c.add_argument("--label", help="label column (CSV: index or name; default 0) or field (default y; text: overall)")
    c.add_argument("--features", default="x", help="features field/column/array (JSON Lines, Parquet, npz)")
    c.add_argument("--header", choices=("yes", "no"), help="CSV: whether row 1 is a header (default: detected)")
    c.add_argument("--dtype", choices=FEATURE_DTYPES, help="store features as (default: the source's; CSV float32)")
    c.add_argument("--scale", type=float, help="divide features by this when read (default 255 for uint8, else 1)")
    c.add_argument("--rows-per-file", type=int, default=1 << 16)
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    t = c.add_argument_group("text (Amazon-review-style JSON Lines or CSV)")
    t.add_argument("--text", action="store_true", help="the source is text: tokenize it")
    t.add_argument("--text-fields", default="summary,reviewText", help="fields joined into the text")
    t.add_argument("--label-offset", type=int, default=0, help="subtracted from each label (1 for Amazon's 1-5)")
    t.add_argument("--tokenizer", choices=("wordpiece", "hash"), default="wordpiece",
                   help="wordpiece: a Hugging Face tokenizer trained on the source, saved beside the data; "
                        "hash: feature hashing of lower-cased words")
    t.add_argument("--vocab-size", type=int, default=8192)
    t.add_argument("--max-len", type=int, default=128, help="tokens per row (truncated, padded with 0)")
    v = sub.add_parser("verify", help="check a converted set against its manifest, checksums included")
    v.add_argument("dest")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "verify":
            ds = ConvertedDataset(args.dest, verify_checksums=True)
            print(f"{args.dest}: {len(ds):,} rows in {len(ds.manifest.files)} files, checksums match")
            return 0
        dest = Path(args.dest)
        if dest.exists() and not (dest / "manifest.json").is_file():
            raise DatasetError(f"{dest} exists and is not a converted data set: not replacing it")
        label: str | int | None = args.label
        if isinstance(label, str) and label.lstrip("-").isdigit():
            label = int(label)
        text = None
        if args.text:
            text = {"fields": [f for f in args.text_fields.split(",") if f], "label": label or "overall",
                    "label_offset": args.label_offset, "tokenizer": args.tokenizer,
                    "vocab_size": args.vocab_size, "max_len": args.max_len}
        opts = ConvertOptions(label=label, features=args.features,
                              header=None if args.header is None else args.header == "yes", dtype=args.dtype,
                              scale=args.scale, rows_per_file=args.rows_per_file, text=text)
        ds = convert(args.src, dest, opts, quiet=args.quiet)
    except DatasetError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    m = ds.manifest
    print(f"{dest}: {m.rows:,} rows, {m.kind} {m.dtype} {m.shape}, {m.n_classes} classes, {len(m.files)} files")
    return 0
