"""Speed-up with node count on an emulated cluster: dniasync's modes vs torch DDP, 1 to 8 nodes of one core.

Run (as root: network namespaces, tc, nftables, cgroups): python benchmarks/bench_scaling.py [--quick]
Full: every mode x model x link x node count below; hours on a 2-core machine (each run is slowed
by its time dilation); pick parts with --models, --links, --nodes, --systems.

The nodes. Every run goes through ``python -m dniasync.node --role local --emulate N:LINK``
(dniasync) or the same emulation driven from here (DDP; ``dniasync.node._emulate.Emulation``):
each process of the job is a node of one core in its own network namespace, on a bridge, with
its own host name; with C cores and P processes (N trainers, PS shards, the coordinator) each is
held to min(1, C/P) of a core by a cgroup quota, so the run is d = max(1, P/C) times slower than
on P real one-core nodes, and its links are shaped to BANDWIDTH / d (tc tbf) with LATENCY x d
added each way by the delay proxy. Every time reported here is divided by d: what P one-core
machines on the stated link would show.

The systems, on mnist5k (4,000 train / 1,000 held out, seed 0):
- ``downpour_codec``: examples/downpour_mnist_threshold.toml, N replicas (Strom's threshold codec; its thresholds
  on the MLP: DOWNPOUR_CODEC);
- ``p2p``: examples/p2p_mnist.toml (``job.mode = "p2p"``), N peers, threshold codec, no local steps;
- ``dni_downpour``: examples/dni_downpour_mnist.toml (cDNI stages, each stage's weights on its own
  PS shard), and ``spectrain``: examples/cnn_mnist_spectrain.toml's pipeline, with N workers as
  s stages x r pipeline replicas: s = N up to the cuts the model has (MLP 2, CNN 4), r = N / s
  (replicated SpecTrain is SpecTrain x Downpour: each stage predicts from its weights' velocity on
  its PS shard); replicated pipelines exchange with their stage shards every PIPELINE_EXCHANGE steps,
  int8-coded (PIPELINE_CODEC), their shards stepping PIPELINE_OPTIMIZER;
- ``ddp`` / ``ddp_powersgd``: torch DistributedDataParallel over gloo, plain and with PowerSGD
  (bench_links' wrapper, benchmarks/_scaling_torch.py), N ranks, over the same emulated links.
Models: ``mlp``, bench_train's compute-bound MLP 784-2048-2048-10; ``cnn``, train/models.py's CNN
(16/32 channels, GroupNorm, 128 hidden). Each system keeps its example's optimizer (but the lrs of
ADAGRAD_LR and the replicated pipelines' PIPELINE_OPTIMIZER); the dniasync
modes snapshot the weights every 256 samples (``eval.deferred``: scored after the run, off the clock).

Reported per (model, link, system, N): samples/s (steady: between the first and last snapshot),
time to TARGET held-out accuracy, the speed-up over 1 node (time to target at 1 node / at N; the
throughput speed-up beside it) and the parallel efficiency (speed-up / N). Ratios (bigger is
better): ``<mode>_efficiency_8_nodes_1gbit`` for each dniasync mode, ``best_speedup_8_nodes_1gbit``
(the best mode's), ``best_vs_ddp_8_nodes_100mbit`` (DDP's time to target / the best mode's), on
the MLP; the same prefixed ``cnn_`` on the CNN. Beside them, not a goal: ``best_throughput_speedup_8_nodes_1gbit``,
the best mode's samples/s at 8 nodes over its own at 1 (what the nodes add before staleness and the combined batch
cost samples to target; the time-to-target speed-up is the one that counts). A ratio whose runs did not reach the target is left
out and named in ``ratios_missing``. Where a curve bends, the summaries' own counters say why: each
dniasync run keeps its summary's ``metrics`` (staleness, PS and stage counters) in the results.

Validation of the emulation: downpour_codec and DDP on the MLP at 1 and 2 nodes, emulated at
1 Gbit/s / 0.2 ms and run for real (``--role local`` on loopback, unconfined; DDP ranks on
loopback), their samples/s and time to target side by side; within TOLERANCE is the claim. And a
link microbenchmark: two emulated hosts on each link as shaped at d = 1 and at the dilation of
8 nodes; 8 MB through it and pings through the delay proxy, against the rate and 2 x delay.

The synchronous bound (``bound`` in the results, a dash-dot line on the PNG): how far time to target can scale
on this job at all. N nodes of batch 32 that step together are one process at batch 32 N; with free links and N
times one node's samples/s, their speed-up over one node is N x S(32) / S(32 N), S the samples to TARGET (plain
Adagrad in one process, the best lr of BOUND_LRS, median over BOUND_SEEDS, scored every 256 samples as the runs
are). An asynchronous mode is not bound by it exactly, but it pays for its N in staleness instead.

``--quick``: the MLP, 1 Gbit/s, 1 and 2 nodes, downpour_codec and DDP, 1 epoch; the validation at
1 node; the link microbenchmark at d = 1; the bound at one lr and seed (a few minutes: every emulated run
starts its processes under their quotas).

``--update`` starts from the committed results and replaces only the runs asked, for a full run takes hours:
    python benchmarks/bench_scaling.py --update --models mlp --links 1gbit --systems ddp_powersgd --nodes 2,4,8
    python benchmarks/bench_scaling.py --update --systems '' --bound
    python benchmarks/bench_scaling.py --update --validate --models mlp --systems downpour_codec
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import tomllib  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import _common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_train import EXAMPLES, ROOT, _split, steady_rate, time_to, to_toml  # noqa: E402

from _scaling_torch import MODELS, build  # noqa: E402
from dniasync.node._emulate import Emulation, Link, cores, missing, parse_spec  # noqa: E402

HERE = Path(__file__).resolve().parent
TARGET = 0.90
NODES = [1, 2, 4, 8]
LINKS = {"1gbit": "1gbit:0.2ms", "100mbit": "100mbit:5ms"}
MODES = ["downpour_codec", "p2p", "dni_downpour", "spectrain"]
PIPELINES = ("dni_downpour", "spectrain")
REFERENCES = ["ddp", "ddp_powersgd"]
EPOCHS = {"mlp": 5, "cnn": 10}
"""The asynchronous modes' sample budget (20,000 and 40,000 samples): Downpour with the threshold codec reached
90% on the MLP after about 7,500 samples on one node (4,544 with DOWNPOUR_CODEC's thresholds), and needs more
with more nodes (staleness). On the CNN, 8 Downpour replicas (lr 0.01) were at 50.9% after 3 epochs (12,000 samples; 1.0 s of emulated time)."""
DDP_EPOCHS = {"mlp": 3, "cnn": 3}
"""Synchronous DDP reaches 92% within 7,200 samples at any rank count on the MLP (bench_links): two epochs covered
90% (and kept its 100 Mbit/s runs, 23 MB of gradients per step, within minutes) until DDP + PowerSGD at 8 ranks on
100 Mbit/s ended them at 88.8% (another run had touched 90% at 7,328 samples, 88.9% at the end): three since. The
MLP's DDP cells run at two epochs that reached 90% keep their figures (time to target does not depend on the
rest). The CNN at 8 ranks needs 7,424 samples to 90% at its best lr (``bound``): three epochs."""
ADAGRAD_LR = {"mlp": 0.01, "cnn": 0.01}
"""The Adagrad systems' lr on a model (Downpour, p2p, DDP, PowerSGD; their examples' 0.05 and 0.03 otherwise):
on this MLP 0.05 made Downpour diverge at 4 replicas (loss 51 at 2,100 samples) and slowed all-core torch
2x in bench_train, whose compute-bound rows run every system at 0.01. On the CNN the examples' 0.05 left
Downpour at 57.8% and 34.8% after 3 epochs at 4 and 8 replicas, and 9.7% at 8 on 100 Mbit/s (the synchronous
bound's best lr is 0.005 at every batch size from 32 to 256, 0.01 next to it)."""
DOWNPOUR_STALENESS = {"cnn": "inverse"}
"""Downpour's staleness policy on a model (``downpour.staleness``; ``none`` otherwise), at every node count: on the
CNN, lr / staleness (Zhang et al. 2016). Without it 8 replicas at Adagrad 0.01 stayed at 8-11% for their first 5,000
samples (mean staleness 6.8) and ended at 84.3% after 40,000; with it one trial at 8 nodes (1 Gbit/s) reached 90%
after 12,224 samples (1.01 s emulated) and ended at 92.9%. (A replica's staleness is 0 alone: its lr is unchanged.)
Not on the MLP: one trial with it at 8 nodes (1 Gbit/s, mean staleness 6.9) ended its 5 epochs at 83.7%, never at
90%, where without it 90% came at 7.5 s (emulated)."""
DOWNPOUR_CODEC = {"mlp": {"tau": 0.002, "delta_tau": 0.0001}}
"""The threshold codec's thresholds on a model (``downpour.tau`` of the pushed gradients, ``downpour.delta_tau`` of
the pulled parameter deltas; the example's tau 0.02 and 10% of the parameter RMS otherwise). The example's are set
for its 784-256-256-10 MLP; this MLP's 2048-wide layers have smaller gradients and weights, and with them one
replica needed 7,104-7,584 samples to 90% (2 epochs, lr 0.01, for real; 0.886 at the end) where uncompressed
Downpour needed 1,824-2,560 (0.927). tau 0.002 alone: 3,840; with delta_tau 0.0001: 2,432 (0.919). At 8 replicas
(for real, 5 epochs): 16,252 samples to 90% with the example's against 9,528, at 737 and 952 samples/s; emulated
at 1 Gbit/s, 20,124 (7.5 s, an earlier run on another host) against 13,016 (5.2 s, 3,029 samples/s). The int8
codec instead: 2,944 samples at 1 replica, 8,380 at 8 emulated, but at 1,168 samples/s its quarter of the dense
bytes fills the links (10.4 s)."""
PS_SHARDS_PER_NODES = 1
"""Downpour's PS shards: one per this many replicas (at least 2), so the PS grows with the job, as in DistBelief.
With one per 2 replicas the shards saturated: 4 replicas ran at 1.19x the samples/s of 2, and the shards (0.29
and 0.15 of a core each at 4 and 8 replicas) could not answer the coordinator's weight snapshots within 10 s."""
NODES_FOR = {"cnn:100mbit": [1, 8]}
"""The CNN's gradients are 0.8 MB (the MLP's 23 MB): on the slow link only its end points, for the 8-node ratios."""
PIPELINE_CODEC = "int8"
"""Replicated pipelines' pushes to their stages' PS shards and the shards' answers to their pulls (``pipeline.codec``):
blockwise 8-bit, a quarter of the dense bytes. Without it every stage replica pushed and pulled its dense weights
every step and the PS links saturated: SpecTrain x Downpour on the MLP ran at 287 and 326 samples/s at 4 and 8 nodes
(1 Gbit/s) against 1,507 at 2 (one pipeline, no PS). ``threshold`` cost DNI x Downpour 13-15 points in 10 epochs
(tau 0.002 and 0.01, with its PS shards' Adam); int8 0.3."""
PIPELINE_EXCHANGE = {"mlp": 4}
"""Replicated pipelines' ``pipeline.n_fetch`` and ``n_push`` on a model (1 otherwise): every stage replica pulls its
weights from its stage's PS shard and pushes its summed gradient every this many steps. The MLP's second stage holds
4.2 M of its 5.8 M weights on one shard, which at every step decoded, applied and answered each of its replicas: at 8
nodes (4 replicas, 1 Gbit/s) DNI x Downpour ran at 544 samples/s against one pipeline's 886, its stages busy 17% of
the time. Every 4 steps: 3,279 samples/s (one trial, Adam 3e-4). The CNN's shards are small: with this and
PIPELINE_OPTIMIZER its 8-node SpecTrain reached 90% after 18,176 samples (4.6 s) against 20,384 (5.0 s) without,
one trial each, so the CNN keeps the examples' settings."""
PIPELINE_OPTIMIZER = {"mlp": {"name": "adagrad", "lr": 0.005}}
"""The optimizer of the pipelines on a model at every node count (the examples' otherwise: Adam 3e-4 for DNI x
Downpour, momentum 0.02 / 0.9 for SpecTrain). Replicated, their PS shards step it; a single pipeline's stages step
it themselves (SpecTrain's then predict from the weights' observed velocity, as on PS shards: Adagrad keeps no step
direction). Until single pipelines could step Adagrad, their 1- and 2-node runs took the examples'. With 4 replicas
pushing to one shard,
momentum and Adam compound with the pushes' staleness (2.9): at 8 nodes (1 Gbit/s, pushes every 4 steps, one trial
each, 20,000 samples) DNI x Downpour with Adam 3e-4 swung between 59% and 80% and never reached 90% in 60,000 samples
(Adam 1.2e-3: 70%, 6e-4: 82%), SpecTrain with momentum 0.9 fell to 24% (0.5: 59%, Adam 3e-4: 76%); with Adagrad
0.01, as Downpour has here, 89.4% and 85.8%, rising at every snapshot. In 10 epochs at 0.01, DNI x Downpour fell to
11% at 10,536 samples and ended at 83.9% (SpecTrain: 90% at 13.4 s); at 0.005 90% at 34,768 samples, 12.3 s
(SpecTrain: 13.5 s)."""
PIPELINE_EPOCHS = {"mlp": 10}
"""The pipelines' sample budget on a model (EPOCHS otherwise): 8 nodes of DNI x Downpour and SpecTrain x Downpour
with Adagrad were at 89.4% and 85.8% after 5 epochs of the MLP."""
RUN_CAP_S = 300.0
"""A dniasync run stops after this many real seconds even before its sample budget (a replicated DNI x Downpour
pipeline at 8 nodes pushed its stages' dense weights every step, before PIPELINE_CODEC and PIPELINE_EXCHANGE: 15 GB
for the MLP's budget; at 100 Mbit/s the 8-node pipelines still stop at it)."""
WORK = ROOT / "runs" / "bench_scaling"
"""Each run's directory; its ``result.json`` is taken again by ``--reuse`` when what it depends on is equal."""
SNAPSHOT_EVERY = 256
EVAL_TIMEOUT_S = 300.0
"""Real seconds a dniasync run's coordinator may take to gather one evaluation's weights (``eval.timeout_s``, 30 s
by default). Emulated, every transfer is d times slower: at 8 nodes the MLP's 23 MB on a 100 Mbit/s link take
about 9 s of real time before any contention, and with the 10 s the PS shards were once asked in, every snapshot
timed out and the run had no figure. DDP's ranks copy their own parameters: nothing crosses a link."""
TOLERANCE = 0.25
"""Emulated vs real at 1 and 2 nodes: samples/s and time to target within 25% of each other."""
Y2_POINT = (6, 2.7)
"""The y2 cluster's speed-up on 6 nodes (Strom 2015), on the plot for scale."""
GROUPS: dict[str, dict[int, list[list[int]]]] = {
    # MLP layers: 0 Linear 1 ReLU 2 Linear 3 ReLU 4 Linear; CNN: see models.cnn
    "mlp": {1: [[0, 1, 2, 3, 4]], 2: [[0, 1], [2, 3, 4]]},
    "cnn": {1: [list(range(13))], 2: [[0, 1, 2, 3, 4], list(range(5, 13))],
            4: [[0, 1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11], [12]]},
}
EXAMPLE = {"downpour_codec": "downpour_mnist_threshold.toml", "p2p": "p2p_mnist.toml",
           "dni_downpour": "dni_downpour_mnist.toml", "spectrain": "cnn_mnist_spectrain.toml"}
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="eth0")
TORCH_PORT = 29500
ONE_CORE = ["taskset", "-c", "0"]
"""The dilation's own check: a run pinned to one core is emulated at twice the dilation."""


