"""The TOML job config: typed sections (msgspec structs), strict validation, one reference.

Every problem raises one :class:`ConfigError` whose message names the full
dotted key (``unknown key 'downpour.n_replica' (did you mean 'n_replicas'?)``).
Unknown sections and keys are errors, as are keys that do not apply to the
chosen mode, optimizer or codec. Relative paths are relative to the working
directory of the process that reads the config.

The sections common to every job are defined here; each mode's own section
(``[downpour]``, ``[hogwild]``, ``[pipeline]``, ...) is defined by its mode
module in :mod:`dniasync.cluster.modes`. Each key's type, bounds, default and
one-line description live on its field; :func:`config_reference` renders them
all (``python -m dniasync.cluster.config`` prints the reference, which is also
``docs/config.md``).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Final, Literal

from msgspec import Meta

from dniasync.train.data import BUILTIN_DATASETS, DatasetError, count_examples, dataset_kind

from ._schema import ConfigError, KeyProblem, Section, convert_section, reference, to_table, unknown_key
from .modes import MODES, RENAMED, get_mode

__all__ = [
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "JobConfig",
    "KeyProblem",
    "ModelConfig",
    "OptimizerConfig",
    "ScheduleConfig",
    "Section",
    "StopConfig",
    "SyncConfig",
    "config_reference",
    "load_config",
    "parse_config",
]

_NAME_RE: Final = re.compile(r"^[A-Za-z0-9_.-]+$")
_FACTORY_RE: Final = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

Positive = Annotated[float, Meta(gt=0.0)]
Fraction = Annotated[float, Meta(ge=0.0, lt=1.0)]


class JobConfig(Section, frozen=True):
    """What runs and where its results go."""

    mode: Annotated[str, Meta(description="the training method: one of the modes, each with its own section below")]
    name: Annotated[str, Meta(description="letters, digits, `_ . -`")] = "dniasync-job"
    seed: Annotated[int, Meta(ge=0, description="model init, split, shard order")] = 0
    output_dir: Annotated[str, Meta(description="where the summary JSON and PNG go (default `runs/<name>`)")] | None = None
    standby: Annotated[bool, Meta(description=(
        "run a standby coordinator that follows the job and takes it over, with the same processes, if the "
        "coordinator dies (mode downpour with sync.kind 'ps' and ps_replicas = 1; the launcher starts it)"))] = False

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise KeyProblem("name", f"'{{key}}' must use only letters, digits, '_', '.', '-', got {self.name!r}")
        if self.output_dir == "":
            raise KeyProblem("output_dir", "'{key}' must not be empty")


class ModelConfig(Section, frozen=True):
    """The model factory and its keyword arguments."""

    factory: Annotated[str, Meta(description="`package.module:function` returning a `torch.nn.Module`")]
    kwargs: Annotated[dict[str, Any], Meta(description="keyword arguments for the factory")] = {}

    def __post_init__(self) -> None:
        if not _FACTORY_RE.match(self.factory):
            raise KeyProblem("factory", f"'{{key}}' must look like 'package.module:function', got {self.factory!r}")


_DATA_KEY_KINDS: Final[dict[str, tuple[str, ...]]] = {
    "csv_label_column": ("csv",),
    "csv_header": ("csv",),
    "npz_x_key": ("npz",),
    "npz_y_key": ("npz",),
    "scale": ("csv", "npz", "idx", "dir"),
}
_CONVERTED_NOTE: Final = " (a converted data set keeps the settings it was converted with)"


class DataConfig(Section, frozen=True):
    """The data set, its split and the mini-batch size."""

    dataset: Annotated[str, Meta(description=(
        "`mnist5k`, `digits`, or a path to `.npz`, `.csv[.gz]`, an `*idx3-ubyte[.gz]` file (labels beside it), "
        "a directory of MNIST IDX files, or a converted data set (a directory with a `manifest.json`, written by "
        "`python -m dniasync.data convert SRC DEST`: memory-mapped, each trainer reads only its shard's rows)"))]
    n_train: Annotated[int, Meta(ge=1, description="size of the seeded training split")]
    n_test: Annotated[int, Meta(ge=1, description="size of the held-out split; n_train + n_test <= the data set")]
    batch_size: Annotated[int, Meta(ge=1, description="examples per step, at most n_train")] = 32
    scale: Annotated[float, Meta(gt=0.0, description=(
        "divide features by this (default 255 for 8-bit IDX/npz data, else 1); not for built-ins"))] | None = None
    csv_label_column: Annotated[int | str, Meta(description="CSV only: the label column, by index or name")] = 0
    csv_header: Annotated[bool, Meta(description="CSV only: whether the first row is a header (detected if unset)")] | None = None
    npz_x_key: Annotated[str, Meta(description="npz only: the features array")] = "x"
    npz_y_key: Annotated[str, Meta(description="npz only: the labels array")] = "y"
    shuffle: Annotated[Literal["global", "blocks"], Meta(description=(
        "`global`: the split and every epoch's shards are permutations of all rows (each shard's rows change "
        "every epoch); `blocks`: rows in blocks of data.block_rows in a seeded order, each shard a fixed range of "
        "blocks, permuted every epoch, rows shuffled within windows of data.shuffle_window blocks (a trainer "
        "touches only its shard's rows). Default: `blocks` for a converted data set, else `global`. The same "
        "seed and shuffle give the same batches from a converted set and from its in-memory source"))] | None = None
    block_rows: Annotated[int, Meta(ge=1, description="shuffle `blocks`: rows per block")] = 64
    shuffle_window: Annotated[int, Meta(ge=1, description=(
        "shuffle `blocks`: rows are shuffled within this many consecutive blocks of an epoch's order"))] = 16

    def __post_init__(self) -> None:
        try:
            dataset_kind(self.dataset)
        except DatasetError as e:
            raise KeyProblem("dataset", f"'{{key}}': {e}") from None
        if self.batch_size > self.n_train:
            raise KeyProblem("batch_size", f"'{{key}}' is {self.batch_size}, more than data.n_train = {self.n_train}")
        total = BUILTIN_DATASETS.get(self.dataset)
        if total is not None and self.n_train + self.n_test > total:
            raise KeyProblem("n_train", f"'{{key}}' + data.n_test = {self.n_train + self.n_test} exceeds the "
                                        f"{total} examples of {self.dataset!r}")

    def check_given(self, given: frozenset[str]) -> None:
        kind = dataset_kind(self.dataset)
        for key, kinds in _DATA_KEY_KINDS.items():
            if key in given and kind not in kinds:
                raise KeyProblem(key, f"'{{key}}' applies only to {' or '.join(kinds)} data sets; "
                                      f"{self.dataset!r} is {kind}" + (_CONVERTED_NOTE if kind == "converted" else ""))
        for key in ("block_rows", "shuffle_window"):
            if key in given and self.order != "blocks":
                raise KeyProblem(key, f"'{{key}}' applies only with data.shuffle = 'blocks' (it is {self.order!r})")

    @property
    def order(self) -> str:
        """``shuffle``, or its default for this data set."""
        if self.shuffle is not None:
            return self.shuffle
        return "blocks" if dataset_kind(self.dataset) == "converted" else "global"

    def reader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`dniasync.train.data.load_dataset` for this data set."""
        out: dict[str, Any] = {"label_column": self.csv_label_column, "x_key": self.npz_x_key,
                               "y_key": self.npz_y_key}
        if self.csv_header is not None:
            out["header"] = self.csv_header
        if self.scale is not None:
            out["scale"] = self.scale
        return out


