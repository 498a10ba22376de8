"""Peer-to-peer training (mode ``p2p``): the sync in one process, then real peers through the real launcher.

Everything asserted here is a count or a final state; nothing depends on how fast a step or a message goes (the
consensus distance while training is checked only where it cannot race: copies that lack no update are equal).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from _jobs import run_job, run_jobs_together, summary, write_job
from dniasync import Actor, ActorSystem
from dniasync.remote import RemoteSettings, WebSocketTransport
from dniasync.train.specs import OptimizerSpec, P2PSpec
from dniasync.train.sync import SyncContext
from dniasync.train.sync.p2p import P2PSync, Peers, Update

# -- the sync alone: three peers in one actor system -----------------------------------------------------------
OPTIMIZER = OptimizerSpec("sgd", 0.1, momentum=0.0)
TAU = 1e-3


class _Trainer(Actor):
    """Stands in for a replica: the actor a peer's inbox is a child of."""

    def __init__(self, found: dict[str, Actor]) -> None:
        found[self.name] = self


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


@asynccontextmanager
async def _peers(n: int, **spec: Any) -> AsyncIterator[list[P2PSync]]:
    """``n`` started peers that know each other (the inbox of each is up), ticking every 50 ms."""
    async with ActorSystem() as system:
        found: dict[str, Actor] = {}
        syncs = []
        for i in range(n):
            await system.spawn(_Trainer, found, name=f"trainer-{i}")
            p2p = P2PSpec([], codec="threshold", tau=TAU, tick_s=0.05, **spec)
            syncs.append(P2PSync(p2p, _model(), SyncContext(f"trainer-{i}", 100 + i, OPTIMIZER,
                                                             actor=found[f"trainer-{i}"])))
        for sync in syncs:
            await sync.ready()
        everyone = Peers(1, [s.inbox for s in syncs if s.inbox is not None])
        for sync in syncs:
            sync.on_peers(everyone)
        yield syncs
        for sync in syncs:
            await sync.close()


async def _train(sync: P2PSync, steps: int, seed: int) -> None:
    """``steps`` steps on batches of this peer's own (seeded) data, driven the way a replica drives a sync."""
    gen = torch.Generator().manual_seed(seed)
    model = sync.flat.model
    for _ in range(steps):
        await sync.ready()
        x = torch.randn(16, 4, generator=gen)
        y = (x[:, 0] > 0).long()
        sync.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        sync.step()
        await sync.sync(16)
        await asyncio.sleep(0)  # let the inboxes run, as the event loop would between a replica's steps


