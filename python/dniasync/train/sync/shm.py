"""One store every trainer on the machine maps, stepped in place without locks: Hogwild!, and Downpour on one host.

The job creates a shared-memory ``ParamStore`` (segment :data:`HOGWILD_SEGMENT`,
with the optimizer's state) and names it in a
:class:`~dniasync.train.specs.SharedStoreSpec`; each trainer attaches to it and
each gradient is applied by the store's Rust optimizer. Nothing travels.

- Hogwild (Niu et al. 2011; ``n_fetch = n_push = 0``): the model's parameters
  are views of the store, and every step is applied at once.
- Downpour (Dean et al. 2012) with the store as its parameter server
  (``n_fetch, n_push >= 1``, mode ``downpour`` with ``sync.kind = "shm"``): a
  replica computes on its own copy of the weights, copied from the store every
  ``n_fetch`` steps, and applies its gradient summed over ``n_push`` steps, as
  it would push it to PS shards, without PS processes sharing the machine's
  cores or a byte through a socket.

An embedding table's step touches only the rows the gradient did (``sparse``,
:mod:`dniasync.train.sparse`): the sparse updates Hogwild was designed for,
where a dense step would write every row back, over other workers' updates.

A step applied as soon as it is computed (Hogwild, or ``n_push = 1``) with SGD
or Adagrad and no weight decay goes to the store parameter by parameter, from
the gradients autograd wrote (``ParamStore.step_spans`` over each parameter's
span: where the gradient is zero nothing changes, so the steps are the dense
one's): no flat gradient is summed and zeroed. On this machine's compute-bound
MLP, memory-bound at batch 32, that is four of a step's ten passes over the
weights' size.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..flat import FlatModel
from ..sparse import embedding_tables, spans_of, touched
from ..specs import OptimizerSpec, SharedStoreSpec
from .base import StepScales, SyncContext, SyncKind, SyncStats, register

__all__ = ["HOGWILD_SEGMENT", "HOGWILD_STEPS_PER_CALL", "SharedStoreSync"]

HOGWILD_SEGMENT = "params"
"""The store segment holding the model's flat parameters."""
HOGWILD_STEPS_PER_CALL = 8


class SharedStoreSync:
    """Applies each step's gradient (Hogwild), or the gradient summed over ``n_push`` steps of a copy fetched
    every ``n_fetch`` (Downpour), to the shared store ``name`` in place (its optimizer, ``optimizer.lr``);
    embedding tables only at the rows a step touched, as ``sparse`` says (:data:`~dniasync.train.sparse.SPARSE_MODES`).
    ``sparse_steps`` counts the steps that went over spans."""

    optimizer: torch.optim.Optimizer | None = None
    pulls_params = False

    def __init__(self, model: nn.Module, name: str, optimizer: OptimizerSpec, sparse: str = "auto",
                 n_fetch: int = 0, n_push: int = 0) -> None:
        if (n_fetch == 0) != (n_push == 0) or n_fetch < 0 or n_push < 0:
            raise ValueError(f"n_fetch and n_push are both 0 (Hogwild) or both >= 1, got {n_fetch} and {n_push}")
        n = sum(p.numel() for p in model.parameters())
        self.store = optimizer.attach(name, [(HOGWILD_SEGMENT, n)])
        shared = self.store.view(HOGWILD_SEGMENT)
        self.n_fetch, self.n_push = n_fetch, n_push
        self.flat = FlatModel(model, shared if n_fetch == 0 else shared.copy())
        self.lr = optimizer.lr
        self.scale = 1.0
        self._gate = StepScales()
        self._params = list(model.parameters())
        self.tables = embedding_tables(model) if sparse != "never" else []
        self.sparse = sparse
        self.steps = 0
        self.sparse_steps = 0
        self._direct: list[tuple[nn.Parameter, np.ndarray, torch.Tensor | None]] = []
        """(parameter, its span, the store's values there when the replica fetches them every step) when each step
        goes to the store from the parameters' gradients (see above)."""
        if (n_push <= 1 and not self.tables and optimizer.name in ("sgd", "adagrad") and optimizer.weight_decay == 0
                and optimizer.clip_norm is None):
            store = torch.from_numpy(shared)
            self._direct = [(p, np.array([[offset, k]], dtype=np.uint32),
                             store[offset:offset + k].view_as(p) if n_fetch == 1 else None)
                            for p, offset, k in self.flat.slices()]

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def step(self, lr_scale: float = 1.0) -> None:
        self.steps += 1
        self._gate.add(lr_scale)
        if self._direct:
            self._apply_direct()
            if self.n_fetch > 1 and self.steps % self.n_fetch == 0:
                self.flat.flat.copy_(torch.from_numpy(self.store.view(HOGWILD_SEGMENT)))
            return
        self.flat.accumulate_grad()
        if self.n_fetch == 0:
            self._apply()
            return
        if self.steps % self.n_push == 0:
            self._apply()
        if self.steps % self.n_fetch == 0:
            self.flat.flat.copy_(torch.from_numpy(self.store.view(HOGWILD_SEGMENT)))

    def _apply_direct(self) -> None:
        """Step the store with each parameter's gradient over its span, and clear the gradients; a replica that
        fetches every step (``n_fetch = 1``) copies each span back as soon as it is stepped, while the span is
        still in the cache, rather than the whole store after the last (on the compute-bound MLP one pass over
        the weights' size fewer from memory)."""
        lr = self.lr * self.scale * self._gate.take()
        with torch.no_grad():
            for p, span, fetched in self._direct:
                if p.grad is not None:
                    self.store.step_spans(HOGWILD_SEGMENT, span, p.grad.reshape(-1).numpy(), lr)
                    p.grad = None
                if fetched is not None:
                    p.copy_(fetched)

    def _apply(self) -> None:
        """Step the store with the gradient accumulated since the last time, and clear it."""
        grad = self.flat.grad.numpy()
        keep = touched(grad, self.tables, self.sparse) if self.tables else None
        lr = self.lr * self.scale * self._gate.take()
        if keep is None:
            self.store.step(HOGWILD_SEGMENT, grad, lr)
        else:
            self.store.step_spans(HOGWILD_SEGMENT, spans_of(keep), grad[keep], lr)
            self.sparse_steps += 1
        self.flat.grad.zero_()

    def steps_per_call(self, steps: int) -> int:
        return HOGWILD_STEPS_PER_CALL

    async def ready(self) -> None:
        return

    async def sync(self, samples: int) -> None:
        return

    def scale_lr(self, scale: float) -> None:
        self.scale = scale

    def lr_now(self) -> float:
        return self.lr * self.scale

    async def flush(self) -> None:
        """Apply what a Downpour replica has summed since its last push."""
        if self.n_push and self.steps % self.n_push:
            self._apply()

    def relinked(self, layers: nn.Module) -> SharedStoreSync:
        raise RuntimeError("a Hogwild store holds the whole model: its layers cannot be regrouped")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Nothing: the store (parameters and optimizer state) belongs to the job, which keeps it."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        return

    def stats(self) -> SyncStats:
        return SyncStats()

    async def close(self) -> None:
        return


def _build(spec: SharedStoreSpec, model: nn.Module, ctx: SyncContext) -> SharedStoreSync:
    return SharedStoreSync(model, spec.name, ctx.optimizer, spec.sparse, spec.n_fetch, spec.n_push)


register(SyncKind("shm", SharedStoreSpec, _build, needs_ps=False, owns_optimizer=False,
                  doc="the machine's shared-memory store, stepped in place without locks: every step at once "
                      "(Hogwild), or every n_push steps from a copy fetched every n_fetch (Downpour on one host)"))