class OptimizerConfig(Section, frozen=True):
    """The update rule (applied by the PS shards, Hogwild workers or pipeline stages)."""

    only_for = {"momentum": ("name", ("momentum", "nesterov")), "eps": ("name", ("adagrad", "adam")),
                "betas": ("name", ("adam",))}

    name: Annotated[Literal["adagrad", "sgd", "momentum", "nesterov", "adam"], Meta(description="the optimizer")] = "adagrad"
    lr: Annotated[float, Meta(gt=0.0, description="learning rate")] = 0.01
    momentum: Annotated[float, Meta(ge=0.0, lt=1.0, description="momentum coefficient")] = 0.9
    weight_decay: Annotated[float, Meta(ge=0.0, description="L2 weight decay")] = 0.0
    clip_norm: Annotated[float, Meta(gt=0.0, description=(
        "clip each mini-batch gradient's global L2 norm to this on the replica, before accumulation"))] | None = None
    eps: Annotated[float, Meta(gt=0.0, description="numerical floor (default 1e-10 for adagrad, 1e-8 for adam)")] | None = None
    betas: Annotated[tuple[Fraction, Fraction], Meta(description="Adam's moment decays")] = (0.9, 0.999)

    @property
    def epsilon(self) -> float:
        """``eps``, or the optimizer's default."""
        return self.eps if self.eps is not None else (1e-10 if self.name == "adagrad" else 1e-8)