class RunFailed(Exception):
    """A run could not give a figure: its text goes into the results instead."""


def stages(model: str, nodes: int) -> tuple[int, int]:
    """(stages, pipeline replicas) for ``nodes`` pipeline workers: as many stages as the model's cuts allow."""
    s = max(k for k in GROUPS[model] if k <= nodes and nodes % k == 0)
    return s, nodes // s


# --------------------------------------------------------------------------- dniasync through the launcher


def pipeline_depends(model: str, nodes: int) -> dict[str, Any]:
    """What of PIPELINE_EXCHANGE and PIPELINE_OPTIMIZER a pipeline run takes (empty: its example's settings)."""
    r = stages(model, nodes)[1]
    out: dict[str, Any] = {}
    if r > 1 and model in PIPELINE_EXCHANGE:
        out["exchange"] = PIPELINE_EXCHANGE[model]
    if model in PIPELINE_OPTIMIZER:
        out["optimizer"] = PIPELINE_OPTIMIZER[model]
    return out


def job(system: str, model: str, nodes: int, out: Path, epochs: int) -> dict[str, Any]:
    doc = tomllib.loads((EXAMPLES / EXAMPLE[system]).read_text())
    factory, kwargs = MODELS[model]
    doc["model"] = {"factory": factory, "kwargs": dict(kwargs)}
    doc["job"].update(name=f"{system}_{model}_{nodes}", output_dir=str(out))
    doc["stop"] = {"max_epochs": epochs, "max_seconds": RUN_CAP_S}  # on the real clock: a cap on the bench's time
    doc["eval"] = {"every_steps": max(1, SNAPSHOT_EVERY // doc["data"]["batch_size"]), "deferred": True,
                   "timeout_s": EVAL_TIMEOUT_S}
    doc["checkpoint"] = {"every_seconds": 1e6}
    if model in ADAGRAD_LR and doc["optimizer"]["name"] == "adagrad":
        doc["optimizer"]["lr"] = ADAGRAD_LR[model]
    if system == "downpour_codec":
        doc["downpour"]["n_replicas"] = nodes
        doc["downpour"]["n_ps_shards"] = max(2, nodes // PS_SHARDS_PER_NODES)
        if model in DOWNPOUR_STALENESS:
            doc["downpour"]["staleness"] = DOWNPOUR_STALENESS[model]
        doc["downpour"].update(DOWNPOUR_CODEC.get(model, {}))
    elif system == "p2p":
        doc["p2p"]["n_peers"] = nodes
        doc.setdefault("sync", {})["local_steps"] = 1
    else:
        s, r = stages(model, nodes)
        pipeline = doc["pipeline"]
        pipeline["groups"] = GROUPS[model][s]
        if model in PIPELINE_OPTIMIZER:
            doc["optimizer"] = dict(PIPELINE_OPTIMIZER[model])
        if r > 1:
            every = PIPELINE_EXCHANGE.get(model, 1)
            pipeline.update(replicas=r, n_fetch=every, n_push=every, codec=PIPELINE_CODEC)
        else:
            for key in ("replicas", "n_fetch", "n_push"):
                pipeline.pop(key, None)
    return doc


def run_dniasync(system: str, model: str, nodes: int, link: str | None, run: Path, epochs: int,
                 one_core: bool) -> dict[str, Any]:
    """One launcher run; ``link`` None: for real (loopback, no quotas); ``one_core``: the launcher and
    its processes pinned to core 0 (``taskset``), so the emulation dilates twice as much."""
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    cfg = run / "job.toml"
    cfg.write_text(to_toml(job(system, model, nodes, run / "out", epochs)) + "\n")
    argv = [*ONE_CORE * one_core, sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(cfg)]
    if link is not None:
        argv += ["--emulate", f"{nodes}:{LINKS[link]}"]
    with (run / "launcher.log").open("wb") as log:
        proc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT, timeout=4 * 3600)
    summary_path = run / "out" / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        tail = (run / "launcher.log").read_text(errors="replace")[-1500:]
        raise RunFailed(f"the launcher exited {proc.returncode}: {tail}")
    summary = json.loads(summary_path.read_text())
    emulation = summary.get("emulation", {})
    return figures(summary["history"], summary["samples"], summary["wall_s"],
                   dilation=emulation.get("dilation", 1.0), processes=emulation.get("processes"),
                   metrics=summary.get("metrics", {}))


# --------------------------------------------------------------------------- torch DDP over the same links


STALL_S = {"1gbit": 60.0, "100mbit": 600.0, None: 60.0}
"""A DDP run in which no rank finished a step this long (each touches ``step-R`` after every step) is stuck in a
collective: stopped and recorded as failed. On 8 nodes a step moves 40 MB through every rank's link: about 4 s of
real time at 1 Gbit/s emulated, and the first step at 100 Mbit/s took longer than 60 s."""


def run_ddp(system: str, model: str, nodes: int, link: str | None, run: Path, epochs: int,
            one_core: bool) -> dict[str, Any]:
    """N ranks of torch DDP; at one node PowerSGD's run is plain DDP's (nothing to compress, and torch's
    PowerSGD hook waited forever in a one-rank group here)."""
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    c = 1 if one_core else cores()
    dilation = max(1.0, nodes / c) if link is not None else 1.0
    emulation: Emulation | None = None
    if link is not None:
        spec = parse_spec(f"{nodes}:{LINKS[link]}")
        emulation = Emulation([f"r{i}" for i in range(nodes)],
                              Link(spec.bandwidth_bps / dilation, spec.latency_s * dilation), min(1.0, c / nodes))
        emulation.start()
    try:
        master = f"{emulation.address('r0') if emulation else '127.0.0.1'}:{TORCH_PORT}"
        procs = []
        for rank in range(nodes):
            argv = [*ONE_CORE * one_core, sys.executable, str(HERE / "_scaling_torch.py"), "--model", model,
                    "--system", "ddp" if nodes == 1 else system, "--rank", str(rank), "--world", str(nodes),
                    "--dir", str(run), "--master", master,
                    "--epochs", str(epochs), "--snapshot-every", str(SNAPSHOT_EVERY)]
            if model in ADAGRAD_LR:
                argv += ["--lr", str(ADAGRAD_LR[model])]
            with (run / f"rank-{rank}.log").open("wb") as log:
                env = ENV if emulation else {k: v for k, v in ENV.items() if k != "GLOO_SOCKET_IFNAME"}
                if emulation is not None:
                    procs.append(emulation.popen(f"r{rank}", argv, stdout=log, stderr=log, env=env, cwd=HERE))
                else:
                    procs.append(subprocess.Popen(argv, stdout=log, stderr=log, env=env, cwd=HERE))
        deadline = time.monotonic() + 600
        while not all((run / f"ready-{r}").exists() for r in range(nodes)):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise RunFailed(f"a rank did not start: {(run / 'rank-0.log').read_text(errors='replace')[-1500:]}")
            time.sleep(0.05)
        (run / "go.tmp").write_text(repr(time.monotonic()))
        (run / "go.tmp").rename(run / "go")
        while None in (codes := [p.poll() for p in procs]):  # a rank that fails leaves the others in a collective
            steps = [f.stat().st_mtime for f in [run / "go", *run.glob("step-*")]]
            stalled = time.time() - max(steps) > STALL_S[link]
            if any(codes) or stalled:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            if stalled:
                raise RunFailed(f"stalled: no rank finished a step in {STALL_S[link]:g} s (a collective that never "
                                f"completes)")
            time.sleep(0.2)
        if any(codes):
            raise RunFailed(f"ranks exited {codes}: {(run / 'rank-0.log').read_text(errors='replace')[-1500:]}")
    finally:
        if emulation is not None:
            emulation.close()
    reports = [json.loads((run / f"rank-{r}.json").read_text()) for r in range(nodes)]
    snaps = np.load(run / "snapshots.npz")
    zero = np.array(reports[0]["timeline"])
    _, _, x_test, y_test = _split()
    net = build(model)
    history = []
    from dniasync.train.flat import evaluate

    for weights, wall in zip(snaps["weights"], snaps["wall_s"]):
        i = max(0, int(np.searchsorted(zero[:, 0], wall, side="right")) - 1)
        torch.nn.utils.vector_to_parameters(torch.from_numpy(weights), net.parameters())
        accuracy, loss = evaluate(net, x_test, y_test)
        history.append({"wall_s": float(wall), "samples": nodes * int(zero[i, 1]), "accuracy": accuracy, "loss": loss})
    samples = sum(int(np.array(r["timeline"])[-1, 1]) for r in reports)
    history = [{**p, "wall_s": p["wall_s"] / dilation} for p in history]
    return figures(history, samples, max(r["end_s"] for r in reports) / dilation, dilation=dilation, processes=nodes)


def why(metrics: dict[str, Any]) -> dict[str, float]:
    """The counters that say where a curve bends, from a dniasync summary's ``metrics``: the mean staleness of
    the PS shards' applied pushes, the pipeline stages' busy time per batch and version gap, p2p's bytes per
    step and consensus distance, the bytes each sample pushed."""
    out: dict[str, float] = {}
    applied = sum(v for k, v in metrics.items() if k.startswith("ps") and k.endswith("_applied"))
    if applied:
        stale = sum(v for k, v in metrics.items() if k.startswith("ps") and k.endswith("_staleness_sum"))
        out["staleness_mean"] = stale / applied
        out["ps_applied"] = applied
    busy = [v for k, v in metrics.items() if k.endswith("_busy_ms_per_batch")]
    if busy:
        out["stage_busy_ms_per_batch_max"] = max(busy)
        out["stage_busy_ms_per_batch_min"] = min(busy)
    gaps = [v for k, v in metrics.items() if k.endswith("_version_gap_mean")]
    if gaps:
        out["version_gap_mean_max"] = max(gaps)
    for key in ("bytes_sent_per_step", "consensus_distance_max", "train_samples_per_s"):
        if isinstance(metrics.get(key), (int, float)):
            out[key] = float(metrics[key])
    return out


WHY_COLUMNS = (("staleness_mean", ".2f"), ("stage_busy_ms_per_batch_max", ".1f"), ("version_gap_mean_max", ".2f"),
               ("bytes_sent_per_step", ",.0f"), ("consensus_distance_max", ".3g"))


MIN_RATE_SPAN_S = 1.0
"""Snapshots dated closer than this give no samples/s: two that arrived together at the end of a run whose links
were saturated (p2p at 8 nodes on 100 Mbit/s: 6 ms apart) say when they arrived, not how fast it trained."""


def rate(history: list[dict[str, Any]]) -> float | None:
    """Samples/s between the first and last snapshot, if they are at least MIN_RATE_SPAN_S apart."""
    if len(history) < 2 or history[-1]["wall_s"] - history[0]["wall_s"] < MIN_RATE_SPAN_S:
        return None
    return steady_rate(history)


def figures(history: list[dict[str, Any]], samples: int, wall_s: float, *, dilation: float,
            processes: int | None, metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    ttt, samples_to = time_to(history, TARGET)
    return {
        "samples_per_s": rate(history), "time_to_target_s": ttt, "samples_to_target": samples_to,
        "final_accuracy": history[-1]["accuracy"] if history else None, "samples": samples, "wall_s": wall_s,
        "dilation": dilation, "processes": processes, "metrics": metrics or {}, "why": why(metrics or {}),
    }


def _unaffected(kept: dict[str, Any], depends: dict[str, Any], run: Path) -> bool:
    """A run saved with a shorter evaluation timeout in which no evaluation timed out (none failed): a longer
    timeout would have changed nothing in it."""
    if "eval_timeout_s" not in depends or kept.get("eval_timeout_s", 30.0) > depends["eval_timeout_s"]:
        return False
    if {k: v for k, v in kept.items() if k != "eval_timeout_s"} != {k: v for k, v in depends.items()
                                                                    if k != "eval_timeout_s"}:
        return False
    summary = run / "out" / "summary.json"
    if not summary.exists():
        return False
    events = json.loads(summary.read_text()).get("events", [])
    return not any(e.get("kind") == "eval_failed" for e in events)


def budget_epochs(system: str, model: str) -> int:
    """The epochs a system's run on a model may take: DDP_EPOCHS, PIPELINE_EPOCHS or EPOCHS."""
    if system in REFERENCES:
        return DDP_EPOCHS[model]
    return (PIPELINE_EPOCHS if system in PIPELINES and model in PIPELINE_EPOCHS else EPOCHS)[model]


def run_one(system: str, model: str, nodes: int, link: str | None, work: Path, quick: bool,
            reuse: bool = False, *, epochs: int | None = None, one_core: bool = False) -> dict[str, Any]:
    """One run (or its saved result, with ``reuse``), its figures printed; a failure is a result with its error."""
    runner = run_ddp if system in REFERENCES else run_dniasync
    if epochs is None:
        epochs = 1 if quick else budget_epochs(system, model)
    depends = {"system": system, "model": model, "nodes": nodes, "link": LINKS.get(link or "", "real"),
               "epochs": epochs, "target": TARGET, "snapshot_every": SNAPSHOT_EVERY,
               "lr": ADAGRAD_LR.get(model), **({} if system in REFERENCES else {"cap_s": RUN_CAP_S,
                                                                                    "eval_timeout_s": EVAL_TIMEOUT_S}),
               **({"ps_shards_per_nodes": PS_SHARDS_PER_NODES, "staleness": DOWNPOUR_STALENESS.get(model, "none"),
                   **({"codec": DOWNPOUR_CODEC[model]} if model in DOWNPOUR_CODEC else {})}
                  if system == "downpour_codec" else {}),
               **({"pipeline": piped} if system in PIPELINES and (piped := pipeline_depends(model, nodes))
                  else {}),
               "cores": 1 if one_core else cores()}
    run = work / f"{system}_{model}_{link or 'real'}_{nodes}{'_one_core' * one_core}_e{epochs}"
    saved = run / "result.json"
    if reuse and saved.exists():
        kept = json.loads(saved.read_text())
        # a failed run's error too: delete its result.json to run it again
        if kept.get("depends") == depends or _unaffected(kept.get("depends", {}), depends, run):
            _common.say(f"  {model} {link or 'real':8s} {system:15s} {nodes} node(s): reused {saved}")
            result = dict(kept["result"])
            if "error" not in result:
                result["why"] = why(result.get("metrics", {}))
            summary = run / "out" / "summary.json"  # a run saved before MIN_RATE_SPAN_S: its rate, checked again
            if result.get("samples_per_s") and summary.exists():
                result["samples_per_s"] = rate(json.loads(summary.read_text()).get("history", []))
            return result
    start = time.monotonic()
    try:
        result = runner(system, model, nodes, link, run, epochs, one_core)
    except (RunFailed, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
        result = {"error": str(exc)[-2000:]}
    result["run_s"] = time.monotonic() - start
    result["commit"] = _common.machine().get("commit")
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps({"depends": depends, "result": result}) + "\n")
    fig = result.get("samples_per_s")
    _common.say(f"  {model} {link or 'real':8s} {system:15s} {nodes} node(s): "
                + (f"{fig:8,.0f} samples/s, to {TARGET:.0%}: {fmt(result.get('time_to_target_s'), '.1f')} s "
                   f"(d {result.get('dilation', 1):.3g}, {result['run_s']:.0f} s)" if fig else
                   f"no figure: {result.get('error', 'too few snapshots')[:200]}"))
    return result


# --------------------------------------------------------------------------- the statistical bound

BOUND_LRS = (0.0025, 0.005, 0.01, 0.02, 0.04)
"""Adagrad's lrs for the synchronous bound: each batch size gets its best (bigger batches may take bigger steps)."""
BOUND_SEEDS = (0, 1, 2)
BOUND_EXTEND = 2
"""A batch size whose best lr is an end of the lrs it ran at runs the next lr beyond that end (half or twice), at most
this many times: in a first measurement batch 256's best was 0.0025, the grid's lowest."""


def samples_to_target(model: str, data: tuple[torch.Tensor, ...], batch: int, lr: float, seed: int,
                      budget: int) -> int | None:
    """Samples one process of plain synchronous Adagrad at ``batch`` takes to TARGET on the held-out 1,000, scored
    every SNAPSHOT_EVERY samples (as the runs' snapshots are), the first ``budget`` samples at most; None: not
    reached. ``data``: ``_split()``'s (x, y, x_test, y_test). Seed ``seed``: the initial weights and the order of
    the samples."""
    return samples_to_targets(model, data, batch, lr, seed, budget, (TARGET,))[TARGET]


def samples_to_targets(model: str, data: tuple[torch.Tensor, ...], batch: int, lr: float, seed: int,
                       budget: int, targets: Sequence[float]) -> dict[float, int | None]:
    """``samples_to_target`` for each of ``targets``: the samples at the first snapshot at or above it (None: not
    within ``budget``); one run, until every target is reached or the budget spent."""
    import torch.nn.functional as F

    from dniasync.train.flat import evaluate
    from dniasync.train.models import build_model

    factory, kwargs = MODELS[model]
    net = build_model(factory, kwargs, seed=seed)
    opt = torch.optim.Adagrad(net.parameters(), lr=lr)
    x, y, x_test, y_test = data
    rng = np.random.default_rng(seed)
    reached: dict[float, int | None] = dict.fromkeys(targets)
    done, next_eval = 0, SNAPSHOT_EVERY
    while done < budget:
        order = torch.from_numpy(rng.permutation(len(x)))
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i:i + batch]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x[idx]), y[idx]).backward()  # type: ignore[no-untyped-call]
            opt.step()
            done += batch
            if done >= next_eval:
                while next_eval <= done:
                    next_eval += SNAPSHOT_EVERY
                accuracy = evaluate(net, x_test, y_test)[0]
                for t in targets:
                    if reached[t] is None and accuracy >= t:
                        reached[t] = done
                if all(v is not None for v in reached.values()):
                    return reached
            if done >= budget:
                return reached
    return reached


