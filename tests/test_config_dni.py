"""Mode ``dni`` job configs: the shipped examples parse; every mistake names its key and the problem."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from dniasync.cluster.config import Config, ConfigError, DNIConfig, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]
DELETE = object()


def base() -> dict[str, Any]:
    return {
        "job": {"name": "t", "mode": "dni", "seed": 1},
        "model": {"factory": "dniasync.train.models:mlp", "kwargs": {"sizes": [64, 32, 32, 10]}},
        "data": {"dataset": "digits", "n_train": 1000, "n_test": 500, "batch_size": 16},
        "optimizer": {"name": "adam", "lr": 1e-3},
        "dni": {"groups": [[0, 1], [2, 3], [4]]},
    }


def with_(raw: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    *parents, last = dotted.split(".")
    table = out
    for part in parents:
        table = table.setdefault(part, {})
    if value is DELETE:
        del table[last]
    else:
        table[last] = value
    return out


@pytest.mark.parametrize("name", ["dni_mnist.toml", "dni_downpour_mnist.toml"])
def test_shipped_examples_parse_and_round_trip(name: str) -> None:
    config = load_config(ROOT / "examples" / name)
    assert config.mode == "dni"
    assert parse_config(config.to_dict()) == config


def test_examples_match_the_issue() -> None:
    dni = load_config(ROOT / "examples/dni_mnist.toml")
    assert dni.model.kwargs["sizes"] == [784, 256, 256, 256, 10]
    assert (dni.data.dataset, dni.data.n_train, dni.data.n_test) == ("mnist5k", 4000, 1000)
    assert (dni.dni.variant, len(dni.dni.groups), dni.dni.n_workers, dni.stop.max_epochs) == ("cdni", 3, 3, 30)
    downpour = load_config(ROOT / "examples/dni_downpour_mnist.toml")
    assert (len(downpour.dni.groups), downpour.dni.replicas, downpour.dni.n_workers) == (2, 2, 4)


def test_defaults_and_placement() -> None:
    config: Config = parse_config(base())
    assert config.dni == DNIConfig(groups=((0, 1), (2, 3), (4,)))
    assert config.dni.group_workers == (0, 1, 2) and config.n_data_shards == 1
    placed = parse_config(with_(with_(base(), "dni.placement", [0, 0, 1]), "dni.replicas", 2))
    assert placed.dni.workers_per_pipeline == 2 and placed.dni.n_workers == 4 and placed.n_data_shards == 2
    with pytest.raises(ConfigError, match="not 'dni'"):
        parse_config(with_(with_(base(), "job.mode", "hogwild"), "dni", DELETE)).dni


@pytest.mark.parametrize(
    ("dotted", "value", "key", "message"),
    [
        ("dni.groups", DELETE, "dni.groups", "missing required key 'dni.groups'"),
        ("dni.groups", [], "dni.groups", "non-empty array"),
        ("dni.groups", [[0, 1], [], [2, 3, 4]], "dni.groups", "group 1 is empty"),
        ("dni.groups", [[0, 1], [2, 3]], "dni.groups", r"layers \[4\] are in no group"),
        ("dni.groups", [[0, 1, 2], [2, 3], [4]], "dni.groups", "layer 2 is in group 0 and in group 1"),
        ("dni.groups", [[0, 1], [2, 3], [4, 5]], "dni.groups", "layer 5 is out of range"),
        ("dni.groups", [[0, 2], [1, 3], [4]], "dni.groups", "not a contiguous"),
        ("dni.groups", [[2, 3], [0, 1], [4]], "dni.groups", "out of order"),
        ("dni.groups", [[0, "1"], [2, 3, 4]], "dni.groups", "only integers"),
        ("dni.variant", "sdni", "dni.variant", "choose one of 'dni', 'cdni', 'sync'"),
        ("dni.grops", [[0]], "dni.grops", "did you mean 'groups'"),
        ("dni.sg_lr", 0.0, "dni.sg_lr", "must be > 0.0"),
        ("dni.max_in_flight", 0, "dni.max_in_flight", "at least 1"),
        ("dni.sg_fit_rows", -1, "dni.sg_fit_rows", "at least 0"),
        ("dni.sg_fit_rows", 17, "dni.sg_fit_rows", "more than data.batch_size = 16"),
        ("dni.micro_batches", 2, "dni.micro_batches", "applies only when dni.variant is 'sync'"),
        ("dni.n_fetch", 2, "dni.n_fetch", "applies only when dni.replicas > 1"),
        ("dni.replicas", 0, "dni.replicas", "at least 1"),
        ("dni.replicas", 1001, "dni.replicas", "more than data.n_train"),
        ("dni.placement", [0, 1], "dni.placement", "2 entries for 3 groups"),
        ("dni.placement", [0, 2, 2], "dni.placement", r"leaves workers \[1\] without a group"),
        ("dni.placement", [0, -1, 1], "dni.placement", ">= 0"),
        ("optimizer.name", "adagrad", "optimizer.name", "layer groups train with 'adam' or 'sgd'"),
        ("optimizer.clip_norm", 1.0, "optimizer.clip_norm", "does not apply in mode 'dni'"),
        ("optimizer.weight_decay", 0.1, "optimizer.weight_decay", "does not apply in mode 'dni' with dni.replicas = 1"),
        ("model", {"factory": "torch.nn:Identity"}, "model.factory", "returns a Identity; mode 'dni' cuts an nn.Sequential"),
        ("downpour", {"n_replicas": 2}, "downpour", "does not apply: job.mode is 'dni'"),
    ],
)
def test_bad_dni_configs_name_the_key(dotted: str, value: Any, key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        parse_config(with_(base(), dotted, value))
    assert err.value.key == key, str(err.value)


def test_sync_rules() -> None:
    sync = with_(base(), "dni.variant", "sync")
    assert parse_config(with_(sync, "dni.micro_batches", 8)).dni.micro_batches == 8
    for key, value in (("synthetic_inputs", True), ("sg_lr", 1e-3), ("sg_fit_rows", 8), ("max_in_flight", 2)):
        with pytest.raises(ConfigError, match=f"'dni.{key}' applies only when dni.variant is 'dni' or 'cdni'"):
            parse_config(with_(sync, f"dni.{key}", value))
    with pytest.raises(ConfigError, match="more than data.batch_size = 16") as err:
        parse_config(with_(sync, "dni.micro_batches", 17))
    assert err.value.key == "dni.micro_batches"


def test_deferred_evaluation_rules() -> None:
    assert parse_config(with_(base(), "eval.deferred", True)).eval.deferred
    with pytest.raises(ConfigError, match="cannot be used with stop.target_accuracy") as err:
        parse_config(with_(with_(base(), "eval.deferred", True), "stop.target_accuracy", 0.9))
    assert err.value.key == "eval.deferred"
    hogwild = with_(with_(base(), "job.mode", "hogwild"), "dni", DELETE)
    with pytest.raises(ConfigError, match="applies only in mode 'dni', not 'hogwild'"):
        parse_config(with_(hogwild, "eval.deferred", True))
    with pytest.raises(ConfigError, match="must be true or false"):
        parse_config(with_(base(), "eval.deferred", "yes"))


def test_replicated_groups_take_any_ps_optimizer() -> None:
    raw = with_(with_(base(), "dni.replicas", 2), "optimizer", {"name": "adagrad", "lr": 0.05})
    config = parse_config(with_(raw, "dni.n_push", 2))
    assert (config.optimizer.name, config.dni.n_push, config.dni.n_workers) == ("adagrad", 2, 6)
