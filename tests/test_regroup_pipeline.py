"""Moving layers between running stages (in one process; the job-level tests run real processes).

A move keeps the model's function, carries the optimizer state with the
layers (training across a move equals training without it), and loses or
repeats no batch, for every update rule.
"""

from __future__ import annotations

import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

from dniasync import ActorSystem
from dniasync.train.pipeline import (
    PipelineDriver,
    Schedule,
    StageSettings,
    batch_order,
    spawn_stages,
    train_backprop,
)
from dniasync.cluster.modes._pipeline_job import merge_stage_states as _merged
from dniasync.train.pipeline.protocol import StageState, StateRequest

torch.set_num_threads(1)

BEFORE = [[0, 1, 2, 3], [4]]
AFTER = [[0, 1], [2, 3, 4]]
RULES = ["sync", "async", "stash", "spectrain", "spectrain_stash", "dni", "cdni"]


def mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 10))


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    return torch.tensor(data.data / 16.0, dtype=torch.float32), torch.tensor(data.target, dtype=torch.int64)


@pytest.mark.parametrize("rule", RULES)
async def test_a_move_mid_training_keeps_the_function_and_every_batch(
    digits: tuple[torch.Tensor, torch.Tensor], rule: str
) -> None:
    x, y = digits[0][:256], digits[1][:256]
    settings = StageSettings(rule=rule, optimizer="adam", lr=1e-3, max_in_flight=4, sg_hidden_layers=0)
    batches = [idx for _, idx in batch_order(256, 32, epochs=2, seed=1)]
    probe_x, probe_y = digits[0][1000:1200], digits[1][1000:1200]
    seen: dict[str, object] = {}
    async with ActorSystem() as system:
        refs = await spawn_stages(system, mlp(seed=3), BEFORE, settings, 64)
        schedule = Schedule.for_rule(rule, max_in_flight=4, micro_batches=1)
        async with PipelineDriver(system, refs, schedule) as driver:
            fed = 0

            async def between() -> None:
                nonlocal fed
                fed += 1
                if fed == 5:
                    await driver.drain()
                    seen["before"] = await driver.evaluate(probe_x, probe_y)
                    await driver.stats()  # the stages' loss records are read up to here
                    seen["states"] = _merged(BEFORE, await driver.states())
                    seen["moves"] = await driver.regroup(BEFORE, AFTER)
                    await driver.stats()  # ... and read again at once, before the new rules recorded anything
                    seen["after"] = await driver.evaluate(probe_x, probe_y)
                    seen["states_after"] = _merged(AFTER, await driver.states())

            result = await driver.train(x, y, batches, between=between)
    moves = seen["moves"]
    assert isinstance(moves, list) and len(moves) == 1
    assert moves[0].layers == [2, 3] and (moves[0].source, moves[0].target) == (0, 1) and moves[0].bytes > 0
    assert seen["before"] == seen["after"]
    before, after = seen["states"], seen["states_after"]
    assert isinstance(before, dict) and isinstance(after, dict) and before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert result.samples == 256 * 2
    assert driver.samples_done == 256 * 2  # every batch reached the loss once
    assert [s.steps for s in result.stats] == [len(batches), len(batches)]
    assert [s.first_layer for s in result.stats] == [0, 2]
    assert [len(s.layer_seconds) for s in result.stats] == [2, 3]


