"""Cutting an ``nn.Sequential`` into pipeline stages: contiguous groups of layers, checked.

:func:`validate_groups` names the first problem of a cut; :func:`build_stages`
describes each stage (its layers, widths, seed) as a :class:`StageSpec`, what
a :class:`~dniasync.train.pipeline.stage.Stage` is spawned with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .rules import get_rule
from .settings import StageSettings, StageShape

__all__ = [
    "GroupConfigError",
    "StageSpec",
    "build_stages",
    "example_input",
    "probe_shapes",
    "split_sequential",
    "validate_groups",
]


class GroupConfigError(ValueError):
    """A cut of a model into stages is invalid; the message names the problem."""


def validate_groups(groups: Sequence[Sequence[int]], n_layers: int) -> list[list[int]]:
    """Check that ``groups`` cut layers ``0..n_layers-1`` into contiguous, ordered groups.

    Returns the groups as lists. Raises :class:`GroupConfigError` naming the
    first problem found: no groups, an empty group, a non-integer or
    out-of-range index, a layer in two groups, a non-contiguous or out-of-order
    group, or layers left out.
    """
    if n_layers <= 0:
        raise GroupConfigError(f"the model has no layers to group (n_layers={n_layers})")
    if len(groups) == 0:
        raise GroupConfigError("no stages given")
    owner: dict[int, int] = {}
    result: list[list[int]] = []
    for gi, group in enumerate(groups):
        members = list(group)
        if not members:
            raise GroupConfigError(f"group {gi} is empty")
        for idx in members:
            if not isinstance(idx, int) or isinstance(idx, bool):
                raise GroupConfigError(f"group {gi}: layer index {idx!r} is not an integer")
            if not 0 <= idx < n_layers:
                raise GroupConfigError(
                    f"group {gi}: layer {idx} is out of range (the model has layers 0..{n_layers - 1})"
                )
            if idx in owner:
                where = "twice in group" if owner[idx] == gi else f"in group {owner[idx]} and in group"
                raise GroupConfigError(f"layer {idx} is {where} {gi}")
            owner[idx] = gi
        if members != list(range(members[0], members[0] + len(members))):
            raise GroupConfigError(f"group {gi} {members} is not a contiguous ascending run of layers")
        result.append(members)
    missing = sorted(set(range(n_layers)) - owner.keys())
    if missing:
        raise GroupConfigError(f"layers {missing} are in no group (the model has {n_layers} layers)")
    for gi in range(1, len(result)):
        if result[gi][0] != result[gi - 1][-1] + 1:
            raise GroupConfigError(
                f"groups are out of order: group {gi} {result[gi]} does not follow group {gi - 1} {result[gi - 1]}"
            )
    return result


def split_sequential(model: nn.Sequential, groups: Sequence[Sequence[int]]) -> list[nn.Sequential]:
    """Cut ``model`` into one ``nn.Sequential`` per group (sharing the layer objects)."""
    layers = list(model)
    checked = validate_groups(groups, len(layers))
    return [nn.Sequential(*(layers[i] for i in group)) for group in checked]


def _describe(index: int, layer: nn.Module) -> str:
    return f"layer {index} ({type(layer).__name__})"


# layers whose output is not a function of their input and weights: a rule that recomputes the forward at
# backward time (async, spectrain) would back-propagate through another function than the one that went forward
_RANDOM_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


# layers that take token ids (int64) rather than features: a text model's first layer
_TOKEN_LAYERS = (nn.Embedding, nn.EmbeddingBag)


def example_input(
    model: nn.Sequential, batch: int, in_shape: Sequence[int], *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``(batch, *in_shape)`` inputs ``model`` can take: token ids for an embedding first layer, else features.

    Without ``generator``: zeros (id 0, the padding id, for tokens); with it: random ids below the
    embedding's size, or standard normal features.
    """
    first = model[0] if len(model) else None
    if isinstance(first, _TOKEN_LAYERS):
        if generator is None:
            return torch.zeros(batch, *in_shape, dtype=torch.long)
        return torch.randint(0, first.num_embeddings, (batch, *in_shape), generator=generator)
    if generator is None:
        return torch.zeros(batch, *in_shape)
    return torch.randn(batch, *in_shape, generator=generator)


