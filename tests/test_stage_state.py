"""A stage's saved state is all that steers its training: rolled back to it, the same batches give the same weights.

In one process (real actors, real stages); the job-level tests kill real processes. One batch in flight at a
time, so every run of the same batches is the same computation, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.numpy
import torch
from sklearn.datasets import load_digits
from torch import nn

from dniasync import ActorSystem
from dniasync.train.pipeline import PipelineDriver, Schedule, StageSettings, batch_order, spawn_stages
from dniasync.train.pipeline.stage_state import FetchHeld, Held, HoldStage, RestoreStage, StageCheckpoint

torch.set_num_threads(1)

CASES = {
    "cdni+inputs": dict(rule="cdni", optimizer="adam", synthetic_inputs=True),
    "dni": dict(rule="dni", optimizer="sgd"),
    "spectrain": dict(rule="spectrain", optimizer="sgd", momentum=0.9),
    "stash": dict(rule="stash", optimizer="adam"),
    "sync": dict(rule="sync", optimizer="adam"),
}


def mlp() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 10))


def through_file(state: StageCheckpoint, path: Path) -> StageCheckpoint:
    """The state as a checkpoint file holds it (safetensors, numpy) and reads it back."""
    safetensors.numpy.save_file({n: t.numpy() for n, t in zip(state.names, state.tensors)}, str(path))
    loaded = safetensors.numpy.load_file(str(path))
    return StageCheckpoint(state.first_layer, state.n_layers, state.names,
                           [torch.from_numpy(loaded[n].copy()) for n in state.names])


@pytest.mark.parametrize("case", list(CASES))
async def test_a_rolled_back_pipeline_trains_the_same_batches_to_the_same_weights(case: str, tmp_path: Path) -> None:
    data = load_digits()
    x = torch.tensor(data.data[:320] / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target[:320], dtype=torch.int64)
    batches = [idx for _, idx in batch_order(320, 32, epochs=2, seed=1)]
    first, second = batches[:10], batches[10:]
    kwargs = dict(CASES[case])
    settings = StageSettings(lr=1e-2, max_in_flight=1, num_classes=10, **kwargs)  # type: ignore[arg-type]
    async with ActorSystem() as system:
        refs = await spawn_stages(system, mlp(), [[0, 1], [2, 3], [4]], settings, 64)
        schedule = Schedule.for_rule(settings.rule, max_in_flight=1, micro_batches=2)
        async with PipelineDriver(system, refs, schedule, synthetic_inputs=settings.synthetic_inputs) as driver:
            await driver.train(x, y, iter(first))
            for ref in refs:  # each stage copies its state in place, and trains on
                held = await ref.ask(HoldStage(7), timeout=30.0)
                assert isinstance(held, Held) and held.capture == 7 and held.nbytes > 0
            await driver.train(x, y, iter(second))
            once = await driver.states()
            await driver.train(x, y, iter(first))  # more training, which the rollback must undo
            saved = []
            for k, ref in enumerate(refs):  # the copies, taken after all that training: still the state at the hold
                with pytest.raises(ValueError, match="capture 6 is not held here"):
                    await ref.ask(FetchHeld(6), timeout=30.0)
                state = await ref.ask(FetchHeld(7), timeout=30.0)
                assert isinstance(state, StageCheckpoint)
                saved.append(through_file(state, tmp_path / f"stage-{k}.safetensors"))
            with pytest.raises(ValueError, match="it holds none"):  # let go once sent
                await refs[0].ask(FetchHeld(7), timeout=30.0)
            for ref, state in zip(refs, saved):
                assert await ref.ask(RestoreStage(state.first_layer, state.names, state.tensors), timeout=30.0)
            await driver.train(x, y, iter(second))
            again = await driver.states()
    names = {n.split(".", 1)[0] for s in saved for n in s.names}
    if settings.rule in ("dni", "cdni"):
        assert {"layers", "sg", "sg_agreement"} <= names, names
    if settings.optimizer == "adam" or settings.momentum:  # plain SGD keeps no state
        assert {"opt"} <= names and (settings.rule not in ("dni", "cdni") or "sg_opt" in names), names
    if settings.synthetic_inputs:
        assert {"input", "input_opt"} <= names, names
    for k, (a, b) in enumerate(zip(once, again, strict=True)):
        for name in a:
            assert torch.equal(a[name], b[name]), f"stage {k} {name} differs after the rollback"
