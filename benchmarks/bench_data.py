"""Converted data sets (#29): the memory-mapped reader against the in-memory array and torch's DataLoader, and start-up.

    python benchmarks/bench_data.py [--quick]

One set of uint8 images (784 features, 10 classes, random: the figures are about reading, not learning) is written
as a converted set (Arrow IPC files, ``python -m dniasync.data convert``'s format) and as an ``.npz``. Side by side:

- **batches/s**, one shard's epoch in batches of 64 by the seeded block order (``shuffle = "blocks"``), read the way
  a replica reads them: the in-memory array (``MemoryRows``, the ``.npz`` loaded whole), the memory-mapped reader
  (``MappedRows``: the next batches, ``AHEAD`` of them, prefetched on its thread while this one is taken; uint8 rows
  gathered and scaled from the mapping in one Rust pass) and ``torch.utils.data.DataLoader``
  with 1 worker process over the same files and the same row batches (``__getitems__`` gathers a batch at once);
  ratio ``mmap_vs_in_memory`` (goal >= 0.9) and ``mmap_vs_dataloader``; and the same two readers feeding what a
  replica does between batches, one step of a 784-256-10 MLP on one thread (``mmap_vs_in_memory_training``);
- **start-up of a replica**: a fresh process that imports torch, opens its split and has its first batch, on the set
  and on one 10 times its size, the files dropped from the page cache first (``posix_fadvise(DONTNEED)``: what a
  replica meets on a host that has not read them); ``startup_10x_over_1x`` (goal <= 1.2: flat). The process's own
  seconds to open the split and take a batch (imports excluded) are in the results beside it;
- **a set larger than the memory a trainer may use** (``large``): 6 GB of generated uint8 images (``--quick``:
  0.8 GB) in a temporary directory (under ``$BENCH_DATA_DIR`` if set; not on tmpfs), written with progress and
  deleted as soon as it has been read (on Ctrl-C and SIGTERM too), read whole by 2 trainer processes, one shard each
  (block-shuffled, blocks of 8,192 rows), each in a memory cgroup of its own limited to 1.5 GB (``--quick``: 0.6 GB;
  the limit is put on after the trainer has imported torch and taken a step). Stated per trainer: whether it
  trained, OOM kills, rows read and MB/s, its peak RSS (``VmHWM``, mapped pages included) and its group's peak
  (page cache included). Needs root and a cgroup v1 memory controller (``_memcg.py``; skipped with the reason in the
  results otherwise);
- **sparse pushes** (``_sparse_push.py``): Downpour on the fastText example's job (EmbeddingBag), dense pushes
  against pushes of the touched rows only, at batches of 32 and 16: bytes pushed per sample, samples/s and held-out
  accuracy of both; ``sparse_push_bytes_reduction`` (dense / sparse bytes per sample at the example's batch of 32,
  goal >= 20) and ``sparse_push_samples_per_s`` (sparse / dense).

Writes ``benchmarks/results/bench_data[_quick].json`` and ``.png``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
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
import _sparse_push  # noqa: E402

WIDTH, CLASSES, BATCH = 784, 10, 64
AHEAD = 2
"""Batches a reader is asked for ahead of the one taken: a replica asks for its next batch before it steps on this
one (and for all of a call's batches at once when it takes several steps per call); with nothing to compute between
batches here, one batch ahead would time the hand-over between threads, not the reader."""

STARTUP_PROBE = """
import json, sys, time
t0 = time.perf_counter()
import torch
from dniasync.train.data import DataCursor, ShardPlan
from dniasync.train.data.source import open_split
torch.set_num_threads(1)
t1 = time.perf_counter()
n_train = int(sys.argv[2])
rows, _, _ = open_split(sys.argv[1], {}, n_train, 1000, 0, shuffle="blocks", held_out=False)  # as a replica does
idx, _ = ShardPlan(n_train, 2, 0, "blocks").next_batch(DataCursor(0), 64)
x, y = rows.take(idx)
torch.from_numpy(x)
print(json.dumps({"imports_s": t1 - t0, "open_and_first_batch_s": time.perf_counter() - t1}))
"""


LARGE_PROBE = """
import json, sys, time, torch
from torch.nn import functional as F
from dniasync.train.data import DataCursor, ShardPlan
from dniasync.train.data.source import open_split
torch.set_num_threads(1)
path, shard, n_shards, n_train, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
rows, _, _ = open_split(path, {}, n_train, 1000, 0, shuffle="blocks", block=block)
plan = ShardPlan(n_train, n_shards, 0, "blocks", block=block, window=1)
model = torch.nn.Linear(rows.n_features, 10)
opt = torch.optim.SGD(model.parameters(), lr=0.01)

def step(x, y):
    opt.zero_grad(); loss = F.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)); loss.backward(); opt.step()
    return float(loss.detach())