async def test_training_across_a_move_equals_training_without_it(digits: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One batch in flight: the pipeline is backprop; moving layers 2-3 (and their Adam moments) to the other
    stage after 4 steps changes nothing in the 8 that follow."""
    x, y = digits[0][:192], digits[1][:192]
    reference = mlp(seed=5)
    train_backprop(reference, x, y, epochs=2, batch_size=32, seed=2, lr=1e-3, optimizer="adam")
    settings = StageSettings(rule="async", optimizer="adam", lr=1e-3, max_in_flight=1)
    batches = [idx for _, idx in batch_order(192, 32, epochs=2, seed=2)]
    async with ActorSystem() as system:
        refs = await spawn_stages(system, mlp(seed=5), BEFORE, settings, 64)
        async with PipelineDriver(system, refs, Schedule(max_in_flight=1)) as driver:
            fed = 0

            async def between() -> None:
                nonlocal fed
                fed += 1
                if fed == 4:
                    await driver.regroup(BEFORE, AFTER)

            await driver.train(x, y, batches, between=between)
            got = _merged(AFTER, await driver.states())
    want = reference.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


async def test_moves_across_several_boundaries_and_back(digits: tuple[torch.Tensor, torch.Tensor]) -> None:
    torch.manual_seed(2)
    deep = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(64, 64), nn.ReLU())), nn.Linear(64, 10))
    start, goal = [[0, 1, 2, 3, 4, 5], [6, 7], [8]], [[0, 1], [2, 3], [4, 5, 6, 7, 8]]
    x, y = digits[0][:64], digits[1][:64]
    settings = StageSettings(rule="sync", optimizer="adam", lr=1e-3)
    async with ActorSystem() as system:
        refs = await spawn_stages(system, deep, start, settings, 64)
        async with PipelineDriver(system, refs, Schedule.for_rule("sync", micro_batches=1)) as driver:
            want = await driver.evaluate(x, y)
            moves = await driver.regroup(start, goal)
            assert await driver.evaluate(x, y) == want
            crossed: dict[int, int] = {}
            for move in moves:
                for layer in move.layers:
                    crossed[layer] = crossed.get(layer, 0) + 1
            assert crossed[4] == crossed[5] == 2  # from stage 0 to stage 2, one boundary at a time
            assert [s.first_layer for s in await driver.stats()] == [0, 2, 4]
            await driver.regroup(goal, start)
            assert await driver.evaluate(x, y) == want
            stats = await driver.stats()
    assert [s.first_layer for s in stats] == [0, 6, 8]


async def test_a_stage_refuses_to_give_away_its_last_layer(digits: tuple[torch.Tensor, torch.Tensor]) -> None:
    from dniasync.train.pipeline.protocol import ReleaseLayers

    settings = StageSettings(rule="sync", optimizer="adam", lr=1e-3)
    async with ActorSystem() as system:
        refs = await spawn_stages(system, mlp(seed=1), BEFORE, settings, 64)
        async with PipelineDriver(system, refs, Schedule.for_rule("sync", micro_batches=1)):
            with pytest.raises(ValueError, match="keeps at least one"):
                await refs[1].ask(ReleaseLayers(1, "front"), timeout=30)


async def test_a_receiver_lost_during_a_move_breaks_the_pipeline_and_the_giver_keeps_its_layers(
    digits: tuple[torch.Tensor, torch.Tensor]
) -> None:
    from dniasync.train.pipeline import PipelineBroken

    settings = StageSettings(rule="sync", optimizer="adam", lr=1e-3)
    async with ActorSystem() as system:
        refs = await spawn_stages(system, mlp(seed=1), BEFORE, settings, 64)
        async with PipelineDriver(system, refs, Schedule.for_rule("sync", micro_batches=1)) as driver:
            want = (await driver.states())[0]
            await system.stop(refs[1])
            with pytest.raises(PipelineBroken, match="stage-1"):
                await driver.regroup(BEFORE, AFTER)
            got = await refs[0].ask(StateRequest(), timeout=30)
    assert isinstance(got, StageState)
    assert got.names == list(want) and all(torch.equal(a, want[n]) for n, a in zip(got.names, got.tensors))


@pytest.mark.parametrize("rule", ["cdni", "spectrain"])
async def test_a_cnn_moves_a_convolutional_block_with_its_batch_norm_statistics(
    digits: tuple[torch.Tensor, torch.Tensor], rule: str
) -> None:
    """The second conv block (Conv2d, BatchNorm2d with its running statistics, ReLU, MaxPool2d) moves to the
    other stage mid-training: the boundary activations become 4-D, the rules rebuild for the new shape (cDNI a
    convolutional SG model), the function is unchanged and training goes on."""
    from dniasync.train.models import cnn

    torch.manual_seed(4)
    model = cnn(image=(1, 8, 8), channels=(4, 8), hidden=32)
    before, after = [list(range(9)), list(range(9, 13))], [list(range(5)), list(range(5, 13))]
    x, y = digits[0][:256], digits[1][:256]
    probe_x, probe_y = digits[0][1000:1200], digits[1][1000:1200]
    optimizer = ("sgd", 0.9) if rule == "spectrain" else ("adam", 0.0)
    settings = StageSettings(rule=rule, optimizer=optimizer[0], momentum=optimizer[1], lr=0.02 if rule == "spectrain"
                             else 1e-3, max_in_flight=4, sg_hidden_layers=0)
    batches = [idx for _, idx in batch_order(256, 32, epochs=3, seed=1)]
    seen: dict[str, object] = {}
    async with ActorSystem() as system:
        refs = await spawn_stages(system, model, before, settings, 64)
        async with PipelineDriver(system, refs, Schedule.for_rule(rule, max_in_flight=4)) as driver:
            fed = 0

            async def between() -> None:
                nonlocal fed
                fed += 1
                if fed == 8:
                    await driver.drain()
                    seen["before"] = await driver.evaluate(probe_x, probe_y)
                    seen["moves"] = await driver.regroup(before, after)
                    seen["after"] = await driver.evaluate(probe_x, probe_y)

            result = await driver.train(x, y, batches, between=between)
    moves = seen["moves"]
    assert isinstance(moves, list) and [m.layers for m in moves] == [[5, 6, 7, 8]]
    assert seen["before"] == seen["after"]
    assert driver.samples_done == 3 * 256
    assert [s.steps for s in result.stats] == [len(batches), len(batches)]
    assert [s.first_layer for s in result.stats] == [0, 5]
