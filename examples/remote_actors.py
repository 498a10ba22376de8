"""Two processes talking through remote actors.

Terminal 1 (a node hosting a parameter shard)::

    python examples/remote_actors.py serve --listen 127.0.0.1:7100

Terminal 2 (a node whose worker pushes gradients to it and gets called back)::

    python examples/remote_actors.py work 127.0.0.1:7100

Or run ``python examples/remote_actors.py`` alone: it starts the serving
process itself and plays terminal 2. Add ``--token-file F`` to both sides to
authenticate with a shared cluster token (required beyond loopback).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
from dataclasses import dataclass

import numpy as np

from dniasync import Actor, ActorRef, ActorSystem, handler, message, run
from dniasync.remote import WebSocketTransport, read_token_file


@message("example.remote.Push")
@dataclass(frozen=True)
class Push:
    """A gradient for the shard, and who to tell when it is applied."""

    grad: np.ndarray
    notify: ActorRef


@message("example.remote.Pull")
@dataclass(frozen=True)
class Pull:
    pass


@message("example.remote.Applied")
@dataclass(frozen=True)
class Applied:
    version: int
    norm: float


class Shard(Actor):
    """Holds parameters; applies pushed gradients; tells the pusher's ``notify`` ref."""

    def __init__(self, size: int) -> None:
        self.params = np.zeros(size, dtype=np.float32)
        self.version = 0

    @handler
    async def push(self, msg: Push) -> int:
        self.params -= 0.1 * msg.grad
        self.version += 1
        await msg.notify.tell(Applied(self.version, float(np.linalg.norm(self.params))))
        return self.version

    @handler
    def pull(self, msg: Pull) -> np.ndarray:
        return self.params


class Progress(Actor):
    """Lives on the worker's node; the shard calls it back through a ref it received."""

    def __init__(self) -> None:
        self.seen = 0

    @handler
    def applied(self, msg: Applied) -> None:
        self.seen += 1
        print(f"  shard applied version {msg.version}, |params| = {msg.norm:.3f}")


async def serve(listen: str, token: bytes | None) -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    async with ActorSystem() as system, WebSocketTransport(system, listen, token=token) as transport:
        await system.spawn(Shard, 1000, name="shard")
        print(f"shard@{transport.address} listening on {transport.address}", flush=True)
        await stop.wait()


async def work(server: str, token: bytes | None) -> None:
    async with ActorSystem() as system, WebSocketTransport(system, token=token):
        progress = await system.spawn(Progress, name="progress")
        shard = system.ref(f"shard@{server}")  # an actor in the other process
        rng = np.random.default_rng(0)
        for step in range(5):
            version = await shard.ask(Push(rng.standard_normal(1000).astype(np.float32), progress), timeout=10)
            print(f"worker: push {step} -> version {version}")
        params = await shard.ask(Pull(), timeout=10)
        print(f"worker: pulled {params.dtype} parameters of shape {params.shape}, mean {params.mean():+.4f}")
        await asyncio.sleep(0.2)  # let the last callback arrive before this node goes away


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", choices=["serve", "work"], help="omit to run both sides")
    parser.add_argument("server", nargs="?", default="127.0.0.1:7100", help="work: the serving node's HOST:PORT")
    parser.add_argument("--listen", default="127.0.0.1:7100", help="serve: HOST:PORT to listen on")
    parser.add_argument("--token-file", help="shared cluster token file (both sides)")
    args = parser.parse_args()
    token = read_token_file(args.token_file) if args.token_file else None
    if args.mode == "serve":
        run(serve(args.listen, token))
    elif args.mode == "work":
        run(work(args.server, token))
    else:
        extra = ["--token-file", args.token_file] if args.token_file else []
        child = subprocess.Popen(
            [sys.executable, __file__, "serve", "--listen", "127.0.0.1:0", *extra], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout is not None
            line = child.stdout.readline()  # "shard@HOST:PORT listening on HOST:PORT"
            address = line.rsplit(" ", 1)[-1].strip()
            print(f"started the serving process: {line.strip()}")
            run(work(address, token))
        finally:
            child.terminate()
            child.wait(10)


if __name__ == "__main__":
    main()