async def _settle(syncs: list[P2PSync], timeout: float = 10.0) -> None:
    """Until every peer's ledger holds every update every peer sent (their ticks repair what is missing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s.ledger.get(o.origin) is not None and s.ledger[o.origin].have == o.seq and not s.ledger[o.origin].extra
               for s in syncs for o in syncs if o is not s and o.seq):
            return
        await asyncio.sleep(0.02)
    raise AssertionError({s.me: {o: r.count() for o, r in s.ledger.items()} for s in syncs})


def _decoded_sum(syncs: list[P2PSync]) -> np.ndarray:
    """The sum of every update every peer sent (from each origin's own record of what it sent)."""
    total = np.zeros(syncs[0].n, dtype=np.float64)
    for sync in syncs:
        assert len(sync._own) == sync.seq  # nothing evicted: every update sent is still kept
        for _, codec, payload, _ in sync._own:
            total += sync._decode(codec, payload)
    return total


async def test_each_peer_applies_exactly_what_it_sent_plus_what_it_received() -> None:
    async with _peers(3) as syncs:
        w0 = syncs[0].w.copy()
        assert all(np.array_equal(s.w, w0) for s in syncs)  # one factory, one seed
        await asyncio.gather(*(_train(s, 20, seed=i) for i, s in enumerate(syncs)))
        await _settle(syncs)
        expected = w0 + _decoded_sum(syncs)
        for sync in syncs:
            np.testing.assert_allclose(sync.w, expected, atol=1e-6)  # the same sum, added in another order
            assert sync.counters.sent == 20 and sync.counters.received == 40  # each update is new once
            assert sync.counters.dense_taken == 0  # nothing was lost: no copy needed


async def test_the_residual_keeps_what_the_threshold_left_out() -> None:
    async with _peers(1) as (sync,):
        base = sync.w.copy()
        await sync.ready()
        model = sync.flat.model
        nn.functional.cross_entropy(model(torch.ones(8, 4)), torch.zeros(8, dtype=torch.long)).backward()  # type: ignore[no-untyped-call]
        sync.step()
        # the model's weights are the shared copy: the step left them, and its change waits to be coded
        np.testing.assert_array_equal(sync.store.view("params"), base)
        change = sync.change.copy()  # what the local optimizer did
        assert np.count_nonzero(change) > 0
        (coded,) = sync._coded
        sent = sync.codec.extract(coded)
        assert np.abs(sent).max() == pytest.approx(TAU)  # only +-tau goes out ...
        residual = sync.codec.residual()  # type: ignore[attr-defined]
        np.testing.assert_allclose(sent + residual, change, atol=1e-7)  # ... the rest stays here
        assert np.count_nonzero(residual) > 0
        await sync.sync(8)
        np.testing.assert_allclose(sync.w, base + sent, atol=1e-7)  # its own copy takes exactly what it sent
        np.testing.assert_array_equal(sync.store.view("params"), sync.w)  # and the model's weights are that copy


async def test_a_capped_update_sends_the_rest_of_its_codes_with_the_next_ones_under_a_cap_that_doubles() -> None:
    async with _peers(1, update_cap_bytes=64) as (sync,):  # 16 codes at first; the model has 58 weights
        w0 = sync.w.copy()
        await sync.ready()
        model = sync.flat.model
        nn.functional.cross_entropy(model(torch.ones(8, 4)), torch.zeros(8, dtype=torch.long)).backward()  # type: ignore[no-untyped-call]
        sync.step()
        change = sync.change.copy()  # one step that moves many weights past tau
        sizes = [sync._coded[0].payload.nbytes]
        await sync.sync(8)
        assert sizes == [64] and sync.counters.capped == 1  # more than 16 weights crossed tau: 16 went
        while np.abs(sync.codec.residual()).max() >= TAU:  # type: ignore[attr-defined]
            # steps that change nothing: the updates carry only what the first left in the residual
            await sync.ready()
            (0 * model(torch.ones(1, 4)).sum()).backward()  # type: ignore[no-untyped-call]
            sync.step()
            sizes += [c.payload.nbytes for c in sync._coded]
            await sync.sync(1)
        # no link was ever busy (a lone peer): the cap doubled with each update, 64, 128, 256 bytes, ...
        assert len(sizes) >= 2 and all(size <= 64 << k for k, size in enumerate(sizes)), sizes
        # every code got out once, in some update: the shared copy has the whole change but what tau left over
        np.testing.assert_allclose(sync.w - w0 + sync.codec.residual(), change, atol=1e-6)  # type: ignore[attr-defined]


async def test_a_lost_update_is_asked_for_again_from_its_origin() -> None:
    async with _peers(2, max_lag=50) as (a, b):
        await _train(a, 3, seed=0)
        await _settle([a, b])
        seq, codec, payload, _ = a._own[1]  # now b loses update 2 of a: its ledger has a hole below update 3
        np.subtract(b.w, a._decode(codec, payload), out=b.w)
        b.ledger[a.origin].have, b.ledger[a.origin].extra = 1, {3}
        await _settle([a, b])
        assert b.counters.resends_asked >= 1 and a.counters.resent >= 1
        assert b.counters.dense_taken == 0  # one missing update is below max_lag: a resend, not a copy
        np.testing.assert_allclose(a.w, b.w, atol=1e-6)


async def test_an_update_its_origin_no_longer_keeps_comes_with_a_dense_copy_without_asking_for_it() -> None:
    async with _peers(2, max_lag=50, keep_bytes=1) as (a, b):
        await _train(a, 4, seed=0)
        await _settle([a, b])
        assert [seq for seq, *_ in a._own] == [4]  # keep_bytes=1: only its latest update is kept
        deadline = time.monotonic() + 10
        while b._kept_from.get(a.origin) != 4 and time.monotonic() < deadline:  # its ledgers say so
            await asyncio.sleep(0.02)
        assert b._kept_from[a.origin] == 4
        b.ledger[a.origin].have, b.ledger[a.origin].extra = 1, {3, 4}  # b lost update 2, which a no longer keeps
        b.w[:] = 0  # (what it holds no longer matters: the copy replaces it)
        await _settle([a, b])
        assert b.counters.dense_taken == 1 and b.counters.dense_failed == 0
        assert b.counters.resends_asked == 0  # a resend could not bring update 2: b did not ask for it
        np.testing.assert_allclose(a.w, b.w, atol=1e-6)


def _drop_updates_to(sender: P2PSync, receiver: P2PSync) -> None:
    """``sender``'s updates to ``receiver`` are dropped, as when the receiver's queue is full (ledgers still go)."""
    tell = sender._tell

    def dropping(ref: Any, msg: Any) -> bool:
        return False if isinstance(msg, Update) and ref.address == receiver.me else tell(ref, msg)

    sender._tell = dropping  # type: ignore[method-assign]


async def test_a_peer_left_out_past_max_lag_takes_a_dense_copy() -> None:
    async with _peers(3, max_lag=4) as (a, b, c):
        _drop_updates_to(a, c)
        _drop_updates_to(b, c)
        await asyncio.gather(_train(a, 15, seed=0), _train(b, 15, seed=1))
        assert c.counters.received == 0 and a.counters.skipped >= 15
        await _settle([a, b])
        # their ledgers still reach c, which learns it is 15 + 15 updates behind: more than max_lag
        # (a copy taken while a and b still trained lacks their last updates: c takes another after the cooldown)
        deadline = time.monotonic() + 10
        while not all(o.origin in c.ledger and c.ledger[o.origin].have == 15 for o in (a, b)) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert c.counters.dense_taken >= 1 and c.counters.received == 0  # caught up by the copy alone
        assert all(c.ledger[o.origin].have == 15 for o in (a, b))
        np.testing.assert_allclose(a.w, c.w, atol=1e-6)
        del a._tell, b._tell  # c's queue has room again
        await _train(c, 5, seed=2)
        await _settle([a, b, c])
        np.testing.assert_allclose(a.w, c.w, atol=1e-6)
        np.testing.assert_allclose(b.w, c.w, atol=1e-6)


async def test_with_fanout_1_updates_travel_down_a_chain_and_reach_everyone() -> None:
    async with _peers(4, fanout=1) as syncs:
        await asyncio.gather(*(_train(s, 10, seed=i) for i, s in enumerate(syncs)))
        await _settle(syncs)
        for sync in syncs:
            assert all(sync.ledger[o.origin].count() == o.seq == 10 for o in syncs)
        # each update leaves its origin once and is forwarded by the two middle peers of its chain of four
        assert sum(s.counters.forwarded for s in syncs) >= 2 * sum(s.seq for s in syncs)
        assert sum(s.counters.received for s in syncs) == 3 * sum(s.seq for s in syncs)


async def test_duplicates_are_applied_once() -> None:
    async with _peers(2) as (a, b):
        await _train(a, 2, seed=0)
        await _settle([a, b])
        before = b.w.copy()
        seq, codec, payload, _ = a._own[0]
        b.on_update(Update(a.origin, seq, codec, payload, a.me))
        np.testing.assert_array_equal(b.w, before)
        assert b.counters.duplicate == 1


@pytest.mark.parametrize("weight", [float("nan"), float("inf"), -0.25, 1.5])
async def test_an_update_with_a_weight_outside_0_1_is_refused_before_it_counts(weight: float) -> None:
    async with _peers(2, local_steps=2) as (a, b):
        await _train(a, 2, seed=0)
        await _settle([a, b])
        before, waiting = b.w.copy(), len(b._pending)  # a's update 1 waits for an outer step of b's
        seq, codec, payload, _ = a._own[0]
        with pytest.raises(ValueError, match="not within"):
            b.on_update(Update(a.origin, seq + 1, codec, payload, a.me, weight))
        assert b.counters.received == 1 and seq + 1 not in b.ledger[a.origin] and len(b._pending) == waiting
        np.testing.assert_array_equal(b.w, before)


async def test_a_busy_link_holds_the_next_update_and_the_one_after_carries_both_steps() -> None:
    """Flow control: while an update still waits for the wire to a peer, the next step's change is not coded; the
    update after carries it. Two peers on two nodes over a real socket (no shared-memory ring), a model big enough
    that one update (a million coded elements, 4 MB, far above ``max_unsent_bytes``) waits in the connection's
    outbox until the event loop runs."""
    async with AsyncExitStack() as stack:
        syncs: list[P2PSync] = []
        for i in range(2):
            system = await stack.enter_async_context(ActorSystem())
            await stack.enter_async_context(WebSocketTransport(system, settings=RemoteSettings(shm=False)))
            found: dict[str, Actor] = {}
            await system.spawn(_Trainer, found, name=f"trainer-{i}")
            # every element crosses tau, and an update carries them all (4 MB: uncapped)
            spec = P2PSpec([], codec="threshold", tau=1e-9, tick_s=0.05, update_cap_bytes=8 << 20)
            torch.manual_seed(0)  # the same initial weights on both
            ctx = SyncContext(f"trainer-{i}", 100 + i, OPTIMIZER, actor=found[f"trainer-{i}"])
            sync = P2PSync(spec, nn.Sequential(nn.Linear(1024, 1024)), ctx)
            await sync.ready()
            syncs.append(sync)
            stack.push_async_callback(sync.close)
        a, b = syncs
        assert a.inbox is not None and b.inbox is not None and a.inbox.node != b.inbox.node
        a.on_peers(Peers(1, [a.inbox, a.ctx.actor.system.ref(b.inbox.address)]))  # type: ignore[union-attr]
        b.on_peers(Peers(1, [b.ctx.actor.system.ref(a.inbox.address), b.inbox]))  # type: ignore[union-attr]
        x = torch.randn(8, 1024)

        def step() -> None:
            a.zero_grad()
            a.flat.model(x).square().mean().backward()  # type: ignore[no-untyped-call]
            a.step()

        step()
        await a.sync(8)  # update 1 goes into the outbox to b; nothing yields to the loop until the asserts below
        step()
        assert a.counters.held == 1 and not a._coded and a.seq == 1, "the link still carries update 1"
        assert a._cap == a.spec.update_cap_bytes  # doubled by update 1, halved back by the held step
        async with asyncio.timeout(30):  # until update 1 has reached b (small ledger ticks may still be on the way)
            while a._refs[b.me].unsent_bytes() > a.spec.max_unsent_bytes:
                await asyncio.sleep(0.01)
        step()
        assert a.counters.held == 1 and len(a._coded) == 1  # the link is free: update 2 carries steps 2 and 3
        await a.sync(8)
        await _settle([a, b], timeout=30)
        assert b.counters.received == 2 and a.seq == 2
        np.testing.assert_allclose(b.w, a.w, atol=1e-6)  # the same two updates, whatever the link did


async def test_with_local_steps_the_copies_agree_however_the_peers_views_of_the_membership_differed() -> None:
    """Local steps (H = 2): peer c is out of a's and b's membership for a while (as when the job runner declares a
    peer starved of CPU dead, then takes it back) and never hears of it. Each pseudo-gradient weighs 1/N of its
    origin's membership when coded, wherever it lands: c's, sent straight to a and b meanwhile, weigh 1/3 there
    too (they count 2), and a's and b's weigh 1/2 on c (it counts 3), which gets them by resend once it is back.
    So once every update has landed every copy holds the same weighted sum. (Each receiver weighing by its own count,
    the copies stayed apart for good: CI runs of the 4-peer MNIST job below ended at settled consensus distances of
    0.00106 and 0.0032 with every ledger complete; 1 in 6 runs beside 3 busy loops.)"""
    async with _peers(3, local_steps=2) as syncs:
        a, b, c = syncs
        assert a.inbox is not None and b.inbox is not None
        w0 = a.w.copy()
        await asyncio.gather(*(_train(s, 4, seed=i) for i, s in enumerate(syncs)))
        await _settle(syncs)
        pair = Peers(2, [a.inbox, b.inbox])
        a.on_peers(pair)
        b.on_peers(pair)
        await asyncio.gather(_train(a, 4, seed=10), _train(b, 4, seed=11), _train(c, 4, seed=12))
        everyone = Peers(3, [s.inbox for s in syncs if s.inbox is not None])
        for sync in syncs:
            sync.on_peers(everyone)
        for sync in syncs:
            await sync.flush()  # received pseudo-gradients go in as they come from now on
        await _settle(syncs)
        weights = {s.me: [w for *_, w in s._own] for s in syncs}
        assert weights == {a.me: [1 / 3] * 2 + [1 / 2] * 2, b.me: [1 / 3] * 2 + [1 / 2] * 2, c.me: [1 / 3] * 4}
        assert c.counters.dense_taken == 0 and a.counters.resent + b.counters.resent >= 4  # by resends
        expected = w0.astype(np.float64)
        for sync in syncs:
            for _, codec, payload, weight in sync._own:
                expected += weight * sync._decode(codec, payload)
        for sync in syncs:
            np.testing.assert_allclose(sync.w, expected, atol=1e-6)


# -- real peers through the launcher -------------------------------------------------------------------------
MNIST = """
[job]
name = "{name}"
mode = "p2p"
seed = 0
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"
kwargs = {{ sizes = [784, 256, 256, 10], activation = "relu" }}

[data]
dataset = "mnist5k"
n_train = 4000
n_test = 1000
batch_size = 32

[optimizer]
name = "adagrad"
lr = 0.03

[p2p]
n_peers = 4
codec = "threshold"
tau = 0.006

[stop]
max_epochs = 25
target_accuracy = 0.92

[eval]
every_seconds = 0.5
"""

DIGITS = """
[job]
name = "{name}"
mode = "p2p"
seed = 3
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"
kwargs = {{ sizes = [64, 64, 10] }}

[data]
dataset = "digits"
n_train = 1400
n_test = 397
batch_size = 32

[optimizer]
name = "adagrad"
lr = 0.05

[p2p]
n_peers = {peers}
codec = "threshold"
tau = 0.002
wait_for_peers_s = {wait}

[sync]
fanout = {fanout}
max_lag = 16

[stop]
max_epochs = {epochs}
max_seconds = {seconds}

[eval]
every_seconds = 0.5
"""


def _peer_names(doc: dict[str, Any]) -> list[str]:
    return sorted({k.split("/")[1] for k in doc["metrics"] if k.startswith("p2p/") and k.endswith("/sent")})


def _assert_ledgers_complete(doc: dict[str, Any], peers: list[str]) -> None:
    """Every live peer's copy holds every update every live peer sent: a count, whatever the timing was."""
    m = doc["metrics"]
    assert m["p2p_ledgers_complete"] is True
    for peer in peers:
        for origin in peers:
            assert m[f"p2p/{peer}/has/{origin}"] == m[f"p2p/{origin}/sent"], (peer, origin)


def test_four_peers_reach_92_percent_on_mnist_and_their_copies_stay_close(tmp_path: Path) -> None:
    doc, _ = run_job(tmp_path, "p2p4", MNIST, timeout=600)
    # no time limit in the job: a loaded machine takes longer, it does not get fewer epochs. With tau 0.006 (the
    # example's) 0.92 was reached after 2-3 epochs on a quiet machine (seeds 0-2); the job stops there (an
    # evaluation every 0.5 s) or fails at 25. (tau 0.002, the earlier setting, took 9-13.5 epochs quiet and once
    # missed 0.92 in 25 on a loaded CI run: 0.919.)
    assert doc["stop_reason"] == "reached target accuracy 0.92", (doc["stop_reason"], doc["history"])
    assert doc["best_accuracy"] >= 0.92, doc["history"]
    m = doc["metrics"]
    peers = _peer_names(doc)
    assert len(peers) == 4 and m["peers_alive"] == 4
    _assert_ledgers_complete(doc, peers)
    # once every copy holds every update, only float rounding (the order of the adds) keeps them apart
    assert m["consensus_distance_settled"] < 1e-5
    # while training, copies differ by the updates in flight, and how far that puts them apart is the machine's: how
    # many updates are in flight, and how much each carries (flow control folds held steps into the next update; the
    # update cap halves and doubles with how the links keep up), depend on timing. Bounds on that figure failed in CI
    # again and again (0.25, then 0.4: a reading of 0.47 at a lag of 16 or less, 1.6 s in, when the first updates carry Adagrad's
    # first large steps). What cannot race: copies that lack no update hold the same weights, up to float rounding,
    # whenever they are read; copies that broke apart (the same updates, different weights) fail here.
    series = json.loads((tmp_path / "p2p4" / "consensus.json").read_text())
    assert series and all(c["lag_max"] >= 0 and 0 <= c["mean"] <= c["max"] for c in series), series
    assert all(c["max"] < 1e-5 for c in series if c["lag_max"] == 0), series
    # the threshold codec sends far less than the dense update would (three receivers per step)
    assert m["bytes_sent_per_step"] < 3 * m["dense_bytes_per_step"] / 2


LOCAL_STEPS = """
[job]
name = "{name}"
mode = "p2p"
seed = {seed}
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"
kwargs = {{ sizes = [784, 64, 10] }}

[data]
dataset = "mnist5k"
n_train = 4000
n_test = 1000
batch_size = 32

[optimizer]
name = "adagrad"
lr = 0.03

[p2p]
n_peers = 4
codec = "threshold"
tau = 0.002

[sync]
local_steps = {local_steps}

[stop]
max_epochs = {epochs}

[eval]
every_seconds = 1.0
"""

LOCAL_STEPS_EPOCHS = 10
LOCAL_STEPS_MARGIN = 0.05
"""How far under the same job without local steps the run with ``local_steps = 4`` may end (final held-out accuracy).

Measured (this config, seeds 0, 1, 2; 2-core machine shared with other jobs): local_steps 1: 0.911 0.925 0.915,
local_steps 4: 0.888 0.898 0.895, i.e. 2.0 to 2.7 points under. Plain averaging divides each peer's progress by the
4 peers where H = 1 adds every peer's update in full, so it moves slower per epoch; DiLoCo's outer lr 0.7 /
momentum 0.9 did worse still (H = 4, 5 epochs, seed 0: 0.846 against 0.857 averaging). 5 points: 2x the measured
gap, and far less than a broken outer step costs (36-48% at H = 8 with 0.7/0.9)."""


def _local_steps_job(tmp_path: Path, local_steps: int) -> dict[str, Any]:
    doc, _ = run_job(tmp_path, f"h{local_steps}", LOCAL_STEPS, timeout=600, seed=0, local_steps=local_steps,
                     epochs=LOCAL_STEPS_EPOCHS)
    assert doc["stop_reason"] == f"trained {LOCAL_STEPS_EPOCHS} epochs", doc["stop_reason"]
    return doc


def test_local_steps_with_the_default_outer_step_keep_the_accuracy_with_a_quarter_of_the_updates(
        tmp_path: Path) -> None:
    """``[sync] local_steps = 4`` with the default outer step (lr 1, momentum 0: plain averaging) against H = 1."""
    plain, local = _local_steps_job(tmp_path, 1), _local_steps_job(tmp_path, 4)
    assert local["final_accuracy"] >= plain["final_accuracy"] - LOCAL_STEPS_MARGIN, (
        local["final_accuracy"], plain["final_accuracy"])
    per_step = {}
    for doc, h in ((plain, 1), (local, 4)):
        m = doc["metrics"]
        peers = _peer_names(doc)
        assert len(peers) == 4
        _assert_ledgers_complete(doc, peers)
        # a peer codes an update after H steps of its own, or later when flow control held it (a link still busy):
        # each update covers H steps and the ones held, the last fewer than H may be unsent (a count, however the
        # steps were spread over the peers and whatever the links did); a change still held at the stop went then
        for p in peers:
            sent, steps, held = m[f"p2p/{p}/sent"], m[f"p2p/{p}/steps"], m[f"p2p/{p}/held"]
            coded = sent - m[f"p2p/{p}/flushed"]
            assert m[f"p2p/{p}/flushed"] <= 1 and steps - held - h < coded * h <= steps - held, (
                h, p, sent, steps, held, m[f"p2p/{p}/flushed"])
        sent, steps, held = (sum(m[f"p2p/{p}/{key}"] for p in peers) for key in ("sent", "steps", "held"))
        assert steps >= LOCAL_STEPS_EPOCHS * 4000 / 32, (h, steps)  # every epoch was trained, with both H
        # at the end every copy holds every update (with H = 4 too: received pseudo-gradients that waited for an
        # outer step go in once the peer stops), so the final accuracy is of the weights they all hold
        # (once, in a fresh CI run, 0.00106 with H = 4 and complete ledgers: not reproduced in 6 runs beside 3
        # busy loops; the message says whether the settling ended at its deadline and which peers had stopped)
        assert m["p2p_ledgers_complete"] and m["consensus_distance_settled"] < 1e-5, (
            h, m["consensus_distance_settled"], m.get("settle_s"),
            {p: (m.get(f"p2p/{p}/stopped"), m[f"p2p/{p}/dense_taken"], m[f"p2p/{p}/flushed"]) for p in peers})
        per_step[h] = (sent - sum(m[f"p2p/{p}/flushed"] for p in peers)) / (steps - held)
    # updates per step not held (per batch of 32 samples: both jobs run somewhat past their last epoch, by different
    # amounts)
    assert per_step[1] == 1.0 and 0.24 <= per_step[4] <= 0.25, per_step


CAPPED = MNIST.partition("[stop]")[0] + "[sync]\nupdate_cap_bytes = {cap}\n\n[stop]\nmax_epochs = 5\n"
"""The example's job (MNIST above) for 5 epochs, no target, with the cap under test."""
CAPPED_MARGIN = 0.04
"""Measured on examples/p2p_mnist.toml's job for 5 epochs (seeds 0-2, one job at a time on a quiet 2-core host): the
default cap 0.928 / 0.939 / 0.930, uncapped 0.927 / 0.937 / 0.916 (gaps +0.1, +0.2, +1.4 points). At 3 epochs the
spread was too wide for a margin (0.861-0.936, one run with a peer that got through 34 steps). 4 points: above the
measured gaps (the test runs the two jobs at once, which spreads them more)."""


def test_the_default_update_cap_keeps_the_accuracy_of_uncapped_updates_on_mnist(tmp_path: Path) -> None:
    """The example's job: its first updates reach the cap (256 KiB at first: 64Ki of its 269k weights), which doubles
    while the loopback links keep up."""
    jobs = run_jobs_together(tmp_path, CAPPED, {"capped": {"cap": 256 << 10}, "uncapped": {"cap": 1 << 30}},
                             timeout=600)
    capped, uncapped = jobs["capped"], jobs["uncapped"]
    for doc in (capped, uncapped):
        assert doc["stop_reason"] == "trained 5 epochs", doc["stop_reason"]
        _assert_ledgers_complete(doc, _peer_names(doc))
    count = {name: sum(v for k, v in doc["metrics"].items() if k.endswith("/capped")) for name, doc in jobs.items()}
    assert count["capped"] > 0 and count["uncapped"] == 0, count  # the cap was reached, and only where it was set
    assert capped["final_accuracy"] >= uncapped["final_accuracy"] - CAPPED_MARGIN, (
        capped["final_accuracy"], uncapped["final_accuracy"])


def test_with_fanout_1_every_update_reaches_every_peer(tmp_path: Path) -> None:
    doc, _ = run_job(tmp_path, "fan1", DIGITS, timeout=600, peers=4, fanout=1, epochs=8, seconds=120, wait=60)
    m = doc["metrics"]
    peers = _peer_names(doc)
    # all four: the first ones ready waited for the last (a loaded machine once readied one 3.5 s after the first,
    # when the other three had trained the job's 8 epochs of these 1,400 digits; it was not among the peers at the end)
    assert "peers start training: all 4 peers are ready" in (tmp_path / "fan1" / "logs" / "coordinator0.log").read_text()
    assert len(peers) == 4
    _assert_ledgers_complete(doc, peers)  # the count: every origin's every update is in every copy
    assert sum(m[f"p2p/{p}/forwarded"] for p in peers) > 0  # they got there by being passed on
    assert m["consensus_distance_settled"] < 1e-5
    # the point is the count above; this only says the copies learned (chance is 0.1). How far a chain of forwards
    # gets in 8 epochs depends on the order messages run in: measured 0.81 to 0.9
    assert doc["final_accuracy"] >= 0.6


def _node(role: str, *args: str, log: Path, stdin: int | None = None) -> subprocess.Popen[bytes]:
    """A node started by hand, as on separate machines: nobody restarts it."""
    with log.open("wb") as fh:
        return subprocess.Popen([sys.executable, "-m", "dniasync.node", "--role", role, *args],
                                stdout=fh, stderr=subprocess.STDOUT, stdin=stdin)


def _wait_for(log: Path, pattern: str, timeout: float = 180) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, log.read_text(errors="replace"))
        if match:
            return match
        time.sleep(0.1)
    raise AssertionError(f"{log.name} never said {pattern!r}:\n{log.read_text(errors='replace')[-3000:]}")