class StopConfig(Section, frozen=True):
    """The run ends at the first condition met."""

    max_epochs: Annotated[int, Meta(ge=1, description="passes over the training set, all shards together")] = 10
    target_accuracy: Annotated[float, Meta(gt=0.0, le=1.0, description="held-out accuracy to stop at")] | None = None
    max_seconds: Annotated[float, Meta(gt=0.0, description="wall-clock limit")] | None = None


class EvalConfig(Section, frozen=True):
    """Held-out evaluation cadence (at most one of the two intervals; default every 2 seconds)."""

    every_seconds: Annotated[float, Meta(gt=0.0, description=(
        "evaluate this often (a lower bound: evaluation runs on a copy of the weights while training goes on)"))] | None = None
    every_steps: Annotated[int, Meta(ge=1, description="... or after this many mini-batch steps, all workers together")] | None = None
    deferred: Annotated[bool, Meta(description=(
        "take the weights at each interval but score them after training (no evaluation CPU while training; "
        "not with stop.target_accuracy). At most 256 snapshots wait; beyond that the oldest is scored at once"))] = False
    timeout_s: Annotated[float, Meta(gt=0.0, description=(
        "how long taking the weights for one evaluation may last (the PS shards', a peer's or the stages' replies); "
        "past it that evaluation is skipped (event `eval_failed`) and training goes on. Raise it for a large model "
        "on slow links: 23 MB take 1.9 s at 100 Mbit/s, and under `--emulate` every wait is d times longer"))] = 30.0

    def __post_init__(self) -> None:
        if self.every_seconds is not None and self.every_steps is not None:
            raise KeyProblem("every_steps", "'{key}' cannot be set together with eval.every_seconds")

    @property
    def interval_s(self) -> float | None:
        """Seconds between evaluations (None when counted in steps)."""
        if self.every_steps is not None:
            return None
        return self.every_seconds if self.every_seconds is not None else 2.0


class CheckpointConfig(Section, frozen=True):
    """Checkpoints of the job: PS shards, data cursors, history (`--resume` continues from the last)."""

    every_seconds: Annotated[float, Meta(gt=0.0, description=(
        "snapshot every PS shard this often (parameters, optimizer state, version, push ledger) and write a "
        "checkpoint; a PS process that is restarted (by `--role local`, or an operator with the same address) "
        "continues from its last snapshot, losing at most this interval of its updates. A pipeline job also "
        "captures each pipeline this often (drained; every stage's weights, optimizer state, SG and input "
        "models): a stage that dies is restarted and its pipeline rolls back to its last capture"))] | None = 10.0
    dir: Annotated[str, Meta(description="where checkpoints go (default `<output_dir>/checkpoints`)")] | None = None
    keep: Annotated[int, Meta(ge=1, description="checkpoints kept (the oldest go first)")] = 3


