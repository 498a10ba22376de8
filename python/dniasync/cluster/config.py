"""The TOML job config, parsed into frozen dataclasses with strict validation.

Every problem raises one :class:`ConfigError` whose message names the full
dotted key (``unknown key 'downpour.n_replica' (did you mean 'n_replicas'?)``).
Unknown sections and keys are errors, as are keys that do not apply to the
chosen mode, optimizer or codec. Relative paths are relative to the working
directory of the process that reads the config.

``[job]``
  ``name`` (str, default ``"dniasync-job"``): letters, digits, ``_ . -``.
  ``mode`` (str, required): ``"downpour"``, ``"hogwild"`` or ``"dni"``; the mode's own
  section (``[downpour]`` / ``[hogwild]`` / ``[dni]``) may appear, the others may not.
  ``seed`` (int >= 0, default 0): model init, split, shard order.
  ``output_dir`` (str, default ``"runs/<name>"``): where the summary JSON and PNG go.

``[model]``
  ``factory`` (str, required): ``"package.module:function"`` returning a ``torch.nn.Module``.
  ``kwargs`` (table, default empty): keyword arguments for the factory.

``[data]``
  ``dataset`` (str, required): ``mnist5k``, ``digits``, or a path to ``.npz``,
  ``.csv[.gz]``, an ``*idx3-ubyte[.gz]`` file (labels found beside it) or a
  directory of MNIST IDX files.
  ``n_train`` (int >= 1, required), ``n_test`` (int >= 1, required): sizes of
  the seeded training and held-out split; their sum may not exceed the data set.
  ``batch_size`` (int >= 1, default 32): examples per replica step, at most ``n_train``.
  ``scale`` (float > 0, optional): divide features by this (default: 255 for
  8-bit IDX/npz data, else 1); not for built-ins.
  ``csv_label_column`` (int or str, default 0), ``csv_header`` (bool, default:
  detected): CSV only. ``npz_x_key`` / ``npz_y_key`` (str, default ``"x"`` / ``"y"``): npz only.

``[optimizer]`` (applied by each PS shard, or in place by Hogwild workers)
  ``name`` (str, default ``"adagrad"``): ``adagrad``, ``sgd``, ``momentum``, ``nesterov``, ``adam``.
  ``lr`` (float > 0, default 0.01).
  ``momentum`` (float in [0, 1), default 0.9): ``momentum`` and ``nesterov`` only.
  ``weight_decay`` (float >= 0, default 0).
  ``clip_norm`` (float > 0, optional): clip each mini-batch gradient's global
  L2 norm to this on the replica, before accumulation.
  ``eps`` (float > 0, default 1e-10 for adagrad, 1e-8 for adam): those two only.
  ``betas`` (two floats in [0, 1), default ``[0.9, 0.999]``): ``adam`` only.

``[downpour]`` (mode ``downpour``)
  ``n_replicas`` (int >= 1, default 1): model replicas, one data shard each;
  at most ``n_train``. Shards differ in size by at most one example, so
  ``n_train`` need not divide evenly.
  ``n_ps_shards`` (int >= 1, default 1): the flat parameter vector is cut into
  this many contiguous ranges, so at most the number of parameters.
  ``n_fetch`` (int >= 1, default 1): a replica pulls parameters every n_fetch steps.
  ``n_push`` (int >= 1, default 1): it pushes its accumulated gradient every n_push steps.
  ``warm_start_steps`` (int >= 0, default 0): steps the first replica runs
  alone before the others start.
  ``codec`` (str, default ``"none"``): ``none``, ``threshold`` (Strom),
  ``onebit`` (1-bit SGD), ``int8`` (blockwise 8-bit).
  ``tau`` (float > 0): the threshold; required with, and only for, ``threshold``.
  ``block`` (int, default 256): block size for ``onebit`` (a multiple of 8) and ``int8``.
  ``staleness`` (str, default ``"none"``): ``none`` (plain Downpour),
  ``inverse`` (lr / staleness), ``bound`` (drop pushes staler than ``max_staleness``).
  ``max_staleness`` (int >= 0): required with, and only for, ``bound``.

``[hogwild]`` (mode ``hogwild``)
  ``n_workers`` (int >= 1, default 1): processes sharing one ``ParamStore``; at most ``n_train``.

``[dni]`` (mode ``dni``: model parallelism with Decoupled Neural Interfaces)
  The model factory must return an ``nn.Sequential``; it is cut into layer
  groups, each hosted by a ``LayerGroup`` actor in a worker process. With
  ``replicas = 1`` each group trains with ``[optimizer]`` locally (``adam`` or
  ``sgd``; ``lr`` only); with ``replicas > 1`` (DNI x Downpour) every group has
  one PS shard that applies ``[optimizer]`` to the pushes of that group's replicas.
  ``groups`` (array of arrays of ints, required): layer indices of the
  ``nn.Sequential`` per group, e.g. ``[[0, 1], [2, 3], [4]]``; contiguous,
  ordered, every layer in exactly one group (checked against the model at start).
  ``variant`` (str, default ``"cdni"``): ``dni`` (synthetic gradients), ``cdni``
  (synthetic gradients conditioned on the labels) or ``sync`` (the synchronous
  pipeline baseline: real backprop, GPipe-style micro-batches).
  ``synthetic_inputs`` (bool, default false): groups after the first also learn to
  predict their input from the raw data; not with ``sync``.
  ``sg_hidden_layers`` (int >= 0, default 0: linear), ``sg_hidden_width`` (int >= 0,
  default 0: as wide as the activations), ``sg_lr`` (float > 0, default 1e-4):
  the synthetic-gradient model's shape and Adam learning rate; not with ``sync``.
  ``sg_fit_rows`` (int >= 0, default 0: all, at most ``data.batch_size``): fit the
  SG model on this many rows of each returning batch (a random sample: batches
  are shuffled); less SG work per batch for a little accuracy; not with ``sync``.
  ``max_in_flight`` (int >= 1, default 4): mini-batches in a DNI pipeline at once.
  ``micro_batches`` (int >= 1, default 4, at most ``data.batch_size``): ``sync`` only.
  ``replicas`` (int >= 1, default 1): pipelines, each on its own data shard;
  more than one is DNI x Downpour.
  ``n_fetch`` / ``n_push`` (int >= 1, default 1): with ``replicas > 1`` only; a
  group replica pulls its parameters every ``n_fetch`` steps and pushes its
  accumulated gradient every ``n_push``.
  ``placement`` (array of ints, default one worker process per group): the worker
  (0, 1, ...) hosting each group of a pipeline; every worker from 0 to the
  largest must host a group. Worker processes: (largest + 1) x ``replicas``.

``[stop]`` (whichever comes first)
  ``max_epochs`` (int >= 1, default 10): passes over the training set, all shards together.
  ``target_accuracy`` (float in (0, 1], optional): held-out accuracy to stop at.
  ``max_seconds`` (float > 0, optional): wall-clock limit.

``[eval]`` (at most one of the two; default every 2 seconds)
  ``every_seconds`` (float > 0): evaluate on the held-out set this often.
  ``every_steps`` (int >= 1): ... or after this many mini-batch steps, all replicas together.
  The coordinator evaluates a copy of the weights while training goes on, so a
  slow evaluation stretches the interval: ``every_seconds`` is a lower bound.
  ``deferred`` (bool, default false; mode ``dni`` only, not with
  ``stop.target_accuracy``): take the weights at each interval but run their
  forward passes after training, so evaluation takes no CPU from the groups
  while they train (on a small machine it competes with them); the summary,
  plot and history are the same, the live accuracy gauge updates only at the
  end. At most 256 snapshots wait; beyond that the oldest is evaluated at once.

Adding a mode (e.g. DNI): write its settings dataclass and a ``_parse_<mode>``
function, add it to ``_MODE_PARSERS`` and to the ``ModeSettings`` union.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from dniasync.train.data import BUILTIN_DATASETS, DatasetError, count_examples, dataset_kind

__all__ = [
    "CODECS",
    "MODES",
    "OPTIMIZERS",
    "STALENESS_POLICIES",
    "Config",
    "ConfigError",
    "DataConfig",
    "DNIConfig",
    "DNI_VARIANTS",
    "DownpourConfig",
    "EvalConfig",
    "HogwildConfig",
    "JobConfig",
    "ModeSettings",
    "ModelConfig",
    "OptimizerConfig",
    "StopConfig",
    "load_config",
    "parse_config",
]

OPTIMIZERS: Final = ("adagrad", "sgd", "momentum", "nesterov", "adam")
CODECS: Final = ("none", "threshold", "onebit", "int8")
STALENESS_POLICIES: Final = ("none", "inverse", "bound")
DNI_VARIANTS: Final = ("dni", "cdni", "sync")
DNI_LOCAL_OPTIMIZERS: Final = ("adam", "sgd")

_DEFAULT_EPS: Final = {"adagrad": 1e-10, "adam": 1e-8}
_NAME_RE: Final = re.compile(r"^[A-Za-z0-9_.-]+$")
_FACTORY_RE: Final = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_DEFAULT_EVAL_SECONDS: Final = 2.0


class ConfigError(ValueError):
    """A job config is malformed; ``key`` is the dotted key at fault (None for the file itself)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# --------------------------------------------------------------------------- dataclasses