class _Cluster:
    """A coordinator and workers started by hand; every process is stopped at the end."""

    def __init__(self, tmp_path: Path, config: Path, out: Path) -> None:
        self.tmp_path, self.out = tmp_path, out
        self.logs: dict[str, Path] = {"coordinator": tmp_path / "coordinator.log"}
        self.procs: dict[str, subprocess.Popen[bytes]] = {
            "coordinator": _node("coordinator", "--config", str(config), log=self.logs["coordinator"])}
        self.address = _wait_for(self.logs["coordinator"], r" listening on (\S+)").group(1)

    def worker(self, name: str) -> subprocess.Popen[bytes]:
        self.logs[name] = self.tmp_path / f"{name}.log"
        self.procs[name] = _node("worker", "--join", self.address, log=self.logs[name])
        return self.procs[name]

    def ready_worker(self, name: str) -> subprocess.Popen[bytes]:
        """A worker started now that joins when :meth:`join` says (``--join -``: it imports what it trains with
        while it waits, so joining later costs no start-up, however loaded the machine)."""
        self.logs[name] = self.tmp_path / f"{name}.log"
        self.procs[name] = _node("worker", "--join", "-", log=self.logs[name], stdin=subprocess.PIPE)
        return self.procs[name]

    def join(self, name: str) -> None:
        stdin = self.procs[name].stdin
        assert stdin is not None
        stdin.write(f"{self.address}\n".encode())
        stdin.close()

    def replica(self, name: str) -> str:
        """The replica the worker ``name`` runs (it says so once it trains)."""
        return _wait_for(self.logs[name], r"replica (replica-\S+): training shards").group(1)

    def trained(self, samples: int = 1) -> None:
        """Until an evaluation has seen at least ``samples`` samples."""
        deadline = time.monotonic() + 180
        log = self.logs["coordinator"]
        while time.monotonic() < deadline:
            seen = [int(s) for s in re.findall(r"eval: \S+ s, (\d+) samples", log.read_text(errors="replace"))]
            if seen and max(seen) >= samples:
                return
            time.sleep(0.1)
        raise AssertionError(f"the job never trained {samples} samples")

    def finished(self, timeout: float = 300) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not (self.out / "summary.json").exists():
            time.sleep(0.2)
        return summary(self.out)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_a_killed_peer_is_named_and_the_others_finish(tmp_path: Path) -> None:
    config, out = write_job(tmp_path, "kill", DIGITS, peers=3, fanout=0, epochs=100_000, seconds=14, wait=60)
    cluster = _Cluster(tmp_path, config, out)
    try:
        for name in ("w0", "w1", "w2"):
            cluster.worker(name)
        victim = cluster.replica("w2")
        cluster.trained()
        time.sleep(2.0)  # the victim has reported progress by now (every 0.25 s): a silent one gets a 60 s grace
        cluster.procs["w2"].kill()
        doc = cluster.finished()
    finally:
        cluster.stop()
    assert doc["stop_reason"] == "ran 14 s"  # no hang: the time limit ended it
    failed = [e for e in doc["events"] if e["kind"] == "replica_failed"]
    assert [e["replica"] for e in failed] == [victim]
    m = doc["metrics"]
    assert m["peers_alive"] == 2 and m["peers_dead"] == 1
    survivors = _peer_names(doc)
    assert victim not in survivors and len(survivors) == 2
    _assert_ledgers_complete(doc, survivors)
    killed_at = failed[0]["wall_s"]
    assert doc["history"][-1]["samples"] > max(p["samples"] for p in doc["history"] if p["wall_s"] <= killed_at)
    assert doc["final_accuracy"] >= 0.6  # the survivors learned (chance is 0.1); the point is that they went on