class RegroupConfig(Section, frozen=True):
    """Dynamic layer regrouping (mode `pipeline`): move the split between stages while training runs."""

    enabled: Annotated[bool, Meta(description=(
        "measure every stage's per-layer time and move boundary layers to a neighbour when the policy predicts a "
        "gain (the pipeline is drained for each move; weights and optimizer state move with the layers)"))] = False
    policy: Annotated[Literal["balance"], Meta(description=(
        "`balance`: the split whose slowest stage is fastest, from per-layer costs and each stage's measured "
        "slowness"))] = "balance"
    min_gain: Annotated[float, Meta(gt=0.0, description=(
        "move only when the predicted throughput gain is at least this (0.1: 10% more batches per second)"))] = 0.1
    cooldown_s: Annotated[float, Meta(ge=0.0, description=(
        "seconds after a move before the next may be decided, so estimates settle (the first move waits only for "
        "the stages' calibration reports; with `profile`, for a cool-down from the stages' start too)"))] = 10.0
    max_moves: Annotated[int, Meta(ge=0, description="moves in a whole run at most (0: no bound)")] = 10
    interval_s: Annotated[float, Meta(gt=0.0, description=(
        "how often the stages' per-layer times are collected and the policy is asked"))] = 1.0
    profile: Annotated[bool, Meta(description=(
        "before training, time every layer in the coordinator's process and start from the split the policy "
        "finds best for it instead of `pipeline.groups` (which still gives the number of stages); that split "
        "holds for `cooldown_s` before the first move may be decided"))] = False


class ScheduleConfig(Section, frozen=True):
    """Batch-size schedule (the modes that honour it are listed below): the mini-batch grows as training goes; lr unchanged.

    Sandblaster's batch is the sample L-BFGS takes its loss on: the first examples of the training set, in
    whole portions, growing between iterations; its epochs count the examples of every batch gradient."""

    kind: Annotated[Literal["fixed", "stepwise", "dynamic"], Meta(description=(
        "`fixed`: data.batch_size throughout; `stepwise`: start x factor^floor(epoch / every_epochs), at most end; "
        "`dynamic`: Byrd et al.'s dynamic sampling, the batch grows (at most to end) when the norm test on the "
        "gradient's variance fails. The lr is not scaled: a growing batch at a fixed lr lowers the gradient noise "
        "as training goes, which is what the schedule is for (Smith et al. 2018)"))] = "fixed"
    start: Annotated[int, Meta(ge=1, description="the first batch size (default data.batch_size)")] | None = None
    end: Annotated[int, Meta(ge=1, description="the largest batch size")] = 512
    every_epochs: Annotated[float, Meta(gt=0.0, description="stepwise: grow every this many epochs")] = 1.0
    factor: Annotated[float, Meta(ge=1.0, description="stepwise: each growth multiplies the batch size by this")] = 2.0
    theta: Annotated[float, Meta(gt=0.0, description=(
        "dynamic: the norm test's theta; the batch grows while Var(per-example gradient) / batch > theta^2 "
        "|batch gradient|^2 (larger: more noise tolerated, slower growth)"))] = 0.5
    chunks: Annotated[int, Meta(ge=2, description=(
        "dynamic: the tested batch's gradient is taken in this many equal parts; their spread estimates the "
        "per-example variance"))] = 4
    test_every: Annotated[int, Meta(ge=1, description="dynamic: test every this many batches (of each worker)")] = 10


SyncName = Literal["local", "ps", "shm", "p2p"]
"""The weight syncs (``sync.kind``); the names of :data:`dniasync.train.sync.SYNCS`."""

SYNC_NEEDS_PS: Final[dict[str, bool]] = {"local": False, "ps": True, "shm": False, "p2p": False}
"""Whether a sync runs PS shards: ``SyncKind.needs_ps`` of :data:`dniasync.train.sync.SYNCS`, mirrored here because
that registry imports torch and parsing a config must not (``tests/test_config.py`` checks the two agree)."""


