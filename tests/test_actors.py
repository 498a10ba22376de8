"""The local actor runtime: what users embedding ActorSystem rely on."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from dataclasses import dataclass, field

import pytest

from dniasync import (
    Actor,
    ActorNameTaken,
    ActorNotFound,
    ActorStopped,
    ActorSystem,
    AskTimeout,
    Directive,
    MailboxFull,
    SupervisionEscalated,
    UnhandledMessage,
    handler,
    message,
    one_for_all,
    one_for_one,
)
from dniasync.actors import Backoff


@message("test.Append")
class Append:
    value: int


@message("test.Get")
class Get:
    pass


@message("test.Boom")
class Boom:
    reason: str = "boom"


@message("test.Wait")
class Wait:
    event: asyncio.Event


@dataclass
class Log:
    """Shared across restarts: what a test reads back."""

    started: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


class Recorder(Actor):
    """Appends values; fails on Boom; blocks on Wait until the event is set."""

    mailbox_size = 0

    def __init__(self, log: Log | None = None) -> None:
        self.values: list[int] = []
        self.log = log or Log()

    async def on_start(self) -> None:
        self.log.started.append(self.name)

    async def on_stop(self) -> None:
        self.log.stopped.append(self.name)

    async def on_failure(self, exc: BaseException) -> None:
        self.log.failed.append(f"{self.name}:{exc}")

    @handler
    def append(self, msg: Append) -> int:
        self.values.append(msg.value)
        return len(self.values)

    @handler
    def get(self, msg: Get) -> list[int]:
        return list(self.values)

    @handler
    def boom(self, msg: Boom) -> None:
        raise RuntimeError(msg.reason)

    @handler
    async def wait(self, msg: Wait) -> str:
        await msg.event.wait()
        return "released"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_messages_are_handled_one_at_a_time_in_order() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Recorder, name="rec")
        for i in range(500):
            await ref.tell(Append(i))
        assert await ref.ask(Get()) == list(range(500))


async def test_concurrent_senders_keep_their_own_order() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Recorder, name="rec")

        async def send(base: int) -> None:
            for i in range(100):
                await ref.tell(Append(base + i))
                if i % 7 == 0:
                    await asyncio.sleep(0)

        await asyncio.gather(send(0), send(1000), send(2000))
        values = await ref.ask(Get())
        assert sorted(values) == sorted(list(range(100)) + list(range(1000, 1100)) + list(range(2000, 2100)))
        for base in (0, 1000, 2000):
            mine = [v for v in values if base <= v < base + 100]
            assert mine == list(range(base, base + 100))


async def test_ask_returns_handler_value_and_async_handlers_are_awaited() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Recorder, name="rec")
        assert await ref.ask(Append(7)) == 1
        assert await ref.ask(Append(8)) == 2
        event = asyncio.Event()
        reply = asyncio.create_task(ref.ask(Wait(event)))
        await asyncio.sleep(0.01)
        assert not reply.done()
        event.set()
        assert await reply == "released"


async def test_exception_in_ask_reaches_caller_and_actor_keeps_state() -> None:
    log = Log()
    async with ActorSystem() as system:
        ref = await system.spawn(Recorder, log, name="rec")
        await ref.tell(Append(1))
        with pytest.raises(RuntimeError, match="bad input"):
            await ref.ask(Boom("bad input"))
        assert await ref.ask(Get()) == [1]  # same instance: no restart for a failed ask
        assert log.started == ["rec"] and log.failed == []


async def test_unhandled_message_is_a_typed_error() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Recorder, name="rec")
        with pytest.raises(UnhandledMessage, match="Recorder has no handler for str"):
            await ref.ask("hello")


async def test_handler_for_a_base_class_receives_subclasses() -> None:
    @message("test.SpecialAppend")
    class SpecialAppend(Append):
        pass

    async with ActorSystem() as system:
        ref = await system.spawn(Recorder, name="rec")
        assert await ref.ask(SpecialAppend(5)) == 1


async def test_ask_times_out_with_typed_error() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Recorder, name="rec")
        event = asyncio.Event()
        with pytest.raises(AskTimeout) as info:
            await ref.ask(Wait(event), timeout=0.05)
        assert isinstance(info.value, TimeoutError) and info.value.address == "rec@local"
        event.set()
        assert await ref.ask(Append(1)) == 1  # the actor is unharmed


async def test_stop_fails_pending_asks_with_actor_stopped() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Recorder, name="rec")
        event = asyncio.Event()
        blocked = asyncio.create_task(ref.ask(Wait(event)))
        queued = [asyncio.create_task(ref.ask(Append(i))) for i in range(3)]
        await asyncio.sleep(0.01)
        stopping = asyncio.create_task(system.stop(ref))
        await asyncio.sleep(0.01)
        assert not ref.is_alive
        event.set()
        await stopping
        assert await blocked == "released"  # the message in progress completes
        for task in queued:
            with pytest.raises(ActorStopped):
                await task
        with pytest.raises(ActorStopped):
            await ref.ask(Get())  # at once, not after a timeout
        with pytest.raises(ActorStopped):
            await ref.tell(Append(1))
        with pytest.raises(ActorNotFound):
            system.lookup("rec")


async def test_stop_with_drain_handles_what_was_queued() -> None:
    log = Log()
    async with ActorSystem() as system:
        ref = await system.spawn(Recorder, log, name="rec")
        event = asyncio.Event()
        blocked = asyncio.create_task(ref.ask(Wait(event)))
        queued = [asyncio.create_task(ref.ask(Append(i))) for i in range(3)]
        await asyncio.sleep(0.01)
        stopping = asyncio.create_task(system.stop(ref, drain=True))
        await asyncio.sleep(0)
        event.set()
        await stopping
        assert await blocked == "released"
        assert [await t for t in queued] == [1, 2, 3]
        assert log.stopped == ["rec"]


async def test_actor_can_stop_itself() -> None:
    class Quitter(Actor):
        @handler
        def quit(self, msg: Get) -> str:
            self.stop()
            return "bye"

    async with ActorSystem() as system:
        ref = await system.spawn(Quitter, name="q")
        assert await ref.ask(Get()) == "bye"
        for _ in range(100):
            if not ref.is_alive:
                break
            await asyncio.sleep(0.001)
        with pytest.raises(ActorStopped):
            await ref.ask(Get())


async def test_full_mailbox_makes_tell_wait_and_keeps_order() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Recorder, name="rec", mailbox_size=2)
        event = asyncio.Event()
        blocked = asyncio.create_task(ref.ask(Wait(event)))
        await asyncio.sleep(0.01)  # Wait is being handled; the mailbox is empty
        await ref.tell(Append(0))
        await ref.tell(Append(1))
        assert system.mailbox_depth(ref) == 2
        with pytest.raises(MailboxFull):
            ref.tell_nowait(Append(99))
        third = asyncio.create_task(ref.tell(Append(2)))
        fourth = asyncio.create_task(ref.tell(Append(3)))
        await asyncio.sleep(0.01)
        assert not third.done() and not fourth.done()  # backpressure
        event.set()
        await asyncio.wait_for(asyncio.gather(third, fourth), 1)
        await blocked
        assert await ref.ask(Get()) == [0, 1, 2, 3]


@message("test.UrgentAppend")
class UrgentAppend:
    value: int


class Triage(Recorder):
    """A Recorder whose UrgentAppend messages overtake the queued Appends."""

    urgent_messages = (UrgentAppend,)

    @handler
    def urgent_append(self, msg: UrgentAppend) -> int:
        self.values.append(msg.value)
        return len(self.values)


async def test_urgent_messages_overtake_queued_ones_and_keep_their_own_order() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Triage, name="triage")
        event = asyncio.Event()
        blocked = asyncio.create_task(ref.ask(Wait(event)))
        await asyncio.sleep(0.01)  # Wait is being handled; the rest queues up
        await ref.tell(Append(1))
        await ref.tell(Append(2))
        await ref.tell(UrgentAppend(10))
        ref.tell_nowait(UrgentAppend(11))
        await ref.tell(Append(3))
        late = asyncio.create_task(ref.ask(UrgentAppend(12)))
        await asyncio.sleep(0.01)
        event.set()
        await blocked
        assert await late == 3  # handled third, before any Append
        assert await ref.ask(Get()) == [10, 11, 12, 1, 2, 3]


async def test_urgent_messages_respect_the_mailbox_bound() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Triage, name="triage", mailbox_size=2)
        event = asyncio.Event()
        blocked = asyncio.create_task(ref.ask(Wait(event)))
        await asyncio.sleep(0.01)
        await ref.tell(Append(1))
        await ref.tell(Append(2))
        with pytest.raises(MailboxFull):
            ref.tell_nowait(UrgentAppend(10))
        waiting = asyncio.create_task(ref.tell(UrgentAppend(11)))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # backpressure applies to urgent messages too
        assert system.mailbox_depth(ref) == 3  # two queued, one waiting for room
        event.set()
        await asyncio.wait_for(waiting, 1)
        await blocked
        # it entered when Append(1) left, and then went before Append(2)
        assert await ref.ask(Get()) == [1, 11, 2]


async def test_ordinary_actors_ignore_urgency_of_the_same_message() -> None:
    class Plain(Triage):
        urgent_messages = ()

    async with ActorSystem() as system:
        ref = await system.spawn(Plain, name="plain")
        event = asyncio.Event()
        blocked = asyncio.create_task(ref.ask(Wait(event)))
        await asyncio.sleep(0.01)
        await ref.tell(Append(1))
        await ref.tell(UrgentAppend(10))
        event.set()
        await blocked
        assert await ref.ask(Get()) == [1, 10]


async def test_names_are_unique_and_lookup_works() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Recorder, name="rec")
        assert system.lookup("rec") == ref
        assert system.ref("rec@local") == ref
        assert hash(system.lookup("rec")) == hash(ref)
        assert str(ref) == "rec@local" and repr(ref) == "ActorRef('rec@local')"
        assert ref.name == "rec" and ref.node == "local"
        with pytest.raises(ActorNameTaken):
            await system.spawn(Recorder, name="rec")
        with pytest.raises(ActorNotFound):
            system.lookup("nobody")
        anon = await system.spawn(Recorder)
        assert anon.name.startswith("Recorder-")


async def test_actor_cannot_be_constructed_directly() -> None:
    with pytest.raises(TypeError, match="spawn"):
        Recorder()


async def test_one_for_one_restarts_only_the_failed_child() -> None:
    log = Log()
    async with ActorSystem(clock=FakeClock()) as system:
        a = await system.spawn(Recorder, log, name="a")
        b = await system.spawn(Recorder, log, name="b")
        await a.tell(Append(1))
        await b.tell(Append(2))
        await a.tell(Boom("crash"))
        # the restarted instance starts empty; the ref and mailbox survive
        assert await a.ask(Get()) == []
        assert await b.ask(Get()) == [2]
        assert log.failed == ["a:crash"]
        assert log.started == ["a", "b", "a"]
        assert system.restart_count == 1


async def test_one_for_all_restarts_every_sibling() -> None:
    log = Log()

    class Parent(Actor):
        supervisor_strategy = one_for_all(max_restarts=5, within_s=60)

        async def on_start(self) -> None:
            for child in ("c1", "c2", "c3"):
                await self.spawn(Recorder, log, name=child)

        @handler
        def kids(self, msg: Get) -> list[str]:
            return [c.name for c in self.children]

    async with ActorSystem(clock=FakeClock()) as system:
        parent = await system.spawn(Parent, name="parent")
        assert await parent.ask(Get()) == ["c1", "c2", "c3"]
        c1, c2, c3 = (system.lookup(n) for n in ("c1", "c2", "c3"))
        for ref in (c1, c2, c3):
            assert await ref.ask(Append(9)) == 1
        await c2.tell(Boom("c2 broke"))
        assert await c2.ask(Get()) == []
        # by now the siblings have the restart first in line, before any later message
        assert await c1.ask(Get()) == [] and await c3.ask(Get()) == []
        assert log.failed == ["c2:c2 broke"]
        assert sorted(log.stopped) == ["c1", "c3"]  # healthy siblings stopped, then restarted
        assert sorted(log.started) == ["c1", "c1", "c2", "c2", "c3", "c3"]


async def test_stop_directive_stops_the_child() -> None:
    async with ActorSystem(supervisor=one_for_one(decide=lambda exc: Directive.STOP)) as system:
        ref = await system.spawn(Recorder, name="rec")
        assert await ref.ask(Append(1)) == 1
        await ref.tell(Boom())
        later = asyncio.create_task(ref.ask(Get()))
        with pytest.raises(ActorStopped):
            await later
        assert not ref.is_alive and system.restart_count == 0


async def test_per_actor_supervision_overrides_the_strategy() -> None:
    async with ActorSystem() as system:
        temp = await system.spawn(Recorder, name="temp", supervision=Directive.STOP)
        perm = await system.spawn(Recorder, name="perm")
        await temp.tell(Boom())
        await perm.tell(Boom())
        assert await perm.ask(Get()) == []
        with pytest.raises(ActorStopped):
            await temp.ask(Get())


async def test_restart_intensity_escalates_past_the_limit_with_injected_clock() -> None:
    clock = FakeClock()
    log = Log()

    class Parent(Actor):
        supervisor_strategy = one_for_one(max_restarts=2, within_s=10)

        async def on_start(self) -> None:
            await self.spawn(Recorder, log, name="worker")

        async def on_failure(self, exc: BaseException) -> None:
            log.failed.append(f"parent:{exc}")

    async with ActorSystem(clock=clock, supervisor=one_for_one(decide=lambda e: Directive.STOP)) as system:
        parent = await system.spawn(Parent, name="parent")
        worker = system.lookup("worker")
        await worker.tell(Boom("1"))
        assert await worker.ask(Get()) == []
        clock.now += 4
        await worker.tell(Boom("2"))
        assert await worker.ask(Get()) == []
        clock.now += 7  # the first restart (11 s ago) has left the 10 s window
        await worker.tell(Boom("3"))
        assert await worker.ask(Get()) == []
        assert system.restart_count == 3
        clock.now += 1  # restarts at t=4, t=11 and now t=12: a third within 10 s
        await worker.tell(Boom("4"))
        with pytest.raises(ActorStopped):
            await worker.ask(Get())
        for _ in range(200):
            if not parent.is_alive:
                break
            await asyncio.sleep(0.001)
        assert not parent.is_alive  # escalated to the root, which stops it
        assert log.failed[-1] == "parent:4"


async def test_escalation_past_root_raises_from_the_system() -> None:
    with pytest.raises(SupervisionEscalated) as info:
        async with ActorSystem(supervisor=one_for_one(decide=lambda e: Directive.ESCALATE)) as system:
            ref = await system.spawn(Recorder, name="rec")
            await ref.tell(Boom("fatal"))
            await asyncio.sleep(5)  # cancelled by the escalation, not waited out
    assert isinstance(info.value.__cause__, RuntimeError)
    assert str(info.value.__cause__) == "fatal"


async def test_failing_on_start_is_supervised() -> None:
    attempts: list[int] = []

    class Flaky(Actor):
        async def on_start(self) -> None:
            attempts.append(1)
            if len(attempts) < 3:
                raise ConnectionError("not yet")

        @handler
        def get(self, msg: Get) -> int:
            return len(attempts)

    async with ActorSystem(clock=FakeClock(), supervisor=one_for_one(max_restarts=5)) as system:
        ref = await system.spawn(Flaky, name="flaky")
        assert await ref.ask(Get()) == 3


async def test_shutdown_stops_children_first_fails_asks_and_leaves_no_task() -> None:
    order: list[str] = []

    class Node(Actor):
        def __init__(self, depth: int) -> None:
            self.depth = depth

        async def on_start(self) -> None:
            if self.depth:
                await self.spawn(Node, self.depth - 1, name=f"{self.name}.child")

        async def on_stop(self) -> None:
            order.append(self.name)

        @handler
        async def wait(self, msg: Wait) -> None:
            await msg.event.wait()

    before = asyncio.all_tasks()
    event = asyncio.Event()
    async with ActorSystem() as system:
        await system.spawn(Node, 2, name="root1")
        await system.spawn(Node, 0, name="root2")
        blocker = system.lookup("root1.child.child")
        first = asyncio.create_task(blocker.ask(Wait(event)))
        second = asyncio.create_task(blocker.ask(Get()))
        await asyncio.sleep(0.01)
        asyncio.get_running_loop().call_later(0.05, event.set)
    assert await first is None
    with pytest.raises(ActorStopped):
        await second
    assert order == ["root2", "root1.child.child", "root1.child", "root1"]
    assert asyncio.all_tasks() == before
    assert system.actors() == []


async def test_run_blocking_keeps_the_loop_serving_messages() -> None:
    release = threading.Event()

    class Trainer(Actor):
        @handler
        async def train(self, msg: Wait) -> str:
            await self.run_blocking(release.wait, 5)
            return threading.current_thread().name

    async with ActorSystem() as system:
        trainer = await system.spawn(Trainer, name="trainer")
        other = await system.spawn(Recorder, name="rec")
        busy = asyncio.create_task(trainer.ask(Wait(asyncio.Event())))
        await asyncio.sleep(0.01)
        # the loop is free while the blocking call runs
        assert await asyncio.wait_for(other.ask(Append(1)), 1) == 1
        assert not busy.done()
        release.set()
        assert await busy == threading.current_thread().name  # handler runs on the loop thread
        assert await system.run_blocking(lambda: threading.current_thread().name) != threading.current_thread().name


async def test_an_error_in_the_body_propagates_unwrapped_after_shutdown() -> None:
    log = Log()
    with pytest.raises(KeyError, match="from the body"):
        async with ActorSystem() as system:
            await system.spawn(Recorder, log, name="rec")
            raise KeyError("from the body")
    assert log.stopped == ["rec"]


async def test_spawn_outside_the_context_is_refused() -> None:
    system = ActorSystem()
    with pytest.raises(RuntimeError, match="async with"):
        await system.spawn(Recorder)


def test_message_tags_are_validated() -> None:
    with pytest.raises(ValueError, match="invalid message tag"):
        message("bad tag!")
    with pytest.raises(ValueError, match="already registered"):

        @message("test.Append")
        class Other:
            x: int


async def test_a_handler_stuck_on_a_full_mailbox_does_not_hang_shutdown() -> None:
    class Forwarder(Actor):
        def __init__(self, target: object) -> None:
            self.target = target

        @handler(Append)
        async def forward(self, msg: Append) -> None:
            await self.target.tell(msg)  # type: ignore[attr-defined]

    release = asyncio.Event()
    async with ActorSystem(stop_timeout=0.2) as system:
        sink = await system.spawn(Recorder, name="sink", mailbox_size=1)
        forwarder = await system.spawn(Forwarder, sink, name="forwarder")
        blocked = asyncio.create_task(sink.ask(Wait(release)))
        await asyncio.sleep(0.01)
        await sink.tell(Append(1))  # the sink's mailbox is now full
        stuck = asyncio.create_task(forwarder.ask(Append(2)))
        await asyncio.sleep(0.01)
        assert not stuck.done()
        # the forwarder was spawned last, so it is stopped first, while its handler waits for room
        started = asyncio.get_running_loop().time()
    assert asyncio.get_running_loop().time() - started < 2
    with pytest.raises(ActorStopped, match="stopped while handling"):
        await stuck
    release.set()
    with pytest.raises(ActorStopped):
        await blocked


class Delayed(Actor):
    """Sends itself an Append later, through ``send_later``."""

    def __init__(self, arrived: asyncio.Event, values: list[int]) -> None:
        self.arrived = arrived
        self.values = values

    @handler
    def append(self, msg: Append) -> None:
        if msg.value < 0:
            self.send_later(0.01, Append(-msg.value))
            return
        self.values.append(msg.value)
        self.arrived.set()


async def test_send_later_delivers_to_the_actor_itself_and_is_dropped_once_it_stopped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    values: list[int] = []
    async with ActorSystem() as system:
        arrived = asyncio.Event()
        ref = await system.spawn(Delayed, arrived, values, name="delayed")
        await ref.tell(Append(-7))
        await asyncio.wait_for(arrived.wait(), 10)
        await ref.ask(Append(-8))  # schedules 8 ...
        await system.stop(ref)  # ... which falls on a stopped actor
        await asyncio.sleep(0.1)
    assert values == [7]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_backoff_jitter_stays_within_its_fraction_doubles_and_resets() -> None:
    now = [0.0]
    backoff = Backoff(0.1, 1.0, jitter=0.5, clock=lambda: now[0], rng=random.Random(7))
    nominal = [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    for _ in range(50):  # many draws per step: every one in [nominal * (1 - jitter), nominal]
        delays = [backoff.failed() for _ in nominal]
        assert all(n * 0.5 <= d <= n for d, n in zip(delays, nominal, strict=True)), delays
        assert backoff.failures == len(nominal) and not backoff.ready()
        now[0] += delays[-1]
        assert backoff.ready()  # the wait of the last failure is over
        backoff.succeeded()
        assert backoff.failures == 0 and backoff.ready()
    spread = {round(Backoff(0.1, 1.0, jitter=0.5).failed(), 6) for _ in range(20)}
    assert len(spread) > 1  # clients that failed together do not retry in step
    with pytest.raises(ValueError, match="jitter"):
        Backoff(0.1, 1.0, jitter=1.0)
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(2.0, 1.0)