def best_of(runs: dict[float, list[int | None]]) -> tuple[float, float] | None:
    """(median samples, lr) of the lr with the fewest median samples (the smaller lr on a tie); None: no lr
    reached the target on every seed."""
    found = [(float(statistics.median([x for x in v if x is not None])), lr) for lr, v in runs.items()
             if all(x is not None for x in v)]
    return min(found) if found else None


def sync_bound(model: str, nodes: Sequence[int], quick: bool) -> dict[str, Any]:
    """The most an N-node data-parallel job of batch 32 per node can speed up time to TARGET over one node, from
    the samples it needs: N nodes of batch 32 that step together are one process at batch 32 N, so with free
    communication and N times the samples/s its speed-up is N x S(32) / S(32 N), S the samples to TARGET at the
    best lr of BOUND_LRS (median over BOUND_SEEDS). Measured in this process: samples, not time, are the result."""
    torch.set_num_threads(cores())
    budget = EPOCHS[model] * 4000
    lrs, seeds = ((0.01,), (0,)) if quick else (BOUND_LRS, BOUND_SEEDS)
    out: dict[str, Any] = {"budget_samples": budget, "lrs": list(lrs), "seeds": list(seeds), "batches": {}}
    data = _split()

    for n in nodes:
        batch = 32 * n
        runs = {lr: [samples_to_target(model, data, batch, lr, seed, budget) for seed in seeds] for lr in lrs}
        for _ in range(0 if quick else BOUND_EXTEND):
            best = best_of(runs)
            tried = sorted(runs)
            if best is None or tried[0] < best[1] < tried[-1]:
                break
            lr = tried[0] / 2 if best[1] == tried[0] else tried[-1] * 2
            runs[lr] = [samples_to_target(model, data, batch, lr, seed, budget) for seed in seeds]
        best = best_of(runs)
        out["batches"][str(n)] = {"batch": batch,
                                  "samples_to_target": {str(lr): runs[lr] for lr in sorted(runs)},
                                  "best_lr": best[1] if best else None, "samples": best[0] if best else None}
        _common.say(f"  sync bound {model}: batch {batch:4d} ({n} node(s)): "
                    + (f"{best[0]:,.0f} samples to {TARGET:.0%} at lr {best[1]:g}" if best else "target not reached")
                    + f"  {json.dumps({str(lr): runs[lr] for lr in sorted(runs)})}")
    one = out["batches"].get("1", {}).get("samples")
    for n, row in out["batches"].items():
        row["speedup_bound"] = int(n) * one / row["samples"] if one and row["samples"] else None
    return out


