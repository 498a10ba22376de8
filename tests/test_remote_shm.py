"""The same-host shared-memory payload path, between real processes.

Run as a script, this file is the other process: ``mirror`` serves a
``Mirror`` actor (answers a ``Blob`` with itself, records what it was told);
``send ADDR`` also asks ``mirror@ADDR`` big blobs, then waits to be killed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from dniasync import Actor, ActorSystem, handler, message
from dniasync.remote import RemoteSettings, WebSocketTransport
from dniasync.remote._shm import PeerRing, SendRing, available, host_identity

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not available(), reason="no memfd or boot id on this platform"),
]

SCRIPT = str(Path(__file__).resolve())
DEADLINE_S = 60.0
RING_TAG = "dniasync-ring"


@message("test.shm.Blob")
@dataclass(frozen=True)
class Blob:
    seq: int
    data: np.ndarray
    extra: torch.Tensor | None = None


@message("test.shm.Record")
@dataclass(frozen=True)
class Record:
    pass


class Mirror(Actor):
    def __init__(self) -> None:
        self.told: list[tuple[int, str]] = []

    @handler
    def blob(self, msg: Blob) -> Blob:
        self.told.append((msg.seq, digest(msg.data)))
        return msg

    @handler
    def record(self, msg: Record) -> list[tuple[int, str]]:
        return self.told


def digest(data: np.ndarray) -> str:
    return hashlib.sha256(data.tobytes()).hexdigest()


def blobs() -> list[Blob]:
    """Payloads below, at and far above the threshold; odd sizes, several dtypes, two tensors."""
    rng = np.random.default_rng(7)
    return [
        Blob(0, rng.standard_normal(1000).astype(np.float32)),
        Blob(1, rng.integers(0, 255, (64 << 10) + 3, dtype=np.uint8)),
        Blob(2, rng.standard_normal((513, 1031)), torch.randn(300_001).to(torch.bfloat16)),
        Blob(3, rng.integers(-(1 << 40), 1 << 40, 1 << 20, dtype=np.int64), torch.arange(7)),
        Blob(4, rng.standard_normal(3 << 20).astype(np.float32)),
    ]


def same(a: Blob, b: Blob) -> bool:
    if a.seq != b.seq or a.data.dtype != b.data.dtype or a.data.shape != b.data.shape:
        return False
    if a.data.tobytes() != b.data.tobytes():
        return False
    if a.extra is None or b.extra is None:
        return a.extra is None and b.extra is None
    return a.extra.dtype == b.extra.dtype and a.extra.view(torch.uint8).equal(b.extra.view(torch.uint8))


# -- the other process ------------------------------------------------------------------


@contextmanager
def child(*args: str, prefix: tuple[str, ...] = ()) -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = subprocess.Popen([*prefix, sys.executable, SCRIPT, *args], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on "), f"child said {line!r}"
        yield proc, line.split()[-1]
    finally:
        proc.kill()
        proc.wait()


@asynccontextmanager
async def node(**settings: object) -> AsyncIterator[WebSocketTransport]:
    config = RemoteSettings(**settings)  # type: ignore[arg-type]
    async with ActorSystem() as system, WebSocketTransport(system, settings=config) as t:
        yield t


def ring_mappings(pid: int | str = "self") -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if RING_TAG in line]


def ring_descriptors(pid: int | str = "self") -> list[str]:
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return [link for link in links if RING_TAG in link]


def dev_shm() -> set[str]:
    """The files in ``/dev/shm`` named as the transport names its rings (which are memfds, so there should be none).

    Only those: tests in other files run beside this one, and their jobs' Hogwild stores come and go in
    ``/dev/shm`` meanwhile.
    """
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {name for name in names if RING_TAG in name}


async def until(condition: object, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while not condition():  # type: ignore[operator]
        assert loop.time() < deadline, f"still not {what} after {DEADLINE_S} s"
        await asyncio.sleep(0.05)


# -- tests --------------------------------------------------------------------------------


async def test_shared_memory_and_socket_deliver_identical_bytes() -> None:
    with child("mirror") as (_, address):
        for shm in (True, False):
            async with node(shm=shm) as t:
                mirror = t.system.ref(f"mirror@{address}")
                await mirror.ask(Blob(-1, np.zeros(1)), timeout=30)  # after it, both rings are settled
                for blob in blobs():
                    back = await mirror.ask(blob, timeout=30)
                    assert same(back, blob), f"blob {blob.seq} came back different (shm={shm})"
                c = t.counters
                if shm:  # blobs 1-4 each way through the rings, blob 0 (4 KB) on the socket
                    assert c.shm_frames_out == 4 and c.shm_frames_in == 4, c
                else:
                    assert c.shm_frames_out == 0 and c.shm_frames_in == 0, c
                    assert t.peer(address).conn is not None and t.peer(address).conn.ring is None


async def test_a_full_ring_falls_back_to_the_socket_without_losing_or_reordering() -> None:
    with child("mirror") as (_, address):
        async with node(shm_ring_bytes=1 << 20) as t:  # payloads of 150 KB: six fill it
            mirror = t.system.ref(f"mirror@{address}")
            await mirror.ask(Blob(-1, np.zeros(1)), timeout=30)
            rng = np.random.default_rng(3)
            sent = [Blob(seq, rng.integers(0, 255, 150_000, dtype=np.uint8)) for seq in range(60)]
            for blob in sent[:30]:  # in one go: nothing the peer frees can arrive in between
                mirror.tell_nowait(blob)
            for blob in sent[30:]:  # waiting for room when the ring is full
                await mirror.tell(blob)
            told = await mirror.ask(Record(), timeout=60)
            assert [seq for seq, _ in told] == [-1, *range(60)]
            assert [digest for _, digest in told[1:]] == [digest(b.data) for b in sent]
            assert t.counters.shm_fallbacks >= 1 and t.counters.shm_frames_out >= 6, t.counters


@pytest.mark.parametrize("killed", ["listener", "dialer"])
async def test_a_sigkilled_peer_leaves_no_shared_memory(killed: str) -> None:
    before = dev_shm()
    async with node() as t:
        await t.system.spawn(Mirror, name="mirror")
        args = ("mirror",) if killed == "listener" else ("send", t.address)
        with child(*args) as (proc, address):
            if killed == "listener":
                mirror = t.system.ref(f"mirror@{address}")
                for blob in blobs():
                    await mirror.ask(blob, timeout=30)
            else:
                assert proc.stdout is not None
                said = await asyncio.to_thread(proc.stdout.readline)  # this loop must serve it meanwhile
                assert said.strip() == "sent"
            assert t.counters.shm_frames_in + t.counters.shm_frames_out >= 4
            assert len(ring_mappings()) == 2 and len(ring_mappings(proc.pid)) == 2  # a ring each way
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            await until(lambda: t.peer_states().get(address) == "down", "down")
            await until(lambda: not ring_mappings(), "unmapped")
            assert ring_descriptors() == []
    assert dev_shm() == before


async def test_a_peer_that_cannot_open_the_ring_gets_everything_by_socket() -> None:
    """A child in its own pid namespace: same boot id, but neither side can reach the other's ring."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"]).returncode:
        pytest.skip("cannot make a pid namespace here")
    with child("mirror", prefix=("unshare", "--pid", "--fork", "--mount-proc", "--kill-child")) as (_, address):
        async with node() as t:
            mirror = t.system.ref(f"mirror@{address}")
            await mirror.ask(Blob(-1, np.zeros(1)), timeout=30)
            for blob in blobs():
                assert same(await mirror.ask(blob, timeout=30), blob)
            conn = t.peer(address).conn
            assert conn is not None and conn.ring is None and conn.decoder.ring is None
            assert t.counters.shm_frames_out == 0 and t.counters.shm_frames_in == 0


