"""The wire messages of a pipeline: stages, their driver and its monitor.

Plain fields, refs and tensors only: the remote codec sends tensors as raw
bytes with dtype and shape, never pickled. The tags are those the messages had
when stages were called layer groups (``dniasync.dni.*``): the tag, not the
class name, is the wire contract, and checkpoints hold them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...actors import ActorRef, message

__all__ = [
    "Connect",
    "Done",
    "EvalForward",
    "EvalOutput",
    "NormProbe",
    "NormProbeReply",
    "Forward",
    "Gradient",
    "LayerBundle",
    "LossReport",
    "RawInput",
    "AdoptLayers",
    "FlushParams",
    "ReleaseLayers",
    "StageDown",
    "StageState",
    "StageStats",
    "StateRequest",
    "StatsRequest",
    "Trace",
    "TraceRequest",
]


@message("dniasync.dni.Connect")
@dataclass(frozen=True)
class Connect:
    """Wires a stage to its neighbours; empty lists mean first / last stage."""

    upstream: list[ActorRef]
    downstream: list[ActorRef]
    monitor: ActorRef


@message("dniasync.dni.Forward")
@dataclass(frozen=True)
class Forward:
    """Activations of one (micro-)batch travelling downstream.

    ``step_id`` and ``parts`` group micro-batches into one optimizer step
    (``parts=1``: the batch is a step of its own); ``weight`` is this part's
    share of the step's loss (its size over the mini-batch size).
    ``lr_scale``: what every stage multiplies its learning rates by from this
    batch on (the driver's :class:`~dniasync.train.pipeline.schedule.LrDecay`).
    """

    batch_id: int
    step_id: int
    parts: int
    weight: float
    activations: torch.Tensor
    labels: torch.Tensor
    lr_scale: float = 1.0


@message("dniasync.dni.RawInput")
@dataclass(frozen=True)
class RawInput:
    """The raw inputs of a batch, for a stage that predicts its own input."""

    batch_id: int
    inputs: torch.Tensor
    labels: torch.Tensor


@message("dniasync.dni.Gradient")
@dataclass(frozen=True)
class Gradient:
    """``dL/dh`` for a batch's activations, travelling upstream."""

    batch_id: int
    gradient: torch.Tensor


@message("dniasync.dni.Done")
@dataclass(frozen=True)
class Done:
    """A stage has finished with ``batch_id``: nothing more of it will be sent or kept there.

    The last stage sends it after its forward; the others once the batch's
    gradient has come back (and was used, or found its batch evicted).
    """

    batch_id: int


@message("dniasync.dni.LossReport")
@dataclass(frozen=True)
class LossReport:
    """The last stage's real loss on one batch."""

    batch_id: int
    loss: float
    correct: int
    count: int


@message("dniasync.dni.GroupDown")
@dataclass(frozen=True)
class StageDown:
    """A stage failed, stopped, or found a neighbour stopped."""

    address: str
    reason: str


@message("dniasync.dni.EvalForward")
@dataclass(frozen=True)
class EvalForward:
    """Ask: forward ``activations`` through the stage's current weights, eval mode."""

    activations: torch.Tensor


@message("dniasync.dni.EvalOutput")
@dataclass(frozen=True)
class EvalOutput:
    """Reply to :class:`EvalForward`."""

    activations: torch.Tensor


@message("dniasync.dni.NormProbe")
@dataclass(frozen=True)
class NormProbe:
    """Ask the last stage: its parameters' gradient of the loss on ``activations`` and ``labels``, taken in
    ``chunks`` equal parts, as the norm test's scalars (dynamic sampling; nothing is updated)."""

    activations: torch.Tensor
    labels: torch.Tensor
    chunks: int


@message("dniasync.dni.NormProbeReply")
@dataclass(frozen=True)
class NormProbeReply:
    """Σ‖g_j‖² over ``count`` parts of ``chunk_size`` examples, and ‖mean g_j‖²."""

    sum_sq: float
    norm2: float
    count: int
    chunk_size: int


@message("dniasync.dni.StatsRequest")
@dataclass(frozen=True)
class StatsRequest:
    """Ask: counters of a stage, and its SG loss since the previous request."""


@message("dniasync.dni.GroupStats")
@dataclass(frozen=True)
class StageStats:
    """Reply to :class:`StatsRequest`. Mean losses are NaN when nothing was recorded."""

    address: str
    steps: int
    sg_steps: int
    sg_loss: float
    input_steps: int
    input_loss: float
    evictions: int
    late_gradients: int
    sg_staleness_total: int = 0
    """Sum over returning gradients of this stage's own updates between the batch's forward and its return."""
    bytes_pushed: int = 0
    """Payload bytes of the gradients this stage pushed to its PS shards (replicated stages; else 0)."""
    bytes_pulled: int = 0
    """Payload bytes of the parameters this stage pulled from its PS shards."""
    stash_bytes: int = 0
    """Bytes of weight versions stashed for batches in flight now (rule ``stash``; else 0)."""
    stash_peak_bytes: int = 0
    """... and at most so far."""
    first_layer: int = 0
    """The model index of the stage's first layer (it changes when layers move)."""
    layer_seconds: list[float] = field(default_factory=list)
    """Per layer of the stage (first to last): forward plus backward seconds spent on it since the layers last
    changed, over ``layer_batches`` trained batches (measured per layer on the stage, for regrouping)."""
    layer_batches: int = 0
    estimate_error_ratio: float = float("nan")
    """The relative error of what the stage steps on instead of the truth (:meth:`UpdateRule.diagnostics`:
    SpecTrain ``|Ŵ − W| / |W_fwd − W|``, an SG model ``|M − g| / |g|``); NaN if not measured."""
    prediction_error: float = float("nan")
    """SpecTrain's mean ``|Ŵ − W|`` over its probes (NaN otherwise)."""
    busy_seconds: float = 0.0
    """Wall seconds the stage spent on training messages since its layers last changed (compute, optimizer
    steps, predictions, SG work, sends; not waiting for work or for its PS shards): with ``layer_batches``, what a
    batch really costs it, including what its layers' own times leave out."""
    lr: float = float("nan")
    """The learning rate the stage's layers step with now (``lr_scale`` applied); NaN: its PS shards hold it."""
    pushes: int = 0
    """Pushes to its PS shard that went through (with replicated shards: that the chain acknowledged)."""
    pusher: str = ""
    """With PS shards: the key the shard's copies count this stage's pushes under (empty without)."""


@message("dniasync.dni.StateRequest")
@dataclass(frozen=True)
class StateRequest:
    """Ask: a copy of the stage's parameters (tensors only, never pickled)."""


@message("dniasync.dni.GroupState")
@dataclass(frozen=True)
class StageState:
    """Reply to :class:`StateRequest`: ``names[i]`` is the parameter of ``tensors[i]``."""

    names: list[str]
    tensors: list[torch.Tensor]


@message("dniasync.dni.TraceRequest")
@dataclass(frozen=True)
class TraceRequest:
    """Ask: the events this stage recorded, in the order it handled them."""


@message("dniasync.dni.Trace")
@dataclass(frozen=True)
class Trace:
    """Reply to :class:`TraceRequest`: ``events[i]`` happened to ``batch_ids[i]``."""

    events: list[str]
    batch_ids: list[int]


@message("dniasync.pipeline.ReleaseLayers")
@dataclass(frozen=True)
class ReleaseLayers:
    """Ask (pipeline drained): give up the ``count`` layers at the stage's ``side`` (``"front"`` or ``"back"``);
    answered with their :class:`LayerBundle`. The stage keeps at least one layer."""

    count: int
    side: str


@message("dniasync.pipeline.LayerBundle")
@dataclass(frozen=True)
class LayerBundle:
    """Layers on their way from one stage to its neighbour: weights, buffers and optimizer state.

    ``indices``: the layers' model indices, ascending. ``names[i]`` is the key
    of ``tensors[i]`` (``"3/weight"``, ``"3/weight@exp_avg"``; see
    :func:`~dniasync.train.pipeline.regroup.pack_layers`). ``in_shape`` and
    ``out_shape``: one sample's activation shape into the first of them and
    out of the last.
    """

    indices: list[int]
    in_shape: list[int]
    out_shape: list[int]
    names: list[str]
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@message("dniasync.pipeline.AdoptLayers")
@dataclass(frozen=True)
class AdoptLayers:
    """Ask (pipeline drained): take ``bundle``'s layers at the stage's ``side``; answered with the stage's
    :class:`StageStats` (its new ``first_layer`` among them)."""

    bundle: LayerBundle
    side: str


@message("dniasync.pipeline.FlushParams")
@dataclass(frozen=True)
class FlushParams:
    """Ask (pipeline drained): push the gradients accumulated since the last push now (replicated stages, before
    their PS shards are re-partitioned); answered with the stage's :class:`StageStats`."""
