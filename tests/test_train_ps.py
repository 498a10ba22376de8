"""PS shard semantics, exact numbers: idempotent pushes, fencing, staleness, bad gradients."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from dniasync import ActorSystem
from dniasync.train.compression import make_codec
from dniasync.train.messages import Fence, Params, ParamsDelta, Pull, PullDelta, Push, ShardStats
from dniasync.train.ps import PSShard
from dniasync.train.specs import CodecSpec, OptimizerSpec, ShardSpec
from dniasync.train.staleness import StalenessPolicy

N = 8


def push(seq: int, grad: float | np.ndarray, *, replica: str = "r0", incarnation: int = 1, version: int = 0) -> Push:
    values = np.full(N, grad, dtype=np.float32) if isinstance(grad, float) else grad
    return Push(replica, incarnation, seq, version, "none", values.view(np.uint8), 32)


async def spawn_shard(system: ActorSystem, lr: float = 0.01, staleness: str = "none", max_staleness: int = 0) -> object:
    spec = ShardSpec(0, 0, np.zeros(N, np.float32), OptimizerSpec("sgd", lr), staleness=staleness,
                     max_staleness=max_staleness)
    return await system.spawn(PSShard, spec, name="ps-0")


async def values(ref: object) -> tuple[int, np.ndarray]:
    reply: Params = await ref.ask(Pull())  # type: ignore[attr-defined]
    return reply.version, reply.values


async def test_a_push_is_applied_once_however_often_it_arrives() -> None:
    async with ActorSystem() as system:
        shard = await spawn_shard(system, lr=1.0)
        base, _ = await values(shard)
        for _ in range(3):
            await shard.tell(push(1, 1.0, version=base))  # type: ignore[attr-defined]
        await shard.tell(push(2, 1.0, version=base))  # type: ignore[attr-defined]
        version, w = await values(shard)
        assert version == base + 2
        np.testing.assert_array_equal(w, np.full(N, -2.0, np.float32))
        stats = await shard.ask(ShardStats())  # type: ignore[attr-defined]
        assert stats["applied"] == 2 and stats["rejected"]["duplicate"] == 2


async def test_old_incarnations_and_fenced_replicas_are_refused() -> None:
    async with ActorSystem() as system:
        shard = await spawn_shard(system, lr=1.0)
        await shard.tell(push(5, 1.0, incarnation=2))  # type: ignore[attr-defined]
        await shard.tell(push(9, 1.0, incarnation=1))  # type: ignore[attr-defined]  # a zombie of the old process
        await shard.tell(Fence("r1"))  # type: ignore[attr-defined]
        await shard.tell(push(1, 1.0, replica="r1"))  # type: ignore[attr-defined]
        _, w = await values(shard)
        np.testing.assert_array_equal(w, np.full(N, -1.0, np.float32))
        stats = await shard.ask(ShardStats())  # type: ignore[attr-defined]
        assert stats["rejected"]["zombie"] == 2


async def test_inverse_staleness_divides_the_learning_rate() -> None:
    async with ActorSystem() as system:
        shard = await spawn_shard(system, lr=0.5, staleness="inverse")
        base, _ = await values(shard)
        # all three computed on the base version: staleness 0, 1, 2 -> lr 0.5, 0.5, 0.25
        for seq in (1, 2, 3):
            await shard.tell(push(seq, 1.0, version=base))  # type: ignore[attr-defined]
        version, w = await values(shard)
        assert version == base + 3
        np.testing.assert_allclose(w, np.full(N, -1.25, np.float32))
        stats = await shard.ask(ShardStats())  # type: ignore[attr-defined]
        assert stats["staleness_sum"] == 3 and stats["staleness_counts"][:3] == [1, 1, 1]


async def test_bound_staleness_drops_and_counts_stale_pushes() -> None:
    async with ActorSystem() as system:
        shard = await spawn_shard(system, lr=1.0, staleness="bound", max_staleness=1)
        base, _ = await values(shard)
        for seq in (1, 2, 3, 4):
            await shard.tell(push(seq, 1.0, version=base))  # type: ignore[attr-defined]  # staleness 0, 1, 2, 2
        await shard.tell(push(5, 1.0, version=base + 2))  # type: ignore[attr-defined]  # fresh again
        version, w = await values(shard)
        assert version == base + 3
        np.testing.assert_array_equal(w, np.full(N, -3.0, np.float32))
        stats = await shard.ask(ShardStats())  # type: ignore[attr-defined]
        assert stats["rejected"]["stale"] == 2


async def test_nonfinite_gradients_are_rejected_and_counted() -> None:
    async with ActorSystem() as system:
        shard = await spawn_shard(system, lr=1.0)
        base, _ = await values(shard)
        bad = np.ones(N, np.float32)
        bad[3] = np.nan
        await shard.tell(push(1, bad, version=base))  # type: ignore[attr-defined]
        await shard.tell(push(2, 1.0, version=base))  # type: ignore[attr-defined]
        version, w = await values(shard)
        assert version == base + 1 and np.isfinite(w).all()
        np.testing.assert_array_equal(w, np.full(N, -1.0, np.float32))
        stats = await shard.ask(ShardStats())  # type: ignore[attr-defined]
        assert stats["rejected"]["nonfinite"] == 1


async def test_a_push_is_applied_with_the_lr_times_its_lr_scale_and_a_bad_scale_is_refused() -> None:
    """The lr scale a trainer's steps had (the DNI gate, pipeline.lr_decay) travels with the push: the shard runs the
    optimizer, and scaling the gradient instead would not scale Adam's step."""
    async with ActorSystem() as system:
        shard = await spawn_shard(system, lr=1.0)
        base, _ = await values(shard)
        await shard.tell(dataclasses.replace(push(1, 1.0, version=base), lr_scale=0.25))  # type: ignore[attr-defined]
        for seq, scale in ((2, float("nan")), (3, -1.0), (4, float("inf"))):
            bad = dataclasses.replace(push(seq, 1.0, version=base), lr_scale=scale)
            await shard.tell(bad)  # type: ignore[attr-defined]
        version, w = await values(shard)
        assert version == base + 1
        np.testing.assert_array_equal(w, np.full(N, -0.25, np.float32))
        stats = await shard.ask(ShardStats())  # type: ignore[attr-defined]
        assert stats["rejected"]["bad_payload"] == 3 and stats["lr_last"] == 0.25


