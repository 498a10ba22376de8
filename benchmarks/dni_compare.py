"""Side-by-side, in one process: backprop vs the synchronous pipeline vs DNI and cDNI.

The acceptance task of issue 6 run in-process (every stage an actor in
one :class:`~dniasync.actors.ActorSystem`): an MLP on a built-in data set,
the same initial weights, optimizer, learning rate, batch order and epochs
for every method. Prints one JSON object (final accuracy, best accuracy,
samples/s, and the history per method)::

    python benchmarks/dni_compare.py --epochs 30 --seed 0
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from dniasync.runtime import run
from dniasync.train.data import load_dataset, split
from dniasync.train.models import mlp
from dniasync.train.pipeline import StageSettings, TrainResult, run_pipeline, train_backprop

__all__ = ["compare", "main"]

METHODS = ("backprop", "sync", "dni", "cdni", "cdni_si")


def _model(sizes: Sequence[int], seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return mlp(sizes)


def _summary(result: TrainResult) -> dict[str, Any]:
    accuracies = [p.accuracy for p in result.history]
    return {
        "final_accuracy": result.final_accuracy,
        "best_accuracy": max(accuracies) if accuracies else float("nan"),
        "samples_per_s": result.samples_per_s,
        "wall_s": result.wall_s,
        "history": [asdict(p) for p in result.history],
    }


def compare(
    *,
    dataset: str = "mnist5k",
    n_train: int = 4000,
    n_test: int = 1000,
    sizes: Sequence[int] = (784, 256, 256, 256, 10),
    groups: Sequence[Sequence[int]] = ((0, 1), (2, 3), (4, 5, 6)),
    epochs: int = 30,
    batch_size: int = 64,
    lr: float = 1e-4,
    sg_lr: float = 1e-4,
    sg_hidden_layers: int = 0,
    max_in_flight: int = 4,
    micro_batches: int = 4,
    seed: int = 0,
    methods: Sequence[str] = METHODS,
) -> dict[str, Any]:
    """Train every method in ``methods`` on the same split and initial weights; return the summaries."""
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    train, test = split(load_dataset(dataset), n_train, n_test, seed)
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
    ex, ey = torch.from_numpy(test.x), torch.from_numpy(test.y)
    out: dict[str, Any] = {
        "config": {
            "dataset": dataset, "n_train": n_train, "n_test": n_test, "sizes": list(sizes),
            "groups": [list(g) for g in groups], "epochs": epochs, "batch_size": batch_size, "lr": lr,
            "sg_lr": sg_lr, "sg_hidden_layers": sg_hidden_layers, "max_in_flight": max_in_flight,
            "micro_batches": micro_batches, "seed": seed, "optimizer": "adam",
        }
    }  # fmt: skip
    common: dict[str, Any] = {"epochs": epochs, "batch_size": batch_size, "seed": seed, "eval_x": ex, "eval_y": ey}
    for method in methods:
        if method == "backprop":
            result = train_backprop(_model(sizes, seed), x, y, lr=lr, **common)
        else:
            settings = StageSettings(
                rule="cdni" if method.startswith("cdni") else method,
                lr=lr,
                sg_lr=sg_lr,
                sg_hidden_layers=sg_hidden_layers,
                synthetic_inputs=method == "cdni_si",
                num_classes=int(y.max()) + 1,
            )
            result = run(
                run_pipeline(
                    _model(sizes, seed),
                    groups,
                    x,
                    y,
                    settings=settings,
                    max_in_flight=max_in_flight,
                    micro_batches=micro_batches,
                    method=method,
                    **common,
                )
            )
        out[method] = _summary(result)
        print(
            f"{method:9s} final {result.final_accuracy:.4f} best {out[method]['best_accuracy']:.4f} "
            f"{result.samples_per_s:8.0f} samples/s",
            file=sys.stderr,
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: print the comparison as JSON on stdout."""
    parser = argparse.ArgumentParser(prog="python benchmarks/dni_compare.py", description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="mnist5k")
    parser.add_argument("--n-train", type=int, default=4000)
    parser.add_argument("--n-test", type=int, default=1000)
    parser.add_argument("--sizes", default="784,256,256,256,10", help="MLP layer sizes")
    parser.add_argument("--groups", default="0,1;2,3;4,5,6", help="layer indices per group, groups split by ';'")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--sg-lr", type=float, default=1e-4)
    parser.add_argument("--sg-hidden-layers", type=int, default=0)
    parser.add_argument("--max-in-flight", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {','.join(METHODS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = compare(
        dataset=args.dataset,
        n_train=args.n_train,
        n_test=args.n_test,
        sizes=[int(v) for v in args.sizes.split(",")],
        groups=[[int(v) for v in g.split(",")] for g in args.groups.split(";")],
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        sg_lr=args.sg_lr,
        sg_hidden_layers=args.sg_hidden_layers,
        max_in_flight=args.max_in_flight,
        micro_batches=args.micro_batches,
        seed=args.seed,
        methods=[m for m in args.methods.split(",") if m],
    )
    json.dump(result, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
