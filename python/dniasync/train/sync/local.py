"""No sharing: the trainer's own torch optimizer (Adam or SGD) steps its weights.

The sync of a pipeline stage with one replica. It has no flat buffer (a
stage's layers change on a regroup, and their optimizer state moves with
them), pushes and pulls nothing, and its checkpoint is the optimizer's state
(:func:`optimizer_tensors`, also used for a stage's SG and input models).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..flat import FlatModel
from ..specs import LocalSpec, OptimizerSpec
from .base import SyncContext, SyncKind, SyncStats, register

__all__ = [
    "LOCAL_STEPS_PER_CALL",
    "LocalOptimizer",
    "load_optimizer_tensors",
    "make_optimizer",
    "optimizer_tensors",
    "set_lr",
]

LOCAL_STEPS_PER_CALL = 8
"""Steps per thread hop when nothing is shared between them."""


def make_optimizer(
    params: list[nn.Parameter], kind: str, lr: float, *, fused: bool = True, momentum: float = 0.0,
    eps: float = 1e-8, betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """torch's optimizer ``kind``: ``adam``, ``sgd`` (``momentum``: SGD's), and the other rules of a job's
    ``[optimizer]``, as the PS shards' store runs them: ``momentum`` (heavy ball), ``nesterov``, ``adagrad``.

    ``fused`` (the default): torch's single-kernel update where this torch has
    one for the CPU (Adam, SGD and Adagrad since torch 2.5; otherwise its
    default). On the CPU torch's default loops over tensors op by op: for the
    784-1024x4-10 MLP (4.2M parameters) on 2 threads, Adam 11.1 ms a step
    against 1.1 ms fused, Adagrad 3.0 against 0.65 ms, Nesterov 2.2 against
    0.8 ms (AMD EPYC); the same update up to rounding. ``fused=False`` gives
    torch's default (needed for sparse gradients, which the fused kernels
    refuse). The torch baselines of ``compare`` build theirs here, so they are
    torch at its fastest.
    """
    if kind == "adam":
        def build(f: bool | None) -> torch.optim.Optimizer:
            return torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=f)
    elif kind in ("sgd", "momentum", "nesterov"):
        def build(f: bool | None) -> torch.optim.Optimizer:
            return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=kind == "nesterov",
                                   weight_decay=weight_decay, fused=f)
    elif kind == "adagrad":
        def build(f: bool | None) -> torch.optim.Optimizer:
            return torch.optim.Adagrad(params, lr=lr, eps=eps, weight_decay=weight_decay, fused=f)
    else:
        raise ValueError(f"optimizer must be 'adam', 'sgd', 'momentum', 'nesterov' or 'adagrad', got {kind!r}")
    if not fused:
        return build(None)
    try:
        optimizer = build(True)
    except (RuntimeError, TypeError):  # this torch has no fused kernel for it on these tensors
        return build(None)
    optimizer.register_step_pre_hook(_grads_laid_out_as_params)
    return optimizer


def _grads_laid_out_as_params(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before a fused step: a gradient laid out otherwise than its parameter becomes a copy laid out as it. torch's
    fused CPU kernels read a gradient's memory as if its strides were the parameter's (torch 2.15: SGD, Adagrad and
    Adam given a transposed gradient step with the transpose's values). ``backward()`` lays ``.grad`` out as the
    parameter; a gradient from ``torch.autograd.grad`` set by hand (a stashing pipeline rule's) need not be."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is not None and not g.is_sparse and g.stride() != p.stride():
                p.grad = torch.empty_like(p).copy_(g)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every parameter group of ``optimizer`` steps with ``lr`` from its next step on."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """``optimizer``'s state as plain tensors named ``<param index>.<slot>`` (numbers as 0-d float tensors)."""
    out = {}
    for index, slots in optimizer.state_dict()["state"].items():
        for key, value in slots.items():
            if isinstance(value, torch.Tensor):
                out[f"{index}.{key}"] = value.detach().clone()
            elif isinstance(value, (int, float)):
                out[f"{index}.{key}"] = torch.tensor(float(value))
    return out


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, saved: dict[str, torch.Tensor]) -> None:
    """Load :func:`optimizer_tensors` back (the parameter groups and their lr stay ``optimizer``'s own)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in saved.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = tensor.clone()
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})


class LocalOptimizer:
    """The trainer's own torch optimizer: nothing to push or pull (also the inner optimizer of local steps)."""

    flat: FlatModel | None = None
    pulls_params = False

    def __init__(self, params: Iterable[nn.Parameter], kind: str, lr: float, *, momentum: float = 0.0,
                 **options: Any) -> None:
        self.optimizer: torch.optim.Optimizer = make_optimizer(list(params), kind, lr, momentum=momentum, **options)
        self.lr = lr
        """The configured learning rate (:meth:`scale_lr` scales it)."""
        self.scale = 1.0

    @classmethod
    def for_spec(cls, params: Iterable[nn.Parameter], spec: OptimizerSpec) -> LocalOptimizer:
        """torch's counterpart of the rule ``spec`` names for a PS shard (``sgd`` there has no momentum)."""
        return cls(params, spec.name, spec.lr, momentum=0.0 if spec.name == "sgd" else spec.momentum,
                   eps=spec.eps, betas=spec.betas, weight_decay=spec.weight_decay)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, lr_scale: float = 1.0) -> None:
        if lr_scale == 1.0:
            self.optimizer.step()
            return
        set_lr(self.optimizer, self.lr * self.scale * lr_scale)
        try:
            self.optimizer.step()
        finally:
            set_lr(self.optimizer, self.lr * self.scale)

    def steps_per_call(self, steps: int) -> int:
        return LOCAL_STEPS_PER_CALL

    async def ready(self) -> None:
        return

    async def sync(self, samples: int) -> None:
        return

    def scale_lr(self, scale: float) -> None:
        self.scale = scale
        set_lr(self.optimizer, self.lr * scale)

    def lr_now(self) -> float:
        return self.lr * self.scale

    async def flush(self) -> None:
        return

    def relinked(self, layers: nn.Module) -> LocalOptimizer:
        """Itself: the caller has moved the layers' parameters and state in or out of :attr:`optimizer`."""
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        return optimizer_tensors(self.optimizer)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_optimizer_tensors(self.optimizer, state)

    def stats(self) -> SyncStats:
        return SyncStats()

    async def close(self) -> None:
        return


def _build(spec: LocalSpec, model: nn.Module, ctx: SyncContext) -> LocalOptimizer:
    return LocalOptimizer(model.parameters(), ctx.optimizer.name, ctx.optimizer.lr, momentum=ctx.optimizer.momentum)


register(SyncKind("local", LocalSpec, _build, needs_ps=False, owns_optimizer=True,
                  doc="the trainer's own torch optimizer (Adam or SGD): nothing shared"))
