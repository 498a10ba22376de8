"""Multi-process clusters on loopback: forming, asking across nodes, failing, rejoining."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from dniasync import ActorStopped, ActorSystem, ActorUnreachable
from dniasync.node import GetMembers, Members, NodeStatus, NodeStatusReply
from dniasync.node.demo import Forward, Ping
from dniasync.remote import RemoteSettings, WebSocketTransport

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")
ECHO = "dniasync.node.demo:Echo=echo"
RELAY = "dniasync.node.demo:Relay=relay"


@asynccontextmanager
async def observer(token: bytes | None = None, detect_s: float = 3.0) -> AsyncIterator[ActorSystem]:
    """This test process as one more node (not a member): it asks, it watches."""
    settings = RemoteSettings(heartbeat_s=min(0.5, detect_s / 3), detect_s=detect_s)
    async with ActorSystem() as system, WebSocketTransport(system, token=token, settings=settings):
        yield system


async def eventually(probe: Callable[[], Awaitable[T]], ok: Callable[[T], bool], timeout: float = 15.0) -> T:
    """Poll ``probe`` until ``ok`` holds or the deadline passes (then fail with the last value)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = await probe()
            if ok(last):
                return last  # type: ignore[no-any-return]
        except (ActorStopped, TimeoutError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached in {timeout} s; last: {last!r}")
        await asyncio.sleep(0.1)


def alive(members: Members) -> set[str]:
    return set(members.alive())


async def test_three_nodes_form_a_cluster_and_actors_ask_across_nodes(start_node: Any) -> None:
    coord = start_node("--role", "coordinator")
    w1 = start_node("--role", "worker", "--join", coord.address, "--spawn", RELAY)
    w2 = start_node("--role", "ps", "--join", coord.address, "--spawn", ECHO)
    async with observer() as system:
        members = await eventually(
            lambda: system.ref(f"coordinator@{coord.address}").ask(GetMembers(), timeout=5),
            lambda m: alive(m) == {coord.address, w1.address, w2.address},
        )
        assert {m.node: m.role for m in members.members} == {
            coord.address: "coordinator",
            w1.address: "worker",
            w2.address: "ps",
        }
        echo = system.ref(f"echo@{w2.address}")
        assert await echo.ask(Ping(41), timeout=5) == 42
        # an actor on w1 asks one on w2 through a ref that travelled inside the message
        assert await system.ref(f"relay@{w1.address}").ask(Forward(echo, 9), timeout=5) == 10
        # the coordinator told w1 about w2 joining
        status: NodeStatusReply = await eventually(
            lambda: system.ref(f"node@{w1.address}").ask(NodeStatus(), timeout=5),
            lambda s: {m.node for m in s.members if m.alive} >= {w2.address, coord.address},
        )
        assert status.role == "worker" and status.peers[w2.address] == "up"


async def test_killed_node_is_detected_others_carry_on_and_it_rejoins(start_node: Any) -> None:
    coord = start_node("--role", "coordinator", "--detect-s", "2")
    w1 = start_node("--role", "worker", "--join", coord.address, "--spawn", RELAY, "--spawn", ECHO, "--detect-s", "2")
    w2 = start_node("--role", "worker", "--join", coord.address, "--spawn", ECHO, "--detect-s", "2")
    async with observer(detect_s=2.0) as system:
        coordinator = system.ref(f"coordinator@{coord.address}")
        await eventually(lambda: coordinator.ask(GetMembers(), timeout=5), lambda m: len(alive(m)) == 3)
        relay = system.ref(f"relay@{w1.address}")
        echo2 = system.ref(f"echo@{w2.address}")
        assert await relay.ask(Forward(echo2, 1), timeout=5) == 2
        first_incarnation = (await system.ref(f"node@{w2.address}").ask(NodeStatus(), timeout=5)).incarnation

        w2.signal(signal.SIGKILL)
        killed = time.monotonic()
        # an ask from w1 to the dead node fails fast with a typed error, not a timeout
        with pytest.raises(ActorUnreachable):
            for _ in range(100):
                await relay.ask(Forward(echo2, 1, timeout=30.0), timeout=30)
                await asyncio.sleep(0.05)
        assert time.monotonic() - killed < 2.0 + 1.0
        # the others carry on, and learn of the departure
        assert await system.ref(f"echo@{w1.address}").ask(Ping(5), timeout=5) == 6
        await eventually(lambda: coordinator.ask(GetMembers(), timeout=5), lambda m: w2.address not in alive(m))
        await eventually(
            lambda: system.ref(f"node@{w1.address}").ask(NodeStatus(), timeout=5),
            lambda s: w2.address not in {m.node for m in s.members if m.alive},
        )

        w2b = start_node("--role", "worker", "--join", coord.address, "--listen", w2.address, "--spawn", ECHO)
        assert w2b.address == w2.address
        members = await eventually(lambda: coordinator.ask(GetMembers(), timeout=5), lambda m: len(alive(m)) == 3)
        assert members.alive()[w2.address].incarnation != first_incarnation
        # w1 reconnects (jittered backoff) and talks to the restarted node again
        assert await eventually(lambda: relay.ask(Forward(echo2, 7, timeout=2.0), timeout=5), lambda r: r == 8) == 8


async def test_silent_peer_is_declared_down_by_heartbeats(start_node: Any) -> None:
    node = start_node("--role", "coordinator", "--spawn", ECHO)
    async with observer(detect_s=1.0) as system:
        echo = system.ref(f"echo@{node.address}")
        assert await echo.ask(Ping(1), timeout=5) == 2
        node.signal(signal.SIGSTOP)  # alive to the kernel, silent to us: a partition
        try:
            started = time.monotonic()
            with pytest.raises(ActorUnreachable):
                await echo.ask(Ping(1), timeout=30)
            assert time.monotonic() - started < 1.0 + 0.8
            with pytest.raises(ActorUnreachable):  # while down, asks fail at once
                await echo.ask(Ping(1), timeout=30)
            assert not echo.is_alive
        finally:
            node.signal(signal.SIGCONT)
        # back from the partition: the observer reconnects with backoff
        assert await eventually(lambda: echo.ask(Ping(2), timeout=2), lambda r: r == 3) == 3


async def test_sigterm_leaves_the_cluster_and_exits_zero(start_node: Any) -> None:
    coord = start_node("--role", "coordinator")
    worker = start_node("--role", "worker", "--join", coord.address)
    worker.wait_for_line("joined the cluster")
    async with observer() as system:
        coordinator = system.ref(f"coordinator@{coord.address}")
        await eventually(lambda: coordinator.ask(GetMembers(), timeout=5), lambda m: worker.address in alive(m))
        worker.signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.proc.wait, 10) == 0
        members = await eventually(
            lambda: coordinator.ask(GetMembers(), timeout=5), lambda m: worker.address not in {x.node for x in m.members}
        )
        assert alive(members) == {coord.address}
        assert "could not tell the coordinator" not in worker.stderr()


