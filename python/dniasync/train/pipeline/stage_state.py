"""A stage's whole training state as named tensors: what a checkpoint keeps of it and a restart loads back.

:class:`HoldStage` has a drained :class:`~dniasync.train.pipeline.stage.Stage`
copy, and keep in place, its layers' state dict (buffers only when PS shards
hold the parameters: they checkpoint them, and a stage pulls them before its
next batch), its local optimizer's state (Adam moments and step, SGD
momentum; none when PS shards hold it), and its rule's SG model and
synthetic-input model with their optimizers' state. The stage answers with a
few bytes (:class:`Held`), so its pipeline goes on at once;
:class:`FetchHeld` brings the copy over afterwards, while the stage trains.
:class:`RestoreStage` loads such a state into a stage of the same layers:
the layers and models take the saved values, the rule starts afresh around
them (no batch kept, no micro-batch counted), so the stage is as it was when
the state was taken with its pipeline drained. Names: ``layers.<key>``, ``opt.<param>.<key>``,
``sg.<key>``, ``sg_opt.<param>.<key>``, ``input.<key>``, ``input_opt.<param>.<key>``,
and what else steers the updates: the SG model's running agreement with the
true gradients (``sg_agreement``, which scales DNI's synthetic steps) and
SpecTrain's measured version gaps (``version_gaps``).
Plain tensors only: the remote codec and the checkpoint files carry them as raw bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...actors import message
from ..sync import load_optimizer_tensors, optimizer_tensors

if TYPE_CHECKING:
    from .stage import Stage

__all__ = ["FetchHeld", "Held", "HoldStage", "RestoreStage", "StageCheckpoint", "load_stage", "save_stage"]


@message("dniasync.dni.StageCheckpoint")
@dataclass(frozen=True)
class StageCheckpoint:
    """A stage's state: ``names[i]`` names ``tensors[i]``; its layers are model layers ``first_layer`` on."""

    first_layer: int
    n_layers: int
    names: list[str]
    tensors: list[torch.Tensor]


@message("dniasync.dni.HoldStage")
@dataclass(frozen=True)
class HoldStage:
    """Ask a drained stage to copy its whole state and keep it as capture ``capture`` (answered with :class:`Held`;
    a later hold replaces it)."""

    capture: int


@message("dniasync.dni.Held")
@dataclass(frozen=True)
class Held:
    """The stage keeps capture ``capture``: ``nbytes`` of tensors."""

    capture: int
    nbytes: int


@message("dniasync.dni.FetchHeld")
@dataclass(frozen=True)
class FetchHeld:
    """Ask for the state the stage keeps as capture ``capture`` (answered with :class:`StageCheckpoint`; an error
    if it keeps another one or none, e.g. after a restart). The stage lets go of its copy once it is sent."""

    capture: int


@message("dniasync.dni.RestoreStage")
@dataclass(frozen=True)
class RestoreStage:
    """Load a :class:`StageCheckpoint`'s tensors into the stage (answered with True)."""

    first_layer: int
    names: list[str]
    tensors: list[torch.Tensor]


def _optimizer_tensors(prefix: str, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{k}": v for k, v in optimizer_tensors(optimizer).items()}


def _load_optimizer(prefix: str, optimizer: torch.optim.Optimizer, saved: dict[str, torch.Tensor]) -> None:
    load_optimizer_tensors(optimizer, _strip(prefix, saved))


def _with_prefix(prefix: str, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{k}": v.detach().clone() for k, v in module.state_dict().items()}


def _strip(prefix: str, saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len(prefix) + 1:]: v for k, v in saved.items() if k.startswith(prefix + ".")}


def save_stage(stage: Stage) -> StageCheckpoint:
    """Everything ``stage`` has learned, as named tensors (call with its pipeline drained)."""
    out = _with_prefix("layers", stage.layers)
    if stage.params.pulls_params:  # e.g. its PS shards hold (and checkpoint) the parameters: buffers only
        for name, _ in stage.layers.named_parameters():
            del out[f"layers.{name}"]
    out.update({f"opt.{k}": v for k, v in stage.params.state_dict().items()})
    for prefix, model in (("sg", stage.rule.sg), ("input", stage.rule.input_model)):
        if model is not None:
            out.update(_with_prefix(prefix, model))
            out.update(_optimizer_tensors(f"{prefix}_opt", model.optimizer))
    out.update(stage.rule.state_tensors())
    return StageCheckpoint(stage.first_layer, len(stage.layers), list(out), list(out.values()))


def load_stage(stage: Stage, first_layer: int, names: list[str], tensors: list[torch.Tensor]) -> None:
    """Put a :func:`save_stage` state back into ``stage`` (same layers); its rule starts afresh around it."""
    from .rules import make_rule

    if first_layer != stage.first_layer:
        raise ValueError(f"{stage.ref.address}: the saved state is of layers from {first_layer}, "
                         f"the stage holds layers from {stage.first_layer}")
    saved = dict(zip(names, tensors, strict=True))
    layers = _strip("layers", saved)
    with torch.no_grad():
        if stage.params.pulls_params:  # buffers only: the parameters come from the shards' next pull
            missing, unexpected = stage.layers.load_state_dict(layers, strict=False)
            params = {name for name, _ in stage.layers.named_parameters()}
            if unexpected or set(missing) - params:
                raise ValueError(f"{stage.ref.address}: the saved state does not fit its layers "
                                 f"(missing {sorted(set(missing) - params)}, unexpected {sorted(unexpected)})")
        else:
            stage.layers.load_state_dict(layers)
    stage.params.load_state_dict(_strip("opt", saved))
    stage.rule = make_rule(stage.settings, stage.shape)
    stage.rule.connect(stage.upstream is not None)
    stage.sg = stage.rule.sg
    for prefix, model in (("sg", stage.rule.sg), ("input", stage.rule.input_model)):
        if model is not None and any(k.startswith(prefix + ".") for k in saved):
            with torch.no_grad():
                model.load_state_dict(_strip(prefix, saved))
            _load_optimizer(f"{prefix}_opt", model.optimizer, saved)
    stage.rule.load_state_tensors(saved)
    stage._sg_seen = stage._input_seen = 0  # positions in the old models' loss records
    stage._kept.clear()
    stage._parts_done.clear()
