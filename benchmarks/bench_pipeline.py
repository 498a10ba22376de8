"""Pipelines with real gradients side by side: backprop, sync, cDNI, async, stash, SpecTrain.

Part 1, speed and accuracy in one run, one machine (mnist5k, an MLP cut into
2 stages, each pipeline in 2 worker processes through the real launcher,
``python -m dniasync.node --role local``, weights scored after training as in
``bench_dni.py``):

- ``backprop_1thread`` / ``backprop_all_cores``: sequential backprop in this
  process with one torch thread / with every core;
- ``sync``: the synchronous pipeline (GPipe micro-batches, flush per step);
- ``cdni``: label-conditioned synthetic gradients (Adam, its tuned settings);
- ``async``, ``stash``, ``spectrain``: asynchronous 1F1B pipelines with real
  gradients, ``max_in_flight`` batches in flight.

Backprop and the real-gradient pipelines train with SGD + momentum 0.9 (as in
the SpecTrain paper), the same lr, batch size, batch order and epochs.

Ratios (bigger is better): ``spectrain_vs_torch_all_cores`` and
``cdni_vs_torch_all_cores`` (samples/s over backprop with every core),
``spectrain_samples_vs_one_thread`` (over backprop with one thread),
``spectrain_accuracy_gap`` (SpecTrain's final held-out accuracy minus
backprop's: 0 is parity), ``stash_memory_bytes`` (the first stage's peak
stash, a size, reported as the issue names it).

Part 2 (``--accuracy``): final held-out accuracy over seeds, in one process
(in-process stages: the version gap comes from the in-flight count), mnist5k,
an MLP and a CNN, 2 and 4 stages: SpecTrain vs backprop vs async vs stash.

With ``--adam`` the table is instead SpecTrain predicting with the current
Adam step direction against async and backprop with Adam (MLP), to set
beside the momentum rows.

    python benchmarks/bench_pipeline.py [--quick] [--accuracy | --accuracy-only] [--adam] [--seeds 0 1 2]
"""

from __future__ import annotations

import asyncio
import json
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
from torch import nn  # noqa: E402

from dniasync.cluster.config import load_config  # noqa: E402
from dniasync.cluster.plan import data_spec  # noqa: E402
from dniasync.train.models import build_model, cnn, mlp  # noqa: E402
from dniasync.train.pipeline import StageSettings, run_pipeline, train_backprop  # noqa: E402

SPEED_METHODS = ("backprop_1thread", "backprop_all_cores", "sync", "cdni", "async", "stash", "spectrain")

