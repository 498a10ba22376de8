"""Weight syncs: one contract suite over every registered kind, then the PS link's push/pull (counters, versions,
idempotent pushes), backoff and collapsed warnings."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from dniasync import Actor, ActorSystem, handler
from dniasync.actors import ActorRef, ActorUnreachable, Backoff
from dniasync.train.flat import flatten_parameters
from dniasync.train.messages import Params, Pull, Push
from dniasync.train.ps import PSShard
from dniasync.train.specs import CodecSpec, LocalSpec, OptimizerSpec, P2PSpec, PSLinkSpec, SharedStoreSpec, ShardSpec
from dniasync.train.sync import (
    HOGWILD_SEGMENT,
    SYNCS,
    CollapsedWarnings,
    LocalOptimizer,
    PSSync,
    ShardLink,
    SyncContext,
    SyncStats,
    WeightSync,
    build_sync,
    sync_kind,
)

# -- the contract every registered sync keeps -----------------------------------------------------------------
OPTIMIZER = OptimizerSpec("sgd", 0.1, momentum=0.0)
Setup = Callable[[ActorSystem, nn.Module], contextlib.AbstractAsyncContextManager[object]]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


@contextlib.asynccontextmanager
async def _local(system: ActorSystem, model: nn.Module) -> AsyncIterator[object]:
    yield LocalSpec()


@contextlib.asynccontextmanager
async def _ps(system: ActorSystem, model: nn.Module) -> AsyncIterator[object]:
    values = flatten_parameters(model)
    half = values.size // 2
    shards = [await system.spawn(PSShard, ShardSpec(i, offset, values[offset:end].copy(), OPTIMIZER),
                                 name=f"ps-{i}")
              for i, (offset, end) in enumerate([(0, half), (half, values.size)])]
    yield PSLinkSpec(shards, [0, half], n_fetch=1, n_push=1)


@contextlib.asynccontextmanager
async def _shm(system: ActorSystem, model: nn.Module) -> AsyncIterator[object]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    values = flatten_parameters(model)
    store = OPTIMIZER.store([(HOGWILD_SEGMENT, values.size)], shm_name=name)  # the job's copy owns the segment
    store.write(HOGWILD_SEGMENT, values)
    yield SharedStoreSpec(name)
    del store


@contextlib.asynccontextmanager
async def _p2p(system: ActorSystem, model: nn.Module) -> AsyncIterator[object]:
    yield P2PSpec([], codec="threshold", tau=1e-3)  # a lone peer (no trainer actor: nothing to receive with)


SETUPS: dict[str, Setup] = {"local": _local, "ps": _ps, "shm": _shm, "p2p": _p2p}
"""How to run each registered sync in one process: what its spec needs around it (PS shards, a store)."""


async def _train(sync: WeightSync, model: nn.Module, steps: int) -> None:
    """``steps`` SGD-able steps on a fixed batch, the way a trainer drives a sync."""
    x, y = torch.linspace(-1, 1, 32).reshape(8, 4), torch.arange(8) % 2
    done = 0
    while done < steps:
        await sync.ready()
        run = sync.steps_per_call(done)
        assert run >= 1
        for _ in range(run):
            sync.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            sync.step()
        done += run
        await sync.sync(8 * run)


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


@contextlib.asynccontextmanager
async def _built(kind: str) -> AsyncIterator[tuple[WeightSync, nn.Module, Callable[[], WeightSync]]]:
    """A sync of ``kind`` over a fresh model, and a way to build another one of the same spec over another model."""
    if kind not in SETUPS:
        pytest.fail(f"the sync {kind!r} is registered but has no in-process setup in SETUPS: add one")
    async with ActorSystem() as system, SETUPS[kind](system, _model()) as spec:
        ctx = SyncContext("trainer-0", 1, OPTIMIZER)
        model = _model()
        sync = build_sync(spec, model, ctx)
        yield sync, model, lambda: build_sync(spec, _model(), SyncContext("trainer-1", 2, OPTIMIZER))
        await sync.close()


@pytest.mark.parametrize("kind", sorted(SYNCS))
async def test_every_sync_trains_its_model_and_says_who_owns_the_optimizer(kind: str) -> None:
    registered = sync_kind(kind)
    async with _built(kind) as (sync, model, _):
        before = _weights(model)
        await _train(sync, model, 4)
        assert not torch.equal(_weights(model), before)  # the steps reached the weights the model trains with
        assert (sync.optimizer is not None) == registered.owns_optimizer
        assert math.isnan(sync.lr_now()) == registered.needs_ps
        if sync.flat is not None:  # the parameters are views of the flat buffer
            assert torch.equal(sync.flat.flat, _weights(model))


@pytest.mark.parametrize("kind", sorted(SYNCS))
async def test_every_sync_scales_one_steps_lr_wherever_its_optimizer_runs(kind: str) -> None:
    """``step(lr_scale)`` (the DNI gate) multiplies that step's lr, not its gradient, wherever the optimizer runs
    (for PS shards the push carries it): with SGD a step at 0 leaves the weights, one at 0.5 moves them by half of
    lr x gradient, and the next step is at the full lr again. (p2p's weights take its threshold-coded change, in
    steps of tau: only the step at 0 is exact there.)"""
    x, y = torch.linspace(-1, 1, 32).reshape(8, 4), torch.arange(8) % 2
    async with _built(kind) as (sync, model, _):
        for scale in (0.0,) if kind == "p2p" else (0.0, 0.5, 1.0):
            await sync.ready()
            before = _weights(model)
            sync.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
            sync.step(scale)
            await sync.sync(8)
            await sync.ready()
            torch.testing.assert_close(_weights(model), before - OPTIMIZER.lr * scale * grad, msg=f"lr_scale {scale}")


@pytest.mark.parametrize("kind", sorted(SYNCS))
async def test_every_sync_state_dict_loads_into_a_fresh_one(kind: str) -> None:
    async with _built(kind) as (sync, model, another):
        await _train(sync, model, 3)
        state = sync.state_dict()
        assert all(isinstance(t, torch.Tensor) for t in state.values())
        fresh = another()
        fresh.load_state_dict(state)
        again = fresh.state_dict()
        assert sorted(again) == sorted(state)
        for name, tensor in state.items():
            torch.testing.assert_close(again[name], tensor, msg=name)
        await fresh.close()


@pytest.mark.parametrize("kind", sorted(SYNCS))
async def test_every_sync_counts_what_it_sent_and_received(kind: str) -> None:
    registered = sync_kind(kind)
    async with _built(kind) as (sync, model, _):
        assert sync.stats() == SyncStats() or registered.needs_ps  # nothing counted before it trains (a PS pull aside)
        await _train(sync, model, 3)
        stats = sync.stats()
        counters = (stats.bytes_pushed, stats.bytes_pulled, stats.dense_bytes_pushed, stats.pushes, stats.pulls)
        assert all(isinstance(c, int) and c >= 0 for c in counters)
        assert all(isinstance(v, int) for v in stats.versions)
        assert all(isinstance(v, float | int) for v in stats.extra.values())
        if registered.needs_ps:  # three steps: three pushes of both slices, a first pull and three more
            assert (stats.pushes, stats.pulls) == (3, 8)
            assert sync.flat is not None and stats.bytes_pushed == stats.dense_bytes_pushed == 3 * 4 * sync.flat.n
            assert len(stats.versions) == 2 and min(stats.versions) == 3


def test_the_registry_names_its_kinds_and_refuses_unknown_ones() -> None:
    assert {"local", "ps", "shm"} <= set(SYNCS)
    assert all(SYNCS[name].name == name for name in SYNCS)
    with pytest.raises(ValueError, match="unknown weight sync 'nope'; known syncs: .*'ps'"):
        sync_kind("nope")
    with pytest.raises(ValueError, match="no weight sync is registered for a str"):
        build_sync("ps", _model(), SyncContext("t", 1, OPTIMIZER))


# -- the PS link ---------------------------------------------------------------------------------------------


class RecordingShard(Actor):
    """A PS shard reduced to its wire contract: answers pulls with its values, keeps every push."""

    mailbox_size = 0

    def __init__(self, shard: int, values: np.ndarray) -> None:
        self.shard = shard
        self.values = values
        self.version = 7 + shard
        self.pushes: list[Push] = []

    @handler
    def pull(self, msg: Pull) -> Params:
        return Params(self.shard, self.version, self.values.copy())

    @handler
    def push(self, msg: Push) -> None:
        self.pushes.append(msg)

    @handler
    def received(self, msg: str) -> list[Push]:
        return list(self.pushes)


async def test_link_pulls_every_shard_and_pushes_each_its_slice_idempotently() -> None:
    values = np.arange(10, dtype=np.float32)
    async with ActorSystem() as system:
        shards = [await system.spawn(RecordingShard, 0, values[:6].copy(), name="ps-0"),
                  await system.spawn(RecordingShard, 1, values[6:].copy(), name="ps-1")]
        buffer = np.zeros(10, dtype=np.float32)
        link = ShardLink(buffer, [(0, 6), (6, 4)], shards, replica="r0", incarnation=42)
        assert await link.pull()
        np.testing.assert_array_equal(buffer, values)
        assert link.versions == [7, 8] and link.pulls == 2 and link.bytes_pulled == 40
        grad = np.linspace(-1, 1, 10, dtype=np.float32)
        await link.push(grad, samples=32)
        await link.push(grad, samples=32)
        pushes = [await shard.ask("received") for shard in shards]
    assert [[(p.replica, p.incarnation, p.seq, p.version, p.samples) for p in ps] for ps in pushes] == [
        [("r0", 42, 1, 7, 32), ("r0", 42, 2, 7, 32)], [("r0", 42, 1, 8, 32), ("r0", 42, 2, 8, 32)]]
    np.testing.assert_array_equal(pushes[1][0].payload.view(np.float32), grad[6:])
    assert (link.pushes, link.bytes_pushed, link.dense_bytes_pushed) == (2, 80, 80)


class DeadShard:
    """A destination whose node is down until ``up`` is set; counts the attempts that reach it."""

    def __init__(self) -> None:
        self.up = False
        self.attempts = 0

    @property
    def alive(self) -> bool:
        return self.up

    def ask(self, msg: Any, timeout: float | None) -> Coroutine[Any, Any, Any]:
        return self._answer(msg)

    async def _answer(self, msg: Any) -> Any:
        self.attempts += 1
        if not self.up:
            raise ActorUnreachable("ps-0@10.9.9.9:7000", "node is down")
        return Params(0, 3, np.ones(4, dtype=np.float32))

    def tell(self, msg: Any) -> Coroutine[Any, Any, None]:
        return self._answer(msg)

    def tell_nowait(self, msg: Any) -> None:
        raise AssertionError("the link never uses tell_nowait")

    def unsent_bytes(self) -> int:
        return 0


async def test_dead_shard_is_retried_with_backoff_and_its_warnings_collapsed(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    dead = DeadShard()
    buffer = np.zeros(4, dtype=np.float32)
    link = ShardLink(buffer, [(0, 4)], [ActorRef("ps-0@10.9.9.9:7000", dead)], replica="r0", incarnation=1,
                     clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="dniasync.train.sync.ps")
    for ms in range(20_000):  # a replica asking every millisecond for 20 s
        now[0] = ms / 1000
        assert not await link.pull()
        await link.push(np.ones(4, dtype=np.float32), samples=1)
    # attempts at 0, 0.05, 0.15, 0.35, 0.75, 1.55, 3.15 s, then every 2 s: 5.15 ... 19.15
    assert dead.attempts == 15
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("replica r0: pull from shard 0 failed: ps-0@10.9.9.9:7000: node is down")
    assert "failed 10 more times in 11 s" in warnings[1]  # the failures of 0.05 ... 11.15 s, in one line
    assert link.pulls == link.bytes_pushed == 0 and link.pushes == 20_000

    dead.up = True
    now[0] = 21.2
    assert await link.pull()
    assert await link.pull()  # a success resets the backoff: no wait
    assert dead.attempts == 17 and link.versions == [3]
    np.testing.assert_array_equal(buffer, np.ones(4, dtype=np.float32))
    assert caplog.records[-1].getMessage() == "replica r0: pull from shard 0 works again after 15 failures"


async def test_only_an_answered_pull_ends_a_failed_push_run(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    dead = DeadShard()
    link = ShardLink(np.zeros(4, dtype=np.float32), [(0, 4)], [ActorRef("ps-0@10.9.9.9:7000", dead)],
                     replica="r0", incarnation=1, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="dniasync.train.sync.ps")
    await link.push(np.ones(4, dtype=np.float32), samples=1)
    dead.up = True
    now[0] = 0.06
    await link.push(np.ones(4, dtype=np.float32), samples=1)  # delivered, but a tell proves nothing
    assert link.bytes_pushed == 16 and [r.getMessage() for r in caplog.records][-1].startswith(
        "replica r0: push to shard 0 failed")
    assert await link.pull()
    assert caplog.records[-1].getMessage() == "replica r0: push to shard 0 works again after 1 failures"


def test_backoff_doubles_up_to_its_bound_and_resets_on_success() -> None:
    now = [0.0]
    backoff = Backoff(0.05, 2.0, clock=lambda: now[0])
    delays = [backoff.failed() for _ in range(8)]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert not backoff.ready()
    backoff.succeeded()
    assert backoff.ready() and backoff.failed() == 0.05


def test_collapsed_warnings_count_what_they_held_back(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    warnings = CollapsedWarnings(logging.getLogger("test.collapse"), every_s=5.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="test.collapse")
    for i in range(200):  # 200 failures a second, for 6 s
        now[0] = i * 0.03
        warnings.failed("push to shard 1", f"attempt {i}")
    warnings.failed("pull from shard 0", "timeout")  # another operation has its own run
    warnings.recovered("push to shard 1")
    warnings.recovered("push to shard 1")  # no run any more: nothing to say
    assert [r.getMessage() for r in caplog.records] == [
        "push to shard 1 failed: attempt 0",
        "push to shard 1 failed 167 more times in 5 s, last: attempt 167",
        "pull from shard 0 failed: timeout",
        "push to shard 1 works again after 200 failures",
    ]


async def test_ps_sync_accumulates_steps_and_pushes_every_n_push() -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(3, 2))
    shard_values = np.full(8, 0.5, dtype=np.float32)
    async with ActorSystem() as system:
        shard = await system.spawn(RecordingShard, 0, shard_values, name="ps-0")
        params = PSSync(layers, [shard], name="g0", n_fetch=2, n_push=2, incarnation=5)
        await params.ready()
        assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in layers.parameters())  # weights from the shard
        grads = []
        for _ in range(3):
            params.zero_grad()
            layers(torch.ones(1, 3)).sum().backward()  # type: ignore[no-untyped-call]
            grads.append(torch.cat([p.grad.reshape(-1) for p in layers.parameters() if p.grad is not None]))
            params.step()
            await params.sync(0)
        pushes = await shard.ask("received")
    assert [(p.replica, p.seq) for p in pushes] == [("g0", 1)]  # after step 2; step 3 waits for step 4
    np.testing.assert_allclose(pushes[0].payload.view(np.float32), (grads[0] + grads[1]).numpy())
    stats = params.stats()
    assert (stats.bytes_pushed, stats.bytes_pulled) == (32, 64)  # one push; the first pull and one after step 2


@pytest.mark.parametrize(("n_fetch", "n_push", "optimizer"), [
    (2, 2, "sgd"), (3, 1, "sgd"), (1, 2, "sgd"),
    (1, 1, "adagrad"), (2, 2, "adagrad"),  # the shipped example's cadence (each parameter's step alone); summed
])
def test_downpour_over_a_shared_store_fetches_every_n_fetch_and_pushes_the_sum_every_n_push(
        n_fetch: int, n_push: int, optimizer: str) -> None:
    """The replica computes on its own copy: the store moves only at a push, by the optimizer on the gradients
    summed since the last one, and by what the other replicas write meanwhile; the copy becomes the store only at a
    fetch, the others' writes with it; :meth:`flush` applies what is left."""
    spec = OptimizerSpec(optimizer, 0.1, eps=1e-10)
    name = f"test-{uuid.uuid4().hex[:12]}"
    start = flatten_parameters(_model())
    store = spec.store([(HOGWILD_SEGMENT, start.size)], shm_name=name)
    store.write(HOGWILD_SEGMENT, start)
    model = _model()
    sync = build_sync(SharedStoreSpec(name, n_fetch=n_fetch, n_push=n_push), model, SyncContext("t", 1, spec))
    x, y = torch.linspace(-1, 1, 32).reshape(8, 4), torch.arange(8) % 2
    expected_store, copy, pending = start.copy(), start.copy(), np.zeros_like(start)
    squares = np.zeros_like(start)

    def stepped(w: np.ndarray, g: np.ndarray) -> np.ndarray:  # torch's SGD and Adagrad, by hand
        if optimizer == "sgd":
            return w - np.float32(0.1) * g  # type: ignore[no-any-return]
        squares[:] += g * g
        return w - np.float32(0.1) * g / (np.sqrt(squares) + np.float32(1e-10))  # type: ignore[no-any-return]

    for step in range(1, 7):
        np.testing.assert_array_equal(flatten_parameters(model), copy)  # the gradient is taken at the copy
        sync.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
        pending += np.concatenate([p.grad.numpy().ravel() for p in model.parameters() if p.grad is not None])
        other = np.full_like(start, 1e-3 * step)  # another replica's write, just before this one's step
        store.add(HOGWILD_SEGMENT, other)
        expected_store = expected_store + other
        sync.step()
        assert all(p.grad is None for p in model.parameters())
        if step % n_push == 0:
            expected_store = stepped(expected_store, pending)
            pending[:] = 0
        if step % n_fetch == 0:
            copy = expected_store.copy()
        np.testing.assert_allclose(store.view(HOGWILD_SEGMENT), expected_store, rtol=1e-5, atol=1e-6)
    asyncio.run(sync.flush())
    if pending.any():
        expected_store = stepped(expected_store, pending)
    np.testing.assert_allclose(store.view(HOGWILD_SEGMENT), expected_store, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="both 0 \\(Hogwild\\) or both >= 1"):
        build_sync(SharedStoreSpec(name, n_fetch=1), _model(), SyncContext("t", 1, spec))
    store.close()


