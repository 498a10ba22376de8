"""What an update rule is: the per-batch decisions of a pipeline stage, and what it may use of the stage.

A :class:`~dniasync.train.pipeline.stage.Stage` handles the messages; at
three points of a batch's life it asks its rule what to do:

- :meth:`UpdateRule.before_forward`: what to do before the batch's forward
  (train on what arrived first); :meth:`UpdateRule.forward_weights`: which
  weights it meets (the layers' own, or stashed or predicted ones);
- :meth:`UpdateRule.after_forward` (stages with a downstream): update now, or
  keep what the batch's returning gradient will need;
- :meth:`UpdateRule.on_gradient`: the batch's true gradient is back.

A hook answers with an :class:`Outcome`; the stage records, keeps and sends
accordingly. The last stage needs no rule after its forward: its loss gives
the true gradient at once (micro-batches of one step are accumulated).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import torch
from torch import nn

from ...sync import WeightSync
from ..protocol import Forward, Gradient, RawInput
from ..settings import StageSettings, StageShape
from ..synthetic import SyntheticGradient, SyntheticInput

__all__ = ["NOTHING", "Kept", "Outcome", "StageContext", "TrueGradientRule", "UpdateRule"]

R = TypeVar("R")
V = TypeVar("V")


@dataclass
class Kept:
    """What a stage keeps of a batch until its gradient returns."""

    h_in: torch.Tensor | None
    """The input of the batch's graph when the graph is kept, else None (only the outputs are)."""
    h_out: torch.Tensor
    labels: torch.Tensor
    step_id: int
    parts: int
    at_step: int
    """The stage's update count when the batch went forward: its staleness is measured from it."""


@dataclass(frozen=True)
class Outcome:
    """What a rule did with a batch; the stage traces ``event``, keeps, sends upstream, then says done."""

    event: str | None = None
    keep: Kept | None = None
    upstream: torch.Tensor | None = None
    """The gradient with respect to the stage's input, for the stage upstream."""
    done: bool = False
    """The stage is finished with the batch (the monitor is told)."""


NOTHING = Outcome()


