"""Mode ``pipeline`` job configs: the shipped examples parse; every mistake names its key and the problem."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from dniasync.cluster.config import Config, ConfigError, load_config, parse_config
from dniasync.cluster.modes import get_mode
from dniasync.cluster.modes.pipeline import PipelineConfig

ROOT = Path(__file__).resolve().parents[1]
DELETE = object()


def base() -> dict[str, Any]:
    return {
        "job": {"name": "t", "mode": "pipeline", "seed": 1},
        "model": {"factory": "dniasync.train.models:mlp", "kwargs": {"sizes": [64, 32, 32, 10]}},
        "data": {"dataset": "digits", "n_train": 1000, "n_test": 500, "batch_size": 16},
        "optimizer": {"name": "adam", "lr": 1e-3},
        "pipeline": {"groups": [[0, 1], [2, 3], [4]]},
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
    assert config.mode == "pipeline"
    assert parse_config(config.to_dict()) == config


def test_examples_match_the_issue() -> None:
    dni = load_config(ROOT / "examples/dni_mnist.toml")
    assert dni.model.kwargs["sizes"] == [784, 256, 256, 256, 10]
    assert (dni.data.dataset, dni.data.n_train, dni.data.n_test) == ("mnist5k", 4000, 1000)
    assert (dni.settings.method, len(dni.settings.groups), dni.settings.n_workers, dni.stop.max_epochs) == ("cdni", 3, 3, 30)
    downpour = load_config(ROOT / "examples/dni_downpour_mnist.toml")
    assert (len(downpour.settings.groups), downpour.settings.replicas, downpour.settings.n_workers) == (2, 2, 4)


def test_defaults_and_placement() -> None:
    config: Config = parse_config(base())
    assert config.settings == PipelineConfig(groups=((0, 1), (2, 3), (4,)))
    assert config.settings.group_workers == (0, 1, 2) and config.n_data_shards == 1
    placed = parse_config(with_(with_(base(), "pipeline.placement", [0, 0, 1]), "pipeline.replicas", 2))
    assert placed.settings.workers_per_pipeline == 2 and placed.settings.n_workers == 4 and placed.n_data_shards == 2
    with pytest.raises(ConfigError, match="does not apply: job.mode is 'hogwild'"):
        parse_config(with_(base(), "job.mode", "hogwild"))


def test_former_dni_mode_names_point_to_pipeline() -> None:
    raw = with_(with_(base(), "job.mode", "dni"), "pipeline", DELETE)
    with pytest.raises(ConfigError, match="'job.mode' 'dni' was renamed: use job.mode = 'pipeline'") as err:
        parse_config(raw)
    assert err.value.key == "job.mode"
    with pytest.raises(ConfigError, match=r"section '\[dni\]' was renamed") as err:
        parse_config(with_(base(), "dni", {"groups": [[0, 1], [2, 3], [4]]}))
    assert err.value.key == "dni"
    with pytest.raises(ConfigError, match="'pipeline.variant' was renamed: use 'pipeline.method'"):
        parse_config(with_(base(), "pipeline.variant", "cdni"))


@pytest.mark.parametrize(
    ("dotted", "value", "key", "message"),
    [
        ("pipeline.groups", DELETE, "pipeline.groups", "missing required key 'pipeline.groups'"),
        ("pipeline.groups", [], "pipeline.groups", "non-empty array"),
        ("pipeline.groups", [[0, 1], [], [2, 3, 4]], "pipeline.groups", "group 1 is empty"),
        ("pipeline.groups", [[0, 1], [2, 3]], "pipeline.groups", r"layers \[4\] are in no group"),
        ("pipeline.groups", [[0, 1, 2], [2, 3], [4]], "pipeline.groups", "layer 2 is in group 0 and in group 1"),
        ("pipeline.groups", [[0, 1], [2, 3], [4, 5]], "pipeline.groups", "layer 5 is out of range"),
        ("pipeline.groups", [[0, 2], [1, 3], [4]], "pipeline.groups", "not a contiguous"),
        ("pipeline.groups", [[2, 3], [0, 1], [4]], "pipeline.groups", "out of order"),
        ("pipeline.groups", [[0, "1"], [2, 3, 4]], "pipeline.groups", "arrays of integers"),
        ("pipeline.method", "sdni", "pipeline.method", "choose one of 'cdni', 'dni', 'sync'"),
        ("pipeline.grops", [[0]], "pipeline.grops", "did you mean 'groups'"),
        ("pipeline.sg_lr", 0.0, "pipeline.sg_lr", "must be > 0.0"),
        ("pipeline.max_in_flight", 0, "pipeline.max_in_flight", "at least 1"),
        ("pipeline.sg_fit_rows", -1, "pipeline.sg_fit_rows", "at least 0"),
        ("pipeline.sg_fit_rows", 17, "pipeline.sg_fit_rows", "more than data.batch_size = 16"),
        ("pipeline.micro_batches", 2, "pipeline.micro_batches", "applies only when pipeline.method is 'sync'"),
        ("pipeline.n_fetch", 2, "pipeline.n_fetch", "applies only with PS shards .* sync.kind is 'local'"),
        ("pipeline.replicas", 0, "pipeline.replicas", "at least 1"),
        ("pipeline.replicas", 1001, "pipeline.replicas", "more than data.n_train"),
        ("pipeline.placement", [0, 1], "pipeline.placement", "2 entries for 3 groups"),
        ("pipeline.placement", [0, 2, 2], "pipeline.placement", r"leaves workers \[1\] without a group"),
        ("pipeline.placement", [0, -1, 1], "pipeline.placement", ">= 0"),
        ("optimizer.name", "nesterov", "optimizer.name", "stages train with 'adam', 'sgd', 'momentum', 'adagrad'"),
        ("optimizer.clip_norm", 1.0, "optimizer.clip_norm", "does not apply in mode 'pipeline'"),
        ("optimizer.weight_decay", 0.1, "optimizer.weight_decay", "does not apply in mode 'pipeline' with sync.kind 'local'"),
        ("model", {"factory": "torch.nn:Identity"}, "model.factory", "returns a Identity; mode 'pipeline' cuts an nn.Sequential"),
        ("downpour", {"n_replicas": 2}, "downpour", "does not apply: job.mode is 'pipeline'"),
    ],
)
def test_bad_dni_configs_name_the_key(dotted: str, value: Any, key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        parse_config(with_(base(), dotted, value))
    assert err.value.key == key, str(err.value)


def test_sync_rules() -> None:
    sync = with_(base(), "pipeline.method", "sync")
    assert parse_config(with_(sync, "pipeline.micro_batches", 8)).settings.micro_batches == 8
    for key, value in (("synthetic_inputs", True), ("sg_lr", 1e-3), ("sg_fit_rows", 8), ("max_in_flight", 2)):
        with pytest.raises(ConfigError, match=f"'pipeline.{key}' applies only when pipeline.method is 'dni' or 'cdni'"):
            parse_config(with_(sync, f"pipeline.{key}", value))
    with pytest.raises(ConfigError, match="more than data.batch_size = 16") as err:
        parse_config(with_(sync, "pipeline.micro_batches", 17))
    assert err.value.key == "pipeline.micro_batches"


def test_deferred_evaluation_rules() -> None:
    assert parse_config(with_(base(), "eval.deferred", True)).eval.deferred
    with pytest.raises(ConfigError, match="cannot be used with stop.target_accuracy") as err:
        parse_config(with_(with_(base(), "eval.deferred", True), "stop.target_accuracy", 0.9))
    assert err.value.key == "eval.deferred"
    hogwild = with_(with_(base(), "job.mode", "hogwild"), "pipeline", DELETE)
    assert parse_config(with_(hogwild, "eval.deferred", True)).eval.deferred  # every mode defers alike
    with pytest.raises(ConfigError, match="must be true or false"):
        parse_config(with_(base(), "eval.deferred", "yes"))


def test_replicated_groups_take_any_ps_optimizer() -> None:
    raw = with_(with_(base(), "pipeline.replicas", 2), "optimizer", {"name": "adagrad", "lr": 0.05})
    config = parse_config(with_(raw, "pipeline.n_push", 2))
    assert (config.optimizer.name, config.settings.n_push, config.settings.n_workers) == ("adagrad", 2, 6)


def test_stage_shards_take_copies_only_with_ps_shards_and_without_regrouping() -> None:
    """``ps_replicas``: each stage's PS shard in that many PS processes (counted by the launcher); it needs PS
    shards, and regrouping, which re-cuts the shards, is refused beside it."""
    replicated = with_(with_(base(), "pipeline.replicas", 2), "pipeline.ps_replicas", 2)
    config = parse_config(replicated)
    assert config.settings.ps_replicas == 2 and get_mode("pipeline").processes(config) == (6, 6)
    with pytest.raises(ConfigError, match="'pipeline.ps_replicas' applies only with PS shards .* sync.kind is "
                                          "'local'") as err:
        parse_config(with_(base(), "pipeline.ps_replicas", 2))
    assert err.value.key == "pipeline.ps_replicas"
    with pytest.raises(ConfigError, match="'regroup.enabled' does not apply with pipeline.ps_replicas = 2") as err:
        parse_config(with_(replicated, "regroup", {"enabled": True}))
    assert err.value.key == "regroup.enabled"


def test_spectrain_runs_with_ps_shards_and_any_of_their_optimizers_not_with_p2p() -> None:
    """With PS shards the stages predict from their weights' velocity: no optimizer of their own, no momentum."""
    spectrain = with_(with_(base(), "pipeline.method", "spectrain"), "pipeline.replicas", 2)
    for optimizer in ({"name": "sgd", "lr": 0.05}, {"name": "adagrad", "lr": 0.05}):
        config = parse_config(with_(spectrain, "optimizer", optimizer))
        assert (config.settings.method, config.sync_kind, config.optimizer.name) == ("spectrain", "ps", optimizer["name"])
    assert parse_config(with_(spectrain, "pipeline.method", "spectrain_stash")).settings.method == "spectrain_stash"
    with pytest.raises(ConfigError, match="'optimizer.name' is 'sgd'; spectrain predicts with the momentum") as err:
        parse_config(with_(with_(spectrain, "pipeline.replicas", 1), "optimizer", {"name": "sgd", "lr": 0.05}))
    assert err.value.key == "optimizer.name"  # one pipeline steps its own optimizer: momentum or Adam
    one = parse_config(with_(with_(spectrain, "pipeline.replicas", 1), "optimizer", {"name": "adagrad", "lr": 0.05}))
    assert (one.sync_kind, one.optimizer.name) == ("local", "adagrad")  # predicted from the observed velocity
    p2p = with_(with_(spectrain, "sync.kind", "p2p"), "pipeline.tau", 5e-4)
    with pytest.raises(ConfigError, match="with sync.kind 'p2p' a stage steps a ParamStore") as err:
        parse_config(p2p)
    assert err.value.key == "pipeline.method"


