"""Replicated PS shards (``[downpour] ps_replicas``): chain replication loses no acknowledged push.

In one process first (exact counts: the copies are actors, a copy's death is
its actor stopping, the views are sent by hand), then a real job through the
launcher whose head copy is killed with SIGKILL mid-run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from _jobs import trained_log
from _observability import fetch
from dniasync import ActorSystem
from dniasync.actors import ActorRef
from dniasync.cluster.chains import SPARE_HOST, ChainKeeper, copies_placed
from dniasync.cluster.protocol import Assignment, JoinJob, NoJob
from dniasync.train.chain import ChainView, CopySpec
from dniasync.train.messages import Params, Pull, Push, ShardStats
from dniasync.train.ps_chain import CatchingUp, ChainShard
from dniasync.train.specs import OptimizerSpec, ShardSpec
from dniasync.train.sync.chain import ChainRoute

N = 8


def push(seq: int, grad: float, *, replica: str = "r0") -> Push:
    values = np.linspace(grad, 2 * grad, N, dtype=np.float32)
    return Push(replica, 1, seq, 0, "none", values.view(np.uint8), 32)


async def spawn_copy(system: ActorSystem, copy: int, *, joining: bool = False, optimizer: str = "adagrad") -> ActorRef:
    spec = ShardSpec(0, 0, np.zeros(N, np.float32), OptimizerSpec(optimizer, 0.1))
    return await system.spawn(ChainShard, CopySpec(spec, copy, joining), name=f"ps-0-{copy}")


async def view(number: int, chain: list[ActorRef], joining: list[ActorRef] | None = None) -> None:
    """Install a view the way the job runner does: joining copies first."""
    joining = joining or []
    msg = ChainView(0, number, chain, [ref.address for ref in joining])
    for ref in [*joining, *(r for r in chain if r not in joining)]:
        assert await ref.ask(msg)


async def stats(ref: ActorRef) -> dict[str, Any]:
    reply: dict[str, Any] = await ref.ask(ShardStats())
    return reply


async def params(ref: ActorRef) -> Params:
    reply: Params = await ref.ask(Pull())
    return reply


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])  # Adam: a joining copy continues the step count
async def test_every_copy_applies_the_acknowledged_pushes_in_one_order_and_a_dead_copy_loses_none(
    optimizer: str,
) -> None:
    async with ActorSystem() as system:
        a, b, c = [await spawn_copy(system, j, optimizer=optimizer) for j in range(3)]
        await view(1, [a, b, c])
        routes = [ChainRoute(0, [a, b, c], replica=name) for name in ("r0", "r1")]

        async def train(route: ChainRoute, first: int, n: int) -> None:
            for seq in range(first, first + n):
                await route.push(push(seq, 0.01 * seq, replica=route.replica))

        # two replicas at once (the order matters to either rule): the same parameters on every copy, bit for bit
        await asyncio.gather(*(train(route, 1, 10) for route in routes))
        assert [(await stats(ref))["applied"] for ref in (a, b, c)] == [20, 20, 20]
        first = [await params(ref) for ref in (a, b, c)]
        assert len({p.version for p in first}) == 1
        for p in first[1:]:
            np.testing.assert_array_equal(p.values, first[0].values)

        # the middle copy dies: the push in flight is not acknowledged until the chain closes around it
        await system.stop(b)
        pending = asyncio.ensure_future(train(routes[0], 11, 1))
        while (await stats(a))["applied"] < 21:  # the head applied it; the copy after it is gone
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        assert not pending.done()
        await view(2, [a, c])
        await pending
        assert routes[0].sent_again == 1
        await asyncio.gather(train(routes[0], 12, 5), train(routes[1], 11, 5))
        assert sum(route.acknowledged for route in routes) == 31
        assert [(await stats(ref))["applied"] for ref in (a, c)] == [31, 31]  # each applied once
        assert (await stats(a))["rejected"]["duplicate"] == 0  # the push sent again was answered, not applied

        # a restarted copy joins at the tail: the old tail sends it its state, then pushes go on
        d = await spawn_copy(system, 3, joining=True, optimizer=optimizer)
        with pytest.raises(CatchingUp):
            await params(d)
        await view(3, [a, c, d], joining=[d])
        await asyncio.gather(train(routes[0], 17, 4), train(routes[1], 16, 4))
        assert (await stats(d))["applied"] == 8 and (await stats(c))["transfers"] == 1
        last = [await params(ref) for ref in (a, c, d)]
        assert len({p.version for p in last}) == 1 and last[0].version == first[0].version + 19
        for p in last[1:]:
            np.testing.assert_array_equal(p.values, last[0].values)
        assert all(route.regressions == 0 for route in routes)
        assert [(await stats(ref))["divergent"] for ref in (a, c, d)] == [0, 0, 0]


async def test_a_route_follows_the_newest_view_the_copies_hold() -> None:
    async with ActorSystem() as system:
        a, b = [await spawn_copy(system, j) for j in range(2)]
        await view(1, [a, b])
        route = ChainRoute(0, [a, b], replica="r0")
        await route.push(push(1, 0.5))
        await system.stop(a)  # the head dies; the runner names b alone
        await view(2, [b])
        await route.push(push(2, 0.5))
        await route.pull(Pull(), timeout=5.0)
        assert route.view.number == 2 and route.acknowledged == 2 and route.regressions == 0
        assert (await stats(b))["applied"] == 2


async def test_a_route_finds_a_copy_that_took_a_dead_ones_place_once_the_copies_it_started_with_are_gone() -> None:
    """A spare (or a copy back on a new address) in a dead copy's place: the replica learns of it from the views,
    and still finds the chain when it is the only copy left."""
    async with ActorSystem() as system:
        a, b = [await spawn_copy(system, j) for j in range(2)]
        await view(1, [a, b])
        route = ChainRoute(0, [a, b], replica="r0", give_up_s=5.0)
        await route.push(push(1, 0.5))
        await system.stop(a)
        await view(2, [b])
        c = await spawn_copy(system, 2, joining=True)
        await view(3, [b, c], joining=[c])
        await route.push(push(2, 0.5))  # its head is gone: it learns view 3 from b
        assert route.view.number == 3
        await system.stop(b)
        await view(4, [c])
        await route.push(push(3, 0.5))  # c, which it did not start with, is all that is left
        await route.pull(Pull(), timeout=5.0)
        assert route.view.number == 4 and route.acknowledged == 3 and route.regressions == 0
        assert (await params(c)).version == 3


class _Copy:
    """What the job runner's keeper uses of a copy's ref: its address, whether its node answers, and the views."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.is_alive = True
        self.views: list[ChainView] = []

    async def ask(self, msg: ChainView, timeout: float | None = None) -> bool:
        self.views.append(msg)
        return True