idx, cursor = plan.next_batch(DataCursor(shard), 256)
step(*rows.take(idx))  # one step first: what training holds besides the data is in the group before the limit
print("ready", flush=True)
sys.stdin.readline()  # the limit is on
t0 = time.perf_counter()
while cursor.epoch < 1:
    rows.prefetch(plan.next_batch(cursor, 256)[0])
    idx, cursor = plan.next_batch(cursor, 256)
    loss = step(*rows.take(idx))
seconds = time.perf_counter() - t0
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
kb = lambda key: int(status[key].split()[0]) * 1024
print(json.dumps({"rows_read": rows.rows_touched, "seconds": seconds, "loss": loss, "peak_rss_bytes": kb("VmHWM"),
                  "rss_anon_bytes": kb("RssAnon"), "rss_file_bytes": kb("RssFile")}))
"""


def settings(quick: bool) -> dict[str, Any]:
    # large: a set of large_bytes read by `trainers` processes (one shard each), each in a memory cgroup limited to
    # large_limit_bytes; blocks of large_block rows (6.4 MB) are at least the disk's read-ahead, so a block's first
    # page fault brings in little that its shard does not read next
    if quick:
        return {"rows": 20_000, "startup_factor": 10, "repeat": 5, "startup_repeat": 2,
                "large_bytes": 800_000_000, "large_limit_bytes": 600_000_000, "large_trainers": 2, "large_block": 8192}
    return {"rows": 100_000, "startup_factor": 10, "repeat": 5, "startup_repeat": 5,
            "large_bytes": 6_000_000_000, "large_limit_bytes": 1_500_000_000, "large_trainers": 2, "large_block": 8192}


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
        self.path = path
        self._data: Any = None

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

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 256), torch.nn.ReLU(), torch.nn.Linear(256, CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        """A replica's work between batches: one step of a 784-256-10 MLP."""
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()

    def replica_loop(source: Any, train: bool = False) -> float:
        """Batches/s of one epoch taken as a replica takes them (``train``: with :func:`step` between)."""
        source.take(positions[0])  # warm: the mapping made, the first pages in
        for idx in positions[:AHEAD]:
            source.prefetch(idx)
        t0 = time.perf_counter()
        for i, idx in enumerate(positions):
            if i + AHEAD < len(positions):
                source.prefetch(positions[i + AHEAD])
            x, y = source.take(idx)
            tx, ty = torch.from_numpy(x), torch.from_numpy(y)
            if train:
                step(tx, ty)
        return len(positions) / (time.perf_counter() - t0)

    def dataloader() -> float:
        files: Any = _ConvertedFiles(paths["1x"])  # a map-style set by its __getitem__ and __len__
        loader = torch.utils.data.DataLoader(files, batch_sampler=row_batches, num_workers=1,
                                             collate_fn=lambda b: (torch.from_numpy(b[0]), torch.from_numpy(b[1])))
        it = iter(loader)
        next(it)  # the worker started, its set opened: timed from its second batch, as the others from their first
        t0 = time.perf_counter()
        n = sum(1 for _ in it)
        return n / (time.perf_counter() - t0)

    out: dict[str, list[float]] = {"in_memory": [], "mmap": [], "dataloader_1_worker": [], "in_memory_training": [],
                                   "mmap_training": []}
    for _ in range(repeat):  # interleaved, so a noisy neighbour hits all of them alike
        out["in_memory"].append(replica_loop(memory))
        out["mmap"].append(replica_loop(mapped))
        out["dataloader_1_worker"].append(dataloader())
        out["in_memory_training"].append(replica_loop(memory, train=True))
        out["mmap_training"].append(replica_loop(mapped, train=True))
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


