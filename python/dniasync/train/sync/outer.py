"""Local steps and an outer optimizer (DiLoCo, Douillard et al. 2023), on flat float32 buffers.

A trainer takes ``H = local_steps`` inner steps with its own optimizer, then
shares one *pseudo-gradient*: the weights at the last sync (the *anchor*) minus
the weights now. An outer optimizer applies the (averaged) pseudo-gradients to
the anchor: Nesterov momentum with lr 0.7 and momentum 0.9 in the paper::

    delta = anchor - weights                      # LocalSteps.pseudo_gradient, every H steps
    v     = momentum * v + mean(delta)            # OuterOptimizer.step
    new   = anchor - lr * (mean(delta) + momentum * v)

(torch's ``SGD(nesterov=True)`` and the Rust store's ``nesterov`` rule, the same
arithmetic.) With ``lr = 1, momentum = 0`` the outer step is ``anchor -
mean(anchor - w_i) = mean(w_i)``: plain averaging of the trainers' weights, and
with ``H = 1`` that is averaging of each step's update.

Two pieces, pure (numpy only, no actors, no sockets), for any sync to compose:

- :class:`LocalSteps` keeps the anchor, counts inner steps and says when a sync is
  due; :meth:`LocalSteps.pseudo_gradient` gives ``anchor - now``;
  :meth:`LocalSteps.reset` makes the weights the sync brings back the next anchor.
- :class:`OuterOptimizer` holds the momentum buffer and turns an anchor and an
  averaged pseudo-gradient into the new weights.

How the syncs use them:

- **PS** (``train/sync/ps.py``): the inner optimizer runs locally (torch's, as
  for a lone trainer). Every H steps the trainer pushes the pseudo-gradient,
  codec and residual applied as to any gradient, and the PS shards run the outer
  optimizer as their own (the store's ``nesterov`` rule, the one above, with
  ``[sync] outer_momentum``); the trainer then pulls and resets its anchor to what
  it pulled. The shards apply each trainer's pseudo-gradient as it arrives, not an
  average of N: N asynchronous pushes make N outer steps, so Downpour gives them
  the lr ``outer_lr / N``, which matches one averaged step (exactly without
  momentum, in the steady state with it). No OuterOptimizer runs on the trainer.
- **p2p** (``train/sync/p2p.py``): no shard. Every H steps each peer sends its
  pseudo-gradient (quantized, residual kept) and averages what it sent with what
  it received for that round, then runs the outer step itself on its own anchor
  with its own :class:`OuterOptimizer`; since every peer starts from the same
  weights and applies the same averaged pseudo-gradients, the peers' anchors stay
  equal up to what quantization and missed messages leave out. The anchor is
  reset to the result (``LocalSteps.reset(new)``).

Buffers are flat float32 numpy arrays; a CPU torch tensor's ``.numpy()`` is a
view of the same memory, so a model whose parameters are views of one flat
buffer (:class:`~dniasync.train.flat.FlatModel`) is updated in place by passing
that buffer as ``out``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

__all__ = ["DILOCO_LR", "DILOCO_MOMENTUM", "LocalSteps", "OuterOptimizer", "mean_pseudo_gradient"]

DILOCO_LR = 0.7
"""The outer learning rate of DiLoCo (Douillard et al. 2023)."""
DILOCO_MOMENTUM = 0.9
"""The outer Nesterov momentum of DiLoCo."""

Flat = NDArray[np.float32]


def _flat(values: NDArray[np.float32], what: str, n: int | None = None, *, written: bool = False) -> Flat:
    if not isinstance(values, np.ndarray) or values.dtype != np.float32:
        raise TypeError(f"{what} must be a numpy.ndarray of float32, got {getattr(values, 'dtype', type(values))}")
    if written and not values.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous: it is written in place")
    if n is not None and values.size != n:
        raise ValueError(f"{what}: expected {n} elements, got {values.size}")
    return values.reshape(-1)


def mean_pseudo_gradient(pseudo_gradients: Sequence[NDArray[np.float32]]) -> Flat:
    """The element-wise mean of a round's pseudo-gradients (one's own and the peers'), in float32."""
    if not pseudo_gradients:
        raise ValueError("no pseudo-gradients to average")
    n = pseudo_gradients[0].size
    total = np.zeros(n, dtype=np.float32)
    for i, delta in enumerate(pseudo_gradients):
        total += _flat(delta, f"pseudo-gradient {i}", n)
    total /= np.float32(len(pseudo_gradients))
    return total