class SyncConfig(Section, frozen=True):
    """How the trainers share their weights, and the outer optimizer of local steps (DiLoCo)."""

    kind_only: ClassVar[dict[str, tuple[str, ...]]] = {"fanout": ("p2p",), "max_lag": ("p2p",),
                                                        "update_cap_bytes": ("p2p",)}
    """key -> the kinds it applies to (checked against the kind in force, written or the mode's default)."""

    kind: Annotated[SyncName, Meta(description=(
        "`local` (each trainer steps its own optimizer, nothing shared), `ps` (push gradients to and pull "
        "parameters from PS shards), `shm` (one shared store on one machine, stepped in place: Hogwild's workers "
        "at every step; Downpour's replicas every n_push steps, from a copy fetched every n_fetch, with no PS "
        "process) or `p2p` "
        "(no PS: peers send each other their quantized updates); default: the one the mode runs with its settings. "
        "A kind the mode does not take is an error naming those it does"))] | None = None
    local_steps: Annotated[int, Meta(ge=1, description=(
        "inner steps between two exchanges (DiLoCo's H): the weights' change over them is shared as a "
        "pseudo-gradient; 1: share as the kind does at every step. Modes `downpour` (each replica steps its own "
        "`[optimizer]`, pushes the pseudo-gradient and pulls every H steps; the PS shards run the outer step; "
        "not with downpour.n_push or n_fetch above 1) and `p2p`"))] = 1
    outer_lr: Annotated[float, Meta(gt=0.0, description=(
        "the outer (Nesterov) step's lr on the mean pseudo-gradient of a round; downpour's PS shards apply each "
        "replica's push as it comes, with outer_lr / n_replicas. Default 1 with outer_momentum 0: plain averaging "
        "of the trainers' weights. DiLoCo's paper uses 0.7 and momentum 0.9, with AdamW inner steps and H in the "
        "hundreds; measured here (p2p, 4 peers, Adagrad inner steps, mnist5k) 0.7/0.9 at H = 8 peaked at 75-79% "
        "then fell to 36-48% where plain averaging reached 88.6% in 15 epochs"))] = 1.0
    outer_momentum: Annotated[float, Meta(ge=0.0, lt=1.0, description=(
        "the outer step's Nesterov momentum (DiLoCo's: 0.9; see outer_lr)"))] = 0.0
    fanout: Annotated[int, Meta(ge=0, description="peers each update goes to (gossip); 0: every peer")] = 0
    max_lag: Annotated[int, Meta(ge=1, description="a peer this many updates behind takes a dense copy")] = 16
    update_cap_bytes: Annotated[int, Meta(ge=4, description=(
        "the first cap on a threshold update's codes (4 bytes per weight), and the least it falls to: an update "
        "carries the codes of the weights from where the last capped one ended, up to the cap; the others keep "
        "their tau in the residual for the next updates. The cap doubles with each update coded while the peer's "
        "links keep up (to the whole model) and halves with each step held because one is busy. Keeps one update "
        "from filling a slow link (Adagrad's first steps move nearly every weight past tau: uncapped, an update is "
        "the size of the model)"))] = 256 << 10


_COMMON: Final[dict[str, type[Section]]] = {
    "job": JobConfig, "model": ModelConfig, "data": DataConfig, "optimizer": OptimizerConfig,
    "stop": StopConfig, "eval": EvalConfig, "checkpoint": CheckpointConfig, "regroup": RegroupConfig,
    "schedule": ScheduleConfig, "sync": SyncConfig,
}
_REQUIRED: Final = ("job", "model", "data")


