"""Converted data sets (#29): the memory-mapped reader against the in-memory array and torch's DataLoader, and start-up.

    python benchmarks/bench_data.py [--quick]

One set of uint8 images (784 features, 10 classes, random: the figures are about reading, not learning) is written
as a converted set (Arrow IPC files, ``python -m dniasync.data convert``'s format) and as an ``.npz``. Side by side:

- **batches/s**, one shard's epoch in batches of 64 by the seeded block order (``shuffle = "blocks"``), read the way
  a replica reads them: the in-memory array (``MemoryRows``, the ``.npz`` loaded whole), the memory-mapped reader
  (``MappedRows``: the next batch prefetched on its thread while this one is taken) and ``torch.utils.data.DataLoader``
  with 1 worker process over the same files and the same row batches (``__getitems__`` gathers a batch at once);
  ratio ``mmap_vs_in_memory`` (goal >= 0.9) and ``mmap_vs_dataloader``;
- **start-up of a replica**: a fresh process that imports torch, opens its split and has its first batch, on the set
  and on one 10 times its size, the files dropped from the page cache first (``posix_fadvise(DONTNEED)``: what a
  replica meets on a host that has not read them); ``startup_10x_over_1x`` (goal <= 1.2: flat). The process's own
  seconds to open the split and take a batch (imports excluded) are in the results beside it;
- ``sparse_push_bytes_reduction`` (dense / sparse bytes pushed per sample on the EmbeddingBag model) is a
  placeholder in the results: sparse pushes are not built yet.

Writes ``benchmarks/results/bench_data[_quick].json`` and ``.png``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

WIDTH, CLASSES, BATCH = 784, 10, 64

STARTUP_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import torch
from dniasync.train.data import DataCursor, ShardPlan
from dniasync.train.data.source import open_split
torch.set_num_threads(1)
t1 = time.perf_counter()
n_train = int(sys.argv[2])
rows, _, _ = open_split(sys.argv[1], {}, n_train, 1000, 0, shuffle="blocks")
idx, _ = ShardPlan(n_train, 2, 0, "blocks").next_batch(DataCursor(0), 64)
x, y = rows.take(idx)
torch.from_numpy(x)
print(json.dumps({"imports_s": t1 - t0, "open_and_first_batch_s": time.perf_counter() - t1}))
"""


def settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {"rows": 20_000, "startup_factor": 10, "repeat": 3, "startup_repeat": 2}
    return {"rows": 100_000, "startup_factor": 10, "repeat": 5, "startup_repeat": 5}


def make_sets(tmp: Path, rows: int, factor: int) -> dict[str, Path]:
    """The 1x set as a converted dir and an npz; the ``factor`` x set as a converted dir."""
    from dniasync.train.data.converted import ConvertedWriter

    rng = np.random.default_rng(0)
    paths = {}
    for name, n in (("1x", rows), (f"{factor}x", rows * factor)):
        writer = ConvertedWriter(tmp / name, dtype="uint8", shape=[WIDTH], rows_per_file=1 << 16)
        keep_x, keep_y = [], []
        for start in range(0, n, 8192):
            k = min(8192, n - start)
            x = np.frombuffer(rng.bytes(k * WIDTH), np.uint8).reshape(k, WIDTH)
            y = rng.integers(0, CLASSES, k)
            writer.write(x, y)
            if name == "1x":
                keep_x.append(x)
                keep_y.append(y)
        writer.finish(scale=255.0, source="bench_data", n_classes=CLASSES)
        paths[name] = tmp / name
        if name == "1x":
            np.savez(tmp / "1x.npz", x=np.concatenate(keep_x), y=np.concatenate(keep_y))
            paths["npz"] = tmp / "1x.npz"
    return paths


