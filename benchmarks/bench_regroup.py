"""Dynamic regrouping side by side: a fixed unbalanced split, regrouping from it, and the best static split.

One run, one machine: mnist5k and the compute-bound MLP of ``bench_pipeline.py``
(784-1024x4-10, batch 128, SpecTrain with SGD + momentum 0.9, lr 0.02: at
bench_pipeline's 0.05 SpecTrain's final accuracy varies by points from run to
run across 2 processes, which would drown the comparison; 3 batches in
flight, enough to keep 2 stages busy, 12 epochs, so that balanced splits
reach the 90% target too), cut into 2
stages in 2 worker processes with one torch thread each, through the real
launcher (``python -m dniasync.node --role local``; held-out accuracy scored
after training from saved weights, so evaluation takes no CPU from the
stages). Wall times exclude start-up and evaluation.

- ``unbalanced``: every layer but the last in stage 0, fixed;
- ``regroup``: the same start with ``[regroup] enabled`` (balance policy);
- ``best_static``: the best fixed split, found by trying every cut offline
  (a short run per cut, fastest samples/s wins), then run in full.

Each runs ``--repeat`` times (default 3), round robin; figures are medians.
"Steady" samples/s is the rate over the second half of a run's wall time
(after regrouping has settled). Then **reacting to a change**: stage 0's
process is slowed to a third of its speed a third of the way through a
regrouping run (it is pinned to CPU 0 and two busy loops pinned beside it
start, as two co-located jobs would; the rest of
the job is pinned to CPU 1 throughout), and the run's steady rate after its
moves is compared with the best static split under the same slowdown (every
cut tried again with it). A duty-cycled SIGSTOP/SIGCONT was tried first: it
slows a stage only while it computes, so once layers move away and the stage
waits more, the stops land in its idle time, its layers look fast again and
the policy moved them back.

Ratios (bigger is better): ``regroup_vs_unbalanced`` (steady samples/s;
goal >= 1.3), ``regroup_vs_best_static`` (goal >= 0.95),
``regroup_time_to_target_vs_unbalanced`` (the unbalanced split's time to the
target accuracy over regrouping's; goal >= 1.2), ``reaction_vs_best_static``
(steady samples/s after the slowdown and the moves it caused, over the best
static split under that slowdown; goal >= 0.9). Also reported: the pause of
each move (ms) and the bytes it moved, final accuracies.

    python benchmarks/bench_regroup.py [--quick] [--repeat N]
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

import _common

TARGET = 0.90
HOGS = 2
"""Busy loops beside the slowed stage: with two, it runs at about a third of its speed."""

JOB = """
[job]
name = "bench_regroup_{name}"
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
name = "momentum"
lr = {lr}
momentum = 0.9

[pipeline]
groups = {groups}
method = "spectrain"
max_in_flight = {max_in_flight}

[stop]
max_epochs = {epochs}
max_seconds = 900

[eval]
every_seconds = {eval_s}
deferred = true
{regroup}"""

REGROUP = """
[regroup]
enabled = true
cooldown_s = {cooldown_s}
interval_s = 0.5
min_gain = 0.1
max_moves = 20
"""


def settings(quick: bool) -> dict[str, Any]:
    if quick:
        return {"sizes": [784, 256, 256, 10], "n_train": 2000, "n_test": 500, "batch_size": 64, "epochs": 6,
                "probe_epochs": 1, "react_epochs": 12, "lr": 0.05, "seed": 0, "eval_s": 0.25, "max_in_flight": 4,
                "cooldown_s": 0.5, "target": 0.80, "repeat": 1}
    return {"sizes": [784, 1024, 1024, 1024, 1024, 10], "n_train": 4000, "n_test": 1000, "batch_size": 128,
            "epochs": 12, "probe_epochs": 2, "react_epochs": 24, "lr": 0.02, "seed": 0, "eval_s": 0.5,
            "max_in_flight": 3, "cooldown_s": 3.0, "target": TARGET, "repeat": 3}


def n_layers(sizes: list[int]) -> int:
    return 2 * (len(sizes) - 1) - 1


def split_at(cut: int, n: int) -> list[list[int]]:
    return [list(range(cut)), list(range(cut, n))]


class Slowdown:
    """Cut a process's speed to a third as two co-located jobs would: the process (every thread of it) is pinned
    to CPU 0 beside ``HOGS`` busy loops pinned there too (the scheduler shares the core between them), until
    :meth:`stop`. The other processes of the job are pinned to CPU 1 for the whole run (see :func:`pin`), so only
    the slowed stage shares its core."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._hogs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        pin_process(self.pid, {0})
        self._hogs = [subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"])
                      for _ in range(HOGS)]

    def stop(self) -> None:
        for hog in self._hogs:
            hog.kill()
            hog.wait()


