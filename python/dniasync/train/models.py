"""Model factories, named in job configs as ``"module:function"`` strings.

A factory is any callable returning a ``torch.nn.Module``; its keyword
arguments come from the ``[model.kwargs]`` table of the config. Initial
weights come from torch's global generator, so ``torch.manual_seed(s)`` before
the call fixes them (every replica and PS shard can build the same start).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import torch
from torch import nn

__all__ = [
    "ACTIVATIONS",
    "ModelFactoryError",
    "build_model",
    "check_kwargs",
    "cnn",
    "count_parameters",
    "fasttext",
    "kim_cnn",
    "mlp",
    "resolve_factory",
]

#: Activation names accepted by :func:`mlp`.
ACTIVATIONS: Final[dict[str, Callable[[], nn.Module]]] = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "gelu": nn.GELU,
    "elu": nn.ELU,
    "leaky_relu": nn.LeakyReLU,
}


class ModelFactoryError(ValueError):
    """A ``module:function`` model factory cannot be found, called or used."""


def mlp(sizes: Sequence[int] = (784, 256, 256, 10), activation: str = "relu") -> nn.Sequential:
    """Fully connected layers ``sizes[0] -> ... -> sizes[-1]`` with ``activation`` between them.

    The output layer has no activation: it gives logits for cross-entropy.
    """
    sizes = list(sizes)
    if len(sizes) < 2:
        raise ValueError(f"mlp needs at least an input and an output size, got {sizes}")
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"mlp layer sizes must be positive ints, got {sizes}")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"unknown activation {activation!r}; choose one of {', '.join(ACTIVATIONS)}"
        )
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i:
            layers.append(ACTIVATIONS[activation]())
        layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


NORMS: Final[dict[str, Callable[[int], nn.Module]]] = {
    "batch": nn.BatchNorm2d,
    "group": lambda c: nn.GroupNorm(min(8, c), c),
    "none": lambda c: nn.Identity(),
}
"""Normalisation names accepted by :func:`cnn`."""


def cnn(
    image: Sequence[int] = (1, 28, 28),
    channels: Sequence[int] = (16, 32),
    hidden: int = 128,
    classes: int = 10,
    norm: str = "batch",
) -> nn.Sequential:
    """A small convolutional net over flat inputs, as one ``nn.Sequential`` a pipeline can cut anywhere.

    ``Unflatten`` to ``image`` (C, H, W), then per entry of ``channels`` a block
    ``Conv2d 3x3 -> norm -> ReLU -> MaxPool2d 2``, then ``Flatten -> Linear(hidden)
    -> ReLU -> Linear(classes)``. With the defaults the layers are: 0 Unflatten,
    1-4 and 5-8 the blocks, 9 Flatten, 10 Linear, 11 ReLU, 12 Linear.
    """
    image, channels = list(image), list(channels)
    if len(image) != 3 or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in image):
        raise ValueError(f"cnn image must be (channels, height, width) positive ints, got {image}")
    if not channels or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in channels):
        raise ValueError(f"cnn channels must be positive ints, got {channels}")
    if norm not in NORMS:
        raise ValueError(f"unknown norm {norm!r}; choose one of {', '.join(NORMS)}")
    c_in, h, w = image
    if h >> len(channels) < 1 or w >> len(channels) < 1:
        raise ValueError(f"cnn: {len(channels)} pooling blocks do not fit an image of {h}x{w}")
    layers: list[nn.Module] = [nn.Unflatten(1, (c_in, h, w))]
    for c in channels:
        layers += [nn.Conv2d(c_in, c, 3, padding=1), NORMS[norm](c), nn.ReLU(), nn.MaxPool2d(2)]
        c_in, h, w = c, h // 2, w // 2
    layers += [nn.Flatten(), nn.Linear(c_in * h * w, hidden), nn.ReLU(), nn.Linear(hidden, classes)]
    return nn.Sequential(*layers)


def fasttext(vocab_size: int = 8192, dim: int = 64, classes: int = 5, mode: str = "mean") -> nn.Sequential:
    """A bag-of-embeddings classifier (fastText, Joulin et al. 2017) over rows of token ids ``[B, L]`` (0 = padding).

    Layers: 0 ``EmbeddingBag`` (``mode`` mean or sum over a row's non-padding tokens), 1 ``Linear(classes)``;
    a pipeline may cut between them.
    """
    if mode not in ("mean", "sum"):
        raise ValueError(f"fasttext mode must be 'mean' or 'sum', got {mode!r}")
    return nn.Sequential(nn.EmbeddingBag(vocab_size, dim, mode=mode, padding_idx=0), nn.Linear(dim, classes))


class _Channels(nn.Module):
    """``[B, L, D]`` embeddings to ``[B, D, L]`` channels for ``Conv1d``."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.transpose(1, 2)


class _MultiWidthConv(nn.Module):
    """Kim's convolutions: per width a ``Conv1d`` + ReLU + max over time, concatenated."""

    def __init__(self, dim: int, channels: int, widths: Sequence[int]) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(dim, channels, w, padding=w // 2) for w in widths)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.relu(conv(h)).amax(dim=2) for conv in self.convs], dim=1)


def kim_cnn(vocab_size: int = 8192, dim: int = 64, channels: int = 64, widths: Sequence[int] = (3, 4, 5),
            classes: int = 5, dropout: float = 0.5) -> nn.Sequential:
    """A 1-D convolutional text classifier (Kim 2014) over rows of token ids ``[B, L]`` (0 = padding).

    Layers: 0 ``Embedding``, 1 to channels, 2 convolutions of each width with max-over-time pooling,
    3 ``Dropout``, 4 ``Linear(classes)``: one ``nn.Sequential`` a pipeline can cut at any of them.
    """
    widths = list(widths)
    if not widths or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
        raise ValueError(f"kim_cnn widths must be positive ints, got {widths}")
    return nn.Sequential(nn.Embedding(vocab_size, dim, padding_idx=0), _Channels(),
                         _MultiWidthConv(dim, channels, widths), nn.Dropout(dropout),
                         nn.Linear(channels * len(widths), classes))


def resolve_factory(spec: str) -> Callable[..., Any]:
    """The callable that ``"package.module:function"`` names (dots after ``:`` walk attributes)."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path or ":" in attr_path or " " in spec:
        raise ModelFactoryError(
            f"model factory {spec!r} must look like 'package.module:function'"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ModelFactoryError(
            f"model factory {spec!r}: module {module_name!r} not found ({e})"
        ) from None
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ModelFactoryError(
                f"model factory {spec!r}: {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(obj):
        raise ModelFactoryError(
            f"model factory {spec!r} is a {type(obj).__name__}, not callable"
        )
    return obj  # type: ignore[no-any-return]


def check_kwargs(spec: str, factory: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """Raise naming the first keyword ``factory`` would not accept."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # builtins without a signature: the call itself will tell
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        params = signature.parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        unknown = [k for k in kwargs if k not in params and not takes_any]
        which = f" (unknown argument {unknown[0]!r})" if unknown else ""
        raise ModelFactoryError(f"model factory {spec!r}: {e}{which}") from None


def build_model(
    spec: str, kwargs: Mapping[str, Any] | None = None, *, seed: int | None = None
) -> nn.Module:
    """Resolve ``spec``, call it with ``kwargs`` and check it returns a ``torch.nn.Module``.

    With ``seed``, the initial weights are drawn from ``torch.manual_seed(seed)``
    inside a forked generator, leaving the caller's torch RNG state untouched.
    """
    factory = resolve_factory(spec)
    kwargs = dict(kwargs or {})
    check_kwargs(spec, factory, kwargs)
    try:
        if seed is None:
            model = factory(**kwargs)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = factory(**kwargs)
    except Exception as e:  # any failure of user code at build time is a config problem
        raise ModelFactoryError(f"model factory {spec!r} failed: {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise ModelFactoryError(
            f"model factory {spec!r} returned {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def count_parameters(model: nn.Module) -> int:
    """Number of trainable scalars, the length of the flat parameter vector."""
    return sum(int(p.numel()) for p in model.parameters() if p.requires_grad)