class _ConvertedFiles:
    """A map-style torch dataset over a converted set's rows, opened in the worker that reads it."""

    def __init__(self, path: Path) -> None:
        self.path, self._data = path, None

    def _open(self) -> Any:
        if self._data is None:
            from dniasync.train.data import ConvertedDataset

            self._data = ConvertedDataset(self.path)
        return self._data

    def __len__(self) -> int:
        return len(self._open())

    def __getitem__(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = self._open().gather(np.array([row]))
        return x[0], y[0]

    def __getitems__(self, rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
        result: tuple[np.ndarray, np.ndarray] = self._open().gather(np.asarray(rows, dtype=np.int64))
        return result

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_data": None}


def batches_per_s(paths: dict[str, Path], rows: int, repeat: int) -> dict[str, Any]:
    import torch

    from dniasync.train.data import DataCursor, MappedRows, ShardPlan
    from dniasync.train.data.source import open_split

    n_train = rows - 1000
    plan = ShardPlan(n_train, 1, 0, "blocks")
    positions, cursor = [], DataCursor(0)
    while cursor.epoch == 0:
        idx, cursor = plan.next_batch(cursor, BATCH)
        positions.append(idx)
    memory, _, _ = open_split(str(paths["npz"]), {}, n_train, 1000, 0, shuffle="blocks")
    mapped, _, _ = open_split(str(paths["1x"]), {}, n_train, 1000, 0, shuffle="blocks")
    assert isinstance(mapped, MappedRows) and not isinstance(memory, MappedRows)
    row_batches = [mapped.rows_of(p).tolist() for p in positions]

    def replica_loop(source: Any) -> float:
        source.take(positions[0])  # warm: the mapping made, the first pages in
        t0 = time.perf_counter()
        for i, idx in enumerate(positions):
            if i + 1 < len(positions):
                source.prefetch(positions[i + 1])
            x, y = source.take(idx)
            torch.from_numpy(x), torch.from_numpy(y)
        return len(positions) / (time.perf_counter() - t0)

    def dataloader() -> float:
        loader = torch.utils.data.DataLoader(_ConvertedFiles(paths["1x"]), batch_sampler=row_batches, num_workers=1,
                                             collate_fn=lambda b: (torch.from_numpy(b[0]), torch.from_numpy(b[1])))
        it = iter(loader)
        next(it)  # the worker started, its set opened: timed from its second batch, as the others from their first
        t0 = time.perf_counter()
        n = sum(1 for _ in it)
        return n / (time.perf_counter() - t0)

    out: dict[str, list[float]] = {"in_memory": [], "mmap": [], "dataloader_1_worker": []}
    for _ in range(repeat):  # interleaved, so a noisy neighbour hits all three alike
        out["in_memory"].append(replica_loop(memory))
        out["mmap"].append(replica_loop(mapped))
        out["dataloader_1_worker"].append(dataloader())
    mapped.close()
    return {name: {"batches_per_s": statistics.median(v), "runs": v} for name, v in out.items()} | {
        "batches": len(positions), "batch_size": BATCH}


def drop_from_page_cache(path: Path) -> None:
    for part in path.glob("*.arrow"):
        fd = os.open(part, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def startup(path: Path, rows: int, repeat: int) -> dict[str, Any]:
    walls, opens = [], []
    for _ in range(repeat):
        drop_from_page_cache(path)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", STARTUP_PROBE, str(path), str(rows - 1000)], capture_output=True,
                              text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
        walls.append(time.perf_counter() - t0)
        if done.returncode != 0:
            raise RuntimeError(done.stderr)
        opens.append(json.loads(done.stdout)["open_and_first_batch_s"])
    files = sorted(path.glob("*.arrow"))
    return {"rows": rows, "bytes": sum(f.stat().st_size for f in files), "files": len(files),
            "replica_start_s": statistics.median(walls), "open_and_first_batch_s": statistics.median(opens),
            "runs_s": walls}


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    readers = ("in_memory", "mmap", "dataloader_1_worker")
    rates = [results["read"][r]["batches_per_s"] for r in readers]
    left.bar(readers, rates, color=["tab:gray", "tab:blue", "tab:orange"])
    left.set_ylabel(f"batches/s (batches of {BATCH})")
    left.set_title("one shard's epoch, block-shuffled")
    sizes = [k for k in results["startup"]]
    width = 0.38
    xs = np.arange(len(sizes))
    right.bar(xs - width / 2, [results["startup"][k]["replica_start_s"] for k in sizes], width,
              label="replica start to first batch")
    right.bar(xs + width / 2, [results["startup"][k]["open_and_first_batch_s"] for k in sizes], width,
              label="open split + first batch (no imports)")
    right.set_xticks(xs, [f"{k} ({results['startup'][k]['bytes'] / 1e6:,.0f} MB)" for k in sizes])
    right.set_ylabel("seconds (page cache dropped)")
    right.set_title("start-up against data set size")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    args = _common.parser(__doc__.splitlines()[0]).parse_args()
    s = settings(args.quick)
    results: dict[str, Any] = {"config": s}
    with tempfile.TemporaryDirectory(prefix="bench_data_") as d:
        tmp = Path(d)
        big = f"{s['startup_factor']}x"
        _common.say(f"writing {s['rows']:,} and {s['rows'] * s['startup_factor']:,} rows of {WIDTH} bytes")
        paths = make_sets(tmp, s["rows"], s["startup_factor"])
        _common.say("reading: in memory, memory-mapped, DataLoader")
        results["read"] = batches_per_s(paths, s["rows"], s["repeat"])
        _common.say("start-up: 1x, then 10x")
        results["startup"] = {name: startup(paths[name], n, s["startup_repeat"])
                              for name, n in (("1x", s["rows"]), (big, s["rows"] * s["startup_factor"]))}
    results["sparse_push_bytes_reduction"] = "not built yet"  # Downpour sparse pushes of embedding rows: #29, to do
    read, start = results["read"], results["startup"]
    ratios = {
        "mmap_vs_in_memory": read["mmap"]["batches_per_s"] / read["in_memory"]["batches_per_s"],
        "mmap_vs_dataloader": read["mmap"]["batches_per_s"] / read["dataloader_1_worker"]["batches_per_s"],
        # the name and orientation: smaller is better here (goal <= 1.2)
        "startup_10x_over_1x": start[big]["replica_start_s"] / start["1x"]["replica_start_s"],
    }
    results["open_10x_over_1x"] = start[big]["open_and_first_batch_s"] / start["1x"]["open_and_first_batch_s"]
    path = _common.write("bench_data", args.quick, results, ratios)
    plot(results, path.with_suffix(".png"))
    _common.say("\n" + _common.table(
        [(name, f"{read[name]['batches_per_s']:,.0f} batches/s") for name in ("in_memory", "mmap",
                                                                               "dataloader_1_worker")],
        ("reader", f"median of {s['repeat']}, {read['batches']} batches of {BATCH}")))
    _common.say("\n" + _common.table(
        [(name, f"{v['bytes'] / 1e6:,.0f} MB in {v['files']} files", f"{v['replica_start_s']:.2f} s",
          f"{v['open_and_first_batch_s'] * 1e3:.0f} ms") for name, v in start.items()],
        ("set", "size", "replica start", "open + first batch")))
    goals = {"mmap_vs_in_memory": ">= 0.9", "mmap_vs_dataloader": "> 1", "startup_10x_over_1x": "<= 1.2"}
    rows = [(k, f"{v:.2f}", goals[k]) for k, v in ratios.items()]
    rows += [("open_10x_over_1x (no imports)", f"{results['open_10x_over_1x']:.2f}", ""),
             ("sparse_push_bytes_reduction", "not built yet", ">= 20")]
    _common.say("\n" + _common.table(rows, ("ratio", "value", "goal")))
    _common.say(f"\nwrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
