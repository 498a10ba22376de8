"""Pipelines with real gradients side by side: backprop, sync, cDNI, async, stash, SpecTrain (speed and accuracy).

One run, one machine: mnist5k, a compute-bound MLP (784-1024x4-10, batch
128) cut into 2 stages, each pipeline in 2 worker processes with one torch
thread each, through the real launcher (``python -m dniasync.node --role
local``; weights scored on the held-out set after training, as in
``bench_dni.py``, so evaluation takes no CPU from the stages):

- ``backprop_1thread`` / ``backprop_all_cores``: sequential backprop in this
  process with one torch thread / with every core;
- ``backprop_2_processes``: two one-thread backprop processes at once, each
  training its own model (samples/s summed): what two processes can do here
  with no pipeline at all (a bound, not a training method);
- ``sync``: the synchronous pipeline (GPipe micro-batches, flush per step);
- ``cdni``: label-conditioned synthetic gradients (Adam, its tuned settings);
- ``async``, ``stash``, ``spectrain``: asynchronous 1F1B pipelines with real
  gradients, 2 batches in flight (one per stage, as PipeDream's 1F1B runs:
  stage 0's version gap is 1, SpecTrain's ``s`` for stage 0 of 2; 4 in
  flight triples that gap for no speed on 2 cores, and at this lr async and
  stash then end 8-10 points below backprop);
- ``spectrain_stash``: SpecTrain's forward on the predicted weights,
  back-propagated through its own graph (no second forward at stage 0).

Backprop and the real-gradient pipelines train with SGD + momentum 0.9 (as in
the SpecTrain paper), the same lr, batch size, batch order and epochs; every
method's lr (cDNI's Adam and SG models too) falls to 0 over the second half
of the run (cosine, ``pipeline.lr_decay``), so final accuracies are the
plateau's, not one evaluation's wander around it. Each
method runs ``--repeat`` times (default 3), round robin; each figure is the
median over its runs (a run that never reaches the target counts as
infinitely slow). Wall times exclude startup and evaluation.

Ratios of medians (bigger is better): ``spectrain_vs_torch_all_cores`` and
``cdni_vs_torch_all_cores`` (backprop on every core's time to the target
accuracy over the pipeline's; goal >= 1), ``spectrain_samples_vs_one_thread``
(SpecTrain's samples/s over one-thread backprop's; goal >= 1.8),
``spectrain_accuracy_gap`` (SpecTrain's final held-out accuracy minus
one-thread backprop's, in points; goal >= -0.5), ``stash_memory_bytes`` (the
first stage's peak stash: a size, reported as the issue names it); the same
three SpecTrain ratios for ``spectrain_stash`` with that prefix.

The bound: ``cut_bound_vs_one_thread`` times each stage's share of a
one-thread backprop step alone (``cut_bound`` in the JSON); the slower stage
caps any 2-stage pipeline of this cut, before any messaging, at
``whole / slowest`` times one-thread backprop.

The accuracy table over seeds (MLP and CNN, 2 and 4 stages) is
``benchmarks/pipeline_accuracy.py``.

    python benchmarks/bench_pipeline.py [--quick] [--repeat N]
    python benchmarks/bench_pipeline.py --methods backprop_1thread spectrain --lr 0.03 --in-flight 4  # a trial
"""

from __future__ import annotations

import argparse
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
from dniasync.train.pipeline import EvalPoint, LrDecay, evaluate_model, train_backprop  # noqa: E402

SPEED_METHODS = ("backprop_1thread", "backprop_all_cores", "backprop_2_processes", "sync", "cdni", "async", "stash",
                 "spectrain", "spectrain_stash")
