"""A small async app embedding dniasync's actor runtime.

A three-stage pipeline -- Source -> Squarer -> Sink -- where the Squarer is a
supervised worker that crashes on some inputs. Its parent restarts it (one for
one, at most 5 restarts in 10 s); the pipeline keeps going and the sink
reports what arrived. Runs in well under a second:

    python examples/embed_actors.py
"""

from __future__ import annotations

import asyncio
import logging
import time

from dniasync import Actor, ActorRef, ActorSystem, handler, message, one_for_one, run


@message("example.Number")
class Number:
    value: int


@message("example.Squared")
class Squared:
    value: int
    square: int


@message("example.Report")
class Report:
    pass


class Squarer(Actor):
    """Squares numbers and forwards them; multiples of 7 crash it (a bug we tolerate)."""

    def __init__(self, sink: ActorRef) -> None:
        self.sink = sink
        self.handled = 0

    async def on_start(self) -> None:
        print(f"  [squarer] started (fresh instance, handled={self.handled})")

    async def on_failure(self, exc: BaseException) -> None:
        print(f"  [squarer] crashed: {exc}")

    @handler
    async def square(self, msg: Number) -> None:
        if msg.value % 7 == 0:
            raise ValueError(f"cannot square {msg.value}")
        self.handled += 1
        await self.sink.tell(Squared(msg.value, msg.value * msg.value))


class Stage(Actor):
    """Supervises the Squarer: restart it on failure, up to 5 times in 10 s."""

    supervisor_strategy = one_for_one(max_restarts=5, within_s=10.0)

    def __init__(self, sink: ActorRef) -> None:
        self.sink = sink

    async def on_start(self) -> None:
        self.worker = await self.spawn(Squarer, self.sink, name="squarer")

    @handler
    async def forward(self, msg: Number) -> None:
        await self.worker.tell(msg)


class Sink(Actor):
    def __init__(self) -> None:
        self.received: list[Squared] = []

    @handler
    def collect(self, msg: Squared) -> None:
        self.received.append(msg)

    @handler
    def report(self, msg: Report) -> list[Squared]:
        return list(self.received)


async def main() -> None:
    started = time.perf_counter()
    async with ActorSystem() as system:
        sink = await system.spawn(Sink, name="sink")
        stage = await system.spawn(Stage, sink, name="stage")
        print("pipeline: source -> stage -> squarer (supervised, crashes on multiples of 7) -> sink")
        for value in range(1, 21):
            await stage.tell(Number(value))
        # messages flow on their own; poll the sink until all the squares that can arrive have
        expected = [v for v in range(1, 21) if v % 7]
        deadline = time.monotonic() + 5
        while len(received := await sink.ask(Report())) < len(expected) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        print(f"sink received {len(received)} squares: {[r.square for r in received]}")
        print(f"squarer restarts: {system.restart_count} (inputs 7 and 14 crashed it)")
        assert [r.value for r in received] == expected
    print(f"ran and shut down cleanly in {time.perf_counter() - started:.3f} s")


if __name__ == "__main__":
    # the hooks above narrate failures; the runtime's own crash reports (with tracebacks) go to the log
    logging.basicConfig(level=logging.ERROR)
    run(main())
