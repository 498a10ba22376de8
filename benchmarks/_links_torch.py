"""One training process of bench_links' torch-side systems: DDP, DDP + PowerSGD, hivemind.

Started by bench_links.py in an emulated host's namespace, one per rank:

    python benchmarks/_links_torch.py --system ddp|ddp_powersgd|hivemind --rank R --world 4 --dir RUN_DIR ...

The model, initial weights, data split and shard order are bench_train's (the
MLP 784-256-256-10 seeded 0, mnist5k 4,000 / 1,000, ``ShardPlan`` shards per
epoch), batch 32 per process, one torch thread, Adagrad lr 0.05. After its
start-up (imports, the process group or the DHT, one throwaway optimizer step)
a rank writes ``ready-R`` into RUN_DIR and waits for ``go``, which holds the
clock's zero (``time.monotonic()``: one clock for every namespace of the
machine). It then loads the data and trains ``--epochs`` passes over its shard,
noting after each step (time, samples it trained). Rank 0 also copies its
parameters every ``--snapshot-every`` samples (all ranks together) into memory
(a copy of 1 MB, no evaluation); at the end it writes them to
``snapshots.npz`` for bench_links to score after the run. Every rank writes
``rank-R.json``: its timeline and what went wrong, if anything.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_train import ADAGRAD_LR, BATCH, N_TRAIN, SEED, SIZES, _build, _split, _warm_up  # noqa: E402

POWERSGD_RANK = 4
"""PowerSGD's matrix_approximation_rank: 784x256 and 256x256 gradients travel as rank-4 factors (~50x fewer bytes)."""
POWERSGD_START = 10
"""start_powerSGD_iter: plain allreduce for the first 10 steps (torch's advice: ~10% of training; ours is 60-250)."""
POWERSGD_BUCKET_MB = 1024
"""DDP's bucket size under PowerSGD: every gradient in one bucket. With DDP's default buckets (1 MiB first, then
25 MiB) the hook's chained collectives of two buckets (the uncompressed tensors' allreduce, then P's, then Q's, each
issued from the previous one's callback) were issued in a different order on different ranks, and gloo, which pairs
collectives by their order, aborted on a size mismatch (16,384 vs 2,048 bytes, 2 ranks on loopback, the MLP
784-2048-2048-10, at step 10 where PowerSGD starts). One bucket makes one chain per step."""
HIVEMIND_TARGET_BATCH = 1024
"""hivemind.Optimizer epoch: the peers average their parameters every 1,024 samples trained by all (8 steps each)."""
HIVEMIND_MATCHMAKING_S = 1.0
"""matchmaking_time (hivemind's advice is 3-5 s for small local runs: that is longer than the whole run here)."""
HIVEMIND_AVERAGING_TIMEOUT_S = 3.0
"""averaging_timeout: hivemind's advice is twice an all-reduce's time; one of the 0.5 MB float16 state takes ~0.3 s here."""


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", choices=("ddp", "ddp_powersgd", "hivemind"), required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--dir", type=Path, required=True, help="this run's directory (ready/go files, results)")
    p.add_argument("--addr", required=True, help="this host's address")
    p.add_argument("--master", required=True, help="rank 0's host:port (DDP's store, hivemind's first peer)")
    p.add_argument("--epochs", type=int, required=True)
    p.add_argument("--snapshot-every", type=int, required=True, help="samples, all ranks together")
    p.add_argument("--max-seconds", type=float, required=True, help="give up training after this long")
    return p.parse_args(argv)


class Comm:
    """How a system wraps the model and steps: ``net`` for forward, ``step()`` after backward."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module) -> None:
        self.args = args
        self.model = model
        self.net: torch.nn.Module = model
        self.opt: Any = None

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def wrap(self) -> None:
        """Make ``net`` and ``opt``: on the clock, as each system's set-up."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class DDP(Comm):
    def __init__(self, args: argparse.Namespace, model: torch.nn.Module) -> None:
        import torch.distributed as dist

        super().__init__(args, model)
        dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.world)

    def wrap(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if self.args.system == "ddp_powersgd":
            # one bucket: with two or more, gloo mismatched PowerSGD's collectives between ranks (see POWERSGD_BUCKET_MB)
            self.net = DistributedDataParallel(self.model, bucket_cap_mb=POWERSGD_BUCKET_MB)
        else:
            self.net = DistributedDataParallel(self.model)
        if self.args.system == "ddp_powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

            state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=POWERSGD_RANK,
                                           start_powerSGD_iter=POWERSGD_START)
            self.net.register_comm_hook(state, powersgd.powerSGD_hook)
        self.opt = torch.optim.Adagrad(self.net.parameters(), lr=getattr(self.args, "lr", None) or ADAGRAD_LR)

    def close(self) -> None:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