async def test_quantized_pushes_apply_straight_into_the_store() -> None:
    tau = 0.25
    async with ActorSystem() as system:
        spec = ShardSpec(0, 0, np.zeros(N, np.float32), OptimizerSpec("sgd", 1.0), CodecSpec("threshold", tau))
        shard = await system.spawn(PSShard, spec, name="ps-0")
        codec = make_codec("threshold", N, tau=tau)
        grad = np.array([0.3, -0.3, 0.1, 0.0, 0.5, -0.6, 0.2, 0.24], np.float32)
        sent = codec.compress(grad)
        await shard.tell(Push("r0", 1, 1, 0, "threshold", sent.payload, 32))  # type: ignore[attr-defined]
        _, w = await values(shard)
        # +-tau where the value reached tau, the rest stays in the sender's residual
        np.testing.assert_allclose(w, -np.array([tau, -tau, 0, 0, tau, -tau, 0, 0], np.float32))
        np.testing.assert_allclose(codec.residual(), grad - np.array([tau, -tau, 0, 0, tau, -tau, 0, 0]), atol=1e-7)


def test_unknown_staleness_policy_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown staleness policy"):
        StalenessPolicy("random")


@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])  # Adam: the restarted shard continues the step count
async def test_a_shard_restarted_from_its_snapshot_continues_exactly(optimizer: str) -> None:
    from dniasync.train.messages import ShardSnapshot, SnapshotShard
    from dniasync.train.specs import ShardResume

    opt = OptimizerSpec(optimizer, 0.5, eps=1e-10)
    async with ActorSystem() as system:
        first = await system.spawn(PSShard, ShardSpec(0, 0, np.zeros(N, np.float32), opt), name="ps-0")
        for seq in (1, 2, 3):
            await first.tell(push(seq, np.linspace(-1, 1, N, dtype=np.float32) * seq))
        snap: ShardSnapshot = await first.ask(SnapshotShard())
        await first.tell(Fence("zombie"))
        assert len(snap.state) == {"adagrad": 1, "adam": 2}[optimizer] and snap.version >= 3  # the rule's slots
        assert snap.steps == 3
        resume = ShardResume(snap.version, snap.state, snap.ledger, snap.fenced, snap.steps)
        second = await system.spawn(PSShard, ShardSpec(0, 0, snap.values, opt, resume=resume), name="ps-0b")
        version, w = await values(second)
        assert version == snap.version
        np.testing.assert_array_equal(w, snap.values)
        await second.tell(push(3, np.ones(N, np.float32)))  # applied before the snapshot: a duplicate
        await first.tell(push(4, np.ones(N, np.float32)))
        await second.tell(push(4, np.ones(N, np.float32)))
        (v1, w1), (v2, w2) = await values(first), await values(second)
        assert v2 == snap.version + 1 and v2 == v1  # the same step from the same state: the same result
        np.testing.assert_array_equal(w1, w2)
        stats = await second.ask(ShardStats())
        assert stats["rejected"]["duplicate"] == 1