def test_a_late_peer_starts_from_a_neighbours_copy_and_reaches_the_others(tmp_path: Path) -> None:
    # the two first start without waiting for the third (wait_for_peers_s = 0): it is late on purpose
    config, out = write_job(tmp_path, "late", DIGITS, peers=3, fanout=0, epochs=100_000, seconds=25, wait=0)
    cluster = _Cluster(tmp_path, config, out)
    try:
        cluster.worker("w0")
        cluster.worker("w1")
        # started now, joining later: one that imported torch only once the others had trained (seconds of CPU)
        # once joined after the job's 15 s were up on a loaded machine (the replica it hosts took 13 s to start),
        # and was not among the job's peers at its end
        cluster.ready_worker("late")
        cluster.trained(samples=2000)  # the first two have trained well over an epoch of theirs
        cluster.join("late")
        late = cluster.replica("late")
        doc = cluster.finished()
    finally:
        cluster.stop()
    m = doc["metrics"]
    peers = _peer_names(doc)
    assert late in peers and len(peers) == 3
    joined = {e["replica"]: e for e in doc["events"] if e["kind"] == "replica_joined"}
    assert joined[late]["cluster_steps"] > 0  # it joined a job that had trained
    assert m[f"p2p/{late}/dense_taken"] >= 1  # its first weights were a neighbour's copy, not the initial ones
    _assert_ledgers_complete(doc, peers)  # and from then on it holds what every peer sent
    assert m["consensus_distance_settled"] < 1e-5  # the copy it ends with is the others'
    assert doc["final_accuracy"] >= 0.9


