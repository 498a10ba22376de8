"""Remote actors between two processes on loopback: dniasync vs its floor and its peers.

Run: python benchmarks/bench_remote.py [--quick] [--profile]

- small ask: sequential request/reply round trips per second between two
  processes. dniasync (an ``Echo`` actor in a ``python -m dniasync.node``
  process, asked from this one; over the same-host Unix socket, the default
  between two nodes on one host, and over TCP with ``RemoteSettings(unix=False)``)
  vs a bare aiohttp websocket echo over TCP (the floor: same library, same
  loop, no actors, no codec) vs a Ray actor method call.
- tensor throughput: one-way 4 MiB float32 tensors from this process to the
  other, until the receiver has handled them all. dniasync ``tell`` through
  the same-host shared-memory ring (the default between two processes on one
  host) and through the socket (``RemoteSettings(shm=False)``) vs
  torch.distributed ``send``/``recv`` over gloo.

Ray comes with the benchmark extra (``pip install -e '.[bench]'``); without
it that row is skipped. ``--profile`` also writes where the time of an ask goes
(cProfile of both ends in one process) to results/bench_remote_profile.txt.
The metrics-on ask times every ask into the latency histogram and scrapes
both nodes meanwhile. Ratios (bigger is better): ask_vs_bare_ws (same-host
link), ask_tcp_vs_bare_ws, ask_vs_ray,
tensor_throughput_vs_gloo (shared memory), tensor_socket_throughput_vs_gloo,
remote_ask_metrics_on_vs_off.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import itertools
import logging
import os
import pstats
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any
from contextlib import contextmanager
from pathlib import Path

import _common
import numpy as np

from dniasync import ActorSystem
from dniasync.node.demo import Echo, Ping, Sum, Tensor
from dniasync.remote import RemoteSettings, WebSocketTransport
from dniasync.runtime import loop_factory

MIB = 1 << 20
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


@contextmanager
def child(args: list[str]) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A child process; yields it and the address from its 'listening on' line."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = re.search(r"listening on (\S+)", line)
            if match:
                break
        else:
            raise RuntimeError(f"{args} exited before listening")
        yield proc, match.group(1)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def dniasync_node() -> list[str]:
    return [
        sys.executable, "-m", "dniasync.node", "--role", "coordinator", "--log-level", "warning",
        "--spawn", "dniasync.node.demo:Echo=echo", "--spawn", "dniasync.node.demo:Sum=sum",
    ]


# -- small asks --------------------------------------------------------------------------


async def dniasync_ask(address: str, n: int, unix: bool = True) -> float:
    async with ActorSystem() as system, WebSocketTransport(system, settings=RemoteSettings(unix=unix)):
        echo = system.ref(f"echo@{address}")
        msg = Ping(1)
        for _ in range(200):
            await echo.ask(msg)
        start = time.perf_counter()
        for _ in range(n):
            await echo.ask(msg)
        return n / (time.perf_counter() - start)


async def dniasync_ask_metrics(address: str, n: int) -> float:
    """``dniasync_ask`` with metrics on: asks timed into the latency histogram, and both nodes
    scraped meanwhile (this one every 0.1 s, the remote one over HTTP every 0.5 s)."""
    import aiohttp

    from dniasync.metrics import NodeMetrics

    async with ActorSystem() as system:
        transport = WebSocketTransport(system)
        metrics = NodeMetrics(system, "bench", transport)
        async with transport, aiohttp.ClientSession() as http:

            async def scrape() -> None:
                for tick in itertools.count():
                    await asyncio.sleep(0.1)
                    metrics.exposition()
                    if tick % 5 == 4:
                        async with http.get(f"http://{address}/metrics") as resp:
                            await resp.read()

            echo = system.ref(f"echo@{address}")
            msg = Ping(1)
            for _ in range(200):
                await echo.ask(msg)
            scraper = asyncio.create_task(scrape())
            start = time.perf_counter()
            for _ in range(n):
                await echo.ask(msg)
            rate = n / (time.perf_counter() - start)
            scraper.cancel()
            latency = metrics.ask_latency
            assert latency is not None and latency.by_type[Ping][-2] == 0  # every ask was timed, none over 10 s
            return rate


async def bare_ws_ask(address: str, n: int) -> float:
    import aiohttp

    payload = b"\x01\x02" + bytes(28)  # about the size of a dniasync Ping frame
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"http://{address}/echo", compress=0, max_msg_size=1 << 30) as ws:
            for _ in range(200):
                await ws.send_bytes(payload)
                await ws.receive()
            start = time.perf_counter()
            for _ in range(n):
                await ws.send_bytes(payload)
                await ws.receive()
            return n / (time.perf_counter() - start)


def serve_bare_ws() -> None:
    """Child process: an aiohttp websocket echo on uvloop (the floor)."""
    from aiohttp import web

    async def echo(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(compress=False, max_msg_size=1 << 30)
        await ws.prepare(request)
        async for msg in ws:
            await ws.send_bytes(msg.data)
        return ws

    async def sink(request: web.Request) -> web.WebSocketResponse:
        """Counts messages; answers b"ok" after ``n`` of them (one-way throughput)."""
        ws = web.WebSocketResponse(compress=False, max_msg_size=1 << 30)
        await ws.prepare(request)
        n, seen = int(request.query["n"]), 0
        async for _ in ws:
            seen += 1
            if seen == n:
                await ws.send_bytes(b"ok")
                seen = 0
        return ws

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/echo", echo)
        app.router.add_get("/sink", sink)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        print(f"listening on 127.0.0.1:{sock.getsockname()[1]}", flush=True)
        await asyncio.Event().wait()

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(main())


def ray_ask(n: int) -> float | None:
    try:
        import ray
    except ImportError:
        _common.say("ray is not installed (pip install -e .[bench]): skipping the Ray row")
        return None
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:

        @ray.remote
        class RayEcho:
            def ping(self, n: int) -> int:
                return n + 1

        actor = RayEcho.remote()  # type: ignore[attr-defined]
        for _ in range(200):
            ray.get(actor.ping.remote(1))
        start = time.perf_counter()
        for _ in range(n):
            ray.get(actor.ping.remote(1))
        return n / (time.perf_counter() - start)
    finally:
        ray.shutdown()


# -- tensor throughput -------------------------------------------------------------------


async def dniasync_tensors(address: str, n: int, mib: int, shm: bool = True) -> float:
    data = np.random.default_rng(0).standard_normal(mib * MIB // 4).astype(np.float32)
    msg = Tensor(data)
    async with ActorSystem() as system, WebSocketTransport(system, settings=RemoteSettings(shm=shm)) as node:
        sink = system.ref(f"sum@{address}")
        for _ in range(3):
            await sink.tell(msg)
        before = await sink.ask(Ping(0), timeout=60)
        start = time.perf_counter()
        for _ in range(n):
            await sink.tell(msg)
        handled = await sink.ask(Ping(0), timeout=120)  # after every tell: all were handled
        elapsed = time.perf_counter() - start
        assert handled - before == n, (handled, before)
        went = node.counters.shm_frames_out
        assert (went >= n) if shm else went == 0, f"{went} of {n} tensors went through shared memory"
        return n * data.nbytes / elapsed


async def bare_ws_tensors(address: str, n: int, mib: int) -> float:
    import aiohttp

    data = np.random.default_rng(0).standard_normal(mib * MIB // 4).astype(np.float32).tobytes()
    async with aiohttp.ClientSession() as session:
        url = f"http://{address}/sink?n={n}"
        async with session.ws_connect(url, compress=0, max_msg_size=1 << 30) as ws:
            start = time.perf_counter()
            for _ in range(n):
                await ws.send_bytes(data)
            await ws.receive()  # the sink has them all
            return n * len(data) / (time.perf_counter() - start)


def gloo_rank(rank: int, port: int, n: int, mib: int) -> None:
    """Child process: one end of a gloo send/recv stream; rank 0 prints bytes/s."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tensor = torch.randn(mib * MIB // 4) if rank == 0 else torch.empty(mib * MIB // 4)
    ack = torch.zeros(1)
    for _ in range(3):
        dist.send(tensor, 1) if rank == 0 else dist.recv(tensor, 0)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        dist.send(tensor, 1) if rank == 0 else dist.recv(tensor, 0)
    dist.recv(ack, 1) if rank == 0 else dist.send(ack, 0)  # the receiver has them all
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"bytes_per_s {n * tensor.numel() * 4 / elapsed}", flush=True)
    dist.destroy_process_group()


