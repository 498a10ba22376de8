"""The small models of synthetic-gradient rules: ``M(h) ≈ dL/dh`` and a stage's predicted input.

Both are MLPs fitted by MSE with their own optimizer (torch's fused Adam, as
the layers') and record their recent losses for stats and metrics.
"""

from __future__ import annotations

import math
from collections import deque

import torch
import torch.nn.functional as F
from torch import nn

from ..sync import make_optimizer, set_lr

__all__ = ["AGREEMENT_DECAY", "SyntheticGradient", "SyntheticInput"]


class _ConvSG(nn.Module):
    """A small conv net from ``(C + K, H, W)`` to ``(C, H, W)``: ``hidden_layers`` 3x3 ReLU convs of ``width`` channels.

    cDNI's labels come in as ``K`` one-hot planes (constant over the image).
    """

    def __init__(self, channels: int, num_classes: int, hidden_layers: int, width: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c = channels + num_classes
        for _ in range(hidden_layers):
            layers += [nn.Conv2d(c, width, 3, padding=1), nn.ReLU()]
            c = width
        layers.append(nn.Conv2d(c, channels, 3, padding=1))
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


def _mlp(in_features: int, out_features: int, hidden_layers: int, width: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    d = in_features
    for _ in range(hidden_layers):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, out_features))
    return nn.Sequential(*layers)


