"""Model parallelism: a model cut into stages that train as a pipeline.

The model factory must return an ``nn.Sequential``; ``groups`` cuts it into
stages, each hosted by a :class:`~dniasync.train.pipeline.Stage` actor in a
worker process. ``method`` is the update rule every stage follows (DNI and
cDNI: synthetic gradients; ``sync``: the synchronous GPipe-style baseline;
``async``, ``stash``, ``spectrain``: asynchronous 1F1B pipelines with real
gradients; SpecTrain with PS shards predicts from the weights' observed velocity, as the stages step no optimizer
of their own). With ``replicas = 1`` (``sync.kind = "local"``) each stage trains with ``[optimizer]``
locally (``adam``, ``sgd``, ``momentum`` or ``adagrad``; ``lr`` and ``momentum`` only); with ``replicas > 1`` and the
``ps`` sync (DNI x Downpour, the default) every stage has one PS shard that applies ``[optimizer]`` to the pushes of
its replicas; with ``replicas > 1`` and the ``p2p`` sync (DNI x p2p) there is no PS: each stage replica steps its own
optimizer and sends its ``tau``-quantized updates to the stage's other replicas, applying its own and theirs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

from msgspec import Meta

from .._schema import ConfigError, KeyProblem, Section
from ..mode_api import Hoster
from ..panels import PS_PANELS, Line, Panel

if TYPE_CHECKING:
    from torch import nn

    from ..config import Config
    from ..mode_api import ModeJob, Runner

__all__ = ["PIPELINE", "STAGE_PANELS", "PipelineConfig"]

STAGE_PRELOAD: Final = ("torch._dynamo",)
"""What a worker imports before it makes stages (:meth:`Mode.preload`): every stage, and its synthetic-gradient
model, steps a torch optimizer, and the first one made imports ``torch._dynamo``."""
LOCAL_OPTIMIZERS = ("adam", "sgd", "momentum", "adagrad")
_SG_KEYS = ("synthetic_inputs", "sg_hidden_layers", "sg_hidden_width", "sg_lr", "sg_fit_rows")
_ASYNC_METHODS = ("dni", "cdni", "async", "stash", "spectrain", "spectrain_stash")
_BUILTIN_FEATURES = {"mnist5k": 784, "digits": 64}
"""Values per example of the built-in data sets (flat), so a cut is probed before any data is loaded."""

STAGE_PANELS = (
    Panel("stage_version_gap", "Version gap per stage (updates per batch)",
          (Line("stage_version_gap", "stage_gap_total", per="stage_steps", label="stage"),)),
    Panel("stage_busy", "Busy time per stage (ms per batch)",
          (Line("stage_busy_ms", "stage_busy_s", per="stage_batches", label="stage", scale=1e3),)),
)
"""The live page's charts of pipeline 0's stages, from the per-stage counters in the job's ``extra()``: each
stage's own updates between a batch's forward and its gradient's return, and the wall time it spends on a batch."""