def gloo_tensors(n: int, mib: int) -> float:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = str(Path(__file__).resolve())
    procs = [
        subprocess.Popen(
            [sys.executable, script, "--gloo-rank", str(rank), "--gloo-port", str(port), "--n", str(n),
             "--mib", str(mib)],
            stdout=subprocess.PIPE, text=True, env=ENV,
        )
        for rank in (0, 1)
    ]
    out, _ = procs[0].communicate(timeout=300)
    procs[1].wait(60)
    match = re.search(r"bytes_per_s (\S+)", out)
    if match is None:
        raise RuntimeError(f"gloo sender printed no rate: {out!r}")
    return float(match.group(1))


# -- profile -------------------------------------------------------------------------------


async def _both_ends(n_ask: int, n_tensor: int) -> None:
    async with ActorSystem() as server, WebSocketTransport(server) as node:
        await server.spawn(Echo, name="echo")
        await server.spawn(Sum, name="sum")
        async with ActorSystem() as client, WebSocketTransport(client):
            echo = client.ref(f"echo@{node.address}")
            for _ in range(n_ask):
                await echo.ask(Ping(1))
            sink = client.ref(f"sum@{node.address}")
            msg = Tensor(np.ones(MIB, dtype=np.float32))
            for _ in range(n_tensor):
                await sink.tell(msg)
            await sink.ask(Ping(0))


