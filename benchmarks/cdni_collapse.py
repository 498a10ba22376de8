"""cDNI's late collapse, before and after the agreement gate: each run's best and final held-out accuracy.

Two setups, in one process (every stage an actor of one ActorSystem, the
messages they would exchange across processes), one torch thread:

- ``example``: ``examples/dni_mnist.toml`` (MLP 784-256x3-10 in 3 groups,
  Adam 3e-4, linear SG models, sg_lr 1e-4, 2 batches in flight, batch 64, 30
  epochs);
- ``bench``: ``benchmarks/bench_dni.py``'s setup (MLP 784-1024x4-10 in 2
  groups, Adam 3e-4, linear SG models fitted on 64 rows, 4 batches in
  flight, batch 128, 20 epochs).

``--no-gate`` runs the rule as it was before the gate (the SG model's gain
held at 1). ``--lr-decay cosine`` decays every lr (layers and SG models) over
the second half of the run (:class:`~dniasync.train.pipeline.LrDecay`, as
``pipeline.lr_decay`` in the example's config). Every fit of an SG model also records ``|M − g| / |g|`` (the
prediction it starts from against the true gradient that came back) and
``|g|``; each run keeps their means over tenths of training, per SG model.

Acceptance (issue 15): across 10 seeds of each setup, no run ends more than
1 point below its own best. One JSON line per run is appended to ``--out``;
``--summarise`` turns such files into ``benchmarks/results/cdni_collapse.json``.

    nice -n 10 python benchmarks/cdni_collapse.py --setup example --seeds 0 1 2 [--no-gate] [--lr-decay cosine] --out runs.jsonl
    python benchmarks/cdni_collapse.py --summarise before.jsonl after.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("OMP_NUM_THREADS", "1")

import _common  # noqa: E402
import torch  # noqa: E402

from dniasync.runtime import run  # noqa: E402
from dniasync.train.data import load_dataset, split  # noqa: E402
from dniasync.train.models import mlp  # noqa: E402
from dniasync.train.pipeline import LrDecay, StageSettings, run_pipeline  # noqa: E402
from dniasync.train.pipeline import synthetic  # noqa: E402

SETUPS: dict[str, dict[str, Any]] = {
    "example": {"sizes": [784, 256, 256, 256, 10], "groups": [[0, 1], [2, 3], [4, 5, 6]], "batch_size": 64,
                "lr": 3e-4, "sg_lr": 1e-4, "sg_fit_rows": 0, "max_in_flight": 2, "epochs": 30},
    "bench": {"sizes": [784, 1024, 1024, 1024, 1024, 10], "groups": [[0, 1, 2, 3], [4, 5, 6, 7, 8]],
              "batch_size": 128, "lr": 3e-4, "sg_lr": 1e-4, "sg_fit_rows": 64, "max_in_flight": 4, "epochs": 20},
}

_FITS: list[tuple[int, float, float]] = []


def _instrument(gate: bool) -> None:
    fit = synthetic.SyntheticGradient.fit

    def measured_fit(self: synthetic.SyntheticGradient, h: torch.Tensor, labels: torch.Tensor | None,
                     target: torch.Tensor) -> float:
        with torch.no_grad():
            pred, t = self(h.detach(), labels).flatten(1), target.flatten(1)
            _FITS.append((id(self), float((pred - t).norm() / t.norm().clamp_min(1e-12)), float(t.norm())))
        return fit(self, h, labels, target)

    synthetic.SyntheticGradient.fit = measured_fit  # type: ignore[method-assign]
    if not gate:
        synthetic.SyntheticGradient.gain = property(lambda self: 1.0)  # type: ignore[method-assign,assignment]


def one_run(setup: str, seed: int, gate: bool, decay: Literal["none", "cosine"] = "none") -> dict[str, Any]:
    c = SETUPS[setup]
    train, test = split(load_dataset("mnist5k"), 4000, 1000, seed)
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
    ex, ey = torch.from_numpy(test.x), torch.from_numpy(test.y)
    torch.manual_seed(seed)
    model = mlp(c["sizes"])
    settings = StageSettings(rule="cdni", lr=c["lr"], sg_lr=c["sg_lr"], sg_hidden_layers=0,
                             sg_fit_rows=c["sg_fit_rows"], num_classes=10)
    _FITS.clear()
    started = time.perf_counter()
    result = run(run_pipeline(model, c["groups"], x, y, settings=settings, epochs=c["epochs"],
                              batch_size=c["batch_size"], seed=seed, max_in_flight=c["max_in_flight"],
                              micro_batches=4, eval_x=ex, eval_y=ey, lr_decay=LrDecay(decay)))
    accuracies = [p.accuracy for p in result.history]
    error: dict[str, list[list[float]]] = {}
    for k, model_id in enumerate(dict.fromkeys(f[0] for f in _FITS)):
        fits = [f for f in _FITS if f[0] == model_id]
        tenth = max(1, len(fits) // 10)
        chunks = [fits[i:i + tenth] for i in range(0, len(fits), tenth)]
        error[f"sg{k}"] = [[round(sum(f[1] for f in ch) / len(ch), 3), round(sum(f[2] for f in ch) / len(ch), 4)]
                           for ch in chunks]
    return {"setup": setup, "seed": seed, "gate": gate, "lr_decay": decay, "best": max(accuracies), "final": accuracies[-1],
            "accuracy": [round(a, 4) for a in accuracies], "relative_error_and_grad_norm_per_tenth": error,
            "wall_s": round(time.perf_counter() - started, 1)}


def summarise(paths: list[Path]) -> Path:
    runs = [json.loads(line) for p in paths for line in p.read_text().splitlines() if line.strip()]
    table: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    for setup in SETUPS:
        for gate, decay in ((False, "none"), (True, "none"), (True, "cosine")):
            rows = sorted((r for r in runs if r["setup"] == setup and r["gate"] == gate
                           and r.get("lr_decay", "none") == decay), key=lambda r: r["seed"])
            if not rows:
                continue
            label = f"{setup} {'gate' if gate else 'no gate'}{' + cosine lr' if decay != 'none' else ''}"
            table[label] = {"seeds": [r["seed"] for r in rows], "best": [r["best"] for r in rows],
                            "final": [r["final"] for r in rows],
                            "worst_drop_points": max(100.0 * (r["best"] - r["final"]) for r in rows)}
            # bigger is better: the margin left under the 1-point budget by the worst run
            ratios[f"{setup}_{'gate' if gate else 'no_gate'}{'_cosine' if decay != 'none' else ''}"
                   "_worst_drop_margin_points"] = (
                1.0 - table[label]["worst_drop_points"])
            for r in rows:
                _common.say(f"{label:28s} seed {r['seed']}: best {r['best']:.3f} final {r['final']:.3f} "
                            f"(drop {100 * (r['best'] - r['final']):.1f} points)")
    return _common.write("cdni_collapse", False, {"table": table, "runs": runs}, ratios)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else "")
    p.add_argument("--setup", choices=sorted(SETUPS), default="example")
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    p.add_argument("--no-gate", action="store_true", help="the rule before the gate (gain held at 1)")
    p.add_argument("--lr-decay", choices=("none", "cosine"), default="none",
                   help="cosine: every lr decays to 0 over the second half of the run")
    p.add_argument("--out", type=Path, help="append one JSON line per run here")
    p.add_argument("--summarise", type=Path, nargs="+", help="JSON-lines files to summarise into the results")
    args = p.parse_args()
    if args.summarise:
        _common.say(f"wrote {summarise(args.summarise)}")
        return 0
    torch.set_num_threads(1)
    _instrument(gate=not args.no_gate)
    for seed in args.seeds:
        r = one_run(args.setup, seed, gate=not args.no_gate, decay=args.lr_decay)
        _common.say(f"{args.setup} seed {seed}: best {r['best']:.3f} final {r['final']:.3f} ({r['wall_s']} s)")
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