@dataclass(frozen=True)
class JobConfig:
    """``[job]``: what runs and where its results go."""

    mode: str
    name: str = "dniasync-job"
    seed: int = 0
    output_dir: str = "runs/dniasync-job"


@dataclass(frozen=True)
class ModelConfig:
    """``[model]``: the factory and its keyword arguments."""

    factory: str
    kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class DataConfig:
    """``[data]``: the data set, its split and the mini-batch size."""

    dataset: str
    n_train: int
    n_test: int
    batch_size: int = 32
    scale: float | None = None
    csv_label_column: int | str = 0
    csv_header: bool | None = None
    npz_x_key: str = "x"
    npz_y_key: str = "y"


@dataclass(frozen=True)
class OptimizerConfig:
    """``[optimizer]``: the update rule the PS shards (or Hogwild workers) apply."""

    name: str = "adagrad"
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    clip_norm: float | None = None
    eps: float = 1e-10
    betas: tuple[float, float] = (0.9, 0.999)


@dataclass(frozen=True)
class DownpourConfig:
    """``[downpour]``: replicas, PS shards, fetch/push cadence, codec, staleness."""

    n_replicas: int = 1
    n_ps_shards: int = 1
    n_fetch: int = 1
    n_push: int = 1
    warm_start_steps: int = 0
    codec: str = "none"
    tau: float | None = None
    block: int = 256
    staleness: str = "none"
    max_staleness: int | None = None