def write_large(dest: Path, rows: int) -> None:
    """``rows`` random uint8 rows of WIDTH as a converted set, progress every tenth; then out of the page cache."""
    from dniasync.train.data.converted import ConvertedWriter

    rng = np.random.default_rng(1)
    writer = ConvertedWriter(dest, dtype="uint8", shape=[WIDTH], rows_per_file=1 << 16)
    t0, shown = time.perf_counter(), 0
    try:
        for start in range(0, rows, 8192):
            k = min(8192, rows - start)
            writer.write(np.frombuffer(rng.bytes(k * WIDTH), np.uint8).reshape(k, WIDTH), rng.integers(0, CLASSES, k))
            if (start + k) * 10 // rows > shown:
                shown = (start + k) * 10 // rows
                _common.say(f"  written {(start + k) * WIDTH / 1e9:.1f} of {rows * WIDTH / 1e9:.1f} GB "
                            f"({shown * 10}%, {time.perf_counter() - t0:.0f} s)")
        writer.finish(scale=255.0, source="bench_data", n_classes=CLASSES)
    except BaseException:
        writer.abort()
        raise
    drop_from_page_cache(dest)  # the trainers' reads are charged to their own groups, not to this process's


def large_set(tmp: Path, s: dict[str, Any]) -> dict[str, Any]:
    """A set several times a trainer's memory limit, read whole by trainers each in a memory cgroup of that limit."""
    import _memcg

    reason = _memcg.unavailable()
    if reason is not None:
        return {"skipped": reason}
    rows, limit, n = s["large_bytes"] // WIDTH, s["large_limit_bytes"], s["large_trainers"]
    dest = tmp / "large"
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    fs = max((m for m in mounts if str(tmp.resolve()).startswith(m[1])), key=lambda m: len(m[1]))[2]
    if fs in ("tmpfs", "ramfs"):  # its pages would be memory, not clean page cache a cgroup can drop
        return {"skipped": f"{tmp} is on {fs}: set BENCH_DATA_DIR to a directory on a disk"}
    if shutil.disk_usage(tmp).free < 1.1 * s["large_bytes"]:
        return {"skipped": f"less than {1.1 * s['large_bytes'] / 1e9:.1f} GB free under {tmp}"}
    _common.say(f"large set: writing {rows:,} rows ({rows * WIDTH / 1e9:.1f} GB) to {dest}")
    write_large(dest, rows)
    files = sorted(dest.glob("*.arrow"))
    out: dict[str, Any] = {"rows": rows, "bytes": sum(f.stat().st_size for f in files), "files": len(files),
                           "limit_bytes": limit, "block_rows": s["large_block"], "batch_size": 256, "trainers": []}
    _common.say(f"large set: {n} trainers, one shard each, each in a memory cgroup limited to {limit / 1e9:.2f} GB")
    with contextlib.ExitStack() as stack:
        groups = [stack.enter_context(_memcg.MemoryGroup(f"dniasync-bench-data-{i}")) for i in range(n)]
        procs = [g.python("-c", LARGE_PROBE, str(dest), str(i), str(n), str(rows - 1000), str(s["large_block"]))
                 for i, g in enumerate(groups)]
        held = []
        for proc, group in zip(procs, groups):
            assert proc.stdout is not None and proc.stdin is not None
            line = proc.stdout.readline()
            if line.strip() != "ready":
                return {"skipped": f"a trainer did not start: {line}{proc.communicate(timeout=60)[1][-2000:]}"}
            held.append(group.held())
            if held[-1] >= limit:  # the groups' processes are killed on leaving the with block
                return {"skipped": f"a trainer holds {held[-1] / 1e9:.2f} GB before reading, over the limit"}
            group.limit(limit)
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for i, (proc, group) in enumerate(zip(procs, groups)):
            stdout, stderr = proc.communicate(timeout=3600)
            trainer: dict[str, Any] = {"shard": i, "returncode": proc.returncode, "oom_kills": group.oom_kills(),
                                       "held_before_bytes": held[i], "cgroup_peak_bytes": group.peak()}
            if proc.returncode == 0:
                trainer |= json.loads(stdout)
                trainer["mb_per_s"] = trainer["rows_read"] * WIDTH / 1e6 / trainer["seconds"]
            else:
                trainer["stderr"] = stderr[-2000:]
            out["trainers"].append(trainer)
    out["oom_kills"] = sum(t["oom_kills"] for t in out["trainers"])
    out["all_trained"] = all(t["returncode"] == 0 for t in out["trainers"])
    out["set_over_limit"] = out["bytes"] / limit
    out["shard_over_limit"] = out["bytes"] / n / limit
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    large = results["large"]
    panels = 3 if large.get("trainers") else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    left, right = axes[0], axes[1]
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
    if panels == 3:
        trainers = large["trainers"]
        xs = np.arange(len(trainers))
        axes[2].bar(xs - width / 2, [t.get("peak_rss_bytes", 0) / 1e9 for t in trainers], width,
                    label="peak RSS of the process (mapped pages included)")
        axes[2].bar(xs + width / 2, [t["cgroup_peak_bytes"] / 1e9 for t in trainers], width,
                    label="peak of its memory cgroup (page cache included)")
        axes[2].axhline(large["limit_bytes"] / 1e9, color="tab:red", linestyle="--", label="the cgroup's limit")
        axes[2].set_xticks(xs, [f"trainer {t['shard']}" for t in trainers])
        axes[2].set_ylabel("GB")
        axes[2].set_title(f"a {large['bytes'] / 1e9:.1f} GB set, {len(trainers)} trainers, OOM kills: "
                          f"{large['oom_kills']}")
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds the with blocks: the generated sets are deleted


