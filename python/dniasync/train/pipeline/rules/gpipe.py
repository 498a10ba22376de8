"""The synchronous pipeline (GPipe-style): the baseline that waits for the true gradient.

A stage keeps each micro-batch's graph until its gradient comes back, then
back-propagates it, accumulating over the parts of one mini-batch, and
updates once the last part is through. With the driver's flush after every
mini-batch this is plain backprop, cut across stages.
"""

from __future__ import annotations

from typing import ClassVar

from ..protocol import Gradient
from .base import Kept, Outcome, StageContext, TrueGradientRule

__all__ = ["GPipeRule"]


class GPipeRule(TrueGradientRule):
    """Keep graphs, accumulate micro-batches, update when the last part's true gradient is back."""

    flush: ClassVar[bool] = True
    # gradients keep their order of arrival: all forwards of a step, then their backwards, as in GPipe

    async def on_gradient(self, stage: StageContext, kept: Kept, msg: Gradient) -> Outcome:
        assert kept.h_in is not None
        first, last = stage.count_part(kept.step_id, kept.parts)
        grad_in = await stage.run_blocking(stage.backward, kept.h_in, kept.h_out, msg.gradient, zero=first, step=last)
        return Outcome("update" if last else "accumulate", upstream=grad_in, done=True)

    def on_late_gradient(self, batch_id: int) -> Outcome:
        # the graph is gone: this step can never complete
        raise RuntimeError(
            f"batch {batch_id}: graph evicted before its gradient came back (cache_size={self.cache_size} "
            "is smaller than the micro-batches in flight)"
        )