# --------------------------------------------------------------------------- the link itself

SERVER = r"""
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 5000)); s.listen(); print("up", flush=True)
c, _ = s.accept()
while True:
    kind = c.recv(1)
    if not kind: break
    if kind == b"p": c.sendall(b"p"); continue
    n, got = int.from_bytes(c.recv(8, socket.MSG_WAITALL), "big"), 0
    while got < n: got += len(c.recv(1 << 20))
    c.sendall(b"k")
"""
CLIENT = r"""
import json, socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], 5000)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
pings = []
for _ in range(20):
    t = time.perf_counter(); c.sendall(b"p"); c.recv(1); pings.append(time.perf_counter() - t)
n = int(sys.argv[2]); t = time.perf_counter(); c.sendall(b"d" + n.to_bytes(8, "big") + b"x" * n); c.recv(1)
print(json.dumps({"rtt_s": statistics.median(pings), "transfer_s": time.perf_counter() - t}))
"""


def measure_link(rate_bps: float, delay_s: float, size: int) -> dict[str, Any]:
    with Emulation(["a", "b"], Link(rate_bps, delay_s), 1.0) as emu:
        server = emu.popen("b", [sys.executable, "-c", SERVER, emu.address("b")], stdout=subprocess.PIPE)
        assert server.stdout is not None
        server.stdout.readline()
        client = emu.popen("a", [sys.executable, "-c", CLIENT, emu.address("b"), str(size)], stdout=subprocess.PIPE)
        out, _ = client.communicate(timeout=600)
        server.wait(timeout=60)
    got = json.loads(out)
    # the transfer's time holds one round trip (the request's last byte out, the answer back)
    rate = size * 8 / max(1e-9, got["transfer_s"] - 2 * delay_s)
    return {"rate_bps": rate_bps, "delay_s": delay_s, "measured_bps": rate, "rate_ratio": rate / rate_bps,
            "rtt_s": got["rtt_s"], "rtt_expected_s": 2 * delay_s,
            "rtt_ratio": got["rtt_s"] / (2 * delay_s) if delay_s > 0 else None}