TARGET = 0.90

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
lr_decay = "{lr_decay}"
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
                "lr": 0.05, "momentum": 0.9, "adam_lr": 3e-4, "sg_lr": 1e-4, "sg_fit_rows": 0, "seed": 0,
                "eval_s": 0.5, "max_in_flight": 4, "real_in_flight": 2, "micro_batches": 4, "target": 0.80,
                "lr_decay": "cosine"}
    # hidden layers wide enough that compute, not messaging, dominates a step
    return {"sizes": [784, 1024, 1024, 1024, 1024, 10], "n_train": 4000, "n_test": 1000, "batch_size": 128,
            "epochs": 10, "lr": 0.05, "momentum": 0.9, "adam_lr": 3e-4, "sg_lr": 1e-4, "sg_fit_rows": 64, "seed": 0,
            "eval_s": 0.5, "max_in_flight": 4, "real_in_flight": 2, "micro_batches": 4, "target": TARGET,
            "lr_decay": "cosine"}


def halves(sizes: list[int]) -> list[list[int]]:
    n_layers = 2 * (len(sizes) - 1) - 1
    cut = 2 * ((len(sizes) - 1) // 2)
    return [list(range(cut)), list(range(cut, n_layers))]


def run_backprop(config_path: Path, threads: int, s: dict[str, Any], *, evaluate: bool = True) -> dict[str, Any]:
    """One-process backprop; without ``evaluate`` the held-out set is scored once, after training."""
    torch.set_num_threads(threads)
    try:
        config = load_config(config_path)
        x, y, ex, ey = data_spec(config).load_split()
        model = build_model(config.model.factory, config.model.kwargs, seed=config.job.seed)
        result = train_backprop(model, x, y, epochs=s["epochs"], batch_size=s["batch_size"], seed=s["seed"],
                                lr=s["lr"], optimizer="sgd", momentum=s["momentum"], eval_x=ex if evaluate else None,
                                eval_y=ey, evals_per_epoch=4, lr_decay=LrDecay(s["lr_decay"]))
        if not evaluate:
            result.history.append(EvalPoint(result.wall_s, result.samples, s["epochs"], *evaluate_model(model, ex, ey),
                                            math.nan))
    finally:
        torch.set_num_threads(1)
    history = [{"wall_s": p.wall_s, "samples": p.samples, "accuracy": p.accuracy} for p in result.history]
    return {"processes": 1, "threads": threads, "samples_per_s": result.samples_per_s, "wall_s": result.wall_s,
            "final_accuracy": result.final_accuracy, "best_accuracy": max(p["accuracy"] for p in history),
            "history": history}


def cut_bound(s: dict[str, Any], groups: list[list[int]], steps: int = 40) -> dict[str, Any]:
    """One thread, this process: ms per batch of the whole model's step (forward, backward, SGD step) and of each
    stage's share of it alone (the first stage without its input's gradient, the last with the loss). The slower
    stage bounds any 2-stage pipeline of this cut at ``whole / slowest`` times one-thread backprop."""
    from torch import nn

    torch.set_num_threads(1)
    model = build_model("dniasync.train.models:mlp", {"sizes": s["sizes"]}, seed=0)
    assert isinstance(model, nn.Sequential)
    x = torch.randn(s["batch_size"], s["sizes"][0])
    y = torch.randint(0, 10, (s["batch_size"],))

    def timed(part: nn.Module, first: bool, last: bool) -> float:
        opt = torch.optim.SGD(part.parameters(), lr=1e-3, momentum=0.9)
        with torch.no_grad():
            h = model[: groups[1][0]](x) if not first else x
        h = h.detach().requires_grad_(not first)
        grad = torch.randn(s["batch_size"], *part(h).shape[1:]) if not last else None
        times = []
        for k in range(steps + 5):
            started = time.perf_counter()
            out = part(h)
            opt.zero_grad(set_to_none=True)
            if last:
                torch.nn.functional.cross_entropy(out, y).backward()  # type: ignore[no-untyped-call]
            else:
                out.backward(grad)
            opt.step()
            if k >= 5:
                times.append(time.perf_counter() - started)
        return 1e3 * statistics.median(times)

    whole = timed(model, True, True)
    stages = [timed(model[g[0]: g[-1] + 1], k == 0, k == len(groups) - 1) for k, g in enumerate(groups)]
    return {"whole_ms": whole, "stage_ms": stages, "bound_vs_one_thread": whole / max(stages)}


def run_two_processes(config_path: Path, s: dict[str, Any]) -> dict[str, Any]:
    """Two one-thread backprop processes at once, each training its own model: what 2 processes on this machine
    can do at most (no pipeline overhead, perfect balance); samples/s summed."""
    procs = [subprocess.Popen([sys.executable, __file__, "--solo", str(config_path), json.dumps(s)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [json.loads(p.communicate(timeout=1200)[0].strip().splitlines()[-1]) for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"a solo backprop process failed: {[p.returncode for p in procs]}")
    return {**outs[0], "processes": 2, "samples_per_s": sum(o["samples_per_s"] for o in outs),
            "per_process_samples_per_s": [o["samples_per_s"] for o in outs], "history": []}


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
            "version_gap_mean": [m.get(f"stage{k}_version_gap_mean", 0.0) for k in range(2)],
            "stash_peak_bytes": [m.get(f"stage{k}_stash_peak_bytes", 0) for k in range(2)],
            # per stage and batch: its layers' forward + backward, and all it did for the batch (steps, predictions,
            # SG work, sends); the rest of a batch's wall time per stage is waiting (messaging, the other stage)
            "layers_ms_per_batch": [m.get(f"stage{k}_layers_ms_per_batch") for k in range(2)],
            "busy_ms_per_batch": [m.get(f"stage{k}_busy_ms_per_batch") for k in range(2)]}


def time_to(history: list[dict[str, Any]], target: float) -> float | None:
    return next((p["wall_s"] for p in history if p["accuracy"] >= target), None)


def summarise(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Medians over ``runs`` (a run that never reached the target counts as infinitely slow)."""
    for r in runs:
        r["time_to_target_s"] = time_to(r["history"], target)
    t = statistics.median(math.inf if r["time_to_target_s"] is None else r["time_to_target_s"] for r in runs)
    out: dict[str, Any] = {
        "samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
        "time_to_target_s": None if math.isinf(t) else t,
        "final_accuracy": statistics.median(r["final_accuracy"] for r in runs),
        "best_accuracy": statistics.median(r["best_accuracy"] for r in runs),
        "reached_target": sum(r["time_to_target_s"] is not None for r in runs),
        "runs": runs,
    }
    if "version_gap_mean" in runs[0]:
        out["version_gap_mean"] = [statistics.median(r["version_gap_mean"][k] for r in runs) for k in range(2)]
        out["stash_peak_bytes"] = [max(r["stash_peak_bytes"][k] for r in runs) for k in range(2)]
        for name in ("layers_ms_per_batch", "busy_ms_per_batch"):
            if all(r.get(name) and None not in r[name] for r in runs):
                out[name] = [statistics.median(r[name][k] for r in runs) for k in range(2)]
    return out


def config_for(method: str, s: dict[str, Any], groups: list[list[int]], out: Path) -> str:
    variant = "spectrain" if method.startswith("backprop") else method
    if variant == "cdni":
        optimizer = f'name = "adam"\nlr = {s["adam_lr"]}'
        keys = (f"max_in_flight = {s['max_in_flight']}\nsg_hidden_layers = 0\nsg_lr = {s['sg_lr']}\n"
                f"sg_fit_rows = {s['sg_fit_rows']}")
    else:
        optimizer = f'name = "momentum"\nlr = {s["lr"]}\nmomentum = {s["momentum"]}'
        keys = (f"micro_batches = {s['micro_batches']}" if variant == "sync"
                else f"max_in_flight = {s['real_in_flight']}")
    return JOB.format(method=method, out=out, groups=groups, variant=variant, variant_keys=keys, optimizer=optimizer,
                      **{k: s[k] for k in ("seed", "sizes", "n_train", "n_test", "batch_size", "epochs", "eval_s",
                                           "lr_decay")})


def speed(args: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    s = settings(args.quick)
    if args.lr is not None:
        s["lr"] = args.lr
    if args.in_flight is not None:
        s["real_in_flight"] = args.in_flight
    methods = tuple(m for m in SPEED_METHODS if m in args.methods) if args.methods else SPEED_METHODS
    repeat = args.repeat or (1 if args.quick else 3)
    groups = halves(s["sizes"])
    cores = os.cpu_count() or 1
    results: dict[str, Any] = {"config": {**s, "groups": groups, "repeat": repeat, "cores": cores}}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        for attempt in range(repeat):
            for method in methods:
                out = Path(tmp) / f"{method}{attempt}"
                config = Path(tmp) / f"{method}{attempt}.toml"
                config.write_text(config_for(method, s, groups, out))
                _common.say(f"{method} (run {attempt + 1}/{repeat}) ...")
                if method == "backprop_1thread":
                    r = run_backprop(config, 1, s)
                elif method == "backprop_2_processes":
                    r = run_two_processes(config, s)
                elif method == "backprop_all_cores":
                    r = run_backprop(config, cores, s)
                else:
                    r = run_launcher(config, out)
                r["load_avg_1min_after"] = os.getloadavg()[0]  # the machine is shared: how busy it was
                t = time_to(r["history"], s["target"])
                _common.say(f"  {r['samples_per_s']:8,.0f} samples/s, final {r['final_accuracy']:.4f}, "
                            f"best {r['best_accuracy']:.4f}, {s['target']:.0%} at "
                            f"{'never' if t is None else f'{t:.1f} s'} (load average {r['load_avg_1min_after']:.1f})")
                runs[method].append(r)
    for method in methods:
        results[method] = summarise(runs[method], s["target"])
    results["cut_bound"] = bound = cut_bound(s, groups)
    _common.say(f"one thread: whole model {bound['whole_ms']:.1f} ms per batch, stages "
                f"{' / '.join(f'{v:.1f}' for v in bound['stage_ms'])} ms: the cut allows at most "
                f"{bound['bound_vs_one_thread']:.2f}x one-thread backprop")
    if methods != SPEED_METHODS:  # a partial run: its table only
        one = results.get("backprop_1thread") or results[methods[0]]
        _common.say(_common.table(_rows(results, methods, one, s, repeat), _HEADER))
        return results, {}
    one, allc, spec, cdni = (results[m] for m in ("backprop_1thread", "backprop_all_cores", "spectrain", "cdni"))

    def faster(reference: dict[str, Any], other: dict[str, Any]) -> float | None:
        if reference["time_to_target_s"] is None or other["time_to_target_s"] is None:
            return None if other["time_to_target_s"] is None else math.inf
        return float(reference["time_to_target_s"] / other["time_to_target_s"])

    ratios: dict[str, Any] = {
        "spectrain_vs_torch_all_cores": faster(allc, spec),
        "cdni_vs_torch_all_cores": faster(allc, cdni),
        "spectrain_samples_vs_one_thread": spec["samples_per_s"] / one["samples_per_s"],
        "spectrain_accuracy_gap": 100.0 * (spec["final_accuracy"] - one["final_accuracy"]),
        "stash_memory_bytes": results["stash"]["stash_peak_bytes"][0],
    }
    stashed = results["spectrain_stash"]
    ratios.update({
        "spectrain_stash_vs_torch_all_cores": faster(allc, stashed),
        "spectrain_stash_samples_vs_one_thread": stashed["samples_per_s"] / one["samples_per_s"],
        "spectrain_stash_accuracy_gap": 100.0 * (stashed["final_accuracy"] - one["final_accuracy"]),
    })
    one_ms = 1e3 * s["batch_size"] / one["samples_per_s"]
    for m in ("spectrain", "spectrain_stash"):
        if "layers_ms_per_batch" in results[m]:  # the rate if each stage did only its layers' work: the cut's bound
            ratios[f"{m}_compute_bound_vs_one_thread"] = one_ms / max(results[m]["layers_ms_per_batch"])
    ratios["cut_bound_vs_one_thread"] = bound["bound_vs_one_thread"]
    ratios["two_processes_samples_vs_one_thread"] = results["backprop_2_processes"]["samples_per_s"] / one["samples_per_s"]
    _common.say(_common.table(_rows(results, methods, one, s, repeat), _HEADER))
    # where a batch's time goes: one-thread backprop's whole step against each stage's share of it
    profile: list[tuple[str, ...]] = [("backprop_1thread", f"{one_ms:.1f}", "-", "-")]
    for m in SPEED_METHODS:
        r = results[m]
        if "busy_ms_per_batch" in r:
            profile.append((m, f"{1e3 * s['batch_size'] / r['samples_per_s']:.1f}",
                            " / ".join(f"{v:.1f}" for v in r["layers_ms_per_batch"]),
                            " / ".join(f"{v:.1f}" for v in r["busy_ms_per_batch"])))
    _common.say(_common.table(profile, ("system", "wall ms per batch", "layers fwd+bwd ms, stage 0 / 1",
                                        "busy ms (all work for the batch), stage 0 / 1")))
    return results, ratios


_HEADER = ("system", "median of runs", "samples/s vs backprop 1 thread")


def _rows(results: dict[str, Any], methods: tuple[str, ...], one: dict[str, Any], s: dict[str, Any],
          repeat: int) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for m in methods:
        r = results[m]
        shown = "never" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f} s"
        if m == "backprop_2_processes":
            shown = "n/a"  # scored once, after training
        rows.append((m, f"{r['samples_per_s']:,.0f} samples/s, {s['target']:.0%} at {shown} ({r['reached_target']}/"
                        f"{repeat}), final {r['final_accuracy']:.3f}",
                     f"{r['samples_per_s'] / one['samples_per_s']:.2f}x"))
    return rows


def plot(results: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.8))
    ax = fig.subplots()
    for k, method in enumerate(m for m in SPEED_METHODS if m != "backprop_2_processes"):
        for n, run in enumerate(results[method]["runs"]):
            h = run["history"]
            label = f"{method} (median {results[method]['samples_per_s']:,.0f} samples/s)" if n == 0 else None
            ax.plot([p["wall_s"] for p in h], [p["accuracy"] for p in h], marker=".", color=f"C{k}", alpha=0.8,
                    linewidth=1, label=label)
    ax.axhline(results["config"]["target"], color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0.5, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.suptitle("backprop vs 2-stage pipelines in 2 processes (mnist5k MLP 784-1024x4-10), every run")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")


def main() -> int:
    p = _common.parser(__doc__ or "")
    p.add_argument("--repeat", type=int, default=None, help="runs per method (default: 1 with --quick, else 3)")
    p.add_argument("--methods", nargs="+", choices=SPEED_METHODS, help="only these (a trial: nothing is written)")
    p.add_argument("--lr", type=float, help="SGD's lr for backprop and the real-gradient pipelines")
    p.add_argument("--in-flight", type=int, help="batches in flight in the real-gradient pipelines")
    p.add_argument("--solo", nargs=2, metavar=("CONFIG", "SETTINGS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.solo:  # one of backprop_2_processes' processes: train, print samples/s as JSON
        r = run_backprop(Path(args.solo[0]), 1, json.loads(args.solo[1]), evaluate=False)
        print(json.dumps({k: r[k] for k in ("samples_per_s", "wall_s", "final_accuracy", "best_accuracy", "history")}))
        return 0
    results, ratios = speed(args)
    if args.methods:
        return 0
    for name, value in ratios.items():
        _common.say(f"{name:34s} {'n/a' if value is None else f'{value:.4g}'}")
    path = _common.write("bench_pipeline", args.quick, results, ratios)
    png = path.with_suffix(".png")
    plot(results, png)
    _common.say(f"wrote {path} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