@dataclass(frozen=True)
class HogwildConfig:
    """``[hogwild]``: lock-free workers over one shared store."""

    n_workers: int = 1


@dataclass(frozen=True)
class DNIConfig:
    """``[dni]``: the cut into layer groups, the DNI variant, SG models, placement, replicas."""

    groups: tuple[tuple[int, ...], ...]
    variant: str = "cdni"
    synthetic_inputs: bool = False
    sg_hidden_layers: int = 0
    sg_hidden_width: int = 0
    sg_lr: float = 1e-4
    sg_fit_rows: int = 0
    max_in_flight: int = 4
    micro_batches: int = 4
    replicas: int = 1
    n_fetch: int = 1
    n_push: int = 1
    placement: tuple[int, ...] | None = None

    @property
    def group_workers(self) -> tuple[int, ...]:
        """The worker (within one pipeline) that hosts each group."""
        return self.placement if self.placement is not None else tuple(range(len(self.groups)))

    @property
    def workers_per_pipeline(self) -> int:
        return max(self.group_workers) + 1

    @property
    def n_workers(self) -> int:
        """Worker processes the job needs: one per placement slot per replica."""
        return self.workers_per_pipeline * self.replicas


ModeSettings = DownpourConfig | HogwildConfig | DNIConfig


@dataclass(frozen=True)
class StopConfig:
    """``[stop]``: the run ends at the first condition met."""

    max_epochs: int = 10
    target_accuracy: float | None = None
    max_seconds: float | None = None


@dataclass(frozen=True)
class EvalConfig:
    """``[eval]``: held-out evaluation cadence; exactly one field is set."""

    every_seconds: float | None = _DEFAULT_EVAL_SECONDS
    every_steps: int | None = None
    deferred: bool = False


@dataclass(frozen=True)
class Config:
    """A whole job."""

    job: JobConfig
    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig
    settings: ModeSettings
    stop: StopConfig
    eval: EvalConfig

    @property
    def mode(self) -> str:
        """``job.mode``."""
        return self.job.mode

    @property
    def downpour(self) -> DownpourConfig:
        """The Downpour settings; a :class:`ConfigError` in another mode."""
        if not isinstance(self.settings, DownpourConfig):
            raise ConfigError(f"job.mode is {self.mode!r}, not 'downpour'", "job.mode")
        return self.settings

    @property
    def hogwild(self) -> HogwildConfig:
        """The Hogwild settings; a :class:`ConfigError` in another mode."""
        if not isinstance(self.settings, HogwildConfig):
            raise ConfigError(f"job.mode is {self.mode!r}, not 'hogwild'", "job.mode")
        return self.settings

    @property
    def dni(self) -> DNIConfig:
        """The DNI settings; a :class:`ConfigError` in another mode."""
        if not isinstance(self.settings, DNIConfig):
            raise ConfigError(f"job.mode is {self.mode!r}, not 'dni'", "job.mode")
        return self.settings

    @property
    def n_data_shards(self) -> int:
        """How many disjoint training shards: one per replica, worker or DNI pipeline."""
        if isinstance(self.settings, DownpourConfig):
            return self.settings.n_replicas
        if isinstance(self.settings, DNIConfig):
            return self.settings.replicas
        return self.settings.n_workers

    def to_dict(self) -> dict[str, Any]:
        """TOML-shaped plain data, defaults left out; ``parse_config`` of it gives an equal config."""
        out: dict[str, Any] = {}
        for section, value in (
            ("job", self.job), ("model", self.model), ("data", self.data),
            ("optimizer", self.optimizer), (self.mode, self.settings),
            ("stop", self.stop), ("eval", self.eval),
        ):
            table: dict[str, Any] = {}
            for f in fields(value):
                item = getattr(value, f.name)
                default = f.default_factory() if f.default_factory is not MISSING else f.default
                if item is None or item == default:
                    continue  # left out, the key may not apply here; parsing restores it
                if isinstance(item, Mapping):
                    item = dict(item)
                elif isinstance(item, tuple):
                    item = [list(i) if isinstance(i, tuple) else i for i in item]
                table[f.name] = item
            out[section] = table
        return out