def test_peers_that_wait_in_vain_for_one_start_without_it(tmp_path: Path) -> None:
    """Three peers configured, two started: they wait wait_for_peers_s for the third, then train as two."""
    config, out = write_job(tmp_path, "wait", DIGITS, peers=3, fanout=0, epochs=100_000, seconds=4, wait=2)
    cluster = _Cluster(tmp_path, config, out)
    try:
        cluster.worker("w0")
        cluster.worker("w1")
        doc = cluster.finished()
    finally:
        cluster.stop()
    assert "peers start training: 2 of 3 peers ready after 2 s" in cluster.logs["coordinator"].read_text()
    assert doc["stop_reason"] == "ran 4 s"  # no hang: they did not wait for the third for ever
    m = doc["metrics"]
    peers = _peer_names(doc)
    assert len(peers) == 2 and m["peers_alive"] == 2
    assert all(m[f"p2p/{p}/steps"] > 0 for p in peers)
    _assert_ledgers_complete(doc, peers)


def test_a_peer_frozen_for_10_s_does_not_stop_the_others_and_catches_up(tmp_path: Path) -> None:
    config, out = write_job(tmp_path, "freeze", DIGITS, peers=3, fanout=0, epochs=100_000, seconds=22, wait=60)
    cluster = _Cluster(tmp_path, config, out)
    try:
        for name in ("w0", "w1", "w2"):
            cluster.worker(name)
        frozen = cluster.replica("w2")
        cluster.trained()
        pid = cluster.procs["w2"].pid
        os.kill(pid, signal.SIGSTOP)
        time.sleep(10)
        os.kill(pid, signal.SIGCONT)
        doc = cluster.finished()
    finally:
        cluster.stop()
    assert doc["stop_reason"] == "ran 22 s"
    m = doc["metrics"]
    peers = _peer_names(doc)
    assert frozen in peers and m["peers_alive"] == 3  # it is back among the live peers
    # the others went on: they sent many more updates than max_lag while it slept, so it caught up by a dense copy
    assert m[f"p2p/{frozen}/dense_taken"] >= 1
    others = [p for p in peers if p != frozen]
    assert all(m[f"p2p/{p}/sent"] > m[f"p2p/{frozen}/sent"] for p in others)
    _assert_ledgers_complete(doc, peers)
    assert m["consensus_distance_settled"] < 1e-5
    assert doc["final_accuracy"] >= 0.9
    # its loop watch says the whole process stood still, not a call on its loop (its own thread was stopped too)
    paused = [float(line.split("could not run for ")[1].split(" s")[0]) for line in
              cluster.logs["w2"].read_text().splitlines() if "loop watch's own thread could not run for" in line]
    assert paused and max(paused) >= 9.5, paused
