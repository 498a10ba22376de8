"""Decoupled Neural Interfaces (Jaderberg et al. 2016): a stage updates at once from a synthetic gradient.

After its forward, a stage that is not the last steps its layers with
``M(h_out)``, the synthetic gradient its small model predicts, and sends the
gradient with respect to its input upstream, where it is the regression
target of the previous stage's model (bootstrapped: that gradient itself came
from ``M``). When the batch's true gradient comes back, it trains ``M``. cDNI
feeds ``M`` the labels too. With synthetic inputs a stage after the first also
predicts its input from the raw data and trains on it before the real input
arrives.

The synthetic step is gated by the SG model's measured agreement with the
true gradients that came back (:attr:`SyntheticGradient.gain`: the true
gradient's energy over the prediction error's, ``|g|² / |M − g|²``, at most
1): the stage's learning rate is multiplied by it for that step, wherever the
optimizer runs (PS shards apply their lr times the scale the push carries;
the gradient sent upstream is never scaled). Without the gate some cDNI runs fell well below
their best in their last epochs: the true gradient shrinks with the loss
while the SG model's error does not, so late synthetic gradients were mostly
noise (``|M − g| / |g|`` rising from about 1 to 3-5 on a collapsing run,
``benchmarks/bench_dni.py``'s setup) and Adam kept stepping at full size
along them. An error below the gradient's own size leaves the step alone.
What the gate leaves is a plateau's wander: at a constant lr a run's
held-out accuracy still moves by about a point from one evaluation to the
next late in training. ``pipeline.lr_decay`` (every lr, the SG models'
included, falling over the last part of the run) settles it: with both, no
run of ``benchmarks/cdni_collapse.py`` (10 seeds of the example and of
``bench_dni.py``'s setup) ends more than 0.2 points below its best.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

import torch

from ..protocol import Forward, Gradient, RawInput
from ..settings import StageSettings, StageShape
from ..synthetic import SyntheticGradient, SyntheticInput
from .base import NOTHING, Kept, Outcome, StageContext, UpdateRule

__all__ = ["CDNIRule", "DNIRule"]


class DNIRule(UpdateRule):
    """Synthetic-gradient updates at once; the SG model fitted on the returning true gradient.

    ``sg``: a ready SG model to use instead of a fresh one (zero-initialised,
    seeded by the stage's seed). The last stage has none: its loss is real.
    """

    # the true gradient is the SG model's training target: the sooner it is fitted, the fresher the
    # synthetic gradients of the forwards queued behind it
    urgent_gradients: ClassVar[bool] = True
    conditioned: ClassVar[bool] = False

    def __init__(self, settings: StageSettings, shape: StageShape, *, sg: SyntheticGradient | None = None) -> None:
        super().__init__(settings, shape)
        if not shape.last:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(shape.seed)
                self.sg = sg or SyntheticGradient(
                    shape.out_features,
                    num_classes=settings.num_classes if self.conditioned else 0,
                    hidden_layers=settings.sg_hidden_layers,
                    hidden_width=settings.sg_hidden_width,
                    lr=settings.sg_lr,
                    optimizer=settings.model_optimizer,
                    shape=shape.out_shape,
                )
        self._raw: OrderedDict[int, torch.Tensor] = OrderedDict()

    @classmethod
    def check(cls, settings: StageSettings) -> None:
        if cls.conditioned and settings.num_classes < 2:
            raise ValueError("cDNI needs num_classes >= 2")

    def connect(self, has_upstream: bool) -> None:
        if self.settings.synthetic_inputs and has_upstream and self.input_model is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.shape.seed + 1)
                self.input_model = SyntheticInput(
                    self.shape.raw_features,
                    self.shape.in_features,
                    lr=self.settings.input_lr,
                    optimizer=self.settings.model_optimizer,
                )

    def diagnostics(self) -> dict[str, float]:
        if self.sg is None:
            return {}
        error = self.sg.relative_error
        return {"sg_relative_error": error, "sg_gain": self.sg.gain, "estimate_error_ratio": error}

    async def before_forward(self, stage: StageContext, msg: Forward) -> None:
        if self.input_model is not None:
            raw = self._raw.pop(msg.batch_id, None)
            if raw is not None:  # the real input is the input model's target
                await stage.run_blocking(self.input_model.fit, raw, msg.activations.flatten(1))

    async def after_forward(
        self, stage: StageContext, msg: Forward, h_in: torch.Tensor, h_out: torch.Tensor
    ) -> Outcome:
        grad_in = await stage.run_blocking(self._synthetic_update, stage, h_in, h_out, msg.labels)
        kept = Kept(None, h_out.detach(), msg.labels, msg.step_id, msg.parts, stage.steps)
        return Outcome("update", keep=kept, upstream=grad_in)

    async def on_gradient(self, stage: StageContext, kept: Kept, msg: Gradient) -> Outcome:
        assert self.sg is not None  # only a stage with a downstream keeps batches
        rows = self.settings.sg_fit_rows or None
        await stage.run_blocking(self.sg.fit, kept.h_out[:rows], kept.labels[:rows], msg.gradient[:rows])
        return Outcome("sg_step", done=True)

    async def on_raw_input(self, stage: StageContext, msg: RawInput) -> Outcome:
        if self.input_model is None:
            return NOTHING
        stage.trace("synthetic_input", msg.batch_id)
        stage.keep(self._raw, msg.batch_id, msg.inputs)
        await stage.run_blocking(self._synthetic_input_step, stage, msg.inputs, msg.labels)
        return Outcome("update")

    # -- torch work (on a worker thread) --------------------------------------------
    def _synthetic_update(
        self, stage: StageContext, h_in: torch.Tensor, h_out: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor | None:
        assert self.sg is not None
        with torch.no_grad():
            grad = self.sg(h_out.detach(), labels)
        return stage.backward(h_in, h_out, grad, zero=True, step=True, lr_scale=self.sg.gain)

    def _synthetic_input_step(self, stage: StageContext, x: torch.Tensor, labels: torch.Tensor) -> None:
        assert self.input_model is not None
        with torch.no_grad():
            h_in = self.input_model(x).view(-1, *self.shape.in_dims)
        h_out: torch.Tensor = stage.layers(h_in)
        if stage.last:
            stage.loss_backward(h_in, h_out, labels, 1.0, zero=True, step=True)
        else:
            self._synthetic_update(stage, h_in, h_out, labels)


class CDNIRule(DNIRule):
    """cDNI: the SG model also sees the batch's labels, one-hot."""

    conditioned: ClassVar[bool] = True