# --------------------------------------------------------------------------- parsing helpers

_MISSING: Final = object()


class _Section:
    """One TOML table being read: typed getters that name the dotted key on error."""

    def __init__(self, name: str, table: Any, allowed: tuple[str, ...]) -> None:
        if not isinstance(table, dict):
            raise ConfigError(f"'{name}' must be a table, got {_type_name(table)}", name)
        self.name = name
        self.table: dict[str, Any] = table
        for key in table:
            if key not in allowed:
                raise ConfigError(_unknown(f"{name}.{key}", key, allowed), f"{name}.{key}")

    def key(self, key: str) -> str:
        return f"{self.name}.{key}"

    def given(self, key: str) -> bool:
        return key in self.table

    def _default(self, key: str, default: Any) -> Any:
        """The value of an absent key: ``default``, or an error when the key is required."""
        if default is _MISSING:
            raise ConfigError(f"missing required key '{self.key(key)}'", self.key(key))
        return default

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"'{self.key(key)}' {problem}", self.key(key))

    def string(self, key: str, default: Any = _MISSING, choices: tuple[str, ...] = ()) -> Any:
        if key not in self.table:
            return self._default(key, default)
        value = self.table[key]
        if not isinstance(value, str):
            raise self.error(key, f"must be a string, got {_type_name(value)}")
        if choices and value not in choices:
            raise self.error(key, f"is {value!r}; choose one of {', '.join(map(repr, choices))}")
        return value

    def integer(self, key: str, default: Any = _MISSING, minimum: int | None = None) -> Any:
        if key not in self.table:
            return self._default(key, default)
        value = self.table[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an integer, got {_type_name(value)}")
        if minimum is not None and value < minimum:
            raise self.error(key, f"must be at least {minimum}, got {value}")
        return value

    def number(
        self,
        key: str,
        default: Any = _MISSING,
        *,
        low: float | None = None,
        high: float | None = None,
        low_open: bool = False,
        high_open: bool = False,
    ) -> Any:
        if key not in self.table:
            return self._default(key, default)
        value = self.table[key]
        return _check_number(self.key(key), value, low, high, low_open, high_open)

    def boolean(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self.table:
            return self._default(key, default)
        value = self.table[key]
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {_type_name(value)}")
        return value

    def only_for(self, key: str, setting: str, actual: str, allowed: tuple[str, ...]) -> None:
        """Reject ``key`` when the sibling ``setting`` is not one that uses it."""
        if key in self.table and actual not in allowed:
            raise self.error(
                key,
                f"applies only when {self.key(setting)} is {' or '.join(map(repr, allowed))} "
                f"(it is {actual!r})",
            )


def _type_name(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
             list: "an array", dict: "a table"}
    return names.get(type(value), type(value).__name__)


def _unknown(dotted: str, key: str, allowed: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else f" (allowed: {', '.join(allowed)})"
    return f"unknown key '{dotted}'{hint}"


def _check_number(
    dotted: str, value: Any, low: float | None, high: float | None, low_open: bool, high_open: bool
) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"'{dotted}' must be a number, got {_type_name(value)}", dotted)
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"'{dotted}' must be finite, got {number}", dotted)
    if low is not None and (number <= low if low_open else number < low):
        raise ConfigError(f"'{dotted}' must be {'>' if low_open else '>='} {low}, got {number}", dotted)
    if high is not None and (number >= high if high_open else number > high):
        raise ConfigError(f"'{dotted}' must be {'<' if high_open else '<='} {high}, got {number}", dotted)
    return number


# --------------------------------------------------------------------------- sections


def _parse_job(s: _Section) -> JobConfig:
    name = s.string("name", JobConfig.name)
    if not _NAME_RE.match(name):
        raise s.error("name", f"must use only letters, digits, '_', '.', '-', got {name!r}")
    mode = s.string("mode", choices=MODES)
    output_dir = s.string("output_dir", f"runs/{name}")
    if not output_dir:
        raise s.error("output_dir", "must not be empty")
    return JobConfig(mode=mode, name=name, seed=s.integer("seed", 0, minimum=0), output_dir=output_dir)


def _parse_model(s: _Section) -> ModelConfig:
    factory = s.string("factory")
    if not _FACTORY_RE.match(factory):
        raise s.error("factory", f"must look like 'package.module:function', got {factory!r}")
    kwargs = s.table.get("kwargs", {})
    if not isinstance(kwargs, dict):
        raise s.error("kwargs", f"must be a table, got {_type_name(kwargs)}")
    return ModelConfig(factory, MappingProxyType(dict(kwargs)))


_DATA_KEY_KINDS: Final[dict[str, tuple[str, ...]]] = {
    "csv_label_column": ("csv",),
    "csv_header": ("csv",),
    "npz_x_key": ("npz",),
    "npz_y_key": ("npz",),
    "scale": ("csv", "npz", "idx", "dir"),
}


def _parse_data(s: _Section) -> DataConfig:
    dataset = s.string("dataset")
    try:
        kind = dataset_kind(dataset)
    except DatasetError as e:
        raise ConfigError(f"'{s.key('dataset')}': {e}", s.key("dataset")) from None
    for key, kinds in _DATA_KEY_KINDS.items():
        if s.given(key) and kind not in kinds:
            raise s.error(
                key, f"applies only to {' or '.join(kinds)} data sets; {dataset!r} is {kind}"
            )
    n_train = s.integer("n_train", minimum=1)
    n_test = s.integer("n_test", minimum=1)
    batch_size = s.integer("batch_size", DataConfig.batch_size, minimum=1)
    if batch_size > n_train:
        raise s.error("batch_size", f"is {batch_size}, more than data.n_train = {n_train}")
    if dataset in BUILTIN_DATASETS and n_train + n_test > BUILTIN_DATASETS[dataset]:
        raise s.error(
            "n_train",
            f"+ data.n_test = {n_train + n_test} exceeds the {BUILTIN_DATASETS[dataset]} "
            f"examples of {dataset!r}",
        )
    label_column = s.table.get("csv_label_column", 0)
    if isinstance(label_column, bool) or not isinstance(label_column, int | str):
        raise s.error("csv_label_column", f"must be an integer or a column name, got {_type_name(label_column)}")
    scale = s.number("scale", None, low=0.0, low_open=True)
    return DataConfig(
        dataset=dataset,
        n_train=n_train,
        n_test=n_test,
        batch_size=batch_size,
        scale=scale,
        csv_label_column=label_column,
        csv_header=s.boolean("csv_header", None),
        npz_x_key=s.string("npz_x_key", "x"),
        npz_y_key=s.string("npz_y_key", "y"),
    )


def _parse_optimizer(s: _Section) -> OptimizerConfig:
    name = s.string("name", "adagrad", choices=OPTIMIZERS)
    s.only_for("momentum", "name", name, ("momentum", "nesterov"))
    s.only_for("eps", "name", name, ("adagrad", "adam"))
    s.only_for("betas", "name", name, ("adam",))
    betas = s.table.get("betas", [0.9, 0.999])
    if not isinstance(betas, list) or len(betas) != 2:
        raise s.error("betas", f"must be an array of two numbers, got {betas!r}")
    beta1, beta2 = (
        _check_number(s.key("betas"), b, 0.0, 1.0, False, True) for b in betas
    )
    return OptimizerConfig(
        name=name,
        lr=s.number("lr", OptimizerConfig.lr, low=0.0, low_open=True),
        momentum=s.number("momentum", OptimizerConfig.momentum, low=0.0, high=1.0, high_open=True),
        weight_decay=s.number("weight_decay", 0.0, low=0.0),
        clip_norm=s.number("clip_norm", None, low=0.0, low_open=True),
        eps=s.number("eps", _DEFAULT_EPS.get(name, OptimizerConfig.eps), low=0.0, low_open=True),
        betas=(beta1, beta2),
    )


def _parse_downpour(s: _Section) -> DownpourConfig:
    codec = s.string("codec", "none", choices=CODECS)
    staleness = s.string("staleness", "none", choices=STALENESS_POLICIES)
    s.only_for("tau", "codec", codec, ("threshold",))
    s.only_for("block", "codec", codec, ("onebit", "int8"))
    s.only_for("max_staleness", "staleness", staleness, ("bound",))
    tau = s.number("tau", None if codec != "threshold" else _MISSING, low=0.0, low_open=True)
    block = s.integer("block", DownpourConfig.block, minimum=1)
    if codec == "onebit" and block % 8:
        raise s.error("block", f"must be a multiple of 8 for the onebit codec, got {block}")
    return DownpourConfig(
        n_replicas=s.integer("n_replicas", 1, minimum=1),
        n_ps_shards=s.integer("n_ps_shards", 1, minimum=1),
        n_fetch=s.integer("n_fetch", 1, minimum=1),
        n_push=s.integer("n_push", 1, minimum=1),
        warm_start_steps=s.integer("warm_start_steps", 0, minimum=0),
        codec=codec,
        tau=tau,
        block=block,
        staleness=staleness,
        max_staleness=s.integer(
            "max_staleness", None if staleness != "bound" else _MISSING, minimum=0
        ),
    )


def _parse_hogwild(s: _Section) -> HogwildConfig:
    return HogwildConfig(n_workers=s.integer("n_workers", 1, minimum=1))


def _int_list(s: _Section, key: str, value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple):
        raise s.error(key, f"must be an array of {what}, got {_type_name(value)}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            raise s.error(key, f"must hold only integers ({what}), got {item!r}")
    return tuple(value)


def _parse_dni(s: _Section) -> DNIConfig:
    raw_groups = s.table.get("groups", _MISSING)
    if raw_groups is _MISSING:
        raise ConfigError(f"missing required key '{s.key('groups')}'", s.key("groups"))
    if not isinstance(raw_groups, list | tuple) or not raw_groups:
        raise s.error("groups", f"must be a non-empty array of arrays of layer indices, got {raw_groups!r}")
    groups = tuple(_int_list(s, "groups", g, "layer indices per group") for g in raw_groups)
    for k, group in enumerate(groups):
        if not group:
            raise s.error("groups", f"group {k} is empty")
    variant = s.string("variant", DNIConfig.variant, choices=DNI_VARIANTS)
    for key in ("synthetic_inputs", "sg_hidden_layers", "sg_hidden_width", "sg_lr", "sg_fit_rows", "max_in_flight"):
        s.only_for(key, "variant", variant, ("dni", "cdni"))
    s.only_for("micro_batches", "variant", variant, ("sync",))
    replicas = s.integer("replicas", 1, minimum=1)
    for key in ("n_fetch", "n_push"):
        if s.given(key) and replicas == 1:
            raise s.error(key, "applies only when dni.replicas > 1 (DNI x Downpour)")
    placement = None
    if s.given("placement"):
        placement = _int_list(s, "placement", s.table["placement"], "worker indices")
        if len(placement) != len(groups):
            raise s.error("placement", f"has {len(placement)} entries for {len(groups)} groups (one worker per group)")
        if min(placement) < 0:
            raise s.error("placement", f"worker indices must be >= 0, got {list(placement)}")
        unused = sorted(set(range(max(placement) + 1)) - set(placement))
        if unused:
            raise s.error("placement", f"leaves workers {unused} without a group; number workers 0, 1, ... in use")
    return DNIConfig(
        groups=groups,
        variant=variant,
        synthetic_inputs=s.boolean("synthetic_inputs", False),
        sg_hidden_layers=s.integer("sg_hidden_layers", DNIConfig.sg_hidden_layers, minimum=0),
        sg_hidden_width=s.integer("sg_hidden_width", DNIConfig.sg_hidden_width, minimum=0),
        sg_lr=s.number("sg_lr", DNIConfig.sg_lr, low=0.0, low_open=True),
        sg_fit_rows=s.integer("sg_fit_rows", DNIConfig.sg_fit_rows, minimum=0),
        max_in_flight=s.integer("max_in_flight", DNIConfig.max_in_flight, minimum=1),
        micro_batches=s.integer("micro_batches", DNIConfig.micro_batches, minimum=1),
        replicas=replicas,
        n_fetch=s.integer("n_fetch", 1, minimum=1),
        n_push=s.integer("n_push", 1, minimum=1),
        placement=placement,
    )


def _check_dni(config: Config, raw_optimizer: Mapping[str, Any]) -> None:
    """Cross-section rules of mode ``dni`` (the optimizer the groups can apply, micro-batch size)."""
    d = config.dni
    if d.variant == "sync" and d.micro_batches > config.data.batch_size:
        raise ConfigError(
            f"'dni.micro_batches' is {d.micro_batches}, more than data.batch_size = {config.data.batch_size}",
            "dni.micro_batches",
        )
    if d.sg_fit_rows > config.data.batch_size:
        raise ConfigError(
            f"'dni.sg_fit_rows' is {d.sg_fit_rows}, more than data.batch_size = {config.data.batch_size}",
            "dni.sg_fit_rows",
        )
    if config.optimizer.clip_norm is not None:
        raise ConfigError("'optimizer.clip_norm' does not apply in mode 'dni'", "optimizer.clip_norm")
    if d.replicas == 1:  # each group steps its own torch optimizer: only its name and lr apply
        if config.optimizer.name not in DNI_LOCAL_OPTIMIZERS:
            raise ConfigError(
                f"'optimizer.name' is {config.optimizer.name!r}; layer groups train with "
                f"{' or '.join(map(repr, DNI_LOCAL_OPTIMIZERS))} (any optimizer with dni.replicas > 1, "
                "where PS shards apply it)",
                "optimizer.name",
            )
        opt = config.optimizer
        defaults = {"momentum": OptimizerConfig.momentum, "weight_decay": 0.0, "betas": OptimizerConfig.betas,
                    "eps": _DEFAULT_EPS.get(opt.name, OptimizerConfig.eps)}
        for key, default in defaults.items():
            if key in raw_optimizer and getattr(opt, key) != default:
                raise ConfigError(
                    f"'optimizer.{key}' does not apply in mode 'dni' with dni.replicas = 1 "
                    "(layer groups use the optimizer's name and lr only)",
                    f"optimizer.{key}",
                )


def _parse_stop(s: _Section) -> StopConfig:
    return StopConfig(
        max_epochs=s.integer("max_epochs", StopConfig.max_epochs, minimum=1),
        target_accuracy=s.number("target_accuracy", None, low=0.0, high=1.0, low_open=True),
        max_seconds=s.number("max_seconds", None, low=0.0, low_open=True),
    )


def _parse_eval(s: _Section) -> EvalConfig:
    if s.given("every_seconds") and s.given("every_steps"):
        raise s.error("every_steps", "cannot be set together with eval.every_seconds")
    every_steps = s.integer("every_steps", None, minimum=1)
    every_seconds = s.number(
        "every_seconds", None if every_steps else _DEFAULT_EVAL_SECONDS, low=0.0, low_open=True
    )
    return EvalConfig(every_seconds=every_seconds, every_steps=every_steps, deferred=s.boolean("deferred", False))


_ModeParser = Callable[[_Section], ModeSettings]
_MODE_PARSERS: Final[dict[str, tuple[_ModeParser, tuple[str, ...]]]] = {
    "downpour": (
        _parse_downpour,
        ("n_replicas", "n_ps_shards", "n_fetch", "n_push", "warm_start_steps", "codec", "tau",
         "block", "staleness", "max_staleness"),
    ),
    "hogwild": (_parse_hogwild, ("n_workers",)),
    "dni": (
        _parse_dni,
        ("groups", "variant", "synthetic_inputs", "sg_hidden_layers", "sg_hidden_width", "sg_lr", "sg_fit_rows",
         "max_in_flight", "micro_batches", "replicas", "n_fetch", "n_push", "placement"),
    ),
}
MODES: Final = tuple(_MODE_PARSERS)

_SECTIONS: Final[dict[str, tuple[str, ...]]] = {
    "job": ("name", "mode", "seed", "output_dir"),
    "model": ("factory", "kwargs"),
    "data": ("dataset", "n_train", "n_test", "batch_size", "scale", "csv_label_column",
             "csv_header", "npz_x_key", "npz_y_key"),
    "optimizer": ("name", "lr", "momentum", "weight_decay", "clip_norm", "eps", "betas"),
    "stop": ("max_epochs", "target_accuracy", "max_seconds"),
    "eval": ("every_seconds", "every_steps", "deferred"),
}
_REQUIRED_SECTIONS: Final = ("job", "model", "data")


def _section(raw: Mapping[str, Any], name: str, allowed: tuple[str, ...]) -> _Section:
    if name not in raw and name in _REQUIRED_SECTIONS:
        raise ConfigError(f"missing required section '[{name}]'", name)
    return _Section(name, raw.get(name, {}), allowed)


# --------------------------------------------------------------------------- entry points


def parse_config(raw: Mapping[str, Any], *, resolve: bool = True) -> Config:
    """Validate TOML-shaped ``raw`` data into a :class:`Config`.

    With ``resolve`` (the default) it also imports and calls the model factory
    and counts the data set's examples, to check shard counts and split sizes
    against them; without, only the config's own consistency is checked.
    """
    known = (*_SECTIONS, *MODES, "node")  # [node] belongs to the node CLI (listen, token, ...)
    for name in raw:
        if name not in known:
            raise ConfigError(_unknown(name, name, known).replace("key", "section", 1), name)
    job = _parse_job(_section(raw, "job", _SECTIONS["job"]))
    for other in MODES:
        if other != job.mode and other in raw:
            raise ConfigError(
                f"section '[{other}]' does not apply: job.mode is {job.mode!r}", other
            )
    parse_mode, mode_keys = _MODE_PARSERS[job.mode]
    config = Config(
        job=job,
        model=_parse_model(_section(raw, "model", _SECTIONS["model"])),
        data=_parse_data(_section(raw, "data", _SECTIONS["data"])),
        optimizer=_parse_optimizer(_section(raw, "optimizer", _SECTIONS["optimizer"])),
        settings=parse_mode(_section(raw, job.mode, mode_keys)),
        stop=_parse_stop(_section(raw, "stop", _SECTIONS["stop"])),
        eval=_parse_eval(_section(raw, "eval", _SECTIONS["eval"])),
    )
    if job.mode == "dni":
        _check_dni(config, raw.get("optimizer", {}))
    if config.eval.deferred:
        if job.mode != "dni":
            raise ConfigError(f"'eval.deferred' applies only in mode 'dni', not {job.mode!r}", "eval.deferred")
        if config.stop.target_accuracy is not None:
            raise ConfigError(
                "'eval.deferred' cannot be used with stop.target_accuracy: the accuracy is known only after training",
                "eval.deferred",
            )
    shards_key = {"downpour": "downpour.n_replicas", "dni": "dni.replicas"}.get(job.mode, f"{job.mode}.n_workers")
    if config.n_data_shards > config.data.n_train:
        raise ConfigError(
            f"'{shards_key}' is {config.n_data_shards}, more than data.n_train = "
            f"{config.data.n_train}: every data shard needs an example",
            shards_key,
        )
    if resolve:
        _resolve(config)
    return config


def _resolve(config: Config) -> None:
    """Check the config against the model it builds and the data it names."""
    from dniasync.train.models import ModelFactoryError, build_model, check_kwargs, count_parameters
    from dniasync.train.models import resolve_factory

    spec, kwargs = config.model.factory, config.model.kwargs
    try:
        factory = resolve_factory(spec)
    except ModelFactoryError as e:
        raise ConfigError(f"'model.factory': {e}", "model.factory") from None
    try:
        check_kwargs(spec, factory, kwargs)
        model = build_model(spec, kwargs, seed=config.job.seed)
    except ModelFactoryError as e:
        raise ConfigError(f"'model.kwargs': {e}", "model.kwargs") from None
    if isinstance(config.settings, DNIConfig):
        _resolve_groups(config.settings, model)
    n_params = count_parameters(model)
    if isinstance(config.settings, DownpourConfig) and config.settings.n_ps_shards > n_params:
        raise ConfigError(
            f"'downpour.n_ps_shards' is {config.settings.n_ps_shards}, but the model has only "
            f"{n_params} parameters to split into contiguous shards",
            "downpour.n_ps_shards",
        )
    data = config.data
    try:
        n = count_examples(data.dataset, header=data.csv_header, y_key=data.npz_y_key)
    except DatasetError as e:
        raise ConfigError(f"'data.dataset': {e}", "data.dataset") from None
    if data.n_train + data.n_test > n:
        raise ConfigError(
            f"'data.n_train' + data.n_test = {data.n_train + data.n_test} exceeds the {n} "
            f"examples of {data.dataset!r}",
            "data.n_train",
        )


def _resolve_groups(d: DNIConfig, model: Any) -> None:
    """The cut must fit the model: an ``nn.Sequential`` whose layers the groups cover exactly."""
    from torch import nn

    from dniasync.train.dni import GroupConfigError, validate_groups

    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"'model.factory' returns a {type(model).__name__}; mode 'dni' cuts an nn.Sequential into layer groups",
            "model.factory",
        )
    try:
        validate_groups(d.groups, len(model))
    except GroupConfigError as e:
        raise ConfigError(f"'dni.groups': {e}", "dni.groups") from None


def load_config(path: str | Path, *, resolve: bool = True) -> Config:
    """Read and validate the TOML job config at ``path`` (see :func:`parse_config`)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    try:
        return parse_config(raw, resolve=resolve)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}", e.key) from None