# (label, test on "file:function") in order: the first that matches takes a function's own time
_PROFILE_GROUPS: list[tuple[str, Any]] = [
    ("socket writes (aiohttp frame write, kernel loopback)", lambda f: f.endswith("writer.py:_write_websocket_frame")),
    ("event loop (uvloop's own work)", lambda f: f.endswith("runners.py:run")),
    ("decode and validation", lambda f: f.startswith(("_codec.py:feed", "_codec.py:_finish", "_codec.py:_ext",
                                                      "_codec.py:_tensor", "_codec.py:message", "_validate.py:"))
     or "unpackb" in f or "unpack_from" in f),
    ("encode", lambda f: f.startswith(("_codec.py:encode", "_codec.py:pack", "_codec.py:single", "_codec.py:_layout",
                                       "_codec.py:__init__", "_codec.py:__call__", "_codec.py:in_ring"))
     or "method 'pack'" in f),
    ("aiohttp parse and send path", lambda f: f.split(":")[0] in {"web_protocol.py", "client_proto.py", "web_ws.py",
                                                                  "client_ws.py", "writer.py", "_pump.py", "_guard.py"}),
    ("shared-memory copies", lambda f: f.startswith("_shm.py:")),
]


def _profile_summary(stats: pstats.Stats, n: int) -> str:
    """Own time per group of functions, as a share of the whole and in microseconds per operation."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    totals: dict[str, float] = {}
    whole = 0.0
    for (path, _, func), (_, _, tottime, _, _) in raw.items():
        key = f"{Path(path).name}:{func}"
        group = next((label for label, test in _PROFILE_GROUPS if test(key)), "dispatch, actors, futures, the rest")
        totals[group] = totals.get(group, 0.0) + tottime
        whole += tottime
    rows = [f"  {share / whole:5.1%}  {1e6 * share / max(n, 1):7.1f} us  {label}"
            for label, share in sorted(totals.items(), key=lambda kv: -kv[1])]
    return "\n".join(["  share   per op    where (own time, under cProfile)", *rows]) + "\n"


def _cpu_per_ask(n: int) -> float:
    """CPU seconds per small ask, both ends in one process, without a profiler (best of 3)."""
    best = float("inf")
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(_both_ends(200, 0))
        for _ in range(3):
            start = time.process_time()
            runner.run(_both_ends(n, 0))
            best = min(best, (time.process_time() - start) / n)
    return best


def profile(n_ask: int, n_tensor: int) -> str:
    """cProfile of both ends in one process: asks, then 4 MiB tells; a summary by group first."""
    out = io.StringIO()
    out.write(f"CPU per small ask, both ends in one process, no profiler: {1e6 * _cpu_per_ask(n_ask):.1f} us\n\n")
    for label, args in (("small asks", (n_ask, 0)), ("4 MiB tensor tells", (0, n_tensor))):
        profiler = cProfile.Profile()
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            profiler.enable()
            runner.run(_both_ends(*args))
            profiler.disable()
        out.write(f"=== {label}: {args} ===\n")
        stats = pstats.Stats(profiler, stream=out)
        out.write(_profile_summary(stats, max(args)))
        stats.sort_stats("tottime").print_stats(20)
    return out.getvalue()


def run_async(coro: object) -> float:
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(coro)  # type: ignore[arg-type]


def main() -> None:
    parser = _common.parser(__doc__ or "")
    parser.add_argument("--profile", action="store_true", help="also profile the ask hot path")
    parser.add_argument("--serve-ws", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--gloo-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mib", type=int, default=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_ws:
        serve_bare_ws()
        return
    if args.gloo_rank is not None:
        gloo_rank(args.gloo_rank, args.gloo_port, args.n, args.mib)
        return

    logging.getLogger("dniasync").setLevel(logging.ERROR)  # peers going away at the end are expected
    n_ask, n_ray, n_tensor, repeats = (3_000, 500, 40, 1) if args.quick else (20_000, 3_000, 250, 3)
    results: dict[str, float] = {}
    bare, dni, dni_tcp, dni_tensor, dni_socket, gloo, bare_tensor = [], [], [], [], [], [], []
    dni_metrics: list[float] = []
    with child(dniasync_node()) as (_, node), child([sys.executable, __file__, "--serve-ws"]) as (_, ws):
        for _ in range(repeats + 2):  # interleaved, so drift on a shared machine hits both alike; best of
            bare.append(run_async(bare_ws_ask(ws, n_ask)))
            dni.append(run_async(dniasync_ask(node, n_ask)))
            dni_tcp.append(run_async(dniasync_ask(node, n_ask, unix=False)))
            dni_metrics.append(run_async(dniasync_ask_metrics(node, n_ask)))
        for _ in range(repeats):
            gloo.append(gloo_tensors(n_tensor, 4))
            dni_tensor.append(run_async(dniasync_tensors(node, n_tensor, 4)))
            dni_socket.append(run_async(dniasync_tensors(node, n_tensor, 4, shm=False)))
            bare_tensor.append(run_async(bare_ws_tensors(ws, n_tensor, 4)))
    ray_rate = ray_ask(n_ray)
    results["bare_ws_ask_per_s"] = max(bare)
    results["dniasync_ask_per_s"] = max(dni)
    results["dniasync_tcp_ask_per_s"] = max(dni_tcp)
    results["dniasync_ask_metrics_per_s"] = max(dni_metrics)
    results["dniasync_tensor_bytes_per_s"] = max(dni_tensor)
    results["dniasync_socket_tensor_bytes_per_s"] = max(dni_socket)
    results["gloo_tensor_bytes_per_s"] = max(gloo)
    results["bare_ws_tensor_bytes_per_s"] = max(bare_tensor)
    ratios = {
        "ask_vs_bare_ws": results["dniasync_ask_per_s"] / results["bare_ws_ask_per_s"],
        "ask_tcp_vs_bare_ws": results["dniasync_tcp_ask_per_s"] / results["bare_ws_ask_per_s"],
        "tensor_throughput_vs_gloo": results["dniasync_tensor_bytes_per_s"] / results["gloo_tensor_bytes_per_s"],
        "tensor_socket_throughput_vs_gloo": (
            results["dniasync_socket_tensor_bytes_per_s"] / results["gloo_tensor_bytes_per_s"]
        ),
        "remote_ask_metrics_on_vs_off": results["dniasync_ask_metrics_per_s"] / results["dniasync_ask_per_s"],
    }
    rows = [
        ("small ask: bare aiohttp ws echo", f"{results['bare_ws_ask_per_s']:,.0f}/s", "1.00 (floor)"),
        ("small ask: dniasync (same-host Unix socket)", f"{results['dniasync_ask_per_s']:,.0f}/s",
         f"{ratios['ask_vs_bare_ws']:.2f} of bare ws"),
        ("small ask: dniasync over TCP", f"{results['dniasync_tcp_ask_per_s']:,.0f}/s",
         f"{ratios['ask_tcp_vs_bare_ws']:.2f} of bare ws"),
        ("small ask: dniasync, metrics on", f"{results['dniasync_ask_metrics_per_s']:,.0f}/s",
         f"{ratios['remote_ask_metrics_on_vs_off']:.2f} of metrics off"),
    ]
    if ray_rate is not None:
        results["ray_ask_per_s"] = ray_rate
        ratios["ask_vs_ray"] = results["dniasync_ask_per_s"] / ray_rate
        rows.append(("small ask: Ray actor call", f"{ray_rate:,.0f}/s", f"dniasync is {ratios['ask_vs_ray']:.1f}x Ray"))
    rows += [
        ("4 MiB tensors: gloo send/recv", f"{results['gloo_tensor_bytes_per_s'] / 1e9:.2f} GB/s", "1.00 (reference)"),
        ("4 MiB tensors: bare aiohttp ws", f"{results['bare_ws_tensor_bytes_per_s'] / 1e9:.2f} GB/s",
         f"{results['bare_ws_tensor_bytes_per_s'] / results['gloo_tensor_bytes_per_s']:.2f} of gloo"),
        ("4 MiB tensors: dniasync tell, shared memory", f"{results['dniasync_tensor_bytes_per_s'] / 1e9:.2f} GB/s",
         f"{ratios['tensor_throughput_vs_gloo']:.2f} of gloo"),
        ("4 MiB tensors: dniasync tell, socket", f"{results['dniasync_socket_tensor_bytes_per_s'] / 1e9:.2f} GB/s",
         f"{ratios['tensor_socket_throughput_vs_gloo']:.2f} of gloo"),
    ]
    _common.say(_common.table(rows, ("system", "rate", "ratio")))
    path = _common.write("bench_remote", args.quick, results, ratios)
    _common.say(f"wrote {path}")
    _plot(results, path.with_suffix(".png"))
    if args.profile:
        text = profile(2_000, 20) if args.quick else profile(10_000, 100)
        out = _common.RESULTS / "bench_remote_profile.txt"
        out.write_text(text)
        _common.say(f"wrote {out}")


def _plot(results: dict[str, float], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    asks = {"bare ws": "bare_ws_ask_per_s", "dniasync\nUnix": "dniasync_ask_per_s",
            "dniasync\nTCP": "dniasync_tcp_ask_per_s", "Ray": "ray_ask_per_s"}
    shown = {k: results[v] for k, v in asks.items() if v in results}
    left.bar(list(shown), list(shown.values()), color=["grey", "tab:blue", "tab:cyan", "tab:orange"][: len(shown)])
    left.set_ylabel("round trips / s")
    left.set_title("small ask, two processes")
    right.bar(["gloo", "bare ws", "dniasync\nsocket", "dniasync\nshm"],
              [results["gloo_tensor_bytes_per_s"] / 1e9, results["bare_ws_tensor_bytes_per_s"] / 1e9,
               results["dniasync_socket_tensor_bytes_per_s"] / 1e9, results["dniasync_tensor_bytes_per_s"] / 1e9],
              color=["grey", "silver", "tab:cyan", "tab:blue"])
    right.set_ylabel("GB/s")
    right.set_title("4 MiB float32 tensors, one way")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
