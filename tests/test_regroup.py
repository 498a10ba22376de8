"""Dynamic regrouping, the parts that need no cluster: the split policy and moving layers with their state."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import torch
from torch import nn

from dniasync.train.pipeline.regroup import (
    BalancePolicy,
    LayerClock,
    Regrouper,
    StageCosts,
    best_split,
    bottleneck,
    drop_from_optimizer,
    get_policy,
    moved_layers,
    pack_layers,
    profile_layers,
    unpack_layers,
)


def _all_splits(n: int, k: int) -> list[tuple[tuple[int, ...], ...]]:
    splits = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        splits.append(tuple(tuple(range(bounds[s], bounds[s + 1])) for s in range(k)))
    return splits


@pytest.mark.parametrize("seed", range(6))
def test_best_split_is_the_exhaustive_optimum(seed: int) -> None:
    rng = random.Random(seed)
    n, k = rng.randint(3, 9), rng.randint(2, 4)
    k = min(k, n)
    costs = [rng.uniform(0.1, 5.0) for _ in range(n)]
    slowness = [rng.uniform(0.5, 3.0) for _ in range(k)]
    split, value = best_split(costs, slowness)
    assert sorted(i for g in split for i in g) == list(range(n))
    assert all(split)
    assert value == pytest.approx(bottleneck(split, costs, slowness))
    assert value == pytest.approx(min(bottleneck(s, costs, slowness) for s in _all_splits(n, k)))


def test_best_split_rejects_more_stages_than_layers() -> None:
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        best_split([1.0, 1.0], [1.0, 1.0, 1.0])


def _costs(per_layer: list[float]) -> StageCosts:
    est = StageCosts(len(per_layer))
    est.calibrate(dict(enumerate(per_layer)))
    return est


def test_balance_moves_layers_out_of_an_overloaded_stage() -> None:
    est = _costs([1.0, 1.0, 1.0, 1.0, 1.0])
    proposal = BalancePolicy(min_gain=0.1).propose([[0, 1, 2, 3], [4]], est)
    assert proposal is not None
    assert proposal.groups in (((0, 1), (2, 3, 4)), ((0, 1, 2), (3, 4)))
    assert proposal.gain == pytest.approx(4 / 3 - 1)
    assert set(moved_layers([[0, 1, 2, 3], [4]], proposal.groups)) <= {2, 3}


def test_balance_keeps_a_split_whose_gain_is_below_the_threshold() -> None:
    est = _costs([1.0, 1.0, 1.1, 1.0])
    assert BalancePolicy(min_gain=0.1).propose([[0, 1], [2, 3]], est) is None
    assert BalancePolicy(min_gain=0.1).propose([[0, 1, 2], [3]], _costs([1.0, 1.0, 1.0, 3.0])) is None


def test_a_slowed_stage_gives_its_layers_to_its_neighbour() -> None:
    est = _costs([1.0, 1.0, 1.0, 1.0])
    policy = BalancePolicy(min_gain=0.1)
    assert policy.propose([[0, 1], [2, 3]], est) is None
    for _ in range(20):  # stage 0's process now runs at a third of its speed; stage 1 unchanged
        est.report(0, {0: 3.0, 1: 3.0})
        est.report(1, {2: 1.0, 3: 1.0})
    assert est.stage_slowness(2) == pytest.approx([3.0, 1.0], rel=1e-3)
    proposal = policy.propose([[0, 1], [2, 3]], est)
    assert proposal is not None and proposal.groups == ((0,), (1, 2, 3))


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: balance"):
        get_policy("greedy", min_gain=0.1)


def _mlp(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _step(stages: list[nn.Sequential], optimizers: list[torch.optim.Optimizer], x: torch.Tensor,
          y: torch.Tensor) -> None:
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    h = x
    for stage in stages:
        h = stage(h)
    nn.functional.cross_entropy(h, y).backward()
    for opt in optimizers:
        opt.step()


def _make_optimizer(kind: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


@pytest.mark.parametrize("kind", ["adam", "momentum"])
def test_a_move_keeps_the_function_and_the_optimizer_state(kind: str) -> None:
    """Layers 2 and 3 move from stage 0 to stage 1 (packed, then unpacked into fresh modules built with another
    seed): the model's output is unchanged, and the next step equals the step without a move."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 12, generator=gen), torch.randint(0, 4, (8,), generator=gen)

    reference = _mlp(0)
    ref_stages = [nn.Sequential(*reference[:4]), nn.Sequential(*reference[4:])]
    ref_opts = [_make_optimizer(kind, list(s.parameters())) for s in ref_stages]
    moving = _mlp(0)
    stages = [nn.Sequential(*moving[:4]), nn.Sequential(*moving[4:])]
    opts = [_make_optimizer(kind, list(s.parameters())) for s in stages]
    for _ in range(3):
        _step(ref_stages, ref_opts, x, y)
        _step(stages, opts, x, y)

    with torch.no_grad():
        before = stages[1](stages[0](x))
    bundle = pack_layers({2: stages[0][2], 3: stages[0][3]}, opts[0])
    drop_from_optimizer(opts[0], [p for i in (2, 3) for p in stages[0][i].parameters()])
    fresh = _mlp(99)  # the receiving stage builds the layers from the model factory, with any seed
    unpack_layers(bundle, {2: fresh[2], 3: fresh[3]}, opts[1])
    stages = [nn.Sequential(*stages[0][:2]), nn.Sequential(fresh[2], fresh[3], *stages[1])]
    with torch.no_grad():
        after = stages[1](stages[0](x))
    assert torch.equal(before, after)
    assert sum(len(g["params"]) for g in opts[0].param_groups) == 2
    assert len(opts[0].state) == 2

    _step(ref_stages, ref_opts, x, y)
    _step(stages, opts, x, y)
    ref_params = [p for s in ref_stages for p in s.parameters()]
    params = [p for s in stages for p in s.parameters()]
    assert len(ref_params) == len(params)
    for a, b in zip(ref_params, params, strict=True):
        assert torch.equal(a, b)