@dataclass(frozen=True)
class Config:
    """A whole job: the common sections and the mode's own (``settings``)."""

    job: JobConfig
    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig
    settings: Any
    """The mode's section, of the type its mode module defines."""
    stop: StopConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    regroup: RegroupConfig = RegroupConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    sync: SyncConfig = SyncConfig()

    @property
    def mode(self) -> str:
        return self.job.mode

    @property
    def output_dir(self) -> str:
        return self.job.output_dir or f"runs/{self.job.name}"

    @property
    def sample_budget(self) -> int:
        """The training samples ``stop.max_epochs`` allows, all workers together."""
        return self.stop.max_epochs * self.data.n_train

    @property
    def n_data_shards(self) -> int:
        """How many disjoint training shards (one per replica, worker or pipeline)."""
        return get_mode(self.mode).data_shards(self.settings)

    @property
    def sync_kind(self) -> str:
        """The weight sync the trainers use: ``sync.kind``, or the one the mode runs with its settings."""
        return self.sync.kind or get_mode(self.mode).syncs(self.settings)[0]

    @property
    def sync_needs_ps(self) -> bool:
        """The weight sync in force runs PS shards."""
        return SYNC_NEEDS_PS[self.sync_kind]

    def to_dict(self) -> dict[str, Any]:
        """TOML-shaped plain data, defaults left out; ``parse_config`` of it gives an equal config."""
        out = {
            "job": to_table(self.job), "model": to_table(self.model), "data": to_table(self.data),
            "optimizer": to_table(self.optimizer), self.mode: to_table(self.settings),
            "stop": to_table(self.stop), "eval": to_table(self.eval), "checkpoint": to_table(self.checkpoint),
        }
        for name, section in (("regroup", self.regroup), ("schedule", self.schedule), ("sync", self.sync)):
            table = to_table(section)
            if table:
                out[name] = table
        return out


def _table(raw: Mapping[str, Any], name: str) -> Any:
    if name not in raw and name in _REQUIRED:
        raise ConfigError(f"missing required section '[{name}]'", name)
    return raw.get(name, {})


def parse_config(raw: Mapping[str, Any], *, resolve: bool = True) -> Config:
    """Validate TOML-shaped ``raw`` data into a :class:`Config`.

    With ``resolve`` (the default) it also imports and calls the model factory
    and counts the data set's examples, to check shard counts and split sizes
    against them; without, only the config's own consistency is checked.
    """
    known = (*_COMMON, *MODES, "node")  # [node] belongs to the node CLI (listen, token, ...)
    for name in raw:
        if name in RENAMED:
            raise ConfigError(f"section '[{name}]' {RENAMED[name]}", name)
        if name not in known:
            raise ConfigError(unknown_key(name, name, known, what="section"), name)
    job = convert_section("job", _table(raw, "job"), JobConfig)
    mode = get_mode(job.mode)
    for other in MODES:
        if other != job.mode and other in raw:
            raise ConfigError(f"section '[{other}]' does not apply: job.mode is {job.mode!r}", other)
    config = Config(
        job=job,
        model=convert_section("model", _table(raw, "model"), ModelConfig),
        data=convert_section("data", _table(raw, "data"), DataConfig),
        optimizer=convert_section("optimizer", _table(raw, "optimizer"), OptimizerConfig),
        settings=convert_section(job.mode, raw.get(job.mode, {}), mode.settings),
        stop=convert_section("stop", _table(raw, "stop"), StopConfig),
        eval=convert_section("eval", _table(raw, "eval"), EvalConfig),
        checkpoint=convert_section("checkpoint", _table(raw, "checkpoint"), CheckpointConfig),
        regroup=convert_section("regroup", _table(raw, "regroup"), RegroupConfig),
        schedule=convert_section("schedule", _table(raw, "schedule"), ScheduleConfig),
        sync=convert_section("sync", _table(raw, "sync"), SyncConfig),
    )
    if "schedule" in raw and not mode.schedules:
        raise ConfigError(f"section '[schedule]' does not apply to job.mode {job.mode!r}: that mode does not honour a "
                          "batch-size schedule (it trains on data.batch_size throughout)", "schedule")
    _check_sync(config, raw)
    start = config.schedule.start or config.data.batch_size
    if config.schedule.kind != "fixed" and config.schedule.end < start:
        raise ConfigError(f"'schedule.end' is {config.schedule.end}, below the first batch size {start}",
                          "schedule.end")
    if "regroup" in raw and not mode.regroups:
        raise ConfigError(f"section '[regroup]' does not apply to job.mode {job.mode!r}: that mode has no stages to "
                          "regroup", "regroup")
    mode.check(config, raw)
    if config.job.standby:
        _check_standby(config)
    if config.eval.deferred and config.stop.target_accuracy is not None:
        raise ConfigError("'eval.deferred' cannot be used with stop.target_accuracy: the accuracy is known only "
                          "after training", "eval.deferred")
    if config.n_data_shards > config.data.n_train:
        raise ConfigError(
            f"'{mode.shards_key}' is {config.n_data_shards}, more than data.n_train = {config.data.n_train}: "
            "every data shard needs an example",
            mode.shards_key,
        )
    if resolve:
        _resolve(config)
    return config


