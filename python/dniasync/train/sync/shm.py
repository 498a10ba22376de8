"""Hogwild!: every step applied in place, without locks, to one store every worker on the machine maps.

The job creates a shared-memory ``ParamStore`` (segment :data:`HOGWILD_SEGMENT`,
with the optimizer's state) and names it in a
:class:`~dniasync.train.specs.SharedStoreSpec`; each worker attaches to it,
its model's parameters become views of the store, and each step's gradient is
applied by the store's Rust optimizer (Niu et al. 2011). Nothing travels.
An embedding table's step touches only the rows the gradient did (``sparse``,
:mod:`dniasync.train.sparse`): the sparse updates Hogwild was designed for,
where a dense step would write every row back, over other workers' updates.
"""

from __future__ import annotations

import torch
from torch import nn

from ..flat import FlatModel
from ..sparse import embedding_tables, spans_of, touched
from ..specs import OptimizerSpec, SharedStoreSpec
from .base import SyncContext, SyncKind, SyncStats, register

__all__ = ["HOGWILD_SEGMENT", "HOGWILD_STEPS_PER_CALL", "SharedStoreSync"]

HOGWILD_SEGMENT = "params"
"""The store segment holding the model's flat parameters."""
HOGWILD_STEPS_PER_CALL = 8


class SharedStoreSync:
    """Applies each step's gradient to the shared store ``name`` in place (its optimizer, ``optimizer.lr``);
    embedding tables only at the rows a step touched, as ``sparse`` says (:data:`~dniasync.train.sparse.SPARSE_MODES`).
    ``sparse_steps`` counts the steps that went over spans."""

    optimizer: torch.optim.Optimizer | None = None
    pulls_params = False

    def __init__(self, model: nn.Module, name: str, optimizer: OptimizerSpec, sparse: str = "auto") -> None:
        n = sum(p.numel() for p in model.parameters())
        self.store = optimizer.attach(name, [(HOGWILD_SEGMENT, n)])
        self.flat = FlatModel(model, self.store.view(HOGWILD_SEGMENT))
        self.lr = optimizer.lr
        self.scale = 1.0
        self._params = list(model.parameters())
        self.tables = embedding_tables(model) if sparse != "never" else []
        self.sparse = sparse
        self.steps = 0
        self.sparse_steps = 0

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def step(self) -> None:
        self.flat.accumulate_grad()
        grad = self.flat.grad.numpy()
        keep = touched(grad, self.tables, self.sparse) if self.tables else None
        if keep is None:
            self.store.step(HOGWILD_SEGMENT, grad, self.lr * self.scale)
        else:
            self.store.step_spans(HOGWILD_SEGMENT, spans_of(keep), grad[keep], self.lr * self.scale)
            self.sparse_steps += 1
        self.steps += 1
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
        return

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
    return SharedStoreSync(model, spec.name, ctx.optimizer, spec.sparse)


register(SyncKind("shm", SharedStoreSpec, _build, needs_ps=False, owns_optimizer=False,
                  doc="Hogwild: every step applied in place, without locks, to the machine's shared-memory store"))
