"""DNI placed across nodes: every stage on its own ActorSystem, talking over loopback websockets.

The driver holds only refs by address (``stage-k@host:port``); every
activation, gradient, eval batch and parameter copy crosses the wire codec.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn

from dniasync import ActorRef, ActorSystem, Directive
from dniasync.remote import WebSocketTransport
from dniasync.train.pipeline import (
    PipelineBroken,
    PipelineDriver,
    Schedule,
    Stage,
    StageSettings,
    StatsRequest,
    build_stages,
    train_backprop,
)

torch.set_num_threads(1)

GROUPS = [[0, 1], [2, 3], [4]]


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    return x[perm[:1400]], y[perm[:1400]], x[perm[1400:]], y[perm[1400:]]


@asynccontextmanager
async def placed(
    model: nn.Sequential, settings: StageSettings
) -> AsyncIterator[tuple[WebSocketTransport, list[WebSocketTransport], list[ActorRef]]]:
    """A driver node plus one node per stage; yields refs to the stages as the driver sees them."""
    async with AsyncExitStack() as stack:
        nodes = []
        for _ in range(1 + len(GROUPS)):
            system = await stack.enter_async_context(ActorSystem())
            nodes.append(await stack.enter_async_context(WebSocketTransport(system)))
        driver_node, group_nodes = nodes[0], nodes[1:]
        # each node would build the model from the same factory and seed and keep its slice
        for k, (node, spec) in enumerate(zip(group_nodes, build_stages(model, GROUPS, settings, 64))):
            await node.system.spawn(Stage, *spec.args(), name=f"stage-{k}", supervision=Directive.STOP)
        refs = [driver_node.system.ref(f"stage-{k}@{node.address}") for k, node in enumerate(group_nodes)]
        yield driver_node, group_nodes, refs


async def test_sync_pipeline_across_nodes_reproduces_backprop(digits: tuple[torch.Tensor, ...]) -> None:
    x, y = digits[0][:256], digits[1][:256]
    reference = mlp(seed=4)
    train_backprop(reference, x, y, epochs=1, batch_size=32, seed=2)
    model = mlp(seed=4)
    untouched = copy.deepcopy(model)
    async with placed(model, StageSettings(rule="sync")) as (driver_node, _, refs):
        async with PipelineDriver(driver_node.system, refs, Schedule(micro_batches=2, flush=True)) as driver:
            await driver.train(x, y, epochs=1, batch_size=32, seed=2)
            states = await driver.states()  # parameters copied over the wire
    want = reference.state_dict()
    got = {f"{g[int(n.split('.')[0])]}.{n.split('.')[1]}": t for g, s in zip(GROUPS, states) for n, t in s.items()}
    assert got.keys() == want.keys()
    for key in want:
        assert not torch.equal(want[key], untouched.state_dict()[key])
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


async def test_cdni_across_nodes_learns_and_reports_a_dead_node(digits: tuple[torch.Tensor, ...]) -> None:
    xtr, ytr, xte, yte = digits
    settings = StageSettings(rule="cdni", lr=3e-4, sg_hidden_layers=0)
    async with placed(mlp(), settings) as (driver_node, group_nodes, refs):
        schedule = Schedule(max_in_flight=4)
        async with PipelineDriver(driver_node.system, refs, schedule, liveness_interval_s=0.2) as driver:
            before, _ = await driver.evaluate(xte, yte)
            result = await driver.train(xtr, ytr, epochs=3, batch_size=32, eval_x=xte, eval_y=yte)
            assert result.final_accuracy > max(0.5, before + 0.3), [p.accuracy for p in result.history]
            assert all(s.sg_steps > 0 for s in result.stats[:2])

            training = asyncio.create_task(driver.train(xtr, ytr, epochs=100, batch_size=32))
            while (await refs[2].ask(StatsRequest())).steps < result.stats[2].steps + 5:
                pass
            await group_nodes[1].close()  # the middle stage's node goes away
            async with asyncio.timeout(20):
                with pytest.raises(PipelineBroken) as err:
                    await training
    assert err.value.address in (refs[1].address, refs[0].address, refs[2].address)
    assert refs[1].address in str(err.value), str(err.value)
