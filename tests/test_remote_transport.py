"""Two nodes in one process over real loopback sockets: semantics of remote refs."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from dniasync import Actor, ActorNotFound, ActorRef, ActorSystem, ActorUnreachable, AskTimeout, handler, message
from dniasync.remote import DecodeError, RemoteError, RemoteSettings, WebSocketTransport

pytestmark = pytest.mark.timeout(30)


@message("test.transport.Note")
@dataclass(frozen=True)
class Note:
    seq: int
    blob: np.ndarray | None = None


@message("test.transport.Read")
@dataclass(frozen=True)
class Read:
    pass


@message("test.transport.Boom")
@dataclass(frozen=True)
class Boom:
    text: str


@message("test.transport.Grad")
@dataclass(frozen=True)
class Grad:
    values: torch.Tensor
    sender: ActorRef


class Recorder(Actor):
    def __init__(self) -> None:
        self.seen: list[int] = []

    @handler
    def note(self, msg: Note) -> None:
        self.seen.append(msg.seq)

    @handler
    def read(self, msg: Read) -> list[int]:
        return self.seen

    @handler
    def boom(self, msg: Boom) -> None:
        raise ValueError(msg.text)

    @handler
    def grad(self, msg: Grad) -> tuple[torch.Tensor, ActorRef]:
        return msg.values * 2, msg.sender


class Unsendable:
    pass


@message("test.transport.Nap")
@dataclass(frozen=True)
class Nap:
    seconds: float


class Sleeper(Actor):
    @handler
    async def nap(self, msg: Nap) -> float:
        await asyncio.sleep(msg.seconds)
        return msg.seconds


class Sloppy(Actor):
    @handler
    def read(self, msg: Read) -> Unsendable:
        return Unsendable()


@asynccontextmanager
async def two_nodes(**settings: float) -> AsyncIterator[tuple[WebSocketTransport, WebSocketTransport]]:
    config = RemoteSettings(**settings)  # type: ignore[arg-type]
    async with AsyncExitStack() as stack:
        nodes = []
        for _ in range(2):
            system = await stack.enter_async_context(ActorSystem())
            nodes.append(await stack.enter_async_context(WebSocketTransport(system, settings=config)))
        yield nodes[0], nodes[1]


async def test_tells_and_asks_between_two_actors_keep_their_order_around_big_tensors() -> None:
    async with two_nodes() as (a, b):
        await b.system.spawn(Recorder, name="rec", mailbox_size=8)  # small: forces the overflow path
        rec = a.system.ref(f"rec@{b.address}")
        big = np.ones(3_000_000, dtype=np.float32)  # 12 MB: streamed in parts
        for seq in range(200):
            await rec.tell(Note(seq, big if seq % 50 == 7 else None))
            if seq % 20 == 0:
                rec.tell_nowait(Note(-1))
        seen = await rec.ask(Read(), timeout=10)
        assert [s for s in seen if s >= 0] == list(range(200))


async def test_small_messages_overtake_a_big_one_in_flight() -> None:
    async with two_nodes() as (a, b):
        await b.system.spawn(Recorder, name="rec")
        rec = a.system.ref(f"rec@{b.address}")
        big = asyncio.create_task(rec.tell(Note(0, np.ones(32 << 20, dtype=np.uint8))))
        await asyncio.sleep(0)  # the big tell has started writing its parts
        await rec.tell(Note(1))
        await big
        seen = await rec.ask(Read(), timeout=10)
        assert seen == [1, 0], "the small tell waited behind the 32 MiB one"


@message("test.transport.BigRead")
@dataclass(frozen=True)
class BigRead:
    nbytes: int


@message("test.transport.Poke")
@dataclass(frozen=True)
class Poke:
    to: ActorRef
    seq: int


class Holder(Actor):
    """Answers a :class:`BigRead` with that many bytes; a :class:`Poke` makes it tell ``to`` a small :class:`Note`."""

    @handler
    def big_read(self, msg: BigRead) -> np.ndarray:
        return np.ones(msg.nbytes, dtype=np.uint8)

    @handler
    async def poke(self, msg: Poke) -> None:
        await msg.to.tell(Note(msg.seq))


async def test_small_messages_overtake_a_big_reply_in_flight() -> None:
    """A big reply is written as a big tell is: what the replying node sends meanwhile goes between its parts (a
    stage's weights for an evaluation held up the stage's small messages for the whole transfer on a slow link)."""
    async with two_nodes(shm=False) as (a, b):  # through the socket: no shared-memory ring takes the payload
        await b.system.spawn(Holder, name="holder")
        rec = await a.system.spawn(Recorder, name="rec")
        holder = a.system.ref(f"holder@{b.address}")
        await holder.ask(Poke(rec, -1), timeout=10)  # connected both ways; its note came before the answer
        assert await rec.ask(Read(), timeout=10) == [-1]
        back = b.system.ref(f"rec@{a.address}")
        asked = asyncio.create_task(holder.ask(BigRead(256 << 20), timeout=30))
        async with asyncio.timeout(10):
            while not back.unsent_bytes():  # the reply is on its way: queued or being written
                await asyncio.sleep(0)
        await holder.tell(Poke(rec, 1))  # the holder tells rec a small note behind the reply
        assert (await asked).nbytes == 256 << 20
        rec.tell_nowait(Note(0))
        seen = await rec.ask(Read(), timeout=10)
        assert seen == [-1, 1, 0], "the small tell waited behind the 256 MiB reply"


async def test_tensors_and_refs_round_trip_through_an_ask() -> None:
    async with two_nodes() as (a, b):
        await b.system.spawn(Recorder, name="rec")
        me = await a.system.spawn(Recorder, name="me")
        doubled, sender = await a.system.ref(f"rec@{b.address}").ask(Grad(torch.arange(4.0), me), timeout=5)
        assert torch.equal(doubled, torch.tensor([0.0, 2.0, 4.0, 6.0]))
        assert sender == me and sender.is_alive  # a ref to a local actor resolves to it


async def test_remote_failures_come_back_as_typed_errors() -> None:
    async with two_nodes() as (a, b):
        await b.system.spawn(Recorder, name="rec")
        await b.system.spawn(Sloppy, name="sloppy")
        with pytest.raises(RemoteError) as info:
            await a.system.ref(f"rec@{b.address}").ask(Boom("lr too high"), timeout=5)
        assert info.value.remote_type == "ValueError" and "lr too high" in str(info.value)
        with pytest.raises(ActorNotFound):
            await a.system.ref(f"nobody@{b.address}").ask(Read(), timeout=5)
        with pytest.raises(RemoteError, match="TypeError"):
            await a.system.ref(f"sloppy@{b.address}").ask(Read(), timeout=5)
        with pytest.raises(TypeError, match="not a registered message"):
            await a.system.ref(f"rec@{b.address}").ask(Unsendable(), timeout=5)


async def test_message_with_wrong_field_types_gets_a_decode_error_and_the_connection_survives() -> None:
    async with two_nodes() as (a, b):
        await b.system.spawn(Recorder, name="rec")
        rec = a.system.ref(f"rec@{b.address}")
        with pytest.raises(DecodeError, match="test.transport.Note.seq"):
            await rec.ask(Note("seven"), timeout=5)  # type: ignore[arg-type]
        assert b.counters.decode_errors == 1
        await rec.tell(Note(3))
        assert await rec.ask(Read(), timeout=5) == [3]


async def test_down_peer_fails_asks_at_once_and_counts_dropped_tells() -> None:
    async with two_nodes(heartbeat_s=0.1, detect_s=0.5, backoff_max_s=0.5) as (a, b):
        await b.system.spawn(Recorder, name="rec")
        rec = a.system.ref(f"rec@{b.address}")
        await rec.ask(Read(), timeout=5)
        events: list[tuple[str, bool]] = []
        a.add_peer_listener(lambda node, up, why: events.append((node, up)))
        await b.close()
        for _ in range(50):
            if not rec.is_alive:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(ActorUnreachable):
            await rec.ask(Read(), timeout=30)
        await rec.tell(Note(1))
        rec.tell_nowait(Note(2))
        assert a.counters.dropped_tells == 2
        assert events == [(b.address, False)]
        assert a.peer_states()[b.address] == "down"


async def test_nodes_dialing_each_other_at_once_settle_on_one_connection() -> None:
    async with two_nodes() as (a, b):
        await a.system.spawn(Recorder, name="rec")
        await b.system.spawn(Recorder, name="rec")
        to_b, to_a = a.system.ref(f"rec@{b.address}"), b.system.ref(f"rec@{a.address}")
        for seq in range(20):
            await asyncio.gather(to_b.tell(Note(seq)), to_a.tell(Note(seq)))
        assert await to_b.ask(Read(), timeout=5) == list(range(20))
        assert await to_a.ask(Read(), timeout=5) == list(range(20))
        await asyncio.sleep(1.2)  # the losing connection is retired after a grace period
        assert a.peer_states() == {b.address: "up"} and b.peer_states() == {a.address: "up"}
        assert len(a._connections) == 1 and len(b._connections) == 1


def test_refuses_to_listen_beyond_loopback_without_a_token() -> None:
    with pytest.raises(ValueError, match="without a cluster token"):
        WebSocketTransport(ActorSystem(), "0.0.0.0:0")


async def test_a_peer_gone_for_good_is_forgotten_and_dialed_afresh_when_referenced() -> None:
    async with two_nodes(heartbeat_s=0.1, detect_s=0.5, backoff_min_s=0.05, backoff_max_s=0.1, give_up_s=0.5) as (a, b):
        await b.system.spawn(Recorder, name="rec")
        rec = a.system.ref(f"rec@{b.address}")
        await rec.ask(Read(), timeout=5)
        await b.close()
        for _ in range(60):
            if b.address not in a.peer_states():
                break
            await asyncio.sleep(0.05)
        assert b.address not in a.peer_states()
        with pytest.raises(ActorUnreachable, match="unreachable"):
            await rec.ask(Read(), timeout=5)


async def test_remote_asks_time_out_with_ask_timeout_and_late_replies_are_ignored() -> None:
    async with two_nodes() as (a, b):
        await b.system.spawn(Sleeper, name="sleeper")
        sleeper = a.system.ref(f"sleeper@{b.address}")
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(AskTimeout):
            await sleeper.ask(Nap(0.5), timeout=0.15)
        assert 0.15 <= loop.time() - started < 0.4
        assert await sleeper.ask(Nap(0.0), timeout=5) == 0.0  # the late reply to the first ask was dropped
        assert a.peer_states() == {b.address: "up"}


async def test_refs_to_malformed_nodes_are_refused() -> None:
    async with two_nodes() as (a, _):
        for address in ("x@nohost", "x@evil.example/path:80", "x@host:99999", "x@a b:1"):
            with pytest.raises(ValueError):
                a.system.ref(address)


async def test_unsent_bytes_count_what_is_on_its_way_and_fall_to_zero_once_the_peer_took_it() -> None:
    async with two_nodes(shm=False) as (a, b):  # through the socket: no shared-memory ring takes the payloads
        await b.system.spawn(Recorder, name="rec")
        rec = a.system.ref(f"rec@{b.address}")
        await rec.ask(Read(), timeout=10)  # connected
        big = np.ones(1 << 20, dtype=np.float32)  # 4 MB: streamed in parts by the connection's send loop
        for seq in range(3):
            rec.tell_nowait(Note(seq, big))
        # nothing can have been written yet: this coroutine has not yielded since
        assert rec.unsent_bytes() >= 3 * big.nbytes
        assert await rec.ask(Read(), timeout=10) == [0, 1, 2]
        async with asyncio.timeout(10):  # taken and acknowledged: the kernel's queue empties too
            while rec.unsent_bytes():
                await asyncio.sleep(0.01)
        local = await a.system.spawn(Recorder, name="here")
        local.tell_nowait(Note(0))
        assert local.unsent_bytes() == 0  # a local actor's messages go straight to its mailbox
        nowhere = a.system.ref(f"rec@{b.address.rsplit(':', 1)[0]}:1")  # a node never sent to
        assert nowhere.unsent_bytes() == 0


async def test_silent_for_counts_from_the_last_frame_of_the_node_and_is_infinite_without_a_connection() -> None:
    async with two_nodes() as (a, b):
        await b.system.spawn(Recorder, name="rec")
        rec = a.system.ref(f"rec@{b.address}")
        nowhere = a.system.ref(f"rec@{b.address.rsplit(':', 1)[0]}:1")  # a node never sent to
        assert nowhere.silent_for() == math.inf
        local = await a.system.spawn(Recorder, name="here")
        assert local.silent_for() == 0.0
        before = time.monotonic()
        assert await rec.ask(Read(), timeout=10) == []
        # the reply came after `before`: the node was heard from since (the loop clock may be a tick coarse)
        assert 0.0 <= rec.silent_for() <= time.monotonic() - before + 0.05
        await b.close()
        async with asyncio.timeout(10):  # its connection is gone: nothing can be heard from it
            while rec.silent_for() != math.inf:
                await asyncio.sleep(0.01)