def pin_process(pid: int, cpus: set[int]) -> None:
    """Pin every thread of ``pid`` (``sched_setaffinity`` on a pid moves only its main thread; a stage computes
    in a worker thread, which would otherwise escape to the other core)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that just ended
            pass


def pin(out: Path, stage0: int) -> None:
    """Stage 0's worker on CPU 0, every other process of the job (launcher, coordinator, stage 1) on CPU 1."""
    doc = json.loads((out / "cluster.json").read_text())
    pin_process(int(doc["launcher_pid"]), {1})
    for child in doc["children"]:
        pid = int(child["pid"])
        pin_process(pid, {0} if pid == stage0 else {1})


def _stage0_pid(out: Path) -> int | None:
    """The worker process hosting stage 0 (its log says so), from the launcher's cluster.json."""
    try:
        doc = json.loads((out / "cluster.json").read_text())
    except (OSError, ValueError):
        return None
    for child in doc["children"]:
        log = Path(child["log"])
        if child["role"] == "worker" and log.exists() and "hosting stages [0]" in log.read_text():
            return int(child["pid"])
    return None


def run_job(name: str, s: dict[str, Any], groups: list[list[int]], tmp: Path, *, regroup: bool, epochs: int,
            slow_after_s: float | None = None) -> dict[str, Any]:
    """One job through the launcher; with ``slow_after_s``, stage 0 runs at a third of its speed from that many seconds of
    training on (0: from the start)."""
    out = tmp / name
    config = tmp / f"{name}.toml"
    config.write_text(JOB.format(
        name=name, out=out, groups=groups, epochs=epochs,
        regroup=REGROUP.format(cooldown_s=s["cooldown_s"]) if regroup else "",
        **{k: s[k] for k in ("seed", "sizes", "n_train", "n_test", "batch_size", "lr", "eval_s", "max_in_flight")}))
    proc = subprocess.Popen([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    slow: Slowdown | None = None
    slow_at: float | None = None
    if slow_after_s is not None:
        log = out / "logs" / "coordinator0.log"
        while proc.poll() is None and not (log.exists() and "training 1 pipeline" in log.read_text()):
            time.sleep(0.05)
        trained_from = time.monotonic()
        pid = _stage0_pid(out)
        if pid is not None and proc.poll() is None:
            pin(out, pid)
            while proc.poll() is None and time.monotonic() - trained_from < slow_after_s:
                time.sleep(0.05)
            slow = Slowdown(pid)
            slow.start()
            slow_at = time.monotonic() - trained_from
    try:
        output, _ = proc.communicate(timeout=1800)
    finally:
        if slow is not None:
            slow.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{output}")
    doc = json.loads((out / "summary.json").read_text())
    return digest(doc, groups, slow_at)


def digest(doc: dict[str, Any], groups: list[list[int]], slow_at: float | None) -> dict[str, Any]:
    history = [{"wall_s": p["wall_s"], "samples": p["samples"], "accuracy": p["accuracy"]} for p in doc["history"]]
    moves = [{k: e[k] for k in ("wall_s", "before", "split", "layers", "pause_ms", "bytes", "predicted_gain",
                                 "slowness")} for e in doc["events"] if e["kind"] == "regrouped"]
    wall = doc["wall_s"]
    return {
        "start_split": groups, "history": history, "moves": moves, "wall_s": wall, "samples": doc["samples"],
        "samples_per_s": doc["metrics"]["train_samples_per_s"], "final_accuracy": doc["final_accuracy"],
        "best_accuracy": doc["best_accuracy"], "slow_at_s": slow_at,
        "time_to_target_s": None, "steady_samples_per_s": rate_between(history, wall / 2, wall),
    }


def rate_between(history: list[dict[str, Any]], t0: float, t1: float) -> float:
    """Samples per second between the history points nearest to ``t0`` and ``t1``."""
    points = [{"wall_s": 0.0, "samples": 0}, *history]
    a = min(points, key=lambda p: abs(p["wall_s"] - t0))
    b = min(points, key=lambda p: abs(p["wall_s"] - t1))
    if b["wall_s"] <= a["wall_s"]:  # too few points in the window: the whole run's rate
        a, b = points[0], points[-1]
    return (b["samples"] - a["samples"]) / (b["wall_s"] - a["wall_s"]) if b["wall_s"] > 0 else math.nan


def best_cut(s: dict[str, Any], tmp: Path, label: str, slow: bool) -> tuple[int, dict[int, float]]:
    """Every cut tried with a short run; the one with the most samples/s."""
    n = n_layers(s["sizes"])
    rates: dict[int, float] = {}
    for cut in range(1, n):
        run = run_job(f"probe-{label}-{cut}", s, split_at(cut, n), tmp, regroup=False, epochs=s["probe_epochs"],
                      slow_after_s=0.0 if slow else None)
        rates[cut] = run["samples_per_s"]
        print(f"  probe{' (stage 0 at a third of its speed)' if slow else ''}: cut at {cut}: {rates[cut]:,.0f} samples/s",
              flush=True)
    return max(rates, key=lambda c: rates[c]), rates


def summarise(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    for r in runs:
        r["time_to_target_s"] = next((p["wall_s"] for p in r["history"] if p["accuracy"] >= target), None)
    t = statistics.median(math.inf if r["time_to_target_s"] is None else r["time_to_target_s"] for r in runs)
    return {
        "steady_samples_per_s": statistics.median(r["steady_samples_per_s"] for r in runs),
        "samples_per_s": statistics.median(r["samples_per_s"] for r in runs),
        "time_to_target_s": None if math.isinf(t) else t,
        "final_accuracy": statistics.median(r["final_accuracy"] for r in runs),
        "moves": statistics.median(len(r["moves"]) for r in runs),
        "runs": runs,
    }


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, mid, bottom) = plt.subplots(3, 1, figsize=(9, 10), sharex=False)
    colors = {"unbalanced": "tab:red", "regroup": "tab:green", "best_static": "tab:blue",
              "reaction": "tab:purple", "best_static_slowed": "tab:gray"}
    series = {**{k: results[k]["runs"][0] for k in ("unbalanced", "regroup", "best_static")},
              "reaction": results["reaction"], "best_static_slowed": results["best_static_slowed"]}
    for name, run in series.items():
        h = run["history"]
        ts = [(a["wall_s"] + b["wall_s"]) / 2 for a, b in zip(h, h[1:])]
        rs = [(b["samples"] - a["samples"]) / (b["wall_s"] - a["wall_s"]) if b["wall_s"] > a["wall_s"] else math.nan
              for a, b in zip(h, h[1:])]
        ax = bottom if name in ("reaction", "best_static_slowed") else top
        ax.plot(ts, rs, color=colors[name], label=name)
        for m in run["moves"]:
            ax.axvline(m["wall_s"], color=colors[name], linestyle=":", alpha=0.7)
        if run.get("slow_at_s") and name == "reaction":
            ax.axvline(run["slow_at_s"], color="black", linestyle="--", label="stage 0 slowed to a third of its speed")
        mid.plot([p["wall_s"] for p in h], [100 * p["accuracy"] for p in h], color=colors[name], label=name)
    for name in ("regroup", "reaction"):  # the split over time: where each run started, and after each move
        run = series[name]
        start = " | ".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else f"{g[0]}" for g in run["start_split"])
        for t, split in [(0.0, start)] + [(m["wall_s"], m["split"]) for m in run["moves"]]:
            (bottom if name == "reaction" else top).annotate(
                f"{name}: {split}", (t, 0.03), xycoords=("data", "axes fraction"), fontsize=7, rotation=90,
                va="bottom", color=colors[name])
    top.set_title("samples/s over time (dotted: moves)")
    bottom.set_title("reacting to stage 0 at a third of its speed (dashed: slowdown starts)")
    mid.set_title("held-out accuracy (%) over time")
    for ax in (top, mid, bottom):
        ax.set_xlabel("training wall time (s)")
        ax.legend(fontsize=8)
    top.set_ylabel("samples/s")
    bottom.set_ylabel("samples/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = _common.parser(__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=None)
    args = p.parse_args()
    s = settings(args.quick)
    repeat = args.repeat or s["repeat"]
    n = n_layers(s["sizes"])
    unbalanced = split_at(n - 1, n)
    results: dict[str, Any] = {"config": {**s, "repeat": repeat, "unbalanced": unbalanced, "cpu": _cpu()}}
    with tempfile.TemporaryDirectory(prefix="bench_regroup_") as d:
        tmp = Path(d)
        print("trying every cut (short runs)", flush=True)
        cut, rates = best_cut(s, tmp, "even", slow=False)
        results["probe_rates"] = rates
        best = split_at(cut, n)
        results["config"]["best_static"] = best
        runs: dict[str, list[dict[str, Any]]] = {"unbalanced": [], "regroup": [], "best_static": []}
        for rep in range(repeat):
            for name, groups, regroup in (("unbalanced", unbalanced, False), ("regroup", unbalanced, True),
                                          ("best_static", best, False)):
                run = run_job(f"{name}-{rep}", s, groups, tmp, regroup=regroup, epochs=s["epochs"])
                runs[name].append(run)
                print(f"  {name} #{rep}: steady {run['steady_samples_per_s']:,.0f} samples/s, final "
                      f"{100 * run['final_accuracy']:.2f}%, moves {[m['split'] for m in run['moves']]}", flush=True)
        for name, rs in runs.items():
            results[name] = summarise(rs, s["target"])
        print("reacting to a change: every cut with stage 0 at a third of its speed", flush=True)
        slow_cut, slow_rates = best_cut(s, tmp, "slow", slow=True)
        results["probe_rates_slowed"] = slow_rates
        results["config"]["best_static_slowed"] = split_at(slow_cut, n)
        react_epochs = s["react_epochs"]
        results["best_static_slowed"] = run_job("best-static-slowed", s, split_at(slow_cut, n), tmp, regroup=False,
                                                epochs=react_epochs, slow_after_s=0.0)
        # the slowdown starts about a third of the way through (from the best static split's full runs' speed)
        third = statistics.median(r["wall_s"] for r in runs["best_static"]) * react_epochs / s["epochs"] / 3
        reaction = run_job("reaction", s, best, tmp, regroup=True, epochs=react_epochs, slow_after_s=third)
        after = [m for m in reaction["moves"] if reaction["slow_at_s"] is not None and m["wall_s"] > reaction["slow_at_s"]]
        settle = after[-1]["wall_s"] if after else (reaction["slow_at_s"] or 0.0)
        reaction["steady_after_slowdown"] = rate_between(reaction["history"], settle + 1.0, reaction["wall_s"])
        results["reaction"] = reaction
        slowed = results["best_static_slowed"]
        slowed["steady_samples_per_s"] = rate_between(slowed["history"], slowed["wall_s"] / 3, slowed["wall_s"])

    moves = [m for r in results["regroup"]["runs"] for m in r["moves"]] + results["reaction"]["moves"]
    results["move_pause_ms"] = [m["pause_ms"] for m in moves]
    results["move_bytes"] = [m["bytes"] for m in moves]
    ub, rg, bs = results["unbalanced"], results["regroup"], results["best_static"]
    ratios = {
        "regroup_vs_unbalanced": rg["steady_samples_per_s"] / ub["steady_samples_per_s"],
        "regroup_vs_best_static": rg["steady_samples_per_s"] / bs["steady_samples_per_s"],
        "reaction_vs_best_static": results["reaction"]["steady_after_slowdown"] / slowed["steady_samples_per_s"],
        "regroup_accuracy_gap_vs_best_static": 100 * (rg["final_accuracy"] - bs["final_accuracy"]),
    }
    if ub["time_to_target_s"] and rg["time_to_target_s"]:
        ratios["regroup_time_to_target_vs_unbalanced"] = ub["time_to_target_s"] / rg["time_to_target_s"]
    path = _common.write("bench_regroup", args.quick, results, ratios)
    png = path.with_suffix(".png")
    plot(results, png)
    rows = [(name, f"{results[name]['steady_samples_per_s']:,.0f} samples/s steady",
             f"{100 * results[name]['final_accuracy']:.2f}% final, target in "
             f"{results[name]['time_to_target_s'] or float('inf'):.1f} s") for name in ("unbalanced", "regroup",
                                                                                       "best_static")]
    rows.append(("reaction", f"{results['reaction']['steady_after_slowdown']:,.0f} samples/s after the moves",
                 f"best static under the slowdown: {slowed['steady_samples_per_s']:,.0f}"))
    print(_common.table(rows, ("run", "throughput", "accuracy")))
    print(_common.table([(k, f"{v:.3f}", "") for k, v in ratios.items()], ("ratio", "value", "")))
    print(f"moves: pause {statistics.median(results['move_pause_ms'] or [math.nan]):.1f} ms median, "
          f"{statistics.median(results['move_bytes'] or [0]) / 1e6:.2f} MB median; wrote {path} and {png}")
    return 0


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