def probe_shapes(model: nn.Sequential, in_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """The per-sample output shape of every layer of ``model`` fed a batch of 2 :func:`example_input` zeros.

    Raises :class:`GroupConfigError` naming the first layer that cannot take
    its input (a wrong width, a missing Flatten, ...) or gives no tensor.
    """
    shapes = []
    x = example_input(model, 2, in_shape)
    was_training = model.training
    model.eval()  # normalisation layers: no running statistics touched by the probe
    try:
        with torch.no_grad():
            for i, layer in enumerate(model):
                try:
                    out = layer(x)
                except Exception as exc:  # any failure of a layer on this shape is a bad model or cut
                    raise GroupConfigError(
                        f"{_describe(i, layer)} cannot take activations of shape {tuple(x.shape[1:])}: {exc}"
                    ) from None
                if not isinstance(out, torch.Tensor):
                    raise GroupConfigError(
                        f"{_describe(i, layer)} is not supported in a pipeline: it returns a {type(out).__name__}, "
                        "not one tensor"
                    )
                if out.dim() < 2 or out.shape[0] != 2:
                    raise GroupConfigError(
                        f"{_describe(i, layer)} is not supported in a pipeline: it does not keep the batch "
                        f"dimension (output shape {tuple(out.shape)} for a batch of 2)"
                    )
                shapes.append(tuple(int(d) for d in out.shape[1:]))
                x = out
    finally:
        model.train(was_training)
    return shapes


@dataclass
class StageSpec:
    """What a :class:`~dniasync.train.pipeline.stage.Stage` is spawned with:
    ``spawn(Stage, *spec.args(), **spec.kwargs())``.

    ``first_layer``: the model index of its first layer; ``spare``: every layer
    of the model, which the stage may adopt when the split moves.
    """

    layers: nn.Sequential
    settings: StageSettings
    shape: StageShape
    first_layer: int = 0
    spare: list[nn.Module] | None = None

    def args(self) -> tuple[nn.Sequential, StageSettings, StageShape]:
        return self.layers, self.settings, self.shape

    def kwargs(self) -> dict[str, Any]:
        return {"first_layer": self.first_layer, "spare": self.spare}


def build_stages(
    model: nn.Sequential,
    groups: Sequence[Sequence[int]],
    settings: StageSettings,
    in_features: int | Sequence[int],
    *,
    seed: int = 0,
) -> list[StageSpec]:
    """Cut ``model`` and describe each stage.

    ``in_features``: one sample's input size, or its shape. Every layer is
    probed with that shape, so activations of any shape (convolutional
    stages) are described; the last stage must give ``(batch, classes)``.
    Raises :class:`GroupConfigError` for a bad cut or an unsupported layer,
    naming it, ``ValueError`` for settings the update rule cannot train with
    (or an unknown rule).
    """
    rule = get_rule(settings.rule)
    rule.check(settings)
    checked = validate_groups(groups, len(model))
    in_shape = (in_features,) if isinstance(in_features, int) else tuple(in_features)
    raw = math.prod(in_shape)
    shapes = probe_shapes(model, in_shape)
    if len(shapes[-1]) != 1:
        raise GroupConfigError(
            f"{_describe(len(model) - 1, model[-1])} is the last layer: it must give (batch, classes) logits, "
            f"got per-sample shape {shapes[-1]} (a Flatten and a Linear are missing)"
        )
    if rule.recomputes:
        for i, layer in enumerate(model):
            if isinstance(layer, _RANDOM_LAYERS):
                raise GroupConfigError(
                    f"{_describe(i, layer)} is not supported by the rule {settings.rule!r}: it recomputes a batch's "
                    "forward for its backward, and a random layer would give another function"
                )
    specs = []
    shape_in = in_shape
    layers = list(model)
    for k, group in enumerate(checked):
        shape_out = shapes[group[-1]]
        shape = StageShape(
            math.prod(shape_in), math.prod(shape_out), raw, k == len(checked) - 1, seed + 1000 * k,
            in_shape=shape_in if len(shape_in) > 1 else (), out_shape=shape_out if len(shape_out) > 1 else (),
            index=k, stages=len(checked),
        )
        specs.append(StageSpec(nn.Sequential(*(layers[i] for i in group)), settings, shape, group[0], layers))
        shape_in = shape_out
    return specs
