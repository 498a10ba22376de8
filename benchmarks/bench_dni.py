"""DNI side by side: sequential backprop vs dniasync's synchronous, DNI and cDNI pipelines.

One run, one machine, one torch thread per process, the same model, initial
weights, optimizer, learning rate, batch size, batch order and epochs:

- ``backprop``: sequential backprop in this process (the reference);
- ``sync``: dniasync's synchronous pipeline (real gradients, GPipe-style
  micro-batches), 2 stages in 2 worker processes;
- ``dni`` / ``cdni``: dniasync's DNI pipeline with synthetic gradients
  (cDNI: conditioned on the labels), 2 stages in 2 worker processes.

Every pipeline runs through the real launcher (``python -m dniasync.node
--role local``): a coordinator process drives it over loopback websockets and
takes the weights at intervals (``[eval] deferred``: scored on the held-out
set after training, so evaluation takes no CPU from the groups on this
2-core machine, as backprop's evaluations are left out of its timed loop).
Wall times exclude startup (they start when every group is up) and
evaluation.

Asynchronous runs differ from one another even with the same seed (the
order in which gradients and forwards meet depends on timing), and the
machine is shared, so each method runs ``--repeat`` times, round robin, and
each figure is the median over its runs (a run that never reaches 90% counts
as infinitely slow). Every run's figures and curve are in the JSON
(``runs``) and the PNG.

Ratios of medians (bigger is better): ``cdni_vs_sequential`` = cDNI
samples/s over backprop's (goal >= 1.3); ``cdni_vs_sync_pipeline`` = the
synchronous pipeline's time to 90% held-out accuracy over cDNI's (goal > 1).

    python benchmarks/bench_dni.py [--quick]
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import _common  # noqa: E402
import torch  # noqa: E402

from dniasync.cluster.config import load_config  # noqa: E402
from dniasync.cluster.plan import data_spec  # noqa: E402
from dniasync.train.models import build_model  # noqa: E402
from dniasync.train.pipeline import train_backprop  # noqa: E402

TARGET = 0.90
METHODS = ("backprop", "sync", "dni", "cdni")

JOB = """
[job]
name = "bench_dni_{method}"
mode = "pipeline"
seed = {seed}
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"

[model.kwargs]
sizes = {sizes}

[data]
dataset = "mnist5k"
n_train = {n_train}
n_test = {n_test}
batch_size = {batch_size}

[optimizer]
name = "adam"
lr = {lr}

[pipeline]
groups = {groups}
method = "{variant}"
{variant_keys}

[stop]
max_epochs = {epochs}
max_seconds = 900