@pytest.mark.parametrize(("outer_lr", "codec"), [(1.0, "none"), (0.5, "none"), (0.5, "threshold")])
async def test_ps_sync_with_local_steps_pushes_the_pseudo_gradient_every_h_steps_and_pulls_the_outer_step(
        outer_lr: float, codec: str) -> None:
    """H = 3 inner SGD steps on the replica, as torch's SGD alone takes them; then one push of ``anchor - now``
    to real PS shards running the outer step (Nesterov, momentum 0 here: ``anchor - lr * pseudo``), and the
    replica's weights become what it pulls. ``lr = 1`` hands the shards the replica's weights; with the
    threshold codec what the shards got plus the residual kept is the pseudo-gradient, and the quantized pull
    (a delta from the anchor) brings the replica within the delta threshold of the shards."""
    h, inner = 3, OptimizerSpec("sgd", 0.1)
    model, reference = _model(), _model()
    anchor = flatten_parameters(model)
    outer = OptimizerSpec("nesterov", outer_lr, momentum=0.0)
    half = anchor.size // 2
    async with ActorSystem() as system:
        shards = [await system.spawn(PSShard, ShardSpec(i, offset, anchor[offset:end].copy(), outer,
                                                        CodecSpec(codec, tau=0.01, delta_tau=1e-4)), name=f"ps-{i}")
                  for i, (offset, end) in enumerate([(0, half), (half, anchor.size)])]
        spec = PSLinkSpec(shards, [0, half], codec=CodecSpec(codec, tau=0.01, delta_tau=1e-4), local_steps=h,
                          inner=inner)
        sync = build_sync(spec, model, SyncContext("trainer-0", 1, OPTIMIZER))
        assert isinstance(sync, PSSync) and sync.optimizer is not None and sync.lr_now() == pytest.approx(0.1)
        await sync.ready()
        assert sync.steps_per_call(0) == h
        x, y = torch.linspace(-1, 1, 32).reshape(8, 4), torch.arange(8) % 2
        alone = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(h):  # one step per call, as a trainer whose steps end early would
            assert sync.stats().pushes == 0 and sync.steps_per_call(step) == h - step
            alone.zero_grad()
            for m in (model, reference):  # a replica never clears .grad itself: the sync's step does
                nn.functional.cross_entropy(m(x), y).backward()  # type: ignore[no-untyped-call]
            sync.step()
            alone.step()
            assert all(p.grad is None for p in model.parameters())
            await sync.sync(8)
        stats = sync.stats()
        assert (stats.pushes, stats.pulls) == (1, 4)  # the first pull and one after the push, of each shard
        pulled = np.concatenate([(await ps.ask(Pull())).values for ps in shards])
        await sync.close()
    local = flatten_parameters(reference)
    sent = (anchor - pulled) / np.float32(outer_lr)
    if codec == "none":
        np.testing.assert_allclose(sent, anchor - local, rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(_weights(model).numpy(), pulled)  # the new anchor
    else:
        residual = np.concatenate([c.residual() for c in sync.link.codecs])  # type: ignore[attr-defined]
        assert 0 < np.count_nonzero(sent) < sent.size
        np.testing.assert_allclose(sent + residual, anchor - local, rtol=1e-4, atol=1e-5)
        assert np.abs(_weights(model).numpy() - pulled).max() < 1e-4 * (1 + 1e-5)
        assert stats.extra["delta_pulls"] >= 1  # a pull after the push came as a delta from the anchor
    assert sync.local is not None
    np.testing.assert_array_equal(sync.local.anchor, _weights(model).numpy())


def test_ps_sync_refuses_local_steps_without_an_inner_optimizer_or_with_another_cadence() -> None:
    for kwargs in ({"inner": None}, {"n_push": 2}, {"n_fetch": 4}):
        with pytest.raises(ValueError, match="local steps need an inner optimizer and n_fetch = n_push = 1"):
            PSSync(_model(), [], name="g", incarnation=1, local_steps=4,
                   **{"inner": OptimizerSpec("adam", 1e-3), **kwargs})  # type: ignore[arg-type]


def test_local_optimizer_steps_with_torch() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(2, 1)
    before = layer.weight.detach().clone()
    opt = LocalOptimizer(layer.parameters(), "sgd", lr=0.5)
    opt.zero_grad()
    layer(torch.ones(1, 2)).sum().backward()  # type: ignore[no-untyped-call]
    opt.step()
    torch.testing.assert_close(layer.weight.detach(), before - 0.5)
    assert (opt.stats().bytes_pushed, opt.stats().bytes_pulled) == (0, 0)
    with pytest.raises(ValueError, match="'nesterov' or 'adagrad', got 'lbfgs'"):
        LocalOptimizer(layer.parameters(), "lbfgs", lr=0.1)


# -- compressed pulls: quantized parameter deltas from real PS shards, over a real socket ------------------------
DELTA_N = 4000
DELTA_TAU = 0.01


def delta_bound(codec: str, diff: np.ndarray, block: int) -> np.ndarray:
    """Per element, the bound DeltaCodec documents for |shard − replica| right after a delta of ``diff``."""
    if codec == "threshold":
        return np.full(diff.size, DELTA_TAU * (1 + 1e-5), dtype=np.float32)  # < tau, up to float32 rounding
    padded = np.zeros(-(-diff.size // block) * block, dtype=np.float32)
    padded[:diff.size] = np.abs(diff)
    block_max = np.repeat(padded.reshape(-1, block).max(axis=1), block)[:diff.size]
    return block_max / 254 * 1.001 + 1e-7 if codec == "int8" else block_max * 1.001 + 1e-7


async def dense(shard: ActorRef) -> Params:
    reply = await shard.ask(Pull(), timeout=10.0)
    assert isinstance(reply, Params)
    return reply


@pytest.mark.parametrize("codec", ["threshold", "int8", "onebit"])
async def test_pulled_deltas_track_the_shard_within_the_codec_bound_and_exactly_at_each_resync(codec: str) -> None:
    from dniasync.remote import WebSocketTransport
    from dniasync.train.ps import PSShard
    from dniasync.train.specs import CodecSpec, OptimizerSpec, ShardSpec

    rng = np.random.default_rng(1)
    block, resync = 64, 4
    spec = ShardSpec(0, 0, rng.normal(0, 0.1, DELTA_N).astype(np.float32), OptimizerSpec("adagrad", 0.03),
                     CodecSpec(codec, 0.01, block, DELTA_TAU, resync))
    async with ActorSystem() as ps_system, ActorSystem() as worker_system:
        async with WebSocketTransport(ps_system) as ps_node, WebSocketTransport(worker_system):
            await ps_system.spawn(PSShard, spec, name="ps-0")
            shard = worker_system.ref(f"ps-0@{ps_node.address}")
            buffer = np.zeros(DELTA_N, dtype=np.float32)
            link = ShardLink(buffer, [(0, DELTA_N)], [shard], replica="r0", incarnation=3, codec=codec, tau=0.01,
                             block=block)
            versions: list[int] = []
            for pull in range(1, 13):
                before = buffer.copy()
                if pull > 1:  # a sparse gradient: a few parameters move, as under threshold-coded pushes
                    grad = np.zeros(DELTA_N, dtype=np.float32)
                    hit = rng.choice(DELTA_N, 40, replace=False)
                    grad[hit] = rng.normal(0, 0.05, hit.size)
                    await link.push(grad, samples=32)  # same connection, same mailbox: applied before the pull
                assert await link.pull()
                truth = await dense(shard)
                versions.append(link.versions[0])
                assert link.versions[0] == truth.version  # the version of the state the answer brought
                if pull % resync == 1:  # pulls 1, 5, 9: dense, bit for bit
                    np.testing.assert_array_equal(buffer, truth.values)
                else:
                    diff = truth.values - before
                    error = np.abs(truth.values - buffer)
                    assert (error <= delta_bound(codec, diff, block)).all(), (pull, float(error.max()))
                    assert not np.array_equal(buffer, before)  # the delta moved the copy
            assert link.dense_pulls == 3 and link.delta_pulls == 9
            assert versions == sorted(versions) and versions[-1] > versions[0]
            assert link.bytes_pulled < link.dense_bytes_pulled == 12 * 4 * DELTA_N


async def test_a_replica_that_missed_an_answer_or_meets_a_new_shard_gets_a_dense_pull() -> None:
    from dniasync.train.messages import PullDelta
    from dniasync.train.ps import PSShard
    from dniasync.train.specs import CodecSpec, OptimizerSpec, ShardSpec

    values = np.linspace(-1, 1, DELTA_N, dtype=np.float32)
    spec = ShardSpec(0, 0, values, OptimizerSpec("adagrad", 0.05), CodecSpec("threshold", 0.01, 256, DELTA_TAU, 1000))
    grad = np.ones(DELTA_N, dtype=np.float32)
    async with ActorSystem() as system:
        shard = await system.spawn(PSShard, spec, name="ps-0")
        buffer = np.zeros(DELTA_N, dtype=np.float32)
        link = ShardLink(buffer, [(0, DELTA_N)], [shard], replica="r0", incarnation=3, codec="threshold", tau=0.01)
        assert await link.pull() and await link.pull()
        assert (link.dense_pulls, link.delta_pulls) == (1, 1)

        # an answer the shard sent but the replica never applied (a timeout, a dropped connection)
        await link.push(grad, samples=1)
        await shard.ask(PullDelta("r0", 3, *link._answers[0]), timeout=10.0)
        await link.push(grad, samples=1)
        assert await link.pull()
        assert (link.dense_pulls, link.delta_pulls) == (2, 1)
        np.testing.assert_array_equal(buffer, (await dense(shard)).values)

        # a new incarnation of the shard (a restart from a snapshot): the replica's echo names the old one
        await link.push(grad, samples=1)
        truth = await dense(shard)
        restarted = await system.spawn(PSShard, ShardSpec(0, 0, truth.values, spec.optimizer, spec.codec),
                                       name="ps-0-restarted")
        link.shards[0] = restarted
        assert await link.pull()
        assert (link.dense_pulls, link.delta_pulls) == (3, 1)
        np.testing.assert_array_equal(buffer, truth.values)
        assert await link.pull()
        assert (link.dense_pulls, link.delta_pulls) == (3, 2)

        # a new incarnation of the replica that reuses its name: the shard's copy is not its own
        again = ShardLink(buffer, [(0, DELTA_N)], [restarted], replica="r0", incarnation=4, codec="threshold",
                          tau=0.01)
        again._answers = list(link._answers)
        assert await again.pull()
        assert (again.dense_pulls, again.delta_pulls) == (1, 0)


async def test_a_replica_that_holds_the_values_a_shard_started_from_gets_a_delta_at_its_first_pull() -> None:
    """Every process builds the same seeded model: a replica's first pull names its copy by digest, and the
    shard that started from those values answers with the change since then (a delta) instead of a dense copy;
    a replica whose copy differs (another seed, a shard restarted elsewhere) gets the dense copy."""
    from dniasync.train.ps import PSShard
    from dniasync.train.specs import CodecSpec, OptimizerSpec, ShardSpec

    start = np.random.default_rng(5).normal(0, 0.1, DELTA_N).astype(np.float32)
    spec = ShardSpec(0, 0, start.copy(), OptimizerSpec("adagrad", 0.05), CodecSpec("threshold", 0.01, 256, DELTA_TAU, 1000))
    grad = np.zeros(DELTA_N, dtype=np.float32)
    grad[:50] = 1.0
    async with ActorSystem() as system:
        shard = await system.spawn(PSShard, spec, name="ps-0")
        other = ShardLink(np.zeros(DELTA_N, dtype=np.float32), [(0, DELTA_N)], [shard], replica="r1", incarnation=1,
                          codec="threshold", tau=0.01)
        await other.push(grad, samples=32)  # the shard moved on from its start before r0 first pulls
        buffer = start.copy()
        link = ShardLink(buffer, [(0, DELTA_N)], [shard], replica="r0", incarnation=1, codec="threshold", tau=0.01)
        assert await link.pull()
        assert (link.dense_pulls, link.delta_pulls) == (0, 1)
        truth = (await dense(shard)).values
        assert not np.array_equal(truth, start) and np.abs(truth - buffer).max() < DELTA_TAU * (1 + 1e-5)
        assert link.bytes_pulled < 4 * DELTA_N / 10
        assert await other.pull()  # a copy of other values: dense
        assert (other.dense_pulls, other.delta_pulls) == (1, 0)
        np.testing.assert_array_equal(other.buffer, truth)


@pytest.mark.parametrize("kind", ["sgd", "momentum", "nesterov", "adagrad", "adam"])
def test_a_fused_optimizer_takes_a_gradient_laid_out_otherwise_than_its_parameter(kind: str) -> None:
    """torch's fused CPU kernels read a gradient's memory as if laid out as the parameter: a transposed gradient
    (as ``torch.autograd.grad`` can give) stepped the transpose's values. ``make_optimizer`` lays it out first:
    the fused optimizer takes the default one's steps."""
    from dniasync.train.sync import make_optimizer

    torch.manual_seed(0)
    start = torch.randn(64, 32)
    fast, plain = nn.Parameter(start.clone()), nn.Parameter(start.clone())
    fused = make_optimizer([fast], kind, 0.05, momentum=0.9)
    default = make_optimizer([plain], kind, 0.05, momentum=0.9, fused=False)
    assert fused.defaults.get("fused") and not default.defaults.get("fused")  # this torch fuses each of them
    for _ in range(3):
        grad = torch.randn(32, 64).t()  # (64, 32), not contiguous
        fast.grad, plain.grad = grad, grad.clone()
        fused.step()
        default.step()
    assert not torch.equal(fast, start)
    torch.testing.assert_close(fast, plain)