class PipelineConfig(Section, frozen=True):
    """The cut into stages, the update rule, SG models, placement, replicas (mode `pipeline`)."""

    only_for = {**{key: ("method", ("dni", "cdni")) for key in _SG_KEYS}, "micro_batches": ("method", ("sync",)),
                "max_in_flight": ("method", _ASYNC_METHODS),
                **{key: ("lr_decay", ("linear", "cosine")) for key in ("lr_decay_start", "lr_decay_final")}}
    renamed = {"variant": "method"}

    groups: Annotated[tuple[tuple[int, ...], ...], Meta(description=(
        "layer indices of the `nn.Sequential` per stage, e.g. `[[0, 1], [2, 3], [4]]`; contiguous, ordered, every "
        "layer in exactly one stage"))]
    method: Annotated[Literal["cdni", "dni", "sync", "async", "stash", "spectrain", "spectrain_stash"], Meta(description=(
        "`dni` (synthetic gradients), `cdni` (synthetic gradients conditioned on the labels), `sync` (the "
        "synchronous pipeline baseline: real backprop, GPipe-style micro-batches), or an asynchronous 1F1B pipeline "
        "with real gradients, each stage updating as a batch's gradient returns: `async` (no correction), `stash` "
        "(PipeDream weight stashing), `spectrain` (SpecTrain weight prediction; optimizer `momentum` or `adam`, or "
        "`adagrad` or any with PS shards, where it predicts from the weights' observed velocity) "
        "or `spectrain_stash` (SpecTrain's forward, then that forward's own graph back-propagated: the gradient at the "
        "predicted weights, no second forward, one weight copy per batch in flight)"))
    ] = "cdni"
    synthetic_inputs: Annotated[bool, Meta(description=(
        "stages after the first also learn to predict their input from the raw data"))] = False
    sg_hidden_layers: Annotated[int, Meta(ge=0, description="hidden layers of the SG model (0: linear)")] = 0
    sg_hidden_width: Annotated[int, Meta(ge=0, description="their width (0: as wide as the activations)")] = 0
    sg_lr: Annotated[float, Meta(gt=0.0, description="the SG model's Adam learning rate")] = 1e-4
    sg_fit_rows: Annotated[int, Meta(ge=0, description=(
        "fit the SG model on this many rows of each returning batch (0: all; at most data.batch_size)"))] = 0
    max_in_flight: Annotated[int, Meta(ge=1, description=(
        "mini-batches in an asynchronous pipeline (DNI, async, stash, spectrain) at once"))] = 4
    micro_batches: Annotated[int, Meta(ge=1, description="`sync` only: micro-batches per mini-batch")] = 4
    lr_decay: Annotated[Literal["none", "linear", "cosine"], Meta(description=(
        "every stage's learning rates (layers, SG and input models) over the run: `none` (constant), or from "
        "lr_decay_start of stop.max_epochs on down to lr_decay_final of them at the end, `linear` or `cosine`; the "
        "scale goes with each batch, from its place in the data (with pipeline.replicas = 1)"))] = "none"
    lr_decay_start: Annotated[float, Meta(ge=0.0, lt=1.0, description=(
        "the fraction of stop.max_epochs after which the lr decays"))] = 0.5
    lr_decay_final: Annotated[float, Meta(ge=0.0, le=1.0, description=(
        "the lr at the end, as a fraction of the configured one"))] = 0.0
    replicas: Annotated[int, Meta(ge=1, description=(
        "pipelines, each on its own data shard; more than one is DNI x Downpour (sync.kind `ps`: a PS shard per "
        "stage) or DNI x p2p (sync.kind `p2p`: a stage's replicas send each other their updates)"))] = 1
    n_fetch: Annotated[int, Meta(ge=1, description="with PS shards: a stage pulls its parameters every n_fetch steps")] = 1
    n_push: Annotated[int, Meta(ge=1, description="with PS shards: ... and pushes its gradient every n_push steps")] = 1
    ps_replicas: Annotated[int, Meta(ge=1, description=(
        "with PS shards: copies of each stage's PS shard, each in a PS process of its own, chain-replicated as "
        "downpour.ps_replicas: a stage's push is acknowledged once every live copy applied it, and a copy's death "
        "loses no acknowledged push. 1: one copy, restarted from the last snapshot"))] = 1
    codec: Annotated[Literal["none", "threshold", "onebit", "int8"], Meta(description=(
        "with PS shards: how a stage replica's pushed gradients are compressed, and its pulls answered (quantized "
        "parameter deltas, every 100th pull dense), as downpour.codec: `threshold` (Strom), `onebit` (1-bit SGD), "
        "`int8` (blockwise 8-bit, blocks of 256); `none`: dense float32 both ways"))] = "none"
    tau: Annotated[float, Meta(gt=0.0, description=(
        "the threshold of the threshold codec: with sync.kind `p2p` (required there) of the stage replicas' "
        "quantized updates, in weight units (+-tau per element whose accumulated change reached tau, the rest kept "
        "in the sender's residual); with PS shards and codec `threshold` (required there) of the pushed "
        "gradients"))] | None = None
    placement: Annotated[tuple[int, ...], Meta(description=(
        "the worker (0, 1, ...) hosting each stage of a pipeline (default one worker per stage); every worker from 0 "
        "to the largest must host a stage. Worker processes: (largest + 1) x replicas"))] | None = None

    def __post_init__(self) -> None:
        if not self.groups:
            raise KeyProblem("groups", "'{key}' must be a non-empty array of arrays of layer indices")
        for k, group in enumerate(self.groups):
            if not group:
                raise KeyProblem("groups", f"'{{key}}' group {k} is empty")
        if self.placement is not None:
            placement = list(self.placement)
            if len(placement) != len(self.groups):
                raise KeyProblem("placement", f"'{{key}}' has {len(placement)} entries for {len(self.groups)} "
                                              "groups (one worker per group)")
            if min(placement) < 0:
                raise KeyProblem("placement", f"'{{key}}' worker indices must be >= 0, got {placement}")
            unused = sorted(set(range(max(placement) + 1)) - set(placement))
            if unused:
                raise KeyProblem("placement", f"'{{key}}' leaves workers {unused} without a group; number workers "
                                              "0, 1, ... in use")

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