async def test_a_spare_takes_the_place_of_a_copy_whose_process_is_gone_and_joins_at_the_tail() -> None:
    """The keeper's side of ``--spares``: a spare waits (also when it asks before the PS processes), and takes the
    place of a copy only once the chain closed around it and it still does not answer."""
    events: list[tuple[str, dict[str, Any]]] = []
    spec = ShardSpec(0, 0, np.zeros(N, np.float32), OptimizerSpec("adagrad", 0.1))
    keeper = ChainKeeper([spec], lambda kind, **details: events.append((kind, details)), lost_after_s=20.0)
    spare, first, second = f"{SPARE_HOST}@127.0.0.1:9", "ps-host@127.0.0.1:1", "ps-host@127.0.0.1:2"
    copies = {member: _Copy(f"ps-0@{member.partition('@')[2]}") for member in (spare, first, second)}

    def join(member: str, incarnation: int = 1) -> Assignment | NoJob:
        return keeper.place(JoinJob(member, "ps", incarnation))

    async def ready(member: str) -> None:
        assert keeper.ready(member, [copies[member]])  # type: ignore[list-item]
        for _ in range(20):  # the views go out in tasks
            await asyncio.sleep(0)

    waiting = join(spare)
    assert isinstance(waiting, NoJob) and waiting.retry  # not one of the first copies, though it asked first
    for j, member in enumerate((first, second)):
        placed = join(member)
        assert isinstance(placed, Assignment) and placed.spec == CopySpec(spec, j)
        await ready(member)
    assert keeper.placed and isinstance(join(spare), NoJob)
    copies[first].is_alive = False
    assert isinstance(join(spare), NoJob)  # not yet cut out of its chain: nothing to take
    keeper.check(time.monotonic())
    taken = join(spare)
    assert isinstance(taken, Assignment) and taken.spec == CopySpec(spec, 0, joining=True)
    await ready(spare)
    view = keeper.views[0]
    assert view is not None and [ref.address for ref in view.chain] == ["ps-0@127.0.0.1:2", "ps-0@127.0.0.1:9"]
    assert view.joining == ["ps-0@127.0.0.1:9"] and copies[spare].views[-1] == view
    assert [kind for kind, _ in events] == ["ps_copy_down", "ps_chain", "ps_copy_replaced", "ps_chain",
                                            "ps_copy_joined"]
    assert events[2][1] == {"shard": 0, "copy": 0, "address": "ps-0@127.0.0.1:1", "member": spare}
    assert events[4][1]["member"] == spare and keeper.replaced == 1
    assert keeper.copies == [[copies[spare], copies[second]]]
    # the dead copy's process back on its address: every copy is hosted, so it waits as a spare in turn
    assert isinstance(join(first, incarnation=2), NoJob)
    # a copy cut out while frozen that answers again is not replaced: it rejoins its chain
    copies[second].is_alive = False
    keeper.check(time.monotonic())
    copies[second].is_alive = True
    assert isinstance(join(first, incarnation=2), NoJob)
    keeper.check(time.monotonic())
    view = keeper.views[0]
    assert view is not None and [ref.address for ref in view.chain] == ["ps-0@127.0.0.1:9", "ps-0@127.0.0.1:2"]