def test_the_pipeline_sync_follows_its_replicas() -> None:
    """One pipeline trains alone (`local`); replicated pipelines share through PS shards (`ps`) unless told."""
    alone = parse_config(base())
    assert (alone.sync_kind, alone.sync_needs_ps, alone.to_dict().get("sync")) == ("local", False, None)
    replicated = with_(base(), "pipeline.replicas", 2)
    assert (parse_config(replicated).sync_kind, parse_config(replicated).sync_needs_ps) == ("ps", True)
    explicit = parse_config(with_(replicated, "sync.kind", "ps"))
    assert explicit.sync_kind == "ps" and parse_config(explicit.to_dict()) == explicit
    with pytest.raises(ConfigError, match="'sync.kind' is 'ps'; mode 'pipeline', as configured, runs with 'local'") as err:
        parse_config(with_(base(), "sync.kind", "ps"))
    assert err.value.key == "sync.kind"
    with pytest.raises(ConfigError, match="missing required key 'pipeline.tau'") as err:  # p2p codes with a threshold
        parse_config(with_(replicated, "sync.kind", "p2p"))
    assert err.value.key == "pipeline.tau"
    gossip = parse_config(with_(with_(replicated, "sync.kind", "p2p"), "pipeline.tau", 5e-4))
    assert (gossip.sync_kind, gossip.sync_needs_ps) == ("p2p", False)
    decayed = parse_config(with_(replicated, "pipeline.lr_decay", "linear"))  # the pushes carry the lr scale
    assert decayed.sync_needs_ps and decayed.settings.lr_decay == "linear"


