"""Cutting an ``nn.Sequential`` into pipeline stages: contiguous groups of layers, checked.

:func:`validate_groups` names the first problem of a cut; :func:`build_stages`
describes each stage (its layers, widths, seed) as a :class:`StageSpec`, what
a :class:`~dniasync.train.pipeline.stage.Stage` is spawned with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .rules import get_rule
from .settings import StageSettings, StageShape

__all__ = ["GroupConfigError", "StageSpec", "build_stages", "split_sequential", "validate_groups"]


class GroupConfigError(ValueError):
    """A cut of a model into layer groups is invalid; the message names the problem."""


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
        raise GroupConfigError("no layer groups given")
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


def _output_features(module: nn.Module, in_features: int) -> int:
    with torch.no_grad():
        out = module(torch.zeros(1, in_features))
    if out.dim() != 2:
        raise GroupConfigError(f"a layer group must output (batch, features), got shape {tuple(out.shape)}")
    return int(out.shape[1])


@dataclass
class StageSpec:
    """What a :class:`~dniasync.train.pipeline.stage.Stage` is spawned with: ``spawn(Stage, *spec.args())``."""

    layers: nn.Sequential
    settings: StageSettings
    shape: StageShape

    def args(self) -> tuple[nn.Sequential, StageSettings, StageShape]:
        return self.layers, self.settings, self.shape


def build_stages(
    model: nn.Sequential,
    groups: Sequence[Sequence[int]],
    settings: StageSettings,
    in_features: int,
    *,
    seed: int = 0,
) -> list[StageSpec]:
    """Cut ``model`` and describe each stage.

    Raises :class:`GroupConfigError` for a bad cut, ``ValueError`` for settings
    the update rule cannot train with (or an unknown rule).
    """
    get_rule(settings.rule).check(settings)
    parts = split_sequential(model, groups)
    specs = []
    features = in_features
    for k, part in enumerate(parts):
        out = _output_features(part, features)
        shape = StageShape(features, out, in_features, k == len(parts) - 1, seed + 1000 * k)
        specs.append(StageSpec(part, settings, shape))
        features = out
    return specs