async def test_the_keeper_shows_each_copy_waiting_live_down_then_catching_up() -> None:
    """What the live page and the coordinator's metrics read of a chain (:meth:`ChainKeeper.chains`), copies as
    actors: waiting until named, both live, one down when its actor is gone, catching up once restarted until its
    predecessor's state has reached it, then live at the tail."""
    async with ActorSystem() as system:
        spec = ShardSpec(0, 0, np.zeros(N, np.float32), OptimizerSpec("adagrad", 0.1))
        keeper = ChainKeeper([spec], lambda kind, **details: None, lost_after_s=20.0)

        def shown() -> tuple[int, int, list[tuple[int, str]]]:
            [chain] = keeper.chains()
            return chain["view"], chain["length"], [(c["copy"], c["state"]) for c in chain["copies"]]

        async def host(j: int, incarnation: int) -> ActorRef:
            placed = keeper.place(JoinJob(f"ps-host-{j}@127.0.0.1:{j + 1}", "ps", incarnation))
            assert isinstance(placed, Assignment)
            ref = await system.spawn(ChainShard, placed.spec, name=f"ps-0-{j}-{incarnation}")
            assert keeper.ready(f"ps-host-{j}@127.0.0.1:{j + 1}", [ref])
            return ref

        async def settled(want: tuple[int, int, list[tuple[int, str]]]) -> None:
            for _ in range(500):  # the views go out in tasks
                if shown() == want:
                    return
                await asyncio.sleep(0.01)
            assert shown() == want

        assert shown() == (0, 0, [(0, "waiting"), (1, "waiting")])
        head, tail = await host(0, 1), await host(1, 1)
        await settled((1, 2, [(0, "live"), (1, "live")]))
        await system.stop(tail)
        while tail.is_alive:
            await asyncio.sleep(0.01)
        keeper.check(time.monotonic())
        assert shown() == (2, 1, [(0, "live"), (1, "down")])
        await host(1, 2)
        assert shown() == (3, 2, [(0, "live"), (1, "catching up")])
        await settled((3, 2, [(0, "live"), (1, "live")]))
        assert head.is_alive and keeper.changes == 2


# -- a real job ---------------------------------------------------------------------------------------------
JOB = """
[job]
name = "{name}"
mode = "downpour"
seed = 0
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"

[model.kwargs]
sizes = [784, 64, 10]

[data]
dataset = "mnist5k"
n_train = 4000
n_test = 1000
batch_size = 32

[optimizer]
name = "adagrad"
lr = 0.05

[downpour]
n_replicas = 2
n_ps_shards = 1
ps_replicas = 2

[stop]
max_epochs = {epochs}
max_seconds = 240

[eval]
every_seconds = 1.0
"""

TARGET = 0.85
"""Held-out accuracy the job reaches on mnist5k (plain Downpour: ~0.9 after 3 epochs at this lr)."""


def _copy_process(out: Path, *, shard: int, copy: int) -> tuple[str, int]:
    """(address, pid) of the process hosting ``copy`` of ``shard``, once the job trains (from the coordinator's
    placement log, as the chaos tool finds it)."""
    placed = copies_placed(trained_log(out / "logs" / "coordinator0.log"))
    address = next((a for a, where in placed.items() if where == (shard, copy)), None)
    assert address is not None, placed
    children = json.loads((out / "cluster.json").read_text())["children"]
    return address, next(int(c["pid"]) for c in children if c["role"] == "ps" and c["address"] == address)


