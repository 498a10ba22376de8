"""Local actor messaging: dniasync vs a bare asyncio queue + future vs pykka.

Run: python benchmarks/bench_actors.py [--quick]

- ask: sequential request/reply round trips per second (one caller, one actor).
- tell: one-way messages per second into a bounded mailbox, until all handled.

The bare baseline (asyncio.Queue + future, same uvloop) is the floor any actor
layer on asyncio sits on; pykka is a thread-based Python actor library.
The metrics-on ask attaches the node's Prometheus metrics and scrapes them
every 0.1 s meanwhile. Ratios (bigger is better): ask_vs_bare, ask_vs_pykka,
tell_vs_bare, ask_metrics_on_vs_off.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import _common

from dniasync import Actor, ActorSystem, handler, message
from dniasync.metrics import NodeMetrics
from dniasync.runtime import loop_factory, uses_uvloop


@message("bench.Ping")
@dataclass(frozen=True)
class Ping:
    n: int


class Echo(Actor):
    mailbox_size = 1024

    def __init__(self) -> None:
        self.count = 0

    @handler
    def ping(self, msg: Ping) -> int:
        self.count += 1
        return self.count


async def dniasync_ask(n: int) -> float:
    async with ActorSystem() as system:
        ref = await system.spawn(Echo, name="echo")
        msg = Ping(1)
        start = time.perf_counter()
        for _ in range(n):
            await ref.ask(msg)
        return n / (time.perf_counter() - start)


async def dniasync_ask_metrics(n: int) -> float:
    """``dniasync_ask`` with the node's metrics attached and scraped every 0.1 s (50x Prometheus's 5 s)."""
    async with ActorSystem() as system:
        metrics = NodeMetrics(system, "bench")
        ref = await system.spawn(Echo, name="echo")

        async def scrape() -> None:
            while True:
                await asyncio.sleep(0.1)
                metrics.exposition()

        scraper = asyncio.create_task(scrape())
        msg = Ping(1)
        start = time.perf_counter()
        for _ in range(n):
            await ref.ask(msg)
        rate = n / (time.perf_counter() - start)
        scraper.cancel()
        return rate


async def dniasync_tell(n: int) -> float:
    async with ActorSystem() as system:
        ref = await system.spawn(Echo, name="echo")
        msg = Ping(1)
        start = time.perf_counter()
        for _ in range(n):
            await ref.tell(msg)
        assert await ref.ask(msg) == n + 1  # every tell handled
        return n / (time.perf_counter() - start)


async def bare_ask(n: int) -> float:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, asyncio.Future[int]]] = asyncio.Queue(1024)

    async def serve() -> None:
        count = 0
        while True:
            _, fut = await queue.get()
            count += 1
            fut.set_result(count)

    server = asyncio.create_task(serve())
    start = time.perf_counter()
    for _ in range(n):
        fut: asyncio.Future[int] = loop.create_future()
        queue.put_nowait((1, fut))
        await fut
    rate = n / (time.perf_counter() - start)
    server.cancel()
    return rate


async def bare_tell(n: int) -> float:
    queue: asyncio.Queue[int] = asyncio.Queue(1024)
    done = asyncio.Event()

    async def serve() -> None:
        count = 0
        while True:
            await queue.get()
            count += 1
            if count == n:
                done.set()

    server = asyncio.create_task(serve())
    start = time.perf_counter()
    for _ in range(n):
        await queue.put(1)
    await done.wait()
    rate = n / (time.perf_counter() - start)
    server.cancel()
    return rate


def pykka_rates(n_ask: int, n_tell: int) -> tuple[float, float]:
    import pykka

    class PykkaEcho(pykka.ThreadingActor):  # type: ignore[misc,unused-ignore]  # pykka without its types: Any
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def on_receive(self, msg: object) -> int:
            self.count += 1
            return self.count

    ref = PykkaEcho.start()
    try:
        start = time.perf_counter()
        for _ in range(n_ask):
            ref.ask(1)
        ask = n_ask / (time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(n_tell):
            ref.tell(1)
        ref.ask(1)
        tell = n_tell / (time.perf_counter() - start)
    finally:
        ref.stop()
    return ask, tell


def best_of(repeats: int, bench: Callable[[int], Awaitable[float]], n: int) -> float:
    rates: list[float] = []
    for _ in range(repeats):
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            rates.append(runner.run(bench(n)))  # type: ignore[arg-type]
    return max(rates)


def main() -> None:
    args = _common.parser(__doc__ or "").parse_args()
    n_ask, n_tell, repeats = (20_000, 50_000, 2) if args.quick else (200_000, 500_000, 3)
    if not uses_uvloop():
        print("warning: uvloop is not installed; measuring asyncio's loop")
    # interleave the systems so drift on a noisy machine hits them alike
    results: dict[str, float] = {}
    results["bare_ask_per_s"] = best_of(repeats, bare_ask, n_ask)
    results["dniasync_ask_per_s"] = best_of(repeats, dniasync_ask, n_ask)
    results["dniasync_ask_metrics_per_s"] = best_of(repeats, dniasync_ask_metrics, n_ask)
    results["bare_tell_per_s"] = best_of(repeats, bare_tell, n_tell)
    results["dniasync_tell_per_s"] = best_of(repeats, dniasync_tell, n_tell)
    pykka = [pykka_rates(n_ask // 4, n_tell // 4) for _ in range(repeats)]
    results["pykka_ask_per_s"] = max(a for a, _ in pykka)
    results["pykka_tell_per_s"] = max(t for _, t in pykka)
    ratios = {
        "ask_vs_bare": results["dniasync_ask_per_s"] / results["bare_ask_per_s"],
        "ask_vs_pykka": results["dniasync_ask_per_s"] / results["pykka_ask_per_s"],
        "tell_vs_bare": results["dniasync_tell_per_s"] / results["bare_tell_per_s"],
        "ask_metrics_on_vs_off": results["dniasync_ask_metrics_per_s"] / results["dniasync_ask_per_s"],
    }
    rows = [
        ("ask: bare asyncio queue+future", f"{results['bare_ask_per_s']:,.0f}/s", "1.00 (reference)"),
        ("ask: dniasync", f"{results['dniasync_ask_per_s']:,.0f}/s", f"{ratios['ask_vs_bare']:.2f} of bare"),
        ("ask: dniasync, metrics on (scraped every 0.1 s)", f"{results['dniasync_ask_metrics_per_s']:,.0f}/s",
         f"{ratios['ask_metrics_on_vs_off']:.2f} of metrics off"),
        ("ask: pykka (threads)", f"{results['pykka_ask_per_s']:,.0f}/s",
         f"dniasync is {ratios['ask_vs_pykka']:.1f}x pykka"),
        ("tell: bare asyncio queue", f"{results['bare_tell_per_s']:,.0f}/s", "1.00 (reference)"),
        ("tell: dniasync", f"{results['dniasync_tell_per_s']:,.0f}/s", f"{ratios['tell_vs_bare']:.2f} of bare"),
        ("tell: pykka (threads)", f"{results['pykka_tell_per_s']:,.0f}/s", ""),
    ]
    print(_common.table(rows, ("system", "rate", "ratio")))
    path = _common.write("bench_actors", args.quick, results, ratios)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