class _Regressor(nn.Module):
    """A small MLP fitted by MSE with its own optimizer; records its losses."""

    def __init__(self, net: nn.Module, lr: float, optimizer: str, history: int) -> None:
        super().__init__()
        self.net = net
        self.optimizer = make_optimizer(list(net.parameters()), optimizer, lr)
        self.lr = lr
        """The configured learning rate (:meth:`scale_lr` scales it)."""
        self.losses: deque[float] = deque(maxlen=history)
        """The most recent training losses (bounded)."""
        self.steps = 0

    def scale_lr(self, scale: float) -> None:
        """Fit with the configured lr times ``scale`` from now on."""
        set_lr(self.optimizer, self.lr * scale)

    def _fit(self, x: torch.Tensor, target: torch.Tensor) -> float:
        pred = self.net(x)
        loss = F.mse_loss(pred, target.detach())
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        value = float(loss.detach())
        self.losses.append(value)
        self.steps += 1
        self._measured(pred.detach(), target.detach())
        return value

    def _measured(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        """What the prediction made before this fit step says of the model (the SG model's agreement)."""

    def mean_loss_since(self, seen: int) -> tuple[float, int]:
        """Mean of the losses recorded after step ``seen`` (NaN if none), and the step count now."""
        if self.steps == seen:
            return float("nan"), seen
        fresh = min(self.steps - seen, len(self.losses))
        recent = list(self.losses)[-fresh:]
        return sum(recent) / len(recent), self.steps


AGREEMENT_DECAY = 0.98
"""Agreement of an SG model with the true gradients: an average over about 50 returning batches."""


class SyntheticGradient(_Regressor):
    """``M(h) ≈ dL/dh``: predicts the gradient of the loss at a stage's output.

    ``hidden_layers`` ReLU layers of ``hidden_width`` units (0 hidden layers:
    linear); with ``num_classes > 0`` the labels, one-hot, are appended to ``h``
    (cDNI). For activations of shape ``(C, H, W)`` (``shape``, a conv stage)
    it is a small conv net instead (:class:`_ConvSG`, ``hidden_width``
    channels, default ``C``), cDNI's labels given as one-hot planes; other
    shapes are flattened for the MLP. The output layer is zero-initialised, so before any training the
    synthetic gradient is exactly zero. Trained by :meth:`fit` (MSE, its own
    optimizer) on the gradient that arrives later from downstream.

    Each fit also measures how the prediction it starts from, ``M``, agrees
    with the true gradient ``g`` (moving averages over returning batches of
    ``<M, g>``, ``|M|²`` and ``|g|²``): :attr:`relative_error`
    ``|M − g| / |g|`` and :attr:`gain`, the ratio of the true gradient's
    energy to the prediction error's, ``|g|² / |M − g|²``, at most 1. Late in
    training the true gradient shrinks while the model's error does not: the
    relative error passes 1 and a step along ``M`` is mostly noise. The DNI
    rules scale the learning rate of their synthetic steps by the gain.
    """

    def __init__(
        self,
        features: int,
        *,
        num_classes: int = 0,
        hidden_layers: int = 1,
        hidden_width: int = 0,
        lr: float = 1e-4,
        optimizer: str = "adam",
        history: int = 10_000,
        shape: tuple[int, ...] = (),
    ) -> None:
        self.conv = len(shape) == 3
        net: nn.Module
        if self.conv:
            net = _ConvSG(shape[0], num_classes, hidden_layers, hidden_width or shape[0])
            last: nn.Module = net.body[-1]
        else:
            net = _mlp(features + num_classes, features, hidden_layers, hidden_width or features)
            last = net[-1]
        assert isinstance(last, nn.Linear | nn.Conv2d)
        nn.init.zeros_(last.weight)
        assert last.bias is not None
        nn.init.zeros_(last.bias)
        super().__init__(net, lr, optimizer, history)
        self.features = features
        self.num_classes = num_classes
        self._dot = 0.0
        self._pred_sq = 0.0
        self._target_sq = 0.0

    def _measured(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        d = AGREEMENT_DECAY
        self._dot = d * self._dot + float((pred * target).sum())
        self._pred_sq = d * self._pred_sq + float((pred * pred).sum())
        self._target_sq = d * self._target_sq + float((target * target).sum())

    def agreement_tensor(self) -> torch.Tensor:
        """The running agreement sums with the true gradients (dot, |M|², |g|²), as a checkpoint keeps them."""
        return torch.tensor([self._dot, self._pred_sq, self._target_sq], dtype=torch.float64)

    def load_agreement(self, sums: torch.Tensor) -> None:
        """Continue from :meth:`agreement_tensor`'s sums."""
        self._dot, self._pred_sq, self._target_sq = (float(v) for v in sums)

    @property
    def gain(self) -> float:
        """``|g|² / |M − g|²`` over recent fits, at most 1; 1 before any fit."""
        error = self.relative_error
        return 1.0 if not error > 1.0 else 1.0 / (error * error)

    @property
    def relative_error(self) -> float:
        """``|M − g| / |g|`` over recent fits (NaN before any)."""
        if self._target_sq <= 0.0:
            return float("nan")
        return math.sqrt(max(0.0, self._pred_sq - 2.0 * self._dot + self._target_sq) / self._target_sq)

    def _inputs(self, h: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        if not self.conv:
            h = h.flatten(1)
        if not self.num_classes:
            return h
        if labels is None:
            raise ValueError("a label-conditioned synthetic gradient (cDNI) needs the labels")
        onehot = F.one_hot(labels.long(), self.num_classes).to(h.dtype)
        if self.conv:  # one constant plane per class
            onehot = onehot[:, :, None, None].expand(-1, -1, h.shape[2], h.shape[3])
        return torch.cat([h, onehot], dim=1)

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The synthetic gradient for activations ``h`` (shape of ``h``)."""
        out: torch.Tensor = self.net(self._inputs(h, labels))
        return out.view_as(h)

    def fit(self, h: torch.Tensor, labels: torch.Tensor | None, target: torch.Tensor) -> float:
        """One optimizer step of MSE regression of ``M(h)`` onto ``target``; returns the loss."""
        x = self._inputs(h.detach(), labels)
        return self._fit(x, target if self.conv else target.flatten(1))


class SyntheticInput(_Regressor):
    """Predicts a stage's input activations from the raw data (synthetic inputs)."""

    def __init__(
        self,
        raw_features: int,
        features: int,
        *,
        hidden_layers: int = 1,
        hidden_width: int = 0,
        lr: float = 1e-3,
        optimizer: str = "adam",
        history: int = 10_000,
    ) -> None:
        super().__init__(_mlp(raw_features, features, hidden_layers, hidden_width or features), lr, optimizer, history)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The predicted input activations for raw inputs ``x``."""
        out: torch.Tensor = self.net(x)
        return out

    def fit(self, x: torch.Tensor, target: torch.Tensor) -> float:
        """One MSE step towards the real activations ``target``; returns the loss."""
        return self._fit(x, target)