def test_a_killed_head_copy_loses_no_acknowledged_push_and_the_job_reaches_its_target(tmp_path: Path) -> None:
    out = tmp_path / "chain"
    config = tmp_path / "chain.toml"
    config.write_text(JOB.format(name="chain", out=out, epochs=8))
    launcher = subprocess.Popen([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, pid = _copy_process(out, shard=0, copy=0)
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, stdout + stderr
    doc = json.loads((out / "summary.json").read_text())
    metrics = doc["metrics"]
    assert doc["stop_reason"] == "trained 8 epochs"
    assert doc["final_accuracy"] >= TARGET, doc["final_accuracy"]
    kinds = [e["kind"] for e in doc["events"]]
    assert kinds.count("ps_copy_down") == 1, kinds
    # nothing lost: every push a replica saw acknowledged is in the copy that lived through the run, once
    assert metrics["ps_acknowledged_pushes"] > 0
    assert metrics["ps_acknowledged_pushes"] == metrics["ps0_copy1_applied"], metrics
    assert metrics["ps0_copy1_divergent"] == 0
    worker_logs = "".join(p.read_text() for p in (out / "logs").glob("worker*.log"))
    assert "version went back" not in worker_logs  # pulls read the tail: versions never go back
    assert "failed for" not in worker_logs  # no push or pull gave up
    if metrics["ps0_copy1_transfers"]:  # the restarted copy took the state (when it came back before the job ended)
        assert "ps_copy_joined" in kinds
        assert metrics["ps0_copy0_version"] == metrics["ps0_copy1_version"]
        assert metrics["ps0_copy0_applied"] + metrics["ps0_copy1_transfers"] > 0
        assert metrics["ps0_copy0_divergent"] == 0


def test_the_chaos_tools_kill_ps_copy_loses_no_acknowledged_push(tmp_path: Path) -> None:
    """``python -m dniasync.chaos --faults kill_ps_copy`` against a real job: the copy it names dies, the job
    finishes, and every push a replica saw acknowledged is in the copies that hold the shard at the end."""
    out = tmp_path / "chaos"
    config = tmp_path / "chaos.toml"
    # the job runs to its time limit, whatever the machine's speed: the kill, half a second into training, lands in it
    config.write_text(JOB.format(name="chaos", out=out, epochs=100_000).replace("max_seconds = 240", "max_seconds = 12"))
    launcher = subprocess.Popen([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        chaos = subprocess.run(
            [sys.executable, "-m", "dniasync.chaos", "--job-dir", str(out), "--faults", "kill_ps_copy", "--count", "1",
             "--first", "0.5", "--settle-s", "1", "--seed", "3", "--wait", "120",
             "--report", str(tmp_path / "chaos.json")],
            capture_output=True, text=True, timeout=300,
        )
        stdout, stderr = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert chaos.returncode == 0, chaos.stderr
    assert launcher.returncode == 0, stdout + stderr
    [fault] = json.loads((tmp_path / "chaos.json").read_text())["faults"]
    assert fault["kind"] == "kill_ps_copy" and fault["shard"] == 0 and fault["copy"] in (0, 1), fault
    doc = json.loads((out / "summary.json").read_text())
    assert doc["stop_reason"] == "ran 12 s"
    down = [e for e in doc["events"] if e["kind"] == "ps_copy_down"]
    assert [e["shard"] for e in down] == [0], doc["events"]
    assert down[0]["address"].endswith("@" + fault["address"]), (down, fault)
    metrics = doc["metrics"]
    assert metrics["ps_acknowledged_pushes"] > 0
    assert metrics["ps_acknowledged_pushes_kept"] == metrics["ps_acknowledged_pushes"], metrics
    survivor = 1 - fault["copy"]
    assert metrics[f"ps0_copy{survivor}_in_chain"] == 1 and metrics[f"ps0_copy{survivor}_divergent"] == 0


def _shown(out: Path) -> tuple[dict[str, Any] | None, dict[int, tuple[int, list[tuple[int, str, str]]]],
                                dict[tuple[str, str], float]]:
    """What the coordinator shows of the job's chains now: on its live page the coordinator (address, epoch) and per
    shard (view, [(copy, node, state), ...] in chain order, then the copies out of it); on /metrics its chain and
    epoch gauges."""
    children = json.loads((out / "cluster.json").read_text())["children"]
    node = next(c["address"] for c in children if c["role"] == "coordinator")
    status = json.loads(fetch(f"http://{node}/api/status"))
    chains = {c["shard"]: (c["view"], [(p["copy"], p["address"], p["state"]) for p in c["copies"]])
              for c in status["ps_chains"]}
    exported = {(s.name, s.labels.get("shard", "")): s.value
                for family in text_string_to_metric_families(fetch(f"http://{node}/metrics"))
                for s in family.samples if s.name.startswith(("dniasync_ps_chain_", "dniasync_coordinator_"))}
    return status["coordinator"], chains, exported


def test_a_copy_frozen_past_the_detection_interval_rejoins_its_chain_when_it_wakes(tmp_path: Path) -> None:
    """SIGSTOP of a PS copy for longer than the failure detector's 3 s: the chain closes around it and the job goes
    on; once it answers again (the same process: nothing restarts it) it rejoins at the tail with the chain's state,
    so the shard has both copies again and nothing acknowledged is lost. Two shards: the other's chain is untouched;
    the coordinator's live page and metrics show both chains as they are."""
    out = tmp_path / "frozen"
    config = tmp_path / "frozen.toml"
    config.write_text(JOB.format(name="frozen", out=out, epochs=100_000).replace("max_seconds = 240", "max_seconds = 14")
                      .replace("n_ps_shards = 1", "n_ps_shards = 2"))
    launcher = subprocess.Popen([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        tail, pid = _copy_process(out, shard=0, copy=1)
        node = {where: address for address, where in copies_placed(trained_log(out / "logs" / "coordinator0.log")).items()}
        coordinator, chains, exported = _shown(out)
        assert coordinator is not None and coordinator["epoch"] == 1  # the first coordinator runs the job
        assert chains == {k: (1, [(0, node[k, 0], "live"), (1, node[k, 1], "live")]) for k in (0, 1)}, chains
        assert exported == {("dniasync_ps_chain_length", "0"): 2, ("dniasync_ps_chain_length", "1"): 2,
                            ("dniasync_ps_chain_view", "0"): 1, ("dniasync_ps_chain_view", "1"): 1,
                            ("dniasync_ps_chain_changes_total", ""): 0, ("dniasync_coordinator_epoch", ""): 1}, exported
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while "is down; the chain closes around it" not in (out / "logs" / "coordinator0.log").read_text():
            assert time.monotonic() < deadline, "the frozen copy was never missed"
            time.sleep(0.1)
        # shard 0's chain is its head alone (view 2), the frozen copy down; shard 1's is as it was
        _, chains, exported = _shown(out)
        assert chains == {0: (2, [(0, node[0, 0], "live"), (1, tail, "down")]),
                          1: (1, [(0, node[1, 0], "live"), (1, node[1, 1], "live")])}, chains
        assert exported == {("dniasync_ps_chain_length", "0"): 1, ("dniasync_ps_chain_length", "1"): 2,
                            ("dniasync_ps_chain_view", "0"): 2, ("dniasync_ps_chain_view", "1"): 1,
                            ("dniasync_ps_chain_changes_total", ""): 1, ("dniasync_coordinator_epoch", ""): 1}, exported
        os.kill(pid, signal.SIGCONT)
        stdout, stderr = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, stdout + stderr
    doc = json.loads((out / "summary.json").read_text())
    events = [e for e in doc["events"] if e["kind"] in ("ps_copy_down", "ps_copy_joined")]
    assert [(e["kind"], e["address"].rsplit("@", 1)[-1]) for e in events] == [
        ("ps_copy_down", tail), ("ps_copy_joined", tail)], doc["events"]
    metrics = doc["metrics"]
    assert metrics["ps0_copy0_in_chain"] == 1 and metrics["ps0_copy1_in_chain"] == 1, metrics
    assert metrics["ps0_copy1_transfers"] == 0 and metrics["ps0_copy0_transfers"] >= 1  # the tail took the head's
    assert metrics["ps0_copy0_version"] == metrics["ps0_copy1_version"]
    assert metrics["ps0_copy0_divergent"] == metrics["ps0_copy1_divergent"] == 0
    assert metrics["ps_acknowledged_pushes"] > 0
    assert metrics["ps_acknowledged_pushes_kept"] == metrics["ps_acknowledged_pushes"], metrics
