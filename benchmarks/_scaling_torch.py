"""One rank of bench_scaling's torch reference: DDP (gloo), plain or with PowerSGD, on the big MLP or the CNN.

Started by bench_scaling.py, one process per rank, on an emulated node (or on loopback, for the
validation against real runs):

    python benchmarks/_scaling_torch.py --model mlp|cnn --system ddp|ddp_powersgd --rank R --world N --dir RUN_DIR ...

bench_links' DDP wrapper (``_links_torch.DDP``: the process group over gloo, PowerSGD rank 4 from
step 10, Adagrad lr 0.05) around bench_scaling's models, mnist5k 4,000 / 1,000 (seed 0), batch 32 per
rank, ``ShardPlan`` shards per epoch, one torch thread. The protocol is bench_links': after start-up a
rank writes ``ready-R`` and waits for ``go`` (the clock's zero, ``time.monotonic()``); rank 0 keeps a
copy of its parameters every ``--snapshot-every`` samples (all ranks together) and writes them to
``snapshots.npz``; every rank writes ``rank-R.json`` (its timeline of (time, samples) and any error).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _links_torch import DDP, flat  # noqa: E402
from bench_train import BATCH, N_TRAIN, SEED, _split  # noqa: E402

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp": ("dniasync.train.models:mlp", {"sizes": [784, 2048, 2048, 10], "activation": "relu"}),
    "cnn": ("dniasync.train.models:cnn", {"image": [1, 28, 28], "channels": [16, 32], "hidden": 128, "norm": "group"}),
}
"""bench_train's compute-bound MLP and the CNN of train/models.py (GroupNorm: no batch statistics to sync)."""


def build(model: str) -> torch.nn.Module:
    from dniasync.train.models import build_model

    factory, kwargs = MODELS[model]
    return build_model(factory, kwargs, seed=SEED)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--system", choices=("ddp", "ddp_powersgd"), required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--master", required=True, help="rank 0's host:port (the process group's store)")
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--snapshot-every", type=int, required=True, help="samples, all ranks together")
    p.add_argument("--lr", type=float, default=None, help="Adagrad's lr (default: bench_links' ADAGRAD_LR)")
    return p.parse_args(argv)


def train(args: argparse.Namespace, report: dict[str, Any]) -> None:
    from dniasync.train.data import ShardPlan

    torch.set_num_threads(1)
    model = build(args.model)
    comm = DDP(args, model)
    warm = build(args.model)  # one throwaway step: torch's lazy imports are start-up
    F.cross_entropy(warm(torch.zeros(BATCH, 784)), torch.zeros(BATCH, dtype=torch.long)).backward()  # type: ignore[no-untyped-call]
    (args.dir / f"ready-{args.rank}").write_text("")
    go = args.dir / "go"
    while not go.exists():
        time.sleep(0.005)
    t0 = float(go.read_text())
    x, y, _, _ = _split()
    plan = ShardPlan(N_TRAIN, args.world, SEED)
    comm.wrap()
    timeline: list[tuple[float, int]] = [(time.monotonic() - t0, 0)]
    report["timeline"] = timeline
    snaps, stamps = [flat(model)], [timeline[0][0]]
    local_every = max(1, args.snapshot_every // args.world)
    next_snap, done = local_every, 0
    alive = args.dir / f"step-{args.rank}"
    try:
        for epoch in range(args.epochs):
            order = torch.from_numpy(plan.indices(args.rank, epoch))
            for i in range(0, len(order), BATCH):
                idx = order[i:i + BATCH]
                comm.zero_grad()
                F.cross_entropy(comm.net(x[idx]), y[idx]).backward()  # type: ignore[no-untyped-call]
                comm.step()
                done += len(idx)
                alive.touch()  # bench_scaling's stall check: a rank that stops stepping is stuck in a collective
                now = time.monotonic() - t0
                timeline.append((now, done))
                if args.rank == 0 and done >= next_snap:
                    snaps.append(flat(model))
                    stamps.append(now)
                    next_snap += local_every
    finally:
        if args.rank == 0:
            if stamps[-1] != timeline[-1][0]:
                snaps.append(flat(model))
                stamps.append(timeline[-1][0])
            np.savez(args.dir / "snapshots.npz", weights=np.stack(snaps), wall_s=np.array(stamps))
    report["end_s"] = time.monotonic() - t0
    comm.close()


def main() -> None:
    args = parse()
    report: dict[str, Any] = {"rank": args.rank, "system": args.system, "model": args.model}
    try:
        train(args, report)
    except BaseException as exc:  # the benchmark records what failed instead of a figure
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()
        raise
    finally:
        (args.dir / f"rank-{args.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
