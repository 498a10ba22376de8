"""DiLoCo's local steps and outer optimizer (train/sync/outer.py): the update math, by hand and against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dniasync.train.sync.outer import DILOCO_LR, DILOCO_MOMENTUM, LocalSteps, OuterOptimizer, mean_pseudo_gradient


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_local_steps_counts_to_h_and_gives_anchor_minus_now() -> None:
    weights = f32(1.0, 2.0, 3.0)
    local = LocalSteps(weights, local_steps=3)
    weights -= f32(0.5, -1.0, 0.0)  # inner steps move the live weights; the anchor is a copy
    assert not local.step() and not local.step()
    assert local.step() and local.due
    np.testing.assert_array_equal(local.pseudo_gradient(weights), f32(0.5, -1.0, 0.0))
    np.testing.assert_array_equal(local.anchor, f32(1.0, 2.0, 3.0))
    local.reset(f32(7.0, 8.0, 9.0))
    assert (local.steps, local.syncs, local.due) == (0, 1, False)
    np.testing.assert_array_equal(local.anchor, f32(7.0, 8.0, 9.0))
    assert local.step(3)  # a run of steps counted at once
    out = np.empty(3, dtype=np.float32)
    assert local.pseudo_gradient(f32(6.0, 8.0, 10.0), out=out) is out
    np.testing.assert_array_equal(out, f32(1.0, 0.0, -1.0))


def test_diloco_outer_steps_match_a_hand_computation() -> None:
    """Nesterov, lr 0.7, momentum 0.9 (the defaults) over two rounds of two trainers' pseudo-gradients."""
    outer = OuterOptimizer(2)
    assert (outer.lr, outer.momentum) == (DILOCO_LR, DILOCO_MOMENTUM) == (0.7, 0.9)
    anchor = f32(1.0, -2.0)
    # round 1: two trainers moved by (0.2, 0.4) and (0.4, 0.0) from the anchor: d = mean = (0.3, 0.2)
    d1 = mean_pseudo_gradient([f32(0.2, 0.4), f32(0.4, 0.0)])
    np.testing.assert_allclose(d1, [0.3, 0.2], rtol=1e-6)
    new = outer.step(anchor, d1)
    # v = 0.9*0 + d = (0.3, 0.2); new = anchor - 0.7*(d + 0.9 v) = anchor - 0.7*1.9*d = (0.601, -2.266)
    np.testing.assert_allclose(outer.velocity, [0.3, 0.2], rtol=1e-6)
    np.testing.assert_allclose(new, [0.601, -2.266], rtol=1e-6)
    # round 2 from the new anchor, d = (-0.1, 0.1): v = 0.9 (0.3, 0.2) + d = (0.17, 0.28)
    # new = (0.601, -2.266) - 0.7*((-0.1, 0.1) + 0.9 (0.17, 0.28)) = (0.601 - 0.0371, -2.266 - 0.2464)
    new2 = outer.step(new, mean_pseudo_gradient([f32(-0.1, 0.1)]), out=new)
    assert new2 is new
    np.testing.assert_allclose(outer.velocity, [0.17, 0.28], rtol=1e-6)
    np.testing.assert_allclose(new, [0.5639, -2.5124], rtol=1e-6)
    assert outer.steps == 2


def test_outer_steps_equal_torch_sgd_nesterov_on_the_pseudo_gradient() -> None:
    rng = np.random.default_rng(0)
    n, lr, mu = 1000, 0.7, 0.9
    anchor = rng.normal(size=n).astype(np.float32)
    ours = OuterOptimizer(n, lr=lr, momentum=mu)
    param = torch.nn.Parameter(torch.from_numpy(anchor.copy()))
    theirs = torch.optim.SGD([param], lr=lr, momentum=mu, nesterov=True)
    for _ in range(5):
        delta = rng.normal(0, 0.1, n).astype(np.float32)
        anchor = ours.step(anchor, delta)
        param.grad = torch.from_numpy(delta.copy())
        theirs.step()
        np.testing.assert_allclose(anchor, param.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_h1_lr1_momentum0_is_plain_averaging_of_the_trainers_updates() -> None:
    """Three trainers from the same weights, one inner SGD step each, then the outer step: their mean."""
    rng = np.random.default_rng(1)
    n = 64
    start = rng.normal(size=n).astype(np.float32)
    outer = OuterOptimizer(n, lr=1.0, momentum=0.0)
    trainers = [LocalSteps(start, local_steps=1) for _ in range(3)]
    weights = start.copy()
    for _ in range(4):  # four rounds of sync
        after = []
        for local in trainers:
            mine = weights - np.float32(0.1) * rng.normal(size=n).astype(np.float32)  # this trainer's step
            assert local.step()
            after.append((mine, local.pseudo_gradient(mine)))
        weights = outer.step(trainers[0].anchor, mean_pseudo_gradient([delta for _, delta in after]))
        np.testing.assert_allclose(weights, np.mean([mine for mine, _ in after], axis=0), rtol=1e-5, atol=1e-6)
        for local in trainers:
            local.reset(weights)


def test_state_round_trips_and_bad_input_is_refused() -> None:
    outer = OuterOptimizer(3)
    outer.step(f32(0, 0, 0), f32(1, 2, 3))
    again = OuterOptimizer(3)
    again.load_state_dict(outer.state_dict())
    np.testing.assert_array_equal(again.velocity, outer.velocity)
    np.testing.assert_array_equal(again.step(f32(1, 1, 1), f32(1, 0, 0)), outer.step(f32(1, 1, 1), f32(1, 0, 0)))
    local = LocalSteps(f32(1, 2, 3), local_steps=2)
    local.step()
    copy = LocalSteps(f32(0, 0, 0), local_steps=2)
    copy.load_state_dict(local.state_dict())
    np.testing.assert_array_equal(copy.anchor, local.anchor)
    assert copy.steps == 1 and not copy.due and copy.step()

    with pytest.raises(ValueError, match="local_steps"):
        LocalSteps(f32(1), local_steps=0)
    with pytest.raises(TypeError, match="float32"):
        outer.step(np.zeros(3), f32(1, 2, 3))
    with pytest.raises(ValueError, match="expected 3 elements"):
        outer.step(f32(1, 2), f32(1, 2))
    with pytest.raises(ValueError, match="momentum"):
        OuterOptimizer(3, momentum=1.0)
    with pytest.raises(ValueError, match="contiguous"):
        outer.step(f32(0, 0, 0), f32(0, 0, 0), out=np.zeros(6, dtype=np.float32)[::2])
