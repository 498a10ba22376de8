"""Pipelines of stages: a model cut into groups of layers, each group an actor, trained by a pluggable rule.

- :mod:`.cut` cuts an ``nn.Sequential`` into stages (:func:`build_stages`);
- :class:`Stage` (:mod:`.stage`) is the one stage actor: layers, wiring,
  caches, counters; it never knows which paper it implements;
- :mod:`.rules` holds the update rules, chosen by name (:func:`get_rule`):
  ``dni``/``cdni`` (synthetic gradients, :mod:`.synthetic`), ``sync``
  (GPipe) and the asynchronous real-gradient pipelines ``async``, ``stash``
  (PipeDream) and ``spectrain`` (:mod:`.rules.real`); a stage steps its weights through a
  :class:`~dniasync.train.sync.WeightSync` (local, or PS shards);
- :class:`PipelineDriver` (:mod:`.driver`) feeds the first stage as its
  :class:`Schedule` says (its lr scaled down late in the run by
  :class:`LrDecay`), evaluates, drains and rewires;
- :mod:`.protocol` holds the wire messages; :mod:`.baseline` the
  single-process backprop reference and one-call in-process runs.
"""

from .baseline import evaluate_model, run_pipeline, spawn_stages, train_backprop
from .cut import GroupConfigError, StageSpec, build_stages, probe_shapes, split_sequential, validate_groups
from .driver import EvalPoint, PipelineBroken, PipelineDriver, PipelineMonitor, TrainResult
from .protocol import (
    Connect,
    Done,
    EvalForward,
    EvalOutput,
    Forward,
    Gradient,
    LossReport,
    RawInput,
    StageDown,
    StageState,
    StageStats,
    StateRequest,
    StatsRequest,
    Trace,
    TraceRequest,
)
from .rules import RULES, UpdateRule, get_rule, make_rule
from .schedule import LrDecay, Schedule, batch_order
from .settings import StageSettings, StageShape
from .stage import Stage
from .synthetic import SyntheticGradient, SyntheticInput

__all__ = [
    "RULES",
    "Connect",
    "Done",
    "EvalForward",
    "EvalOutput",
    "EvalPoint",
    "Forward",
    "Gradient",
    "GroupConfigError",
    "LossReport",
    "LrDecay",
    "PipelineBroken",
    "PipelineDriver",
    "PipelineMonitor",
    "RawInput",
    "Schedule",
    "Stage",
    "StageDown",
    "StageSettings",
    "StageShape",
    "StageSpec",
    "StageState",
    "StageStats",
    "StateRequest",
    "StatsRequest",
    "SyntheticGradient",
    "SyntheticInput",
    "Trace",
    "TraceRequest",
    "TrainResult",
    "UpdateRule",
    "batch_order",
    "build_stages",
    "probe_shapes",
    "evaluate_model",
    "get_rule",
    "make_rule",
    "run_pipeline",
    "spawn_stages",
    "split_sequential",
    "train_backprop",
    "validate_groups",
]