# --------------------------------------------------------------------------- derived figures, ratios, plot


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def derive(curves: dict[str, dict[str, Any]]) -> None:
    """Speed-ups over 1 node and efficiencies, in place, for one (model, link, system) curve."""
    for system, by_n in curves.items():
        one = by_n.get("1", {})
        for n, r in by_n.items():
            t1, tn = one.get("time_to_target_s"), r.get("time_to_target_s")
            s1, sn = one.get("samples_per_s"), r.get("samples_per_s")
            r["speedup"] = t1 / tn if t1 and tn else None
            r["efficiency"] = r["speedup"] / int(n) if r["speedup"] else None
            r["throughput_speedup"] = sn / s1 if s1 and sn else None


def ratios_of(results: dict[str, Any]) -> tuple[dict[str, float], list[str]]:
    ratios: dict[str, float] = {}
    missing_: list[str] = []
    for model, prefix in (("mlp", ""), ("cnn", "cnn_")):
        runs = results.get("runs", {}).get(model, {})
        fast = runs.get("1gbit", {})
        best: tuple[float, str] | None = None
        fastest: float | None = None
        for mode in MODES:
            throughput = fast.get(mode, {}).get("8", {}).get("throughput_speedup")
            if throughput is not None:
                fastest = max(fastest or throughput, throughput)
            name = f"{prefix}{mode}_efficiency_8_nodes_1gbit"
            eff = fast.get(mode, {}).get("8", {}).get("efficiency")
            if eff is None:
                missing_.append(name)
                continue
            ratios[name] = eff
            speed = fast[mode]["8"]["speedup"]
            best = max(best or (speed, mode), (speed, mode))
        if best is None:
            missing_.append(f"{prefix}best_speedup_8_nodes_1gbit")
        else:
            ratios[f"{prefix}best_speedup_8_nodes_1gbit"] = best[0]
        if fastest is None:
            missing_.append(f"{prefix}best_throughput_speedup_8_nodes_1gbit")
        else:
            ratios[f"{prefix}best_throughput_speedup_8_nodes_1gbit"] = fastest
        slow = runs.get("100mbit", {})
        times = [(r["time_to_target_s"], m) for m in MODES
                 if (r := slow.get(m, {}).get("8", {})).get("time_to_target_s")]
        for ref in REFERENCES:
            name = f"{prefix}best_vs_{ref}_8_nodes_100mbit"
            ref_t = slow.get(ref, {}).get("8", {}).get("time_to_target_s")
            if times and ref_t:
                ratios[name] = ref_t / min(times)[0]
            else:
                missing_.append(name)
    return ratios, missing_