class StageContext(Protocol):
    """What a rule may use of its stage: its layers, its torch work and its bookkeeping; no messaging.

    ``backward`` and ``loss_backward`` run torch work: call them on a worker
    thread (``await stage.run_blocking(...)``).
    """

    layers: nn.Sequential
    last: bool
    steps: int
    params: WeightSync
    upstream: Any
    """The stage upstream (None: the first stage, whose input needs no gradient)."""

    def trace(self, event: str, batch_id: int) -> None: ...

    def keep(self, cache: OrderedDict[int, V], batch_id: int, value: V) -> None:
        """``cache[batch_id] = value``, evicting the oldest beyond the rule's ``cache_size`` (counted)."""

    def count_part(self, step_id: int, parts: int) -> tuple[bool, bool]:
        """Count one micro-batch of ``step_id``: (is it the first, is it the last)."""
        ...

    def backward(
        self, h_in: torch.Tensor, h_out: torch.Tensor, grad: torch.Tensor, *, zero: bool, step: bool,
        lr_scale: float = 1.0,
    ) -> torch.Tensor | None:
        """Back-propagate ``grad`` at ``h_out``; ``zero`` the gradients first, ``step`` after (with the lr times
        ``lr_scale``, wherever the optimizer runs); ``dL/dh_in``."""
        ...

    def gradients(
        self, h_out: torch.Tensor, inputs: Sequence[torch.Tensor], grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        """``grad`` at ``h_out`` back-propagated to ``inputs`` only (``None`` where one is unused); nothing steps."""
        ...

    def loss_backward(
        self, h_in: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor, weight: float, *, zero: bool, step: bool
    ) -> tuple[torch.Tensor | None, float, int]:
        """Back-propagate ``weight`` times the cross-entropy; (``dL/dh_in``, loss, correct predictions)."""
        ...

    def step_with(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Step the layers with these gradients (by parameter name), as :meth:`backward` with ``step`` would."""
        ...

    async def run_blocking(self, func: Callable[..., R], *args: Any, **kwargs: Any) -> R: ...


class UpdateRule:
    """The per-batch behaviour of a stage, chosen by name (:func:`~dniasync.train.pipeline.rules.get_rule`).

    Built once per stage from the pipeline's settings and the stage's shape.
    ``urgent_gradients``: returning gradients overtake the forwards queued at
    the stage. ``flush``: the driver waits for the pipeline to empty after
    every mini-batch. ``sg`` and ``input_model``: the small models the rule
    trains besides the layers, reported in stats and metrics.
    """

    flush: ClassVar[bool] = False
    urgent_gradients: ClassVar[bool] = False
    recomputes: ClassVar[bool] = False
    """The rule runs a batch's forward again for its backward (layers must be deterministic)."""

    def __init__(self, settings: StageSettings, shape: StageShape) -> None:
        self.check(settings)
        self.settings = settings
        self.shape = shape
        self.cache_size = settings.cache_size
        self.sg: SyntheticGradient | None = None
        self.input_model: SyntheticInput | None = None

    @classmethod
    def check(cls, settings: StageSettings) -> None:
        """Raise ``ValueError`` if ``settings`` ask for something this rule cannot do."""

    def connect(self, has_upstream: bool) -> None:
        """The stage was wired (again); ``has_upstream``: it is not the first."""

    def scale_lr(self, scale: float) -> None:
        """Fit the SG and input models with their configured lr times ``scale`` (the layers' is the stage's)."""
        for model in (self.sg, self.input_model):
            if model is not None:
                model.scale_lr(scale)

    async def before_forward(self, stage: StageContext, msg: Forward) -> None:
        """Before the batch's forward: set the weights it meets."""

    async def forward_weights(self, stage: StageContext, msg: Forward) -> Mapping[str, torch.Tensor] | None:
        """The weights (by parameter name) the batch's forward meets; None: the layers' own."""
        return None

    def stash_bytes(self) -> tuple[int, int]:
        """Bytes of weight versions the rule holds for batches in flight: (now, peak)."""
        return 0, 0

    def diagnostics(self) -> dict[str, float]:
        """What the rule measures of its own quality, by name (SG agreement, weight-prediction error); may be empty.

        ``estimate_error_ratio``, when present: the relative error of what the stage steps on instead of the truth
        (exported per stage, in its stats and the job's summary).
        """
        return {}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """What else steers the rule's updates, for a checkpoint (the SG model's agreement: ``sg_agreement``)."""
        return {"sg_agreement": self.sg.agreement_tensor()} if self.sg is not None else {}

    def load_state_tensors(self, saved: Mapping[str, torch.Tensor]) -> None:
        """Continue from :meth:`state_tensors` (``saved`` may hold other names: they are not the rule's)."""
        if self.sg is not None and "sg_agreement" in saved:
            self.sg.load_agreement(saved["sg_agreement"])

    async def after_forward(
        self, stage: StageContext, msg: Forward, h_in: torch.Tensor, h_out: torch.Tensor
    ) -> Outcome:
        """The batch went forward (and downstream) through a stage that is not the last."""
        raise NotImplementedError

    async def on_gradient(self, stage: StageContext, kept: Kept, msg: Gradient) -> Outcome:
        """The true gradient of a batch the stage kept is back."""
        raise NotImplementedError

    def on_late_gradient(self, batch_id: int) -> Outcome:
        """A gradient came back after its batch was evicted from the cache (counted by the stage)."""
        return Outcome(done=True)

    async def on_raw_input(self, stage: StageContext, msg: RawInput) -> Outcome:
        """A batch's raw inputs, sent ahead of its activations."""
        return NOTHING


class TrueGradientRule(UpdateRule):
    """A rule that learns from true gradients only (sync, async, stash, spectrain).

    By default a stage keeps the batch's graph until its gradient is back.
    """

    @classmethod
    def check(cls, settings: StageSettings) -> None:
        if settings.synthetic_inputs:
            raise ValueError("synthetic inputs need the rule 'dni' or 'cdni'")

    async def after_forward(
        self, stage: StageContext, msg: Forward, h_in: torch.Tensor, h_out: torch.Tensor
    ) -> Outcome:
        return Outcome(keep=Kept(h_in, h_out, msg.labels, msg.step_id, msg.parts, stage.steps))
