"""Accuracy acceptance of the pipelines with real gradients: final held-out accuracy over seeds, side by side.

mnist5k (4,000 train / 1,000 held out), an MLP (784-256-256-256-10) and a
CNN (``cnn(channels=(8, 16), hidden=64)``, batch norm), each cut into 2 and
into 4 stages, every stage an actor in one process (the stages exchange the
same messages as across processes; accuracy, not timing, is measured here).
For every seed, every method starts from the same initial weights and sees
the same batches: SGD with momentum 0.9 (as in the SpecTrain paper), the same
lr, batch size and epochs for all, ``max_in_flight`` batches in flight.

- ``backprop``: sequential backprop (the synchronous pipeline reproduces it
  exactly: ``tests/test_pipeline_rules.py``);
- ``async``: no correction (forward on one weight version, backward on a later one);
- ``stash``: PipeDream weight stashing;
- ``spectrain``: SpecTrain weight prediction;
- ``spectrain_stash``: SpecTrain's forward, back-propagated through its own
  graph on the predicted weights (no second forward);
- ``cdni`` (CNN, 2 stages): label-conditioned synthetic gradients, same
  optimizer and lr; ``cdni adam``: with Adam (lr 1e-3, DNI's usual
  optimizer), against ``backprop adam``.

``--adam``: the same MLP table with Adam (lr 1e-3) for backprop, ``async``
and SpecTrain predicting with the current Adam step direction, to set beside
the momentum rows.

Each row's median over seeds; ``ratios`` hold each median's gap to backprop's
in points (bigger is better; the acceptance asks SpecTrain >= -0.5, cDNI on the
CNN >= -1.5). Every run's final and best accuracy and mean version gap per
stage are in the JSON.

    nice -n 10 python benchmarks/pipeline_accuracy.py [--quick] [--adam] [--seeds 0 1 2 3 4] [--models mlp --merge]
        [--rules spectrain spectrain_stash --name NAME] [--lr-decay cosine] [--in-flight 4]
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import _common  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from dniasync.cluster.config import load_config  # noqa: E402
from dniasync.cluster.plan import data_spec  # noqa: E402
from dniasync.train.models import cnn, mlp  # noqa: E402
from dniasync.train.pipeline import LrDecay, StageSettings, TrainResult, run_pipeline, train_backprop  # noqa: E402

BATCH, MOMENTUM, WINDOW = 64, 0.9, 4
LR = 0.05
ADAM_LR = 1e-3
RULES = ("async", "stash", "spectrain", "spectrain_stash")


EPOCHS = {"mlp": 15, "cnn": 8}


def models(epochs: dict[str, int]) -> dict[str, tuple[Callable[[], nn.Sequential], dict[int, list[list[int]]], int]]:
    """name -> (factory, stages -> cut, epochs)."""
    return {
        "mlp": (lambda: mlp([784, 256, 256, 256, 10]),
                {2: [[0, 1, 2, 3], [4, 5, 6]], 4: [[0, 1], [2, 3], [4, 5], [6]]}, epochs["mlp"]),
        "cnn": (lambda: cnn(channels=(8, 16), hidden=64),
                {2: [[0, 1, 2, 3, 4], list(range(5, 13))], 4: [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10], [11, 12]]},
                epochs["cnn"]),
    }  # fmt: skip


def record(result: TrainResult) -> dict[str, Any]:
    accuracies = [p.accuracy for p in result.history]
    gaps = [s.sg_staleness_total / s.steps if s.steps and not s.sg_steps else 0.0 for s in result.stats]
    return {"final": result.final_accuracy, "best": max(accuracies), "version_gap_mean": gaps,
            "stash_peak_bytes": [s.stash_peak_bytes for s in result.stats]}


def table(args: Any) -> dict[str, Any]:
    config = load_config(Path(__file__).resolve().parent.parent / "examples" / "cnn_mnist_sync.toml")
    x, y, ex, ey = data_spec(config).load_split()
    if args.quick:
        x, y = x[:1000], y[:1000]
    specs = models({"mlp": 1, "cnn": 1} if args.quick else {"mlp": args.epochs_mlp, "cnn": args.epochs_cnn})
    rows: dict[str, list[dict[str, Any]]] = {}
    out: dict[str, Any] = {"data": {"dataset": "mnist5k", "n_train": int(x.shape[0]), "n_test": int(ex.shape[0])},
                           "batch_size": BATCH, "momentum": MOMENTUM, "lr": ADAM_LR if args.adam else args.lr,
                           "optimizer": "adam" if args.adam else "sgd+momentum", "max_in_flight": args.in_flight,
                           "epochs": {k: v[2] for k, v in specs.items()}, "seeds": args.seeds, "rows": rows}
    out["lr_decay"] = args.lr_decay
    decay = LrDecay(args.lr_decay)
    names = ["mlp"] if args.adam else [m for m in args.models]
    if args.merge:  # keep the other models' rows (and epochs) of the table already written
        previous = json.loads((_common.RESULTS / f"{args.name}.json").read_text())["results"]
        rows.update({k: v for k, v in previous["rows"].items() if k.split()[0] not in names})
        out["epochs"] = {k: (v if k in names else previous["epochs"][k]) for k, v in out["epochs"].items()}
    optimizer, lr, momentum = ("adam", ADAM_LR, 0.0) if args.adam else ("sgd", args.lr, MOMENTUM)
    for seed in args.seeds:
        for name in names:
            factory, cuts, epochs = specs[name]
            torch.manual_seed(seed)
            model = factory()
            state = {k: v.clone() for k, v in model.state_dict().items()}
            started = time.perf_counter()
            bp = train_backprop(model, x, y, epochs=epochs, batch_size=BATCH, seed=seed, lr=lr, optimizer=optimizer,
                                momentum=momentum, eval_x=ex, eval_y=ey, lr_decay=decay)
            rows.setdefault(f"{name} backprop", []).append({"seed": seed, **record(bp)})
            _common.say(f"{name} seed {seed} backprop: {bp.final_accuracy:.4f} ({time.perf_counter() - started:.0f} s)")
            rules = [r for r in (("async", "spectrain") if args.adam else RULES) if r in args.rules]
            runs = [(n, rule, optimizer) for n in cuts for rule in rules]
            if name == "cnn":  # cDNI with the same optimizer and lr, and with Adam (DNI's usual optimizer)
                runs += [(2, "cdni", "sgd"), (2, "cdni", "adam")]
                torch.manual_seed(seed)
                model = factory()
                model.load_state_dict(state)
                bp_adam = train_backprop(model, x, y, epochs=epochs, batch_size=BATCH, seed=seed, lr=ADAM_LR,
                                         optimizer="adam", eval_x=ex, eval_y=ey, lr_decay=decay)
                rows.setdefault(f"{name} backprop adam", []).append({"seed": seed, **record(bp_adam)})
            for n_stages, rule, opt in runs:
                model = factory()
                model.load_state_dict(state)
                st = StageSettings(rule=rule, optimizer=opt,  # type: ignore[arg-type]  # adam, sgd: checked by argparse momentum=momentum if opt == "sgd" else 0.0,
                                   lr=lr if opt == optimizer else ADAM_LR, sg_hidden_layers=1, sg_hidden_width=8,
                                   sg_lr=1e-4)
                started = time.perf_counter()
                res = asyncio.run(run_pipeline(model, cuts[n_stages], x, y, settings=st, epochs=epochs,
                                               batch_size=BATCH, seed=seed, max_in_flight=args.in_flight,
                                               eval_x=ex, eval_y=ey, lr_decay=decay))
                label = f"{name} {n_stages} stages {rule}" + (" adam" if opt != optimizer else "")
                rows.setdefault(label, []).append({"seed": seed, **record(res)})
                _common.say(f"{label} seed {seed}: {res.final_accuracy:.4f} "
                            f"(backprop {bp.final_accuracy:.4f}; {time.perf_counter() - started:.0f} s)")
            summarise(out)
            _common.write(args.name, args.quick, out, ratios(out))  # after every seed: a partial table survives
    return out


def summarise(out: dict[str, Any]) -> None:
    out["summary"] = {k: {"median": statistics.median(r["final"] for r in v),
                          "min": min(r["final"] for r in v), "max": max(r["final"] for r in v),
                          "median_best_minus_final": statistics.median(r["best"] - r["final"] for r in v),
                          "runs": len(v)}
                      for k, v in out["rows"].items()}  # fmt: skip


def ratios(out: dict[str, Any]) -> dict[str, float]:
    """Each method's median final accuracy minus backprop's, in points (bigger is better)."""
    summary = out["summary"]
    gaps: dict[str, float] = {}
    for key, row in summary.items():
        parts = key.split()  # "mlp 2 stages spectrain"
        if parts[1] == "backprop":
            continue
        name, stages, rule, variant = parts[0], parts[1], parts[3], "".join(f" {v}" for v in parts[4:])
        reference = summary.get(f"{name} backprop{variant}")
        if reference is not None:
            gaps[f"{rule}{variant.replace(' ', '_')}_gap_{name}_{stages}_stages"] = 100.0 * (
                row["median"] - reference["median"])
    return gaps


def main() -> int:
    p = _common.parser(__doc__ or "")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    p.add_argument("--adam", action="store_true", help="the MLP table with Adam (SpecTrain's Adam prediction)")
    p.add_argument("--lr", type=float, default=LR, help="SGD's lr (the momentum table)")
    p.add_argument("--lr-decay", choices=("none", "linear", "cosine"), default="none",
                   help="every method's lr over the second half of the run (pipeline.lr_decay)")
    p.add_argument("--in-flight", type=int, default=WINDOW, help="batches in flight in every pipeline")
    p.add_argument("--epochs-mlp", type=int, default=EPOCHS["mlp"])
    p.add_argument("--epochs-cnn", type=int, default=EPOCHS["cnn"])
    p.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES),
                   help="the real-gradient rules to run (backprop always runs)")
    p.add_argument("--name", default=None, help="results file name (default: pipeline_accuracy[_adam])")
    p.add_argument("--merge", action="store_true", help="rerun --models only, keeping the other models' rows")
    args = p.parse_args()
    args.name = args.name or "pipeline_accuracy" + ("_adam" if args.adam else "")
    torch.set_num_threads(1)
    out = table(args)
    gaps = ratios(out)
    rows = [(k, f"{v['median']:.4f} (min {v['min']:.4f}, max {v['max']:.4f})", str(v["runs"]))
            for k, v in out["summary"].items()]
    _common.say(_common.table(rows, ("model / stages / rule", "final held-out accuracy, median over seeds", "runs")))
    for name, value in gaps.items():
        _common.say(f"{name:36s} {value:+.2f} points")
    path = _common.write(args.name, args.quick, out, gaps)
    _common.say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