class LocalSteps:
    """Counts inner steps since the last sync and keeps the anchor (the weights then).

    ``local_steps`` is H: :attr:`due` turns true after H calls of :meth:`step` (or
    ``step(H)``). The anchor is a copy of the weights given at construction or to
    the last :meth:`reset`.
    """

    def __init__(self, weights: NDArray[np.float32], local_steps: int) -> None:
        if local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {local_steps}")
        self.local_steps = local_steps
        self.anchor: Flat = _flat(weights, "weights").copy()
        self.n = int(self.anchor.size)
        self.steps = 0
        """Inner steps since the last reset."""
        self.syncs = 0
        """Resets so far (one per outer step)."""

    def step(self, n: int = 1) -> bool:
        """Count ``n`` inner steps; True if a sync is due (H or more since the last reset)."""
        if n < 0:
            raise ValueError(f"cannot count {n} steps")
        self.steps += n
        return self.due

    @property
    def due(self) -> bool:
        return self.steps >= self.local_steps

    def pseudo_gradient(self, weights: NDArray[np.float32], out: NDArray[np.float32] | None = None) -> Flat:
        """``anchor - weights`` (into ``out`` if given): what the inner steps moved, as a descent direction."""
        now = _flat(weights, "weights", self.n)
        if out is None:
            return np.subtract(self.anchor, now)
        np.subtract(self.anchor, now, out=_flat(out, "out", self.n, written=True))
        return out

    def reset(self, weights: NDArray[np.float32]) -> None:
        """The weights after a sync become the anchor; the step count starts again."""
        np.copyto(self.anchor, _flat(weights, "weights", self.n))
        self.steps = 0
        self.syncs += 1

    def state_dict(self) -> dict[str, NDArray[np.float32] | int]:
        return {"anchor": self.anchor.copy(), "steps": self.steps, "syncs": self.syncs}

    def load_state_dict(self, state: dict[str, NDArray[np.float32] | int]) -> None:
        anchor = state["anchor"]
        assert isinstance(anchor, np.ndarray)
        np.copyto(self.anchor, _flat(anchor, "anchor", self.n))
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])


class OuterOptimizer:
    """Nesterov momentum on pseudo-gradients: ``v = mu v + d; new = anchor - lr (d + mu v)``.

    Defaults are DiLoCo's (lr 0.7, momentum 0.9). ``nesterov=False`` gives heavy-ball
    momentum (``new = anchor - lr v``); ``lr=1, momentum=0`` gives plain averaging.
    """

    def __init__(self, n: int, *, lr: float = DILOCO_LR, momentum: float = DILOCO_MOMENTUM,
                 nesterov: bool = True) -> None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if not lr > 0.0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.n = n
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.velocity: Flat = np.zeros(n, dtype=np.float32)
        self.steps = 0

    def step(self, anchor: NDArray[np.float32], pseudo_gradient: NDArray[np.float32],
             out: NDArray[np.float32] | None = None) -> Flat:
        """The new weights (into ``out`` if given, which may be ``anchor`` itself) after one outer step."""
        a = _flat(anchor, "anchor", self.n)
        d = _flat(pseudo_gradient, "pseudo-gradient", self.n)
        lr, mu = np.float32(self.lr), np.float32(self.momentum)
        if mu:
            self.velocity *= mu
            self.velocity += d
            update = d + mu * self.velocity if self.nesterov else self.velocity.copy()
        else:
            update = d.copy()
        update *= lr
        self.steps += 1
        if out is None:
            return np.subtract(a, update)
        np.subtract(a, update, out=_flat(out, "out", self.n, written=True))
        return out

    def state_dict(self) -> dict[str, NDArray[np.float32] | int]:
        return {"velocity": self.velocity.copy(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, NDArray[np.float32] | int]) -> None:
        velocity = state["velocity"]
        assert isinstance(velocity, np.ndarray)
        np.copyto(self.velocity, _flat(velocity, "velocity", self.n))
        self.steps = int(state["steps"])