JOB = """
[job]
name = "bench_pipeline_{method}"
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
{optimizer}

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
        return {"sizes": [784, 256, 256, 10], "n_train": 2000, "n_test": 500, "batch_size": 64, "epochs": 2,
                "lr": 0.02, "momentum": 0.9, "adam_lr": 3e-4, "sg_lr": 1e-4, "seed": 0, "eval_s": 0.5,
                "max_in_flight": 4, "micro_batches": 4}
    return {"sizes": [784, 1024, 1024, 1024, 1024, 10], "n_train": 4000, "n_test": 1000, "batch_size": 128,
            "epochs": 8, "lr": 0.02, "momentum": 0.9, "adam_lr": 3e-4, "sg_lr": 1e-4, "seed": 0, "eval_s": 0.5,
            "max_in_flight": 4, "micro_batches": 4}


def halves(sizes: list[int]) -> list[list[int]]:
    n_layers = 2 * (len(sizes) - 1) - 1
    cut = 2 * ((len(sizes) - 1) // 2)
    return [list(range(cut)), list(range(cut, n_layers))]


def run_backprop(config_path: Path, threads: int, s: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(threads)
    try:
        config = load_config(config_path)
        x, y, ex, ey = data_spec(config).load_split()
        model = build_model(config.model.factory, config.model.kwargs, seed=config.job.seed)
        result = train_backprop(model, x, y, epochs=s["epochs"], batch_size=s["batch_size"], seed=s["seed"],
                                lr=s["lr"], optimizer="sgd", momentum=s["momentum"], eval_x=ex, eval_y=ey,
                                evals_per_epoch=2)
    finally:
        torch.set_num_threads(1)
    history = [{"wall_s": p.wall_s, "samples": p.samples, "accuracy": p.accuracy} for p in result.history]
    return {"processes": 1, "threads": threads, "samples_per_s": result.samples_per_s, "wall_s": result.wall_s,
            "final_accuracy": result.final_accuracy, "best_accuracy": max(p["accuracy"] for p in history),
            "history": history}


def run_launcher(config_path: Path, out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config_path)],
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"{config_path} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    doc = json.loads((out / "summary.json").read_text())
    m = doc["metrics"]
    history = [{"wall_s": p["wall_s"], "samples": p["samples"], "accuracy": p["accuracy"]} for p in doc["history"]]
    return {"processes": 2, "samples_per_s": m["train_samples_per_s"], "wall_s": doc["wall_s"],
            "final_accuracy": doc["final_accuracy"], "best_accuracy": doc["best_accuracy"], "history": history,
            "launcher_s": time.perf_counter() - started,
            "version_gap_mean": [m.get(f"group{k}_version_gap_mean", 0.0) for k in range(2)],
            "stash_peak_bytes": [m.get(f"group{k}_stash_peak_bytes", 0) for k in range(2)]}


def speed(args: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    s = settings(args.quick)
    groups = halves(s["sizes"])
    results: dict[str, Any] = {"config": {**s, "groups": groups}}
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        for method in SPEED_METHODS:
            out = Path(tmp) / method
            variant = "spectrain" if method.startswith("backprop") else method
            if variant == "cdni":
                optimizer = f'name = "adam"\nlr = {s["adam_lr"]}'
                keys = f"max_in_flight = {s['max_in_flight']}\nsg_hidden_layers = 0\nsg_lr = {s['sg_lr']}"
            else:
                optimizer = f'name = "momentum"\nlr = {s["lr"]}\nmomentum = {s["momentum"]}'
                keys = (f"micro_batches = {s['micro_batches']}" if variant == "sync"
                        else f"max_in_flight = {s['max_in_flight']}")
            config = Path(tmp) / f"{method}.toml"
            config.write_text(JOB.format(method=method, out=out, groups=groups, variant=variant, variant_keys=keys,
                                         optimizer=optimizer, **{k: s[k] for k in (
                                             "seed", "sizes", "n_train", "n_test", "batch_size", "epochs",
                                             "eval_s")}))
            _common.say(f"{method} ...")
            if method == "backprop_1thread":
                r = run_backprop(config, 1, s)
            elif method == "backprop_all_cores":
                r = run_backprop(config, cores, s)
            else:
                r = run_launcher(config, out)
            r["load_avg_1min_after"] = os.getloadavg()[0]  # the machine is shared: how busy it was
            _common.say(f"  {r['samples_per_s']:8,.0f} samples/s, final {r['final_accuracy']:.4f}, "
                        f"best {r['best_accuracy']:.4f} (load average {r['load_avg_1min_after']:.1f})")
            results[method] = r
    one, allc, spec = results["backprop_1thread"], results["backprop_all_cores"], results["spectrain"]
    ratios: dict[str, Any] = {
        "spectrain_vs_torch_all_cores": spec["samples_per_s"] / allc["samples_per_s"],
        "cdni_vs_torch_all_cores": results["cdni"]["samples_per_s"] / allc["samples_per_s"],
        "spectrain_samples_vs_one_thread": spec["samples_per_s"] / one["samples_per_s"],
        "spectrain_accuracy_gap": spec["final_accuracy"] - one["final_accuracy"],
        "stash_memory_bytes": results["stash"]["stash_peak_bytes"][0],
    }
    rows = [(m, f"{results[m]['samples_per_s']:,.0f} samples/s, final {results[m]['final_accuracy']:.3f}",
             f"{results[m]['samples_per_s'] / allc['samples_per_s']:.2f}x") for m in SPEED_METHODS]
    _common.say(_common.table(rows, ("system", "figures", "vs backprop all cores")))
    return results, ratios


def accuracy_table(args: Any) -> dict[str, Any]:
    """Final held-out accuracy per (model, stages, rule) over seeds, in one process."""
    config = load_config(Path(__file__).resolve().parent.parent / "examples" / "cnn_mnist_sync.toml")
    x, y, ex, ey = data_spec(config).load_split()
    batch, lr, momentum, window = 64, 0.05, 0.9, 4
    models: dict[str, tuple[Any, dict[int, list[list[int]]], int]] = {
        "mlp": (lambda: mlp([784, 256, 256, 256, 10]), {2: [[0, 1, 2, 3], [4, 5, 6]],
                                                         4: [[0, 1], [2, 3], [4, 5], [6]]}, 5),
        "cnn": (lambda: cnn(channels=(8, 16), hidden=64), {2: [[0, 1, 2, 3, 4], list(range(5, 13))],
                                                          4: [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10], [11, 12]]}, 2),
    }
    table: dict[str, Any] = {"epochs": {k: v[2] for k, v in models.items()}, "batch_size": batch, "lr": lr,
                             "momentum": momentum, "max_in_flight": window, "seeds": args.seeds, "rows": {}}
    for name, (factory, cuts, epochs) in models.items():
        if args.adam:  # that table alone
            break
        if args.quick:
            if name == "cnn":
                continue
            epochs = 1
        for seed in args.seeds:
            torch.manual_seed(seed)
            model: nn.Sequential = factory()
            state = {k: v.clone() for k, v in model.state_dict().items()}
            bp = train_backprop(model, x, y, epochs=epochs, batch_size=batch, seed=seed, lr=lr, optimizer="sgd",
                                momentum=momentum, eval_x=ex, eval_y=ey)
            table["rows"].setdefault(f"{name} backprop", []).append(bp.final_accuracy)
            for n_stages, groups in cuts.items():
                for rule in ("async", "stash", "spectrain"):
                    model = factory()
                    model.load_state_dict(state)
                    st = StageSettings(rule=rule, optimizer="sgd", momentum=momentum, lr=lr)
                    res = asyncio.run(run_pipeline(model, groups, x, y, settings=st, epochs=epochs, batch_size=batch,
                                                   seed=seed, max_in_flight=window, eval_x=ex, eval_y=ey))
                    table["rows"].setdefault(f"{name} {n_stages} stages {rule}", []).append(res.final_accuracy)
                    _common.say(f"{name} seed {seed} {n_stages} stages {rule}: {res.final_accuracy:.4f} "
                                f"(backprop {bp.final_accuracy:.4f})")
    if args.adam:  # SpecTrain's Adam prediction (the current Adam step direction) against no correction, MLP
        factory, cuts, epochs = models["mlp"]
        for seed in args.seeds:
            torch.manual_seed(seed)
            model = factory()
            state = {k: v.clone() for k, v in model.state_dict().items()}
            bp = train_backprop(model, x, y, epochs=epochs, batch_size=batch, seed=seed, lr=1e-3, optimizer="adam",
                                eval_x=ex, eval_y=ey)
            table["rows"].setdefault("mlp backprop adam", []).append(bp.final_accuracy)
            for n_stages, groups in cuts.items():
                for rule in ("async", "spectrain"):
                    model = factory()
                    model.load_state_dict(state)
                    st = StageSettings(rule=rule, optimizer="adam", lr=1e-3)
                    res = asyncio.run(run_pipeline(model, groups, x, y, settings=st, epochs=epochs, batch_size=batch,
                                                   seed=seed, max_in_flight=window, eval_x=ex, eval_y=ey))
                    table["rows"].setdefault(f"mlp {n_stages} stages {rule} adam", []).append(res.final_accuracy)
                    _common.say(f"mlp adam seed {seed} {n_stages} stages {rule}: {res.final_accuracy:.4f} "
                                f"(backprop {bp.final_accuracy:.4f})")
    summary = {k: {"mean": statistics.mean(v), "min": min(v), "max": max(v), "runs": v}
               for k, v in table["rows"].items()}
    table["summary"] = summary
    rows = [(k, f"{v['mean']:.4f} (min {v['min']:.4f}, max {v['max']:.4f})", str(len(v["runs"])))
            for k, v in summary.items()]
    _common.say(_common.table(rows, ("model / stages / rule", "final held-out accuracy, mean over seeds", "runs")))
    return table


def plot(results: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for k, method in enumerate(SPEED_METHODS):
        if method not in results:
            continue
        h = results[method]["history"]
        ax.plot([p["wall_s"] for p in h], [p["accuracy"] for p in h], marker=".", color=f"C{k}",
                label=f"{method} ({results[method]['samples_per_s']:,.0f} samples/s)")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0.5, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.suptitle("backprop vs 2-stage pipelines in 2 processes (mnist5k MLP)")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")


def main() -> int:
    p = _common.parser(__doc__ or "")
    p.add_argument("--accuracy", action="store_true", help="also the accuracy table over seeds (part 2)")
    p.add_argument("--accuracy-only", action="store_true", help="only the accuracy table")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--adam", action="store_true", help="accuracy table: SpecTrain's Adam prediction instead (MLP)")
    args = p.parse_args()
    results: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    if not args.accuracy_only:
        results, ratios = speed(args)
        for name, value in ratios.items():
            _common.say(f"{name:34s} {value:.4g}")
    if args.accuracy or args.accuracy_only:
        results["accuracy_table"] = accuracy_table(args)
    name = "bench_pipeline" if not args.accuracy_only else "bench_pipeline_accuracy" + ("_adam" if args.adam else "")
    path = _common.write(name, args.quick, results, ratios)
    if not args.accuracy_only:
        png = path.with_suffix(".png")
        plot(results, png)
        _common.say(f"wrote {path} and {png}")
    else:
        _common.say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