def test_a_codec_compresses_the_stages_pushes_to_their_ps_shards_only() -> None:
    """``pipeline.codec``: with PS shards (replicated pipelines), as downpour.codec; tau is its threshold."""
    replicated = with_(base(), "pipeline.replicas", 2)
    config = parse_config(with_(with_(replicated, "pipeline.codec", "threshold"), "pipeline.tau", 0.02))
    assert (config.settings.codec, config.settings.tau, config.sync_kind) == ("threshold", 0.02, "ps")
    assert parse_config(config.to_dict()) == config
    assert parse_config(with_(replicated, "pipeline.codec", "int8")).settings.codec == "int8"
    with pytest.raises(ConfigError, match="missing required key 'pipeline.tau' .*pipeline.codec 'threshold'") as err:
        parse_config(with_(replicated, "pipeline.codec", "threshold"))
    assert err.value.key == "pipeline.tau"
    with pytest.raises(ConfigError, match="'pipeline.codec' applies only with PS shards .* sync.kind is 'local'") as err:
        parse_config(with_(base(), "pipeline.codec", "int8"))  # one pipeline: nothing is pushed
    assert err.value.key == "pipeline.codec"
    with pytest.raises(ConfigError, match="'pipeline.tau' applies only with sync.kind 'p2p' or pipeline.codec "
                                          "'threshold'") as err:
        parse_config(with_(with_(replicated, "pipeline.codec", "int8"), "pipeline.tau", 0.02))
    assert err.value.key == "pipeline.tau"
    with pytest.raises(ConfigError, match="'regroup.enabled' does not apply with pipeline.codec 'int8'") as err:
        parse_config(with_(with_(replicated, "pipeline.codec", "int8"), "regroup", {"enabled": True}))
    assert err.value.key == "regroup.enabled"
    with pytest.raises(ConfigError, match="pipeline.codec") as err:
        parse_config(with_(replicated, "pipeline.codec", "zstd"))
    assert err.value.key == "pipeline.codec"