[eval]
every_seconds = {eval_s}
deferred = true
"""


def settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {"sizes": [784, 256, 256, 10], "n_train": 2000, "n_test": 500, "batch_size": 64, "epochs": 3,
                "lr": 3e-4, "sg_lr": 1e-4, "sg_fit_rows": 0, "seed": 0, "eval_s": 0.5, "max_in_flight": 4,
                "micro_batches": 4}
    # hidden layers wide enough that compute, not messaging, dominates a step
    return {"sizes": [784, 1024, 1024, 1024, 1024, 10], "n_train": 4000, "n_test": 1000, "batch_size": 128,
            "epochs": 20, "lr": 3e-4, "sg_lr": 1e-4, "sg_fit_rows": 64, "seed": 0, "eval_s": 0.5, "max_in_flight": 4,
            "micro_batches": 4}


def halves(sizes: list[int]) -> list[list[int]]:
    """Two groups of the MLP's layers (Linear, ReLU, ..., Linear) with about half the hidden layers each."""
    n_layers = 2 * (len(sizes) - 1) - 1
    cut = 2 * ((len(sizes) - 1) // 2)
    return [list(range(cut)), list(range(cut, n_layers))]


def time_to(history: list[dict[str, Any]], target: float) -> float | None:
    return next((p["wall_s"] for p in history if p["accuracy"] >= target), None)


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over ``runs`` (a run that never reached the target counts as infinitely slow)."""
    t90 = statistics.median(math.inf if r["time_to_90_s"] is None else r["time_to_90_s"] for r in runs)
    return {
        "samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
        "time_to_90_s": None if math.isinf(t90) else t90,
        "final_accuracy": statistics.median(r["final_accuracy"] for r in runs),
        "best_accuracy": statistics.median(r["best_accuracy"] for r in runs),
        "reached_90": sum(r["time_to_90_s"] is not None for r in runs),
        "runs": runs,
    }


def run_backprop(config_path: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    config = load_config(config_path)
    x, y, ex, ey = data_spec(config).load_split()
    model = build_model(config.model.factory, config.model.kwargs, seed=config.job.seed)
    result = train_backprop(
        model, x, y, epochs=config.stop.max_epochs, batch_size=config.data.batch_size, seed=config.job.seed,
        lr=config.optimizer.lr, optimizer="adam", eval_x=ex, eval_y=ey, evals_per_epoch=4,
    )
    history = [{"wall_s": p.wall_s, "samples": p.samples, "accuracy": p.accuracy} for p in result.history]
    return {
        "processes": 1, "samples_per_s": result.samples_per_s, "wall_s": result.wall_s, "samples": result.samples,
        "final_accuracy": result.final_accuracy, "best_accuracy": max(p["accuracy"] for p in history),
        "time_to_90_s": time_to(history, TARGET), "history": history,
    }


def run_pipeline(config_path: Path, out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config_path)],
        capture_output=True, text=True, timeout=1200,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{config_path} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    doc = json.loads((out / "summary.json").read_text())
    history = [{"wall_s": p["wall_s"], "samples": p["samples"], "accuracy": p["accuracy"]} for p in doc["history"]]
    return {
        "processes": 2, "samples_per_s": doc["metrics"]["train_samples_per_s"], "wall_s": doc["wall_s"],
        "samples": doc["samples"], "final_accuracy": doc["final_accuracy"], "best_accuracy": doc["best_accuracy"],
        "time_to_90_s": time_to(history, TARGET), "history": history,
        "launcher_s": time.perf_counter() - started,
        "group_addresses": [doc["metrics"]["stage0_address"], doc["metrics"]["stage1_address"]],
    }


def plot(results: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for method, color in zip(METHODS, ("C0", "C1", "C2", "C3"), strict=True):
        for k, run in enumerate(results[method]["runs"]):
            history = run["history"]
            label = f"{method} (median {results[method]['samples_per_s']:,.0f} samples/s)" if k == 0 else None
            ax.plot([p["wall_s"] for p in history], [p["accuracy"] for p in history], marker=".", color=color,
                    alpha=0.8, linewidth=1, label=label)
    ax.axhline(TARGET, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0.5, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.suptitle("sequential backprop vs 2-group pipelines in 2 processes (mnist5k), every run")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")


def main() -> int:
    p = _common.parser(__doc__ or "")
    p.add_argument("--repeat", type=int, default=None, help="runs per method (default: 1 with --quick, else 3)")
    p.add_argument("--sg-fit-rows", type=int, default=None,
                   help="rows of each batch the SG models are fitted on (default: the settings'; 0 = all)")
    args = p.parse_args()
    repeat = args.repeat or (1 if args.quick else 3)
    s = settings(args.quick)
    if args.sg_fit_rows is not None:
        s["sg_fit_rows"] = args.sg_fit_rows
    groups = halves(s["sizes"])
    results: dict[str, Any] = {"config": {**s, "groups": groups, "target_accuracy": TARGET, "repeat": repeat}}
    runs: dict[str, list[dict[str, Any]]] = {method: [] for method in METHODS}
    with tempfile.TemporaryDirectory(prefix="bench_dni_") as tmp:
        for attempt in range(repeat):
            for method in METHODS:
                out = Path(tmp) / f"{method}{attempt}"
                variant = "cdni" if method == "backprop" else method
                keys = (f"micro_batches = {s['micro_batches']}" if variant == "sync"
                        else f"max_in_flight = {s['max_in_flight']}\nsg_hidden_layers = 0\nsg_lr = {s['sg_lr']}\n"
                             f"sg_fit_rows = {s['sg_fit_rows']}")
                config = Path(tmp) / f"{method}{attempt}.toml"
                config.write_text(JOB.format(method=method, out=out, groups=groups, variant=variant, variant_keys=keys,
                                             **{k: s[k] for k in ("seed", "sizes", "n_train", "n_test", "batch_size",
                                                                  "lr", "epochs", "eval_s")}))
                _common.say(f"{method} (run {attempt + 1}/{repeat}) ...")
                r = run_backprop(config) if method == "backprop" else run_pipeline(config, out)
                t90 = "never" if r["time_to_90_s"] is None else f"{r['time_to_90_s']:.1f} s"
                _common.say(f"  {r['samples_per_s']:8,.0f} samples/s, final {r['final_accuracy']:.4f}, "
                            f"best {r['best_accuracy']:.4f}, 90% at {t90}")
                runs[method].append(r)
    for method in METHODS:
        results[method] = summarise(runs[method])
    cdni, sync = results["cdni"], results["sync"]
    ratios: dict[str, Any] = {
        "cdni_vs_sequential": cdni["samples_per_s"] / results["backprop"]["samples_per_s"],
        "cdni_vs_sync_pipeline": (sync["time_to_90_s"] / cdni["time_to_90_s"]
                                  if sync["time_to_90_s"] and cdni["time_to_90_s"] else None),
        "dni_vs_sequential": results["dni"]["samples_per_s"] / results["backprop"]["samples_per_s"],
        "sync_pipeline_vs_sequential": sync["samples_per_s"] / results["backprop"]["samples_per_s"],
    }
    base = results["backprop"]
    rows = []
    for method in METHODS:
        r = results[method]
        t90 = "never" if r["time_to_90_s"] is None else f"{r['time_to_90_s']:.1f} s to 90%"
        t90 += f" ({r['reached_90']}/{repeat} runs reached it)"
        rows.append((method, f"{r['samples_per_s']:,.0f} samples/s, {t90}, final {r['final_accuracy']:.3f}",
                     f"{r['samples_per_s'] / base['samples_per_s']:.2f}x samples/s"))
    _common.say(_common.table(rows, ("system", f"median of {repeat} runs", "vs sequential backprop")))
    for name, value in ratios.items():
        _common.say(f"{name:28s} {'n/a' if value is None else f'{value:.2f}'}")
    path = _common.write("bench_dni", args.quick, results, ratios)
    png = path.with_suffix(".png")
    plot(results, png)
    _common.say(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