def run_cli(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dniasync.node", *args], capture_output=True, text=True, timeout=timeout
    )


def test_help_documents_every_option() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for option in ("--role", "--listen", "--join", "--token-file", "--config", "--spawn", "--detect-s", "coordinator"):
        assert option in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--role", "gardener"], "invalid choice"),
        ([], "--role is required"),
        (["--role", "worker"], "needs --join"),
        (["--role", "coordinator", "--listen", "nohost"], "HOST:PORT"),
        (["--role", "coordinator", "--listen", "0.0.0.0:7000"], "without a cluster token"),
        (["--role", "coordinator", "--token-file", "/nonexistent/token"], "token-file"),
        (["--role", "coordinator", "--spawn", "dniasync.node.demo:Ping"], "not an Actor"),
        (["--role", "coordinator", "--detect-s", "0.1"], "heartbeat_s < detect_s"),
        (["--role", "coordinator", "--config", "/nonexistent.toml"], "cannot read config"),
    ],
)
def test_bad_arguments_give_a_clear_message_and_status_2(args: list[str], message: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_config_file_supplies_options_and_unknown_keys_are_refused(tmp_path: Path, start_node: Any) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[node]\nrole = "coordinator"\nlisten_on = "127.0.0.1:0"\n')
    result = run_cli("--config", str(bad))
    assert result.returncode == 2 and "unknown key node.listen_on" in result.stderr
    good = tmp_path / "node.toml"
    good.write_text('[node]\nrole = "coordinator"\nspawn = ["dniasync.node.demo:Echo=echo"]\n')
    node = start_node("--config", str(good))
    node.wait_for_line("coordinator listening")


def test_port_in_use_is_a_runtime_error(start_node: Any) -> None:
    first = start_node("--role", "coordinator")
    result = run_cli("--role", "coordinator", "--listen", first.address)
    assert result.returncode == 1 and "cannot listen" in result.stderr
