"""A torch model over one flat float32 buffer: parameters are views, not copies.

The buffer is a ``ParamStore`` view, so a pull written into the store is what
the next forward pass reads, and a Hogwild store shared through /dev/shm is
trained in place by every process that maps it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["FlatModel", "evaluate", "flatten_parameters", "model_arrays", "split_ranges"]


def flatten_parameters(model: nn.Module) -> np.ndarray:
    """The model's parameters, concatenated in ``parameters()`` order (a copy)."""
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).to(torch.float32).numpy().copy()


def model_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """``model``'s state dict (parameters and buffers) as contiguous numpy copies, named as torch names them."""
    with torch.no_grad():
        return {name: np.ascontiguousarray(t.detach().cpu().numpy()).copy() for name, t in model.state_dict().items()}


def split_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``(offset, length)`` ranges covering ``n``, lengths within one of each other."""
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} parameters into {parts} non-empty ranges")
    base, extra = divmod(n, parts)
    ranges, offset = [], 0
    for i in range(parts):
        length = base + (1 if i < extra else 0)
        ranges.append((offset, length))
        offset += length
    return ranges


class FlatModel:
    """Binds ``model``'s parameters to ``flat`` (float32, one element per parameter)."""

    def __init__(self, model: nn.Module, flat: np.ndarray) -> None:
        params = list(model.parameters())
        n = sum(p.numel() for p in params)
        if flat.dtype != np.float32 or flat.ndim != 1 or flat.size != n:
            raise ValueError(f"flat buffer must be float32 with {n} elements, got {flat.dtype} {flat.shape}")
        self.model = model
        self.n = n
        self.flat = torch.from_numpy(flat)  # shares memory with the store
        self.grad = torch.zeros(n, dtype=torch.float32)
        self._slices: list[tuple[nn.Parameter, int, int]] = []
        offset = 0
        with torch.no_grad():
            for p in params:
                k = p.numel()
                view = self.flat[offset:offset + k].view_as(p)
                p.data = view
                self._slices.append((p, offset, k))
                offset += k

    def slices(self) -> list[tuple[nn.Parameter, int, int]]:
        """(parameter, offset, elements) of each parameter in the flat vector, in order."""
        return list(self._slices)

    def accumulate_grad(self) -> None:
        """Add every parameter's ``.grad`` into :attr:`grad` and clear it."""
        with torch.no_grad():
            for p, offset, k in self._slices:
                if p.grad is not None:
                    self.grad[offset:offset + k].add_(p.grad.reshape(-1))
                    p.grad = None

    def grad_norm(self) -> float:
        return float(torch.linalg.vector_norm(self.grad))


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000,
             threads: int | None = None) -> tuple[float, float]:
    """Held-out (accuracy, mean cross-entropy) of ``model`` on ``x``, ``y``; ``threads``: the torch threads
    to use meanwhile (set in the calling thread, restored after), None: as they are."""
    correct, loss_sum = 0, 0.0
    was_training = model.training
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    model.eval()
    try:
        with torch.no_grad():
            for i in range(0, len(x), batch):
                out = model(x[i:i + batch])
                loss_sum += float(F.cross_entropy(out, y[i:i + batch], reduction="sum"))
                correct += int((out.argmax(dim=1) == y[i:i + batch]).sum())
    finally:
        model.train(was_training)
        if threads is not None:
            torch.set_num_threads(before)
    return correct / len(x), loss_sum / len(x)
