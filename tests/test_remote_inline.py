"""Frames handled where they arrive, with nothing a sender can see changed.

A transport hands a message to an idle actor whose handler is plain (not
``async``) and that handler runs at once, in the actor's own context; a
connection handles binary frames as aiohttp parses them. Order per sender,
supervision, one message at a time and backpressure stay as through the
mailbox and the read loop.
"""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass
from typing import Any

import pytest

from dniasync import Actor, ActorSystem, handler, message
from dniasync.remote import RemoteSettings, WebSocketTransport

pytestmark = pytest.mark.timeout(60)

WHO: contextvars.ContextVar[str] = contextvars.ContextVar("test_inline_who", default="nobody")


@message("test.inline.Add")
@dataclass(frozen=True)
class Add:
    value: int


@message("test.inline.Read")
@dataclass(frozen=True)
class Read:
    pass


@message("test.inline.Boom")
@dataclass(frozen=True)
class Boom:
    text: str


@message("test.inline.Who")
@dataclass(frozen=True)
class Who:
    pass


@message("test.inline.Hold")
@dataclass(frozen=True)
class Hold:
    pass


class Keeper(Actor):
    """Plain handlers, one async one (``Hold`` waits for the class's gate); counts its instances."""

    gate: asyncio.Event | None = None
    instances: list[int] = []

    def __init__(self) -> None:
        self.values: list[int] = []
        Keeper.instances.append(id(self))

    async def on_start(self) -> None:
        WHO.set(f"keeper {id(self)}")

    @handler
    def add(self, msg: Add) -> int:
        self.values.append(msg.value)
        return len(self.values)

    @handler
    def read(self, msg: Read) -> list[int]:
        return list(self.values)

    @handler
    def boom(self, msg: Boom) -> None:
        raise RuntimeError(msg.text)

    @handler
    def who(self, msg: Who) -> str:
        return WHO.get()

    @handler
    async def hold(self, msg: Hold) -> str:
        assert Keeper.gate is not None
        await Keeper.gate.wait()
        return "released"


def _future() -> asyncio.Future[Any]:
    return asyncio.get_running_loop().create_future()


async def test_an_idle_actor_handles_a_delivered_message_at_once_in_its_own_context() -> None:
    async with ActorSystem() as system:
        ref = await system.spawn(Keeper, name="k")
        assert await ref.ask(Read()) == []  # the actor waits on an empty mailbox now
        reply = _future()
        assert system.deliver("k", Add(1), reply)
        assert reply.done() and reply.result() == 1  # handled before deliver returned
        who = _future()
        system.deliver("k", Who(), who)
        assert who.result() == f"keeper {Keeper.instances[-1]}"  # the context its on_start set
        assert WHO.get() == "nobody"  # and not the caller's


async def test_a_busy_actor_gets_delivered_messages_in_order_after_the_current_one() -> None:
    Keeper.gate = asyncio.Event()
    async with ActorSystem() as system:
        ref = await system.spawn(Keeper, name="k")
        await ref.ask(Read())
        held = _future()
        system.deliver("k", Hold(), held)  # async handler: through the mailbox
        replies = [_future() for _ in range(5)]
        for i, reply in enumerate(replies):
            assert system.deliver("k", Add(i), reply)
        assert not any(reply.done() for reply in replies)  # queued behind the held message
        Keeper.gate.set()
        assert await held == "released"
        assert [await reply for reply in replies] == [1, 2, 3, 4, 5]
        late = _future()
        system.deliver("k", Add(5), late)
        assert late.result() == 6
        assert await ref.ask(Read()) == [0, 1, 2, 3, 4, 5]


async def test_a_failing_tell_at_delivery_restarts_the_actor_before_its_next_message() -> None:
    Keeper.instances = []
    async with ActorSystem() as system:
        ref = await system.spawn(Keeper, name="k")
        await ref.ask(Add(7))
        failed = _future()
        system.deliver("k", Boom("in an ask"), failed)  # an ask: the error goes back, no restart
        with pytest.raises(RuntimeError, match="in an ask"):
            failed.result()
        assert len(Keeper.instances) == 1
        assert system.deliver("k", Boom("in a tell"), None)
        after = _future()
        assert system.deliver("k", Add(8), after)
        assert not after.done()  # waits for the supervisor's decision, not for the failed instance
        assert await after == 1  # a fresh instance: empty before 8
        assert len(Keeper.instances) == 2
        assert system.restart_count == 1


async def test_frames_are_handled_as_parsed_and_a_paused_connection_keeps_order() -> None:
    """Both ends hand frames on as aiohttp parses them; a mailbox full past ``overflow_size``
    pauses reading (the read loop takes over, then the parser again) without losing or reordering."""
    Keeper.gate = asyncio.Event()
    settings = RemoteSettings(overflow_size=4)
    async with ActorSystem() as server, WebSocketTransport(server, settings=settings) as node:
        await server.spawn(Keeper, name="k", mailbox_size=2)
        async with ActorSystem() as client, WebSocketTransport(client, settings=settings) as dialer:
            ref = client.ref(f"k@{node.address}")
            assert await ref.ask(Add(-1)) == 1
            await ref.tell(Hold())  # the actor waits on the gate from now on
            for i in range(300):
                await ref.tell(Add(i))
            read = asyncio.ensure_future(ref.ask(Read(), timeout=50))
            await asyncio.sleep(0.2)  # no assertion on timing: give the frames time to pile up
            assert not read.done()
            Keeper.gate.set()
            assert await read == [-1, *range(300)]
            hooked = [conn for conn in (*node._connections, *dialer._connections) if conn._queue is not None]
            assert len(hooked) == 2, "aiohttp's parser could not be hooked on both ends"
