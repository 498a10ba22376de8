"""Model factories resolve from ``module:function`` strings and build deterministic models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dniasync.train.models import (
    ModelFactoryError,
    build_model,
    count_parameters,
    mlp,
    resolve_factory,
)

MLP = "dniasync.train.models:mlp"


def test_mlp_shape_layers_and_parameter_count() -> None:
    model = mlp([784, 256, 256, 10])
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear, nn.ReLU, nn.Linear]
    assert count_parameters(model) == 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10
    out = model(torch.zeros(5, 784))
    assert out.shape == (5, 10)


def test_mlp_activation_is_selectable() -> None:
    model = mlp([4, 3, 2], activation="tanh")
    assert isinstance(model[1], nn.Tanh)


def test_same_seed_same_weights_different_seed_different() -> None:
    torch.manual_seed(3)
    a = mlp([8, 6, 2])
    torch.manual_seed(3)
    b = mlp([8, 6, 2])
    torch.manual_seed(4)
    c = mlp([8, 6, 2])
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_build_model_with_seed_leaves_global_rng_alone() -> None:
    torch.manual_seed(0)
    expected_next = torch.rand(1)
    torch.manual_seed(0)
    a = build_model(MLP, {"sizes": [8, 4, 2]}, seed=9)
    assert torch.equal(torch.rand(1), expected_next)
    b = build_model(MLP, {"sizes": [8, 4, 2]}, seed=9)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_resolve_factory_walks_attributes() -> None:
    assert resolve_factory(MLP) is mlp
    assert resolve_factory("torch.nn:Linear") is nn.Linear


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("dniasync.train.models.mlp", "must look like 'package.module:function'"),
        (":mlp", "must look like"),
        ("dniasync.train.models:", "must look like"),
        ("a:b:c", "must look like"),
        ("dniasync.no_such_module:mlp", "module 'dniasync.no_such_module' not found"),
        ("dniasync.train.models:no_such_fn", "has no attribute 'no_such_fn'"),
        ("dniasync.train.models:ACTIVATIONS", "is a dict, not callable"),
    ],
)
def test_resolve_factory_errors(spec: str, message: str) -> None:
    with pytest.raises(ModelFactoryError, match=message):
        resolve_factory(spec)


@pytest.mark.parametrize(
    ("spec", "kwargs", "message"),
    [
        (MLP, {"size": [4, 2]}, "unknown argument 'size'"),
        (MLP, {"sizes": [4]}, "at least an input and an output"),
        (MLP, {"sizes": [4, 0, 2]}, "positive ints"),
        (MLP, {"activation": "swish"}, "unknown activation 'swish'"),
        ("dniasync.train.models:count_parameters", {"model": None}, "failed: AttributeError"),
        ("builtins:dict", {}, "returned dict, not a torch.nn.Module"),
    ],
)
def test_build_model_errors(spec: str, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ModelFactoryError, match=message):
        build_model(spec, kwargs)
