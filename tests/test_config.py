"""Job configs parse into typed settings; every mistake is refused with the key it concerns."""

from __future__ import annotations

import copy
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dniasync.cluster.config import SYNC_NEEDS_PS, Config, ConfigError, SyncName, load_config, parse_config
from dniasync.cluster.mode_api import Mode
from dniasync.cluster.modes import MODES
from dniasync.cluster.modes.downpour import DownpourConfig
from dniasync.cluster.modes.hogwild import HogwildConfig

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ["downpour_mnist.toml", "downpour_mnist_threshold.toml", "hogwild_mnist.toml"]

TINY_MLP = {"sizes": [64, 4, 10]}  # 64*4+4 + 4*10+10 = 310 parameters


def base(mode: str = "downpour") -> dict[str, Any]:
    raw: dict[str, Any] = {
        "job": {"name": "t", "mode": mode, "seed": 1},
        "model": {"factory": "dniasync.train.models:mlp", "kwargs": dict(TINY_MLP)},
        "data": {"dataset": "digits", "n_train": 1000, "n_test": 500, "batch_size": 16},
        "optimizer": {"name": "adagrad", "lr": 0.05},
        "stop": {"max_epochs": 3},
    }
    raw[mode] = {"n_replicas": 2, "n_ps_shards": 2} if mode == "downpour" else {"n_workers": 2}
    return raw