async def test_pulls_are_deltas_between_dense_resyncs_and_dense_without_a_codec() -> None:
    opt = OptimizerSpec("sgd", 1.0)
    async with ActorSystem() as system:
        coded = await system.spawn(PSShard, ShardSpec(0, 0, np.zeros(N, np.float32), opt,
                                                       CodecSpec("threshold", 0.25, 256, 0.25, 3)), name="ps-0")
        plain = await system.spawn(PSShard, ShardSpec(1, 0, np.zeros(N, np.float32), opt), name="ps-1")
        answers: list[ParamsDelta] = []
        echo = (0, 0)
        grad = np.zeros(N, np.float32)
        grad[[1, 5]] = -0.5
        for seq in range(1, 6):
            await coded.tell(push(seq, grad))  # +0.5 on two elements per push
            reply: ParamsDelta = await coded.ask(PullDelta("r0", 1, *echo))
            answers.append(reply)
            echo = (reply.stream, reply.seq)
        assert [a.dense for a in answers] == [True, False, False, True, False]  # every 3rd pull dense
        assert [a.codec for a in answers] == ["none", "threshold", "threshold", "none", "threshold"]
        # each delta: +0.5 is two thresholds on two elements: their indices (uint32) and counts (int8)
        assert [len(a.parts) for a in answers if not a.dense] == [2, 2, 2]
        assert [a.version for a in answers] == sorted({a.version for a in answers})  # strictly increasing
        np.testing.assert_array_equal(answers[3].parts[0], -4 * grad)
        index, counts = answers[4].parts
        assert np.asarray(index).view(np.uint32).tolist() == [1, 5]
        assert np.asarray(counts).view(np.int8).tolist() == [2, 2]  # +2 tau at indices 1 and 5

        await coded.tell(Fence("r0"))  # a fenced replica's copy is forgotten: a later echo gets a dense answer
        after: ParamsDelta = await coded.ask(PullDelta("r0", 1, *echo))
        assert after.dense
        stats = await coded.ask(ShardStats())
        assert (stats["dense_pulls"], stats["delta_pulls"]) == (3, 3)

        reply = await plain.ask(PullDelta("r0", 1, 0, 0))
        again = await plain.ask(PullDelta("r0", 1, reply.stream, reply.seq))
        assert reply.dense and again.dense  # no codec: every answer dense, as a plain Pull


async def test_a_shard_resumed_from_a_checkpoint_file_takes_adams_next_step_as_the_shard_it_came_from(
    tmp_path: Path,
) -> None:
    """The job's resume path (``--resume``): the snapshot written to a checkpoint and read back, step count
    included (without it Adam's bias correction starts again at step 1: a step several times too small)."""
    from dniasync.cluster import durable
    from dniasync.train.checkpoint import CheckpointStore, Part
    from dniasync.train.messages import ShardSnapshot, SnapshotShard

    opt = OptimizerSpec("adam", 0.05)
    spec = ShardSpec(0, 0, np.zeros(N, np.float32), opt)
    store = CheckpointStore(tmp_path, "job", {"job": {"name": "job"}})
    async with ActorSystem() as system:
        first = await system.spawn(PSShard, spec, name="ps-0")
        for seq in range(1, 8):
            await first.tell(push(seq, np.linspace(-1, 1, N, dtype=np.float32) * seq))
        snap: ShardSnapshot = await first.ask(SnapshotShard())
        assert snap.steps == 7
        durable.write(store, durable.shard_parts({0: snap}), {"wall_s": 1.0})
        loaded = store.latest()
        assert loaded is not None
        (resumed,) = durable.resumed_specs([spec], loaded)
        assert resumed.resume is not None and resumed.resume.steps == 7
        second = await system.spawn(PSShard, resumed, name="ps-0b")
        await first.tell(push(8, np.ones(N, np.float32)))
        await second.tell(push(8, np.ones(N, np.float32)))
        (_, w1), (_, w2) = await values(first), await values(second)
        np.testing.assert_array_equal(w1, w2)
    # a checkpoint written before shards saved their count: its version (which counts every step) stands in
    old = CheckpointStore(tmp_path / "old", "job", {"job": {"name": "job"}})
    part = durable.shard_parts({0: snap})["ps-0"]
    durable.write(old, {"ps-0": Part(part.tensors, {k: v for k, v in part.meta.items() if k != "steps"})},
                  {"wall_s": 1.0})
    loaded = old.latest()
    assert loaded is not None and "steps" not in loaded.part_meta("ps-0")
    (resumed,) = durable.resumed_specs([spec], loaded)
    assert resumed.resume is not None and resumed.resume.steps == snap.version >= 7
