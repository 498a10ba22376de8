"""Downpour over a ~50 Mbit/s link: the threshold codec both ways vs uncompressed.

Run (as root; needs ``ip`` and ``tc`` from iproute2): python benchmarks/bench_bandwidth.py [--quick]

Two network namespaces joined by a veth pair, each end shaped with
``tc qdisc ... root tbf rate 50mbit burst 32kbit latency 50ms`` (so each
direction is limited to 50 Mbit/s). The addresses are a private /30 that
exists only inside the two namespaces: 10.77.0.1 (side A) and 10.77.0.2
(side B). Side A runs the coordinator and the 2 PS shards, side B the 2
replicas, each a ``python -m dniasync.node`` process started by hand with a
shared cluster token (``--token-file``, required off loopback). Each side also
gets a UTS namespace with its own host name (``unshare --uts``): two processes
with one host name and boot id would move tensor payloads through their
same-host shared-memory ring, around the shaped link. The
coordinator evaluates on held-out data every 0.5 s (its pulls stay inside
side A) and stops at 92%; this script polls for its summary.json, then stops
every node with SIGTERM and deletes the namespaces, always.

The job is examples/downpour_mnist.toml (2 replicas, 2 PS shards, Adagrad
lr 0.05, batch 32, pull and push every step) with and without the threshold
codec (tau 0.02, examples/downpour_mnist_threshold.toml), alternating, ``--reps``
times each (default 2). Uncompressed, every pull carries the full 1.08 MB
parameter vector and every push as much. With the codec, traffic is
compressed both ways: pushes are Strom's ±tau codes, and the PS shards answer
pulls with threshold-coded parameter deltas (``delta_tau`` at its default, 10%
of the shard's parameter RMS: each replica's copy within it of the shard's after
each pull; the README's figures were taken with the earlier default,
``delta_tau`` = tau) and a dense pull every ``resync_every`` (100) pulls of a replica.

Time to 92% is read from the coordinator's history (``wall_s`` counts from
the first replica's registration, process start-up excluded; evaluation
every 0.5 s). ``--quick`` runs each once for 8 s (uncompressed too short to
reach 92%). Ratios (bigger is better): bandwidth_codec_speedup = median time
to 92% without the codec / with it; pull_bytes_reduction = bytes pulled per
sample without the codec / with it. Also in results: the same for samples/s,
codec_bytes_reduction (bytes pushed per sample without / with the codec), each
run's final accuracy and the gap between the medians (in points), and the PS
shards' dense and delta pull counts.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common
from bench_train import accuracy_at, job_config, median, time_to, to_toml

NS_A, NS_B = "dniasync-bwA", "dniasync-bwB"
VETH_A, VETH_B = "dniabw-a", "dniabw-b"
ADDR_A, ADDR_B = "10.77.0.1", "10.77.0.2"
PORT = 7000
RATE = "50mbit"
TBF = ["tbf", "rate", RATE, "burst", "32kbit", "latency", "50ms"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
ROOT = Path(__file__).resolve().parent.parent


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


def teardown() -> None:
    """Delete our two namespaces (the veth pair goes with them); quiet if absent."""
    for ns in (NS_A, NS_B):
        sh("ip", "netns", "del", ns, check=False)


def setup() -> None:
    for tool in ("ip", "tc", "unshare", "hostname"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"'{tool}' not found: apt-get install -y iproute2")
    teardown()  # a run killed before its finally
    sh("ip", "netns", "add", NS_A)
    sh("ip", "netns", "add", NS_B)
    sh("ip", "link", "add", VETH_A, "type", "veth", "peer", "name", VETH_B)
    sh("ip", "link", "set", VETH_A, "netns", NS_A)
    sh("ip", "link", "set", VETH_B, "netns", NS_B)
    for ns, dev, addr in ((NS_A, VETH_A, ADDR_A), (NS_B, VETH_B, ADDR_B)):
        sh("ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *TBF)


def link_stats() -> dict[str, Any]:
    out = {}
    for ns, dev in ((NS_A, VETH_A), (NS_B, VETH_B)):
        out[f"{ns}/{dev}"] = sh("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev).stdout.strip()
    return out


class Node:
    def __init__(self, ns: str, role: str, args: list[str], log: Path) -> None:
        self.role = role
        self.log = log
        self.fh = log.open("wb")
        # a host name per side: one host name would send payloads through shared memory, not the link
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', ns,
             sys.executable, "-m", "dniasync.node", "--role", role, *args],
            stdout=self.fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=ENV, cwd=ROOT,
        )

    def listening(self) -> bool:
        return "listening on" in self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.fh.close()


def run_job(name: str, example: str, n_fetch: int, work: Path, token: Path, max_seconds: float) -> dict[str, Any]:
    out = work / name
    doc = job_config(example, out, seconds=max_seconds, eval_s=0.5)
    doc["job"]["name"] = name
    doc["downpour"]["n_fetch"] = n_fetch
    doc["stop"]["target_accuracy"] = 0.92
    cfg = work / f"{name}.toml"
    cfg.write_text(to_toml(doc) + "\n")
    logs = work / f"{name}-logs"
    logs.mkdir()
    tok = ["--token-file", str(token)]
    join = ["--join", f"{ADDR_A}:{PORT}"]
    nodes: list[Node] = []
    started = time.monotonic()
    try:
        coordinator = Node(NS_A, "coordinator", ["--config", str(cfg), "--listen", f"{ADDR_A}:{PORT}", *tok],
                           logs / "coordinator.log")
        nodes.append(coordinator)
        deadline = time.monotonic() + 120
        while not coordinator.listening():
            if coordinator.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the coordinator did not start; see {coordinator.log}:\n"
                                   + coordinator.log.read_text(errors="replace")[-2000:])
            time.sleep(0.1)
        for i in range(doc["downpour"]["n_ps_shards"]):
            nodes.append(Node(NS_A, "ps", [*join, "--listen", f"{ADDR_A}:0", *tok], logs / f"ps{i}.log"))
        for i in range(doc["downpour"]["n_replicas"]):
            nodes.append(Node(NS_B, "worker", [*join, "--listen", f"{ADDR_B}:0", *tok], logs / f"worker{i}.log"))
        summary_path = out / "summary.json"
        deadline = time.monotonic() + max_seconds + 180
        while not summary_path.exists():
            dead = [n for n in nodes if n.proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                what = f"{dead[0].role} exited {dead[0].proc.returncode}" if dead else "timed out"
                log = (dead[0] if dead else coordinator).log
                raise RuntimeError(f"{name}: {what}; see {log}:\n" + log.read_text(errors="replace")[-2000:])
            time.sleep(0.25)
        time.sleep(0.5)  # the writer renames into place; let it finish the PNG too
        summary = json.loads(summary_path.read_text())
    finally:
        for node in reversed(nodes):
            node.stop()
        for node in reversed(nodes):
            node.wait(15)
    t92, s92 = time_to(summary["history"])
    metrics = summary.get("metrics", {})
    pushed, pulled, wall = summary["bytes_pushed"], summary["bytes_pulled"], summary["wall_s"]
    return {
        "n_fetch": n_fetch,
        "codec": doc["downpour"]["codec"],
        "time_to_92_s": t92,
        "samples_to_92": s92,
        "stop_reason": summary["stop_reason"],
        "wall_s": wall,
        "samples": summary["samples"],
        "samples_per_s": summary["samples"] / wall if wall else None,
        "final_accuracy": summary["final_accuracy"],
        "best_accuracy": summary["best_accuracy"],
        "bytes_pushed": pushed,
        "bytes_pulled": pulled,
        "dense_pulls": sum(int(v) for k, v in metrics.items() if k.endswith("_dense_pulls")),
        "delta_pulls": sum(int(v) for k, v in metrics.items() if k.endswith("_delta_pulls")),
        "push_mbit_per_s": 8e-6 * pushed / wall if wall else None,
        "pull_mbit_per_s": 8e-6 * pulled / wall if wall else None,
        "history": [{"wall_s": round(p["wall_s"], 3), "samples": p["samples"], "accuracy": p["accuracy"]}
                    for p in summary["history"]],
        "process_start_s": round(time.monotonic() - started - wall, 1),
    }


def plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for i, (codec, rs) in enumerate(runs.items()):
        for j, r in enumerate(rs):
            h = r["history"]
            ax.plot([p["wall_s"] for p in h], [p["accuracy"] for p in h], marker=".", markersize=3, color=f"C{i}",
                    linewidth=1, label=f"codec {codec}" if j == 0 else None)
    ax.axhline(0.92, color="grey", linestyle="--", linewidth=1)
    ax.set_ylim(0.5, 0.95)
    ax.set_xlabel("wall time since the first replica registered (s)")
    ax.set_ylabel("held-out accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"Downpour across a {RATE} tc-tbf veth: threshold codec both ways vs none", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")


def main() -> None:
    p = _common.parser(__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=None, help="runs of each codec (default 2; 1 with --quick)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="training limit per run (default 240; --quick: 8, too short to reach 92%%)")
    args = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_bandwidth needs root (network namespaces, tc)")
    max_seconds = args.max_seconds or (8.0 if args.quick else 240.0)
    reps = args.reps or (1 if args.quick else 2)
    examples = {"threshold": "downpour_mnist_threshold.toml", "none": "downpour_mnist.toml"}
    work = Path(tempfile.mkdtemp(prefix="bench_bandwidth-"))
    token = work / "cluster.token"
    token.write_text(secrets.token_hex(32) + "\n")
    token.chmod(0o600)
    runs: dict[str, list[dict[str, Any]]] = {codec: [] for codec in examples}
    stats: dict[str, Any] = {}
    try:
        setup()
        for rep in range(reps):
            for codec, example in examples.items():
                t = time.monotonic()
                r = run_job(f"{codec}_rep{rep + 1}", example, 1, work, token, max_seconds)
                runs[codec].append(r)
                t92 = r["time_to_92_s"]
                _common.say(f"rep {rep + 1}/{reps} codec {codec:9s} time to 92% {'-' if t92 is None else f'{t92:.1f}'} s "
                            f"({r['samples_to_92']} samples), {r['samples_per_s']:,.0f} samples/s, "
                            f"push {r['push_mbit_per_s']:.1f} Mbit/s, pull {r['pull_mbit_per_s']:.1f} Mbit/s "
                            f"({time.monotonic() - t:.0f} s)")
        stats = link_stats()
    finally:
        teardown()
        shutil.rmtree(work, ignore_errors=True)

    results: dict[str, Any] = {
        "setup": {"link": f"veth pair between two netns, tbf {' '.join(TBF[1:])} on both ends",
                  "side_a": "coordinator + 2 PS shards", "side_b": "2 replicas", "target_accuracy": 0.92,
                  "eval_every_s": 0.5, "max_seconds": max_seconds, "reps": reps, "n_fetch": 1, "n_push": 1,
                  "threshold_pulls": ("threshold-coded parameter deltas, delta_tau 10% of the shard's parameter RMS, "
                                      "dense every 100 pulls")},
        "tc_stats_at_end": stats,
    }
    for codec, rs in runs.items():
        results[codec] = {
            "time_to_92_s": median([r["time_to_92_s"] for r in rs]),
            "samples_to_92": median([r["samples_to_92"] for r in rs]),
            "samples_per_s": median([r["samples_per_s"] for r in rs]),
            "bytes_pushed_per_sample": median([r["bytes_pushed"] / r["samples"] for r in rs if r["samples"]]),
            "bytes_pulled_per_sample": median([r["bytes_pulled"] / r["samples"] for r in rs if r["samples"]]),
            "final_accuracy": median([r["final_accuracy"] for r in rs]),
            "runs": rs,
        }
    ratios: dict[str, float] = {}
    none, thr = results["none"], results["threshold"]
    if none["time_to_92_s"] and thr["time_to_92_s"]:
        ratios["bandwidth_codec_speedup"] = none["time_to_92_s"] / thr["time_to_92_s"]
    if none["samples_per_s"] and thr["samples_per_s"]:
        results["bandwidth_codec_samples_per_s_speedup"] = thr["samples_per_s"] / none["samples_per_s"]
    if none["bytes_pulled_per_sample"] and thr["bytes_pulled_per_sample"]:
        ratios["pull_bytes_reduction"] = none["bytes_pulled_per_sample"] / thr["bytes_pulled_per_sample"]
    if none["bytes_pushed_per_sample"] and thr["bytes_pushed_per_sample"]:
        results["codec_bytes_reduction"] = none["bytes_pushed_per_sample"] / thr["bytes_pushed_per_sample"]
    if none["final_accuracy"] is not None and thr["final_accuracy"] is not None:
        results["final_accuracy_gap_points"] = 100 * (none["final_accuracy"] - thr["final_accuracy"])
    if none["samples_to_92"] is not None:  # both runs stop at 92%: also compare them at equal samples
        at = [accuracy_at(r["history"], none["samples_to_92"]) for r in thr["runs"]]
        thr["accuracy_at_none_samples_to_92"] = median(at)
        if thr["accuracy_at_none_samples_to_92"] is not None:
            results["accuracy_gap_points_at_equal_samples"] = 100 * (0.92 - thr["accuracy_at_none_samples_to_92"])
    path = _common.write("bench_bandwidth", args.quick, results, ratios)
    plot(runs, path.with_suffix(".png"))
    rows = [(codec, "-" if results[codec]["time_to_92_s"] is None else f"{results[codec]['time_to_92_s']:.1f} s",
             f"{results[codec]['samples_per_s']:,.0f} samples/s, "
             f"{results[codec]['bytes_pushed_per_sample']:,.0f} B pushed, "
             f"{results[codec]['bytes_pulled_per_sample']:,.0f} B pulled /sample, "
             f"final accuracy {results[codec]['final_accuracy']}") for codec in runs]
    _common.say("\n" + _common.table(rows, ("codec", f"time to 92% (median of {reps})", "throughput")))
    goals = {"bandwidth_codec_speedup": ">= 5", "pull_bytes_reduction": "> 1"}
    _common.say("\n" + _common.table([(k, f"{v:.2f}", goals.get(k, "> 1")) for k, v in ratios.items()],
                                     ("ratio", "value", "goal")))
    _common.say(f"\nwrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