class Hivemind(Comm):
    def __init__(self, args: argparse.Namespace, model: torch.nn.Module) -> None:
        import hivemind

        super().__init__(args, model)
        port = int(args.master.rsplit(":", 1)[1])
        peers_file = args.dir / "hivemind-peer0.json"
        host_maddrs = [f"/ip4/{args.addr}/tcp/{port}"]
        if args.rank == 0:
            self.dht = hivemind.DHT(host_maddrs=host_maddrs, start=True)
            tmp = peers_file.with_suffix(".tmp")
            tmp.write_text(json.dumps([str(m) for m in self.dht.get_visible_maddrs()]))
            tmp.rename(peers_file)
        else:
            deadline = time.monotonic() + 120
            while not peers_file.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("peer 0 did not publish its address within 120 s")
                time.sleep(0.05)
            self.dht = hivemind.DHT(host_maddrs=host_maddrs, initial_peers=json.loads(peers_file.read_text()),
                                    start=True)
        self.opt = hivemind.Optimizer(
            dht=self.dht, run_id="bench_links", params=model.parameters(),
            optimizer=partial(torch.optim.Adagrad, lr=ADAGRAD_LR),
            batch_size_per_step=BATCH, target_batch_size=HIVEMIND_TARGET_BATCH, use_local_updates=True,
            matchmaking_time=HIVEMIND_MATCHMAKING_S, averaging_timeout=HIVEMIND_AVERAGING_TIMEOUT_S,
            state_averaging_compression=hivemind.compression.Float16Compression(), verbose=False,
        )

    def wrap(self) -> None:
        pass

    def close(self) -> None:
        self.opt.shutdown()
        self.dht.shutdown()


def flat(model: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def train(args: argparse.Namespace, report: dict[str, Any]) -> None:
    from dniasync.train.data import ShardPlan

    torch.set_num_threads(1)
    model = _build()
    comm: Comm = Hivemind(args, model) if args.system == "hivemind" else DDP(args, model)
    _warm_up(torch.optim.Adagrad, SIZES)
    (args.dir / f"ready-{args.rank}").write_text("")
    go = args.dir / "go"
    while not go.exists():
        time.sleep(0.005)
    t0 = float(go.read_text())
    # -- the clock runs from here: data, wrapping, training
    x, y, _, _ = _split()
    plan = ShardPlan(N_TRAIN, args.world, SEED)
    comm.wrap()
    timeline: list[tuple[float, int]] = [(time.monotonic() - t0, 0)]
    report["timeline"] = timeline
    snaps: list[np.ndarray] = []
    stamps: list[float] = []
    local_every = max(1, args.snapshot_every // args.world)
    next_snap = local_every
    done = 0
    if args.rank == 0:
        snaps.append(flat(model))
        stamps.append(timeline[0][0])
    try:
        for epoch in range(args.epochs):
            order = torch.from_numpy(plan.indices(args.rank, epoch))
            for i in range(0, len(order), BATCH):
                idx = order[i:i + BATCH]
                comm.zero_grad()
                F.cross_entropy(comm.net(x[idx]), y[idx]).backward()  # type: ignore[no-untyped-call]
                comm.step()
                done += len(idx)
                now = time.monotonic() - t0
                timeline.append((now, done))
                if args.rank == 0 and done >= next_snap:
                    snaps.append(flat(model))
                    stamps.append(now)
                    next_snap += local_every
            if timeline[-1][0] > args.max_seconds and args.system == "hivemind":  # DDP ranks must stop together
                report["stopped"] = f"ran {args.max_seconds:g} s"
                break
    finally:
        if args.rank == 0 and snaps:
            if stamps[-1] != timeline[-1][0]:
                snaps.append(flat(model))
                stamps.append(timeline[-1][0])
            np.savez(args.dir / "snapshots.npz", weights=np.stack(snaps), wall_s=np.array(stamps))
    report["end_s"] = time.monotonic() - t0
    comm.close()


def main() -> None:
    args = parse()
    report: dict[str, Any] = {"rank": args.rank, "system": args.system}
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