def test_unpack_names_a_missing_or_foreign_entry() -> None:
    model = _mlp(0)
    bundle = pack_layers({2: model[2]}, None)
    with pytest.raises(ValueError, match="lacks layer 4's 'bias'"):
        unpack_layers(bundle, {2: _mlp(1)[2], 4: _mlp(1)[4]}, None)
    both = pack_layers({2: model[2], 4: model[4]}, None)
    with pytest.raises(ValueError, match="holds '4/bias', which belongs to none of layers \\[2\\]"):
        unpack_layers(both, {2: _mlp(1)[2]}, None)


class _FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Advance(torch.autograd.Function):
    """Identity whose backward moves the fake clock on: a layer's known backward cost."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: _FakeTime, cost: float) -> torch.Tensor:
        ctx.clock, ctx.cost = clock, cost
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.clock.now += ctx.cost
        return grad, None, None


class _Costly(nn.Module):
    def __init__(self, clock: _FakeTime, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.clock, self.forward_s, self.backward_s = clock, forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.now += self.forward_s
        out: torch.Tensor = _Advance.apply(self.lin(x), self.clock, self.backward_s)
        return out


@pytest.mark.parametrize("input_grad", [False, True])
def test_layer_clock_attributes_forward_and_backward_time_to_each_layer(input_grad: bool) -> None:
    fake = _FakeTime()
    layers = nn.Sequential(_Costly(fake, 1.0, 10.0), _Costly(fake, 2.0, 20.0), _Costly(fake, 3.0, 30.0))
    clock = LayerClock(layers, first_index=4, clock=fake)
    for _ in range(2):
        layers(torch.randn(2, 3, requires_grad=input_grad)).sum().backward()
        clock.backward_done()
    layers.eval()
    layers(torch.randn(2, 3))  # an evaluation: not training time
    layers.train()
    assert clock.take() == {4: 11.0, 5: 22.0, 6: 33.0}
    assert clock.take() == {}
    clock.close()
    layers(torch.randn(2, 3)).sum().backward()
    clock.backward_done()
    assert clock.take() == {}


def test_profile_measures_every_layer_and_leaves_the_weights() -> None:
    model = _mlp(0)
    before = [p.detach().clone() for p in model.parameters()]
    times = profile_layers(model, (12,), 16, batches=3, warmup=1, num_classes=4)
    assert sorted(times) == list(range(len(model)))
    assert all(t > 0 for t in times.values())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_regrouper_calibrates_then_moves_once_per_cooldown_within_its_budget() -> None:
    regrouper = Regrouper(((0, 1, 2, 3), (4,)), BalancePolicy(min_gain=0.1), cooldown_s=10.0, max_moves=2,
                          warmup_reports=0, calibration_reports=1)
    regrouper.observe(0, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0})
    assert regrouper.decide(0.0) is None  # stage 1 has not reported: not calibrated
    regrouper.observe(1, {4: 1.0})
    assert regrouper.estimates.costs == [1.0] * 5
    first = regrouper.decide(1.0)  # calibrated: every stage is as fast as the calibration, by definition
    assert first is not None and first.gain > 0.3
    regrouper.applied(first.groups, now=1.0)
    assert regrouper.moves == 1
    regrouper.observe(0, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0})  # stale: from before the move
    assert regrouper.estimates.slowness == {}
    slow = {i: 4.0 for i in first.groups[0]}  # stage 0's process slows to a quarter of its speed
    for _ in range(30):
        regrouper.observe(0, slow)
        regrouper.observe(1, {i: 1.0 for i in first.groups[1]})
    assert regrouper.decide(5.0) is None  # cooling down
    second = regrouper.decide(11.0)
    assert second is not None and len(second.groups[0]) < len(first.groups[0])
    regrouper.applied(second.groups, now=11.0)
    for _ in range(30):
        regrouper.observe(0, {i: 1.0 for i in second.groups[0]})  # and recovers: moving back would gain
        regrouper.observe(1, {i: 1.0 for i in second.groups[1]})
    assert regrouper.decide(30.0) is None  # the run's budget of two moves is spent


def test_regrouper_ignores_warm_up_reports_and_calibrates_on_the_mean_of_the_next() -> None:
    regrouper = Regrouper(((0,), (1,)), BalancePolicy(min_gain=0.1), cooldown_s=0.0)  # 1 warm-up, 2 to calibrate
    regrouper.observe(0, {0: 50.0})  # the first batches: allocation, caches
    regrouper.observe(1, {1: 9.0})
    for t0, t1 in ((1.0, 2.0), (3.0, 4.0)):
        assert regrouper.estimates.costs is None
        regrouper.observe(0, {0: t0})
        regrouper.observe(1, {1: t1})
    assert regrouper.estimates.costs == [2.0, 3.0]


def test_a_slowdown_outside_the_layers_is_seen_through_the_busy_time() -> None:
    # stage 0 spends as long again around its layers as in them (optimizer step, prediction, sends); stage 1 little
    regrouper = Regrouper(((0, 1), (2, 3)), BalancePolicy(min_gain=0.1), cooldown_s=0.0, warmup_reports=0,
                          calibration_reports=1)
    regrouper.observe(0, {0: 1.0, 1: 1.0}, busy_s=4.0)
    regrouper.observe(1, {2: 1.0, 3: 1.0}, busy_s=2.0)
    assert regrouper.estimates.costs == [2.0, 2.0, 1.0, 1.0]  # what is spent around a layer moves with it
    assert regrouper.decide(0.0) is None  # as calibrated: 4 vs 2 per batch, and no split beats 4 by 10%
    for _ in range(30):  # stage 0's process slows down where its layers' own clocks hardly see it
        regrouper.observe(0, {0: 1.1, 1: 1.1}, busy_s=8.0)
        regrouper.observe(1, {2: 1.0, 3: 1.0}, busy_s=2.0)
    assert regrouper.estimates.stage_slowness(2) == pytest.approx([2.0, 1.0], rel=1e-3)
    proposal = regrouper.decide(1.0)
    assert proposal is not None and proposal.groups == ((0,), (1, 2, 3))