def _check_p2p(config: Config) -> None:
    """What stage replicas sharing peer to peer cannot do: their layers stay put, a stage steps a ParamStore."""
    p: PipelineConfig = config.settings
    if p.tau is None:
        raise ConfigError("missing required key 'pipeline.tau' (the threshold of the stages' updates, sync.kind "
                          "'p2p')", "pipeline.tau")
    if config.regroup.enabled:
        raise ConfigError("'regroup.enabled' does not apply with sync.kind 'p2p': a stage's layers never move "
                          "between its peers' copies", "regroup.enabled")
    if p.method.startswith("spectrain"):
        raise ConfigError("'pipeline.method' spectrain with stage replicas predicts for PS shards (sync.kind 'ps'); "
                          "with sync.kind 'p2p' a stage steps a ParamStore and applies its peers' updates as they "
                          "come, which its prediction is not made for", "pipeline.method")
    if config.sync.fanout > 0 and config.sync.fanout >= p.replicas:
        raise ConfigError(f"'sync.fanout' is {config.sync.fanout}, but a stage has only {p.replicas - 1} other "
                          "replicas: use 0 (every one)", "sync.fanout")


class _Pipeline:
    name = "pipeline"
    settings = PipelineConfig
    shards_key = "pipeline.replicas"
    worker_kind = "stage worker"
    member_kind = "stage"
    schedules = True
    regroups = True
    takes_local_steps = False

    def data_shards(self, settings: PipelineConfig) -> int:
        return settings.replicas

    def restarts_workers(self, config: Config) -> bool:
        return config.checkpoint.every_seconds is not None  # stages come back from their pipeline's last capture

    def preload(self, config: Config) -> tuple[str, ...]:
        return STAGE_PRELOAD

    def worker_state(self, members: Mapping[str, str], address: str) -> str | None:
        states = {state for name, state in members.items() if name.endswith(f"@{address}")}
        return "dead" if "dead" in states else ("alive" if states else None)  # dead if the job gave any away

    def syncs(self, settings: PipelineConfig) -> tuple[str, ...]:
        return ("local",) if settings.replicas == 1 else ("ps", "p2p")  # one pipeline has no one to share with

    def check(self, config: Config, raw: Mapping[str, Any]) -> None:
        p: PipelineConfig = config.settings
        batch = config.data.batch_size
        if p.method == "sync" and p.micro_batches > batch:
            raise ConfigError(f"'pipeline.micro_batches' is {p.micro_batches}, more than data.batch_size = {batch}",
                              "pipeline.micro_batches")
        if p.sg_fit_rows > batch:
            raise ConfigError(f"'pipeline.sg_fit_rows' is {p.sg_fit_rows}, more than data.batch_size = {batch}",
                              "pipeline.sg_fit_rows")
        opt, given = config.optimizer, raw.get("optimizer", {})
        if opt.clip_norm is not None:
            raise ConfigError("'optimizer.clip_norm' does not apply in mode 'pipeline'", "optimizer.clip_norm")
        if config.regroup.enabled and len(p.groups) < 2:
            raise ConfigError("'regroup.enabled' needs at least 2 stages in pipeline.groups", "regroup.enabled")
        kind = config.sync_kind
        if "tau" in raw.get("pipeline", {}) and kind != "p2p" and p.codec != "threshold":
            raise ConfigError(f"'pipeline.tau' applies only with sync.kind 'p2p' or pipeline.codec 'threshold'; "
                              f"sync.kind is {kind!r}, pipeline.codec {p.codec!r}", "pipeline.tau")
        if kind == "p2p":
            _check_p2p(config)
        if not config.sync_needs_ps:
            for key in ("n_fetch", "n_push", "ps_replicas", "codec"):
                if key in raw.get("pipeline", {}):
                    raise ConfigError(f"'pipeline.{key}' applies only with PS shards (sync.kind 'ps', with "
                                      f"pipeline.replicas > 1); sync.kind is {kind!r}", f"pipeline.{key}")
        else:
            if p.codec != "none" and config.regroup.enabled:
                raise ConfigError(f"'regroup.enabled' does not apply with pipeline.codec {p.codec!r}: moving layers "
                                  "re-cuts the stages' PS shards, and the codecs' residuals with them",
                                  "regroup.enabled")
            if p.codec == "threshold" and p.tau is None:
                raise ConfigError("missing required key 'pipeline.tau' (the threshold of the pushed gradients, "
                                  "pipeline.codec 'threshold')", "pipeline.tau")
            if p.ps_replicas > 1 and config.regroup.enabled:
                raise ConfigError(f"'regroup.enabled' does not apply with pipeline.ps_replicas = {p.ps_replicas}: "
                                  "moving layers re-cuts the stages' PS shards, and their copies' chains cannot be "
                                  "re-cut while they run", "regroup.enabled")
            return  # the shards apply any optimizer; spectrain predicts from the weights' observed velocity
        # each stage steps its own torch optimizer: only its name, lr and (SGD's) momentum apply
        if opt.name not in LOCAL_OPTIMIZERS:
            raise ConfigError(
                f"'optimizer.name' is {opt.name!r}; stages train with {', '.join(map(repr, LOCAL_OPTIMIZERS))} "
                "(any optimizer with PS shards, which apply it: sync.kind 'ps' with pipeline.replicas > 1)",
                "optimizer.name")
        if p.method.startswith("spectrain") and opt.name == "sgd":
            raise ConfigError("'optimizer.name' is 'sgd'; spectrain predicts with the momentum: use 'momentum' "
                              "(SGD with momentum, as in the paper), 'adam' or 'adagrad' (predicted from the "
                              "weights' observed velocity)", "optimizer.name")
        for key in ("weight_decay", "betas", "eps"):
            if key in given:
                raise ConfigError(f"'optimizer.{key}' does not apply in mode 'pipeline' with sync.kind {kind!r} "
                                  "(stages use the optimizer's name, lr and momentum only)", f"optimizer.{key}")

    def resolve(self, config: Config, model: nn.Module) -> None:
        from torch import nn

        from ...train.pipeline import GroupConfigError, StageSettings, build_stages, validate_groups

        if not isinstance(model, nn.Sequential):
            raise ConfigError(f"'model.factory' returns a {type(model).__name__}; mode 'pipeline' cuts an "
                              "nn.Sequential into stages", "model.factory")
        try:
            validate_groups(config.settings.groups, len(model))
            features = _BUILTIN_FEATURES.get(config.data.dataset)
            if features is not None:  # probe every layer with the data's shape now (a file's is known on loading)
                build_stages(model, config.settings.groups, StageSettings(rule=config.settings.method), features)
        except GroupConfigError as e:
            raise ConfigError(f"'pipeline.groups': {e}", "pipeline.groups") from None

    def processes(self, config: Config) -> tuple[int, int]:
        p: PipelineConfig = config.settings
        # a PS shard per stage, each in ps_replicas copies
        return (len(p.groups) * p.ps_replicas if config.sync_needs_ps else 0), p.n_workers

    def summary_lines(self, config: Config, doc: Mapping[str, Any]) -> list[str]:
        p: PipelineConfig = config.settings
        metrics = doc.get("metrics", {})
        lines = [f"  stages             {len(p.groups)} x {p.replicas} pipeline(s), method {p.method}"
                 f"{' + synthetic inputs' if p.synthetic_inputs else ''},"
                 f" {metrics.get('train_samples_per_s', 0):,.0f} training samples/s"]
        for key in sorted(k for k in metrics if k.endswith("_sg_loss_last")):
            group = key.removesuffix("_sg_loss_last")
            lines.append(f"  {group + ' SG loss':18s} {metrics[group + '_sg_loss_first']:.3g} -> {metrics[key]:.3g}")
        if metrics.get("regroup_moves") is not None:
            lines.append(f"  {'regrouping':18s} {metrics['regroup_moves']} move(s), split now {metrics['split']}")
        for key in sorted(k for k in metrics if k.endswith("_version_gap_mean")):
            group = key.removesuffix("_version_gap_mean")
            stash = metrics.get(group + "_stash_peak_bytes")
            predicted = metrics.get(group + "_prediction_error")
            lines.append(f"  {group + ' version gap':18s} {metrics[key]:.2f} updates per batch (mean)"
                         + (f", stash peak {stash / 1024:,.1f} KiB" if stash else "")
                         + (f", prediction error |Ŵ−W| {predicted:.3g} "
                            f"({metrics.get(group + '_estimate_error_ratio', float('nan')):.2f} of no prediction's)"
                            if predicted is not None else ""))
        for key in sorted(k for k in metrics if k.endswith("_estimate_error_ratio")):
            group = key.removesuffix("_estimate_error_ratio")
            if group + "_sg_loss_last" in metrics:
                lines.append(f"  {group + ' SG error':18s} |M−g|/|g| {metrics[key]:.2f} (the synthetic step's lr "
                             f"is scaled by min(1, 1/{metrics[key]:.2f}²))")
        return lines

    def panels(self, config: Config) -> tuple[Panel, ...]:
        return STAGE_PANELS + (PS_PANELS if config.sync_needs_ps else ())  # replicated stages push to PS shards

    def job(self, config: Config, runner: Runner) -> ModeJob:
        from ._pipeline_job import PipelineJob

        return PipelineJob(config, runner)

    def hosters(self) -> dict[type, Hoster]:
        from ...train.chain import CopySpec
        from ...train.specs import ShardSpec, StagesSpec
        from ..chains import host_copy
        from ._pipeline_job import host_stages
        from .downpour import host_shard

        return {StagesSpec: host_stages, ShardSpec: host_shard, CopySpec: host_copy}


PIPELINE = _Pipeline()