def plot(results: dict[str, Any], path: Path) -> None:
    from matplotlib.figure import Figure

    runs = results.get("runs", {})
    from matplotlib.ticker import NullFormatter

    fig = Figure(figsize=(8.5 * max(1, len(runs)), 5))
    for k, (model, links) in enumerate(runs.items()):
        ax = fig.add_subplot(1, max(1, len(runs)), k + 1)
        top = max(NODES)
        ax.plot([1, top], [1, top], color="grey", linestyle="--", label="ideal")
        ax.plot(*Y2_POINT, marker="*", markersize=12, color="black", linestyle="none", label="y2 cluster, 6 nodes")
        bound = results.get("bound", {}).get(model, {}).get("batches", {})
        pts = sorted((int(n), r["speedup_bound"]) for n, r in bound.items() if r.get("speedup_bound"))
        if pts:
            ax.plot(*zip(*pts), color="black", linestyle="-.", label="synchronous bound (batch 32 N, free links)")
        for link, systems in links.items():
            for system, by_n in systems.items():
                pts = sorted((int(n), r["speedup"]) for n, r in by_n.items() if r.get("speedup"))
                if pts:
                    ax.plot(*zip(*pts), marker="o", linestyle="-" if link == "1gbit" else ":",
                            label=f"{system} {link}")
        ax.set(title=f"{model}: speed-up to {TARGET:.0%} over 1 node", xlabel="emulated nodes (one core each)",
               ylabel="speed-up", xscale="log", yscale="log")
        ax.set_xticks(NODES, [str(n) for n in NODES])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ticks = [0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 4, 8]
        ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = _common.parser(__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--links", default=",".join(LINKS))
    p.add_argument("--nodes", default=",".join(map(str, NODES)))
    p.add_argument("--systems", default=",".join(MODES + REFERENCES))
    p.add_argument("--nodes-for", action="append", default=[], metavar="MODEL:LINK=N,N",
                   help="other node counts for one model and link (repeatable); default: "
                        + " ".join(f"{k}={','.join(map(str, v))}" for k, v in NODES_FOR.items()))
    p.add_argument("--reuse", action="store_true",
                   help="take a run's saved result (runs/bench_scaling/*/result.json) when what it depends on is equal")
    p.add_argument("--update", action="store_true",
                   help="start from the committed benchmarks/results/bench_scaling.json: run only the runs asked "
                        "(--systems '' for none) and put them in place of its; its link figures and validation "
                        "are kept; every run says the commit it ran at")
    p.add_argument("--bound", action="store_true",
                   help="with --update: measure the synchronous bound again (a full run always does)")
    p.add_argument("--validate", action="store_true",
                   help="with --update: run the validation's checks of the --systems asked again, after their runs")
    args = p.parse_args()
    why = missing()
    if why is not None:
        sys.exit(f"bench_scaling: emulated nodes {why}")
    if args.quick:
        models, links, nodes, systems = ["mlp"], ["1gbit"], [1, 2], ["downpour_codec", "ddp"]
    else:
        models, links = args.models.split(","), args.links.split(",")
        nodes, systems = [int(n) for n in args.nodes.split(",")], [x for x in args.systems.split(",") if x]
    work = WORK.with_name("bench_scaling_quick") if args.quick else WORK
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"target": TARGET, "cores": cores(), "tolerance": TOLERANCE, "runs": {},
                               "validation": {}, "links": {}, "work_dir": str(work),
                               "epochs": {"dniasync": EPOCHS, "ddp": DDP_EPOCHS, "pipelines": PIPELINE_EPOCHS},
                               "bound": {}}
    committed = _common.RESULTS / "bench_scaling.json"
    if args.update:
        if args.quick or not committed.exists():
            sys.exit(f"bench_scaling: --update needs the full run's {committed} (and no --quick)")
        before = json.loads(committed.read_text())
        kept, at = before["results"], before["machine"].get("commit")
        for by_link in kept.get("runs", {}).values():
            for by_system in by_link.values():
                for by_n in by_system.values():
                    for r in by_n.values():
                        r.setdefault("commit", at)
        results.update({k: kept[k] for k in ("runs", "validation", "links", "bound") if k in kept})
        results["updated_from"] = at
    nodes_for = dict(NODES_FOR)
    for item in args.nodes_for:
        key, _, counts = item.partition("=")
        nodes_for[key] = [int(n) for n in counts.split(",") if n]  # MODEL:LINK= (none): that part is left out
    plan = [(m, link, system, n) for m in models for link in links for system in systems
            for n in (nodes if args.quick else nodes_for.get(f"{m}:{link}", nodes))]
    _common.say(f"bench_scaling: {cores()} cores; {len(plan)} runs in {work}")
    started = time.monotonic()

    def save() -> None:
        """The results so far: an interrupted run leaves what finished (``partial``)."""
        ratios_, missing_now = ratios_of(results)
        _common.write("bench_scaling", args.quick, {**results, "partial": True, "ratios_missing": missing_now,
                                                    "bench_wall_s": time.monotonic() - started}, ratios_)

    if not args.update:
        _common.say("link microbenchmark (two emulated hosts, 1 core each)")
    size = 2_000_000 if args.quick else 8_000_000
    for link in links if not args.update else []:
        spec = parse_spec(f"1:{LINKS[link]}")
        for d in ([1.0] if args.quick else [1.0, max(1.0, 10 / cores())]):
            m = measure_link(spec.bandwidth_bps / d, spec.latency_s * d, size)
            results["links"][f"{link}_d{d:g}"] = m
            _common.say(f"  {link} at d {d:g}: {m['measured_bps'] / 1e6:.1f} of {m['rate_bps'] / 1e6:.1f} Mbit/s, "
                        f"rtt {1e3 * m['rtt_s']:.2f} ms for {1e3 * m['rtt_expected_s']:.2f} ms")

    def validate() -> None:
        _common.say("validation: emulated at 1gbit vs real runs (loopback, unconfined), and vs the same emulation "
                    "on one core (twice the dilation), MLP")
        checks: list[tuple[str, int, bool]] = [(system, n, False) for system in ["downpour_codec", "ddp"]
                                               for n in ([1] if args.quick else [1, 2])]
        if not args.quick:
            checks += [("downpour_codec", 1, True), ("ddp", 2, True)]
        if args.update:
            checks = [c for c in checks if c[0] in systems]
        for system, n, one_core in checks:
            emulated = results["runs"].get("mlp", {}).get("1gbit", {}).get(system, {}).get(str(n))
            if emulated is None:
                emulated = run_one(system, "mlp", n, "1gbit", work, args.quick, args.reuse)
            if one_core:  # samples/s is what is compared: two epochs keep the doubly dilated run short
                other = run_one(system, "mlp", n, "1gbit", work, args.quick, args.reuse, epochs=2, one_core=True)
            else:
                other = run_one(system, "mlp", n, None, work, args.quick, args.reuse)
            row: dict[str, Any] = {"emulated": emulated, "one_core" if one_core else "real": other}
            for key in ("samples_per_s",) if one_core else ("samples_per_s", "time_to_target_s"):
                e, r = emulated.get(key), other.get(key)
                row[f"{key}_ratio"] = e / r if e and r else None
            row["within_tolerance"] = all(abs(v - 1) <= TOLERANCE for k, v in row.items()
                                          if k.endswith("_ratio") and v is not None)
            results["validation"][f"{system}_{n}{'_one_core' * one_core}"] = row
            save()

    for k, (model, link, system, n) in enumerate(plan):
        _common.say(f"[{k + 1}/{len(plan)}, {(time.monotonic() - started) / 60:.0f} min]")
        curves = results["runs"].setdefault(model, {}).setdefault(link, {})
        curves.setdefault(system, {})[str(n)] = run_one(system, model, n, link, work, args.quick, args.reuse)
        derive(curves)
        save()
        if model == "mlp" and not args.update and (k + 1 == len(plan) or plan[k + 1][0] != "mlp"):
            validate()  # once the MLP's runs are done: they are its emulated side
    if ("mlp" not in models and not args.update) or (args.update and args.validate):
        validate()
    if not args.update or args.bound:
        _common.say(f"the synchronous bound: one process at batch 32 N, Adagrad, the best of lrs {BOUND_LRS}")
        for model in models:
            results["bound"][model] = sync_bound(model, sorted({1, *nodes}), args.quick)
            save()
    results["bench_wall_s"] = time.monotonic() - started

    ratios, missing_ = ratios_of(results)
    results["ratios_missing"] = missing_
    rows = []
    for model, by_link in results["runs"].items():
        for link, systems_ in by_link.items():
            for system, by_n in systems_.items():
                for n, r in by_n.items():
                    rows.append((model, link, system, n, fmt(r.get("samples_per_s"), ",.0f"),
                                 fmt(r.get("time_to_target_s"), ".1f"), fmt(r.get("speedup"), ".2f"),
                                 fmt(r.get("efficiency"), ".2f"), fmt(r.get("throughput_speedup"), ".2f"),
                                 fmt(r.get("dilation"), ".3g")))
    _common.say(_common.table(rows, ("model", "link", "system", "nodes", "samples/s", f"to {TARGET:.0%} s",
                                     "speed-up", "efficiency", "thr. speed-up", "d")))
    bends = [(model, link, system, n, *(fmt(r.get("why", {}).get(k), f) for k, f in WHY_COLUMNS))
             for model, by_link in results["runs"].items() for link, systems_ in by_link.items()
             for system, by_n in systems_.items() for n, r in by_n.items() if r.get("why")]
    if bends:
        _common.say("where the curves bend (the runs' own counters):")
        _common.say(_common.table(bends, ("model", "link", "system", "nodes", *(k for k, _ in WHY_COLUMNS))))
    for name, row in results["validation"].items():
        other = "one core" if "one_core" in row else "real"
        _common.say(f"validation {name}: samples/s emulated/{other} {fmt(row['samples_per_s_ratio'], '.2f')}, "
                    f"time to target {fmt(row.get('time_to_target_s_ratio'), '.2f')} "
                    f"({'within' if row['within_tolerance'] else 'outside'} {TOLERANCE:.0%})")
    for model, bound in results["bound"].items():
        _common.say(f"synchronous bound, {model}: " + ", ".join(
            f"{n} node(s) {fmt(r['samples'], ',.0f')} samples, speed-up <= {fmt(r['speedup_bound'], '.2f')}"
            for n, r in bound["batches"].items()))
    for name, value in ratios.items():
        _common.say(f"  {name:45s} {value:.3f}")
    if missing_:
        _common.say("  not computed (a run did not reach the target or failed): " + ", ".join(missing_))
    path = _common.write("bench_scaling", args.quick, results, ratios)
    png = path.with_suffix(".png")
    plot(results, png)
    _common.say(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