def with_(raw: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``raw`` with ``dotted`` set to ``value`` (``DELETE`` removes it)."""
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


DELETE = object()


# ------------------------------------------------------------------ good configs


@pytest.mark.parametrize("name", EXAMPLES)
def test_shipped_examples_parse_and_round_trip(name: str) -> None:
    config = load_config(ROOT / "examples" / name)
    assert config.data.dataset == "mnist5k"
    assert (config.data.n_train, config.data.n_test) == (4000, 1000)
    assert config.model.kwargs["sizes"] == [784, 256, 256, 10]
    assert config.stop.target_accuracy == 0.92
    assert config.n_data_shards == 2
    assert parse_config(config.to_dict()) == config


def test_example_settings_match_the_issue() -> None:
    downpour = load_config(ROOT / "examples" / "downpour_mnist.toml")
    assert downpour.settings.n_replicas == 2 and downpour.settings.n_ps_shards == 2
    assert downpour.optimizer.name == "adagrad" and downpour.settings.codec == "none"
    threshold = load_config(ROOT / "examples" / "downpour_mnist_threshold.toml")
    assert threshold.settings.codec == "threshold" and threshold.settings.tau is not None
    assert threshold.to_dict() | {"job": {}, "downpour": {}} == downpour.to_dict() | {"job": {}, "downpour": {}}
    hogwild = load_config(ROOT / "examples" / "hogwild_mnist.toml")
    assert hogwild.settings == HogwildConfig(n_workers=2)


def test_defaults_fill_in() -> None:
    config = parse_config(
        {
            "job": {"mode": "downpour"},
            "model": {"factory": "dniasync.train.models:mlp", "kwargs": TINY_MLP},
            "data": {"dataset": "digits", "n_train": 100, "n_test": 50},
        }
    )
    assert config.job.name == "dniasync-job" and config.output_dir == "runs/dniasync-job"
    assert config.settings == DownpourConfig()
    assert config.optimizer.name == "adagrad" and config.optimizer.epsilon == 1e-10
    assert config.data.batch_size == 32
    assert config.eval.interval_s == 2.0 and config.eval.every_steps is None
    assert config.stop.max_epochs == 10 and config.stop.target_accuracy is None


def test_mode_specific_values() -> None:
    raw = base()
    raw["downpour"] |= {"codec": "threshold", "tau": 0.005, "staleness": "bound", "max_staleness": 4}
    raw["optimizer"] = {"name": "adam", "lr": 1e-3, "betas": [0.8, 0.99], "eps": 1e-7}
    raw["eval"] = {"every_steps": 50}
    config = parse_config(raw)
    assert config.settings.tau == 0.005 and config.settings.max_staleness == 4
    assert config.optimizer.betas == (0.8, 0.99) and config.optimizer.eps == 1e-7
    assert config.eval.every_steps == 50 and config.eval.interval_s is None
    assert parse_config(config.to_dict()) == config
    hogwild = parse_config(base("hogwild"))
    assert hogwild.settings == HogwildConfig(n_workers=2)
    assert isinstance(hogwild, Config) and parse_config(hogwild.to_dict()) == hogwild


def test_data_files_are_checked_against_their_size(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((30, 64), np.float32), y=np.arange(30) % 10)
    raw = with_(base(), "data", {"dataset": str(path), "n_train": 20, "n_test": 10, "batch_size": 4})
    assert parse_config(raw).data.n_train == 20
    with pytest.raises(ConfigError, match="'data.n_train' \\+ data.n_test = 31 exceeds the 30") as err:
        parse_config(with_(raw, "data.n_test", 11))
    assert err.value.key == "data.n_train"
    npz_keys = with_(raw, "data.npz_y_key", "labels")
    with pytest.raises(ConfigError, match="data.dataset.*'labels'"):
        parse_config(npz_keys)


@pytest.mark.parametrize(("key", "value"), [("downpour.n_ps_shards", 2), ("downpour.codec", "onebit"),
                                            ("downpour.staleness", "inverse"), ("downpour.ps_replicas", 2),
                                            ("sync.local_steps", 4)])
def test_downpour_over_the_shared_store_refuses_what_needs_ps_shards(key: str, value: Any) -> None:
    shared = with_(with_(base(), "downpour.n_ps_shards", DELETE), "sync", {"kind": "shm"})
    config = parse_config(shared)
    assert config.sync_kind == "shm" and not config.sync_needs_ps
    assert MODES["downpour"].processes(config) == (0, 2)  # no PS process
    with pytest.raises(ConfigError, match="sync.kind 'shm'") as err:
        parse_config(with_(shared, key, value))
    assert err.value.key == key


# ------------------------------------------------------------------ bad configs

BAD: list[tuple[str, Any, str, str]] = [
    # (dotted key to set, value, expected ConfigError.key, message fragment)
    ("downpour.n_replica", 2, "downpour.n_replica", "unknown key 'downpour.n_replica' \\(did you mean 'n_replicas'\\?\\)"),
    ("job.nmae", "x", "job.nmae", "unknown key 'job.nmae' \\(did you mean 'name'\\?\\)"),
    ("optimizer.learning_rate", 0.1, "optimizer.learning_rate", "unknown key 'optimizer.learning_rate'"),
    ("downpur", {}, "downpur", "unknown section 'downpur' \\(did you mean 'downpour'\\?\\)"),
    ("hogwild", {"n_workers": 2}, "hogwild", "section '\\[hogwild\\]' does not apply"),
    ("job", DELETE, "job", "missing required section '\\[job\\]'"),
    ("model", 3, "model", "'model' must be a table"),
    ("job.mode", "spectrain", "job.mode", "'job.mode' is 'spectrain'; choose one of 'downpour', 'hogwild', 'pipeline'"),
    ("job.mode", DELETE, "job.mode", "missing required key 'job.mode'"),
    ("job.name", "a b", "job.name", "'job.name' must use only"),
    ("job.seed", -1, "job.seed", "'job.seed' must be at least 0"),
    ("job.seed", 1.5, "job.seed", "'job.seed' must be an integer, got a float"),
    ("job.output_dir", "", "job.output_dir", "must not be empty"),
    ("model.factory", DELETE, "model.factory", "missing required key 'model.factory'"),
    ("model.factory", "dniasync.train.models.mlp", "model.factory", "'model.factory' must look like"),
    ("model.kwargs", [1], "model.kwargs", "'model.kwargs' must be a table"),
    ("data.dataset", "mnist", "data.dataset", "unknown data set 'mnist'"),
    ("data.n_train", "1000", "data.n_train", "'data.n_train' must be an integer, got a string"),
    ("data.n_train", True, "data.n_train", "'data.n_train' must be an integer, got a boolean"),
    ("data.n_test", 0, "data.n_test", "'data.n_test' must be at least 1"),
    ("data.n_train", 1500, "data.n_train", "'data.n_train' \\+ data.n_test = 2000 exceeds the 1797"),
    ("data.batch_size", 1001, "data.batch_size", "more than data.n_train"),
    ("data.csv_header", True, "data.csv_header", "applies only to csv data sets; 'digits' is builtin"),
    ("data.npz_x_key", "x", "data.npz_x_key", "applies only to npz"),
    ("data.scale", 255.0, "data.scale", "applies only to"),
    ("optimizer.name", "rmsprop", "optimizer.name", "choose one of 'adagrad', 'sgd'"),
    ("optimizer.lr", 0, "optimizer.lr", "'optimizer.lr' must be > 0.0"),
    ("optimizer.lr", float("nan"), "optimizer.lr", "must be finite"),
    ("optimizer.lr", "0.1", "optimizer.lr", "must be a number, got a string"),
    ("optimizer.momentum", 0.9, "optimizer.momentum", "applies only when optimizer.name is 'momentum' or 'nesterov'"),
    ("optimizer.betas", [0.9, 0.99], "optimizer.betas", "applies only when optimizer.name is 'adam'"),
    ("optimizer.weight_decay", -0.1, "optimizer.weight_decay", "must be >= 0.0"),
    ("optimizer.clip_norm", 0.0, "optimizer.clip_norm", "must be > 0.0"),
    ("downpour.n_replicas", 0, "downpour.n_replicas", "'downpour.n_replicas' must be at least 1"),
    ("downpour.n_replicas", 1001, "downpour.n_replicas", "more than data.n_train = 1000"),
    ("downpour.n_ps_shards", 0, "downpour.n_ps_shards", "must be at least 1"),
    ("downpour.n_ps_shards", 311, "downpour.n_ps_shards", "model has only 310 parameters"),
    ("downpour.n_fetch", 0, "downpour.n_fetch", "must be at least 1"),
    ("downpour.n_push", 2.0, "downpour.n_push", "must be an integer"),
    ("downpour.warm_start_steps", -5, "downpour.warm_start_steps", "must be at least 0"),
    ("downpour.codec", "zstd", "downpour.codec", "choose one of 'none', 'threshold', 'onebit', 'int8'"),
    ("downpour.codec", "threshold", "downpour.tau", "missing required key 'downpour.tau'"),
    ("downpour.tau", 0.01, "downpour.tau", "applies only when downpour.codec is 'threshold'"),
    ("downpour.staleness", "bound", "downpour.max_staleness", "missing required key 'downpour.max_staleness'"),
    ("downpour.staleness", "linear", "downpour.staleness", "choose one of 'none', 'inverse', 'bound'"),
    ("downpour.max_staleness", 3, "downpour.max_staleness", "applies only when downpour.staleness is 'bound'"),
    ("downpour.block", 256, "downpour.block", "applies only when downpour.codec is 'onebit' or 'int8'"),
    ("stop.max_epochs", 0, "stop.max_epochs", "must be at least 1"),
    ("stop.target_accuracy", 1.5, "stop.target_accuracy", "must be <= 1.0"),
    ("stop.target_accuracy", 0, "stop.target_accuracy", "must be > 0.0"),
    ("stop.max_seconds", -1, "stop.max_seconds", "must be > 0.0"),
    ("stop.max_steps", 10, "stop.max_steps", "unknown key 'stop.max_steps'"),
    ("eval.every_seconds", 0, "eval.every_seconds", "must be > 0.0"),
    ("eval.every_steps", 0, "eval.every_steps", "must be at least 1"),
    ("eval.timeout_s", 0, "eval.timeout_s", "must be > 0.0"),
    ("model.kwargs.size", [64, 10], "model.kwargs", "unknown argument 'size'"),
    ("model.kwargs.activation", "swish", "model.kwargs", "unknown activation 'swish'"),
    ("model.factory", "dniasync.train.models:nope", "model.factory", "has no attribute 'nope'"),
    ("model.factory", "no_such_pkg.models:mlp", "model.factory", "module 'no_such_pkg.models' not found"),
]


@pytest.mark.parametrize(("dotted", "value", "key", "message"), BAD, ids=[f"{b[0]}={'<deleted>' if b[1] is DELETE else repr(b[1])}" for b in BAD])
def test_bad_config_names_its_key(dotted: str, value: Any, key: str, message: str) -> None:
    raw = with_(base(), dotted, value)
    with pytest.raises(ConfigError, match=message) as err:
        parse_config(raw)
    assert err.value.key == key
    assert key in str(err.value)


@pytest.mark.parametrize(
    ("raw", "key", "message"),
    [
        (with_(base("hogwild"), "hogwild.n_workers", 0), "hogwild.n_workers", "must be at least 1"),
        (with_(base("hogwild"), "hogwild.n_workers", 1001), "hogwild.n_workers", "more than data.n_train"),
        (with_(base("hogwild"), "downpour", {}), "downpour", "does not apply: job.mode is 'hogwild'"),
        (with_(base(), "eval", {"every_seconds": 1, "every_steps": 5}), "eval.every_steps", "not both|together"),
        (with_(with_(base(), "downpour.codec", "onebit"), "downpour.block", 12), "downpour.block", "multiple of 8"),
        (with_(base(), "optimizer.name", "sgd") | {"optimizer": {"name": "sgd", "eps": 1e-8}}, "optimizer.eps", "applies only when optimizer.name is 'adagrad' or 'adam'"),
        (with_(base(), "optimizer", {"name": "adam", "betas": [0.9]}), "optimizer.betas", "array of two numbers"),
        (with_(base(), "optimizer", {"name": "adam", "betas": [0.9, 1.0]}), "optimizer.betas", "must be < 1.0"),
    ],
)
def test_more_bad_configs(raw: dict[str, Any], key: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        parse_config(raw)
    assert err.value.key == key


def test_resolve_false_skips_model_and_data_checks() -> None:
    raw = with_(base(), "model.factory", "no_such_pkg.models:mlp")
    assert parse_config(raw, resolve=False).model.factory == "no_such_pkg.models:mlp"


def test_load_config_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[job\nmode = 1\n")
    with pytest.raises(ConfigError, match="broken.toml: not valid TOML"):
        load_config(broken)
    typo = tmp_path / "typo.toml"
    typo.write_text(
        (ROOT / "examples" / "downpour_mnist.toml").read_text().replace("n_replicas", "n_replica")
    )
    with pytest.raises(ConfigError, match="typo.toml: unknown key 'downpour.n_replica'") as err:
        load_config(typo)
    assert err.value.key == "downpour.n_replica"


def test_the_config_reference_is_generated_from_the_schema() -> None:
    from dniasync.cluster.config import config_reference

    assert (ROOT / "docs" / "config.md").read_text() == "\n".join(config_reference()) + "\n", (
        "docs/config.md is stale: python -m dniasync.cluster.config > docs/config.md"
    )


# ------------------------------------------------------------------ [sync] and what a mode declares


@pytest.mark.parametrize(("mode", "kind", "needs_ps"), [("downpour", "ps", True), ("hogwild", "shm", False)])
def test_a_config_without_sync_runs_the_modes_own(mode: str, kind: str, needs_ps: bool) -> None:
    config = parse_config(base(mode))
    assert (config.sync_kind, config.sync_needs_ps) == (kind, needs_ps)
    assert "sync" not in config.to_dict()


def test_sync_keys_are_checked_and_round_trip() -> None:
    raw = with_(with_(base(), "sync.kind", "ps"), "sync.local_steps", 4)
    config = parse_config(with_(raw, "sync.outer_momentum", 0.5))
    assert (config.sync.local_steps, config.sync.outer_lr, config.sync.outer_momentum) == (4, 1.0, 0.5)
    assert config.to_dict()["sync"] == {"kind": "ps", "local_steps": 4, "outer_momentum": 0.5}
    assert parse_config(config.to_dict()) == config
    for dotted, value, message in [
        ("sync.kind", "p2p", "'sync.kind' is 'p2p'; mode 'downpour', as configured, runs with 'ps' or 'shm'"),
        ("sync.kind", "gossip", "'sync.kind' is 'gossip'; choose one of 'local', 'ps', 'shm', 'p2p'"),
        ("sync.local_steps", 0, "'sync.local_steps' must be at least 1, got 0"),
        ("sync.outer_momentum", 1.0, "'sync.outer_momentum' must be < 1.0"),
        ("sync.fanout", 2, "'sync.fanout' applies only when sync.kind is 'p2p' \\(it is 'ps'\\)"),
        ("sync.max_lag", 4, "'sync.max_lag' applies only when sync.kind is 'p2p'"),
        ("sync.kinds", "ps", "did you mean 'kind'"),
    ]:
        with pytest.raises(ConfigError, match=message) as err:
            parse_config(with_(base(), dotted, value))
        assert err.value.key == dotted


def test_local_steps_refuse_what_contradicts_them_naming_the_key() -> None:
    local = with_(base(), "sync.local_steps", 4)
    assert parse_config(with_(local, "downpour.n_fetch", 1)).sync.local_steps == 4  # 1 is the exchange itself
    for raw, key, message in [
        (with_(local, "downpour.n_push", 2), "downpour.n_push",
         "'downpour.n_push' is 2; with sync.local_steps = 4 a replica pushes its pseudo-gradient and pulls every "
         "local_steps steps"),
        (with_(local, "downpour.n_fetch", 3), "downpour.n_fetch", "'downpour.n_fetch' is 3"),
        (with_(base("hogwild"), "sync.local_steps", 4), "sync.local_steps",
         "'sync.local_steps' applies only in job.mode 'downpour' or 'p2p' \\(it is 'hogwild'\\)"),
        (with_(base(), "sync.outer_lr", 0.5), "sync.outer_lr",
         "'sync.outer_lr' applies only with sync.local_steps above 1"),
    ]:
        with pytest.raises(ConfigError, match=message) as err:
            parse_config(raw)
        assert err.value.key == key


class _Unscheduled:
    """A mode as registered, except that it does not honour [schedule]."""

    schedules = False

    def __init__(self, mode: Mode) -> None:
        self._mode = mode

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mode, name)


def test_schedule_on_a_mode_that_does_not_take_it_names_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = with_(base("hogwild"), "schedule", {"kind": "stepwise", "end": 64})
    assert parse_config(raw).schedule.kind == "stepwise"
    monkeypatch.setitem(MODES, "hogwild", _Unscheduled(MODES["hogwild"]))
    with pytest.raises(ConfigError, match="'\\[schedule\\]' does not apply to job.mode 'hogwild': that mode does not "
                                          "honour a batch-size schedule") as err:
        parse_config(raw)
    assert err.value.key == "schedule"


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_example_runs_a_sync_the_config_knows(path: Path) -> None:
    config = load_config(path, resolve=False)
    kinds = MODES[config.mode].syncs(config.settings)
    assert config.sync_kind in kinds and set(kinds) <= set(typing.get_args(SyncName))  # written, or the default
    if config.sync.kind is None:
        assert config.sync_kind == kinds[0]
    assert SYNC_NEEDS_PS[config.sync_kind] == (MODES[config.mode].processes(config)[0] > 0)


def test_the_sync_names_mirror_the_train_side_registry() -> None:
    from dniasync.train.sync import SYNCS

    for name, kind in SYNCS.items():
        assert name in SYNC_NEEDS_PS, f"train.sync registers {name!r}: add it to cluster.config's SyncName"
        assert SYNC_NEEDS_PS[name] == kind.needs_ps, name