def test_an_offer_from_another_host_or_with_a_wrong_nonce_is_refused(tmp_path: Path) -> None:
    ring = SendRing(1 << 20, "test")
    other = os.open(tmp_path / "not-a-ring", os.O_CREAT | os.O_RDWR)
    try:
        offer = ring.offer()
        host, boot = host_identity()
        for key, value, why in [
            ("boot", boot[::-1], "another host"),
            ("host", host + "-elsewhere", "another host"),
            ("nonce", "00" * 16, "nonce"),
            ("fd", other, "not a dniasync ring"),
            ("size", offer["size"] * 2, "another size"),
        ]:
            with pytest.raises(ValueError, match=why):
                PeerRing.open({**offer, key: value})
        opened = PeerRing.open(offer)
        opened.close()
    finally:
        os.close(other)
        ring.close()


def test_the_ring_never_overwrites_what_the_peer_has_not_released() -> None:
    ring = SendRing(1 << 12, "test")
    peer = PeerRing.open(ring.offer())
    try:
        payload = [bytes(range(256)) * 4]  # 1 KiB: the largest payload is half the ring (2 KiB)
        placed = [ring.place(payload, 1024) for _ in range(5)]
        assert all(p is not None for p in placed[:4]) and placed[4] is None
        offset, mark = placed[0]  # type: ignore[misc]
        assert bytes(peer.take(offset, 1024, mark)) == payload[0]
        assert ring.release(mark) and ring.place(payload, 1024) is not None
        assert not ring.release(mark - 1) and not ring.release(ring.head + 1)
    finally:
        peer.close()
        ring.close()


# -- script mode ----------------------------------------------------------------------


async def _serve(args: list[str]) -> None:
    async with ActorSystem() as system, WebSocketTransport(system) as t:
        await system.spawn(Mirror, name="mirror")
        print(f"listening on {t.address}", flush=True)
        if args[0] == "send":
            mirror = system.ref(f"mirror@{args[1]}")
            for blob in blobs():
                await mirror.ask(blob, timeout=30)
            print("sent", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    from dniasync.runtime import run

    run(_serve(sys.argv[1:]))