def main() -> int:
    args = _common.parser(__doc__.splitlines()[0]).parse_args()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
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
    with tempfile.TemporaryDirectory(prefix="bench_data_large_", dir=os.environ.get("BENCH_DATA_DIR")) as d:
        results["large"] = large_set(Path(d), s)
    _common.say("sparse pushes: the fastText example's Downpour job, dense against sparse")
    with tempfile.TemporaryDirectory(prefix="bench_data_sparse_") as d:
        results["sparse_push"], sparse_ratios = _sparse_push.measure(Path(d), args.quick)
    read, start = results["read"], results["startup"]
    ratios = sparse_ratios | {
        "mmap_vs_in_memory": read["mmap"]["batches_per_s"] / read["in_memory"]["batches_per_s"],
        "mmap_vs_dataloader": read["mmap"]["batches_per_s"] / read["dataloader_1_worker"]["batches_per_s"],
        "mmap_vs_in_memory_training": read["mmap_training"]["batches_per_s"]
        / read["in_memory_training"]["batches_per_s"],
        # the name and orientation: smaller is better here (goal <= 1.2)
        "startup_10x_over_1x": start[big]["replica_start_s"] / start["1x"]["replica_start_s"],
    }
    results["open_10x_over_1x"] = start[big]["open_and_first_batch_s"] / start["1x"]["open_and_first_batch_s"]
    path = _common.write("bench_data", args.quick, results, ratios)
    plot(results, path.with_suffix(".png"))
    _common.say("\n" + _common.table(
        [(name, f"{read[name]['batches_per_s']:,.0f} batches/s") for name in (
            "in_memory", "mmap", "dataloader_1_worker", "in_memory_training", "mmap_training")],
        ("reader", f"median of {s['repeat']}, {read['batches']} batches of {BATCH}")))
    _common.say("\n" + _common.table(
        [(name, f"{v['bytes'] / 1e6:,.0f} MB in {v['files']} files", f"{v['replica_start_s']:.2f} s",
          f"{v['open_and_first_batch_s'] * 1e3:.0f} ms") for name, v in start.items()],
        ("set", "size", "replica start", "open + first batch")))
    large = results["large"]
    if "skipped" in large:
        _common.say(f"\nlarge set: skipped ({large['skipped']})")
    else:
        _common.say(f"\nlarge set: {large['bytes'] / 1e9:.2f} GB, each trainer limited to "
                    f"{large['limit_bytes'] / 1e9:.2f} GB "
                    f"(the set {large['set_over_limit']:.1f}x, a shard {large['shard_over_limit']:.1f}x the limit); "
                    f"OOM kills: {large['oom_kills']}")
        _common.say(_common.table(
            [(str(t["shard"]), "yes" if t["returncode"] == 0 else f"no ({t['returncode']})",
              f"{t.get('rows_read', 0):,}", f"{t.get('mb_per_s', 0):,.0f}",
              f"{t.get('peak_rss_bytes', 0) / 1e6:,.0f} MB",
              f"{t['cgroup_peak_bytes'] / 1e6:,.0f} MB", f"{t['held_before_bytes'] / 1e6:,.0f} MB")
             for t in large["trainers"]],
            ("trainer", "trained", "rows read", "MB/s", "peak RSS", "cgroup peak", "held before reading")))
    _common.say("\n" + _sparse_push.table(results["sparse_push"]))
    goals = {"mmap_vs_in_memory": ">= 0.9", "mmap_vs_dataloader": "> 1", "startup_10x_over_1x": "<= 1.2",
             "mmap_vs_in_memory_training": ">= 0.9",
             "sparse_push_bytes_reduction": ">= 20"}
    rows = [(k, f"{v:.2f}", goals.get(k, "")) for k, v in ratios.items()]
    rows += [("open_10x_over_1x (no imports)", f"{results['open_10x_over_1x']:.2f}", "")]
    _common.say("\n" + _common.table(rows, ("ratio", "value", "goal")))
    _common.say(f"\nwrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