def _check_standby(config: Config) -> None:
    """What a standby coordinator can take over today: Downpour's replicas and PS shards as they run."""
    replicas = getattr(config.settings, "ps_replicas", 1)
    if config.mode != "downpour" or config.sync_kind != "ps" or replicas != 1:
        what = (f"job.mode {config.mode!r}" if config.mode != "downpour" else
                f"sync.kind {config.sync_kind!r}" if config.sync_kind != "ps" else f"downpour.ps_replicas = {replicas}")
        raise ConfigError(f"'job.standby' is true, but a standby coordinator can take over only mode 'downpour' with "
                          f"sync.kind 'ps' and ps_replicas = 1 (this job has {what}); use [checkpoint] and --resume",
                          "job.standby")


def _check_sync(config: Config, raw: Mapping[str, Any]) -> None:
    """``sync.kind`` must be one the mode takes; the kind-specific keys must fit the kind in force."""
    kinds = get_mode(config.mode).syncs(config.settings)
    kind = config.sync.kind
    if kind is not None and kind not in kinds:
        raise ConfigError(f"'sync.kind' is {kind!r}; mode {config.mode!r}, as configured, runs with "
                          f"{' or '.join(map(repr, kinds))}", "sync.kind")
    given = raw.get("sync", {})
    for key, applies in SyncConfig.kind_only.items():
        if key in given and config.sync_kind not in applies:
            raise ConfigError(f"'sync.{key}' applies only when sync.kind is {' or '.join(map(repr, applies))} "
                              f"(it is {config.sync_kind!r})", f"sync.{key}")
    modes = [name for name, mode in MODES.items() if mode.takes_local_steps]
    for key in ("local_steps", "outer_lr", "outer_momentum"):
        if key in given and config.mode not in modes:
            raise ConfigError(f"'sync.{key}' applies only in job.mode {' or '.join(map(repr, modes))} (it is "
                              f"{config.mode!r})", f"sync.{key}")
    for key in ("outer_lr", "outer_momentum"):
        if key in given and config.sync.local_steps == 1:
            raise ConfigError(f"'sync.{key}' applies only with sync.local_steps above 1: with 1 there is no outer "
                              "step", f"sync.{key}")


def _resolve(config: Config) -> None:
    """Check the config against the model it builds and the data it names."""
    from dniasync.train.models import ModelFactoryError, build_model, check_kwargs, resolve_factory

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
    get_mode(config.mode).resolve(config, model)
    data = config.data
    try:
        n = count_examples(data.dataset, header=data.csv_header, y_key=data.npz_y_key)
    except DatasetError as e:
        raise ConfigError(f"'data.dataset': {e}", "data.dataset") from None
    if data.n_train + data.n_test > n:
        raise ConfigError(
            f"'data.n_train' + data.n_test = {data.n_train + data.n_test} exceeds the {n} examples of {data.dataset!r}",
            "data.n_train",
        )


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


def config_reference() -> Iterator[str]:
    """The Markdown reference of every section and key (``docs/config.md``)."""
    notes = {
        "job": "job.mode is one of " + ", ".join(f"`{name}`" for name in MODES) + " (the mode registry), each with its "
               "section below.",
        "schedule": "Honoured by job.mode " + ", ".join(f"`{m.name}`" for m in MODES.values() if m.schedules) + ".",
    }
    yield "# Job config reference"
    yield ""
    yield "Generated from the schema by `python -m dniasync.cluster.config`; do not edit by hand."
    yield ""
    for name, cls in _COMMON.items():
        yield from reference(name, cls)
        if name in notes:
            yield notes[name]
            yield ""
    for name, mode in MODES.items():
        yield from reference(name, mode.settings)


if __name__ == "__main__":
    print("\n".join(config_reference()))
