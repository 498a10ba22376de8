"""One-process helpers: the sequential backprop reference, and a whole pipeline in one ActorSystem.

:func:`train_backprop` is the reference the pipelines are measured against
(same batch order for the same seed); :func:`run_pipeline` cuts a model,
spawns its stages with :func:`spawn_stages` and drives them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ...actors import ActorRef, ActorSystem, Directive
from ..sync import make_optimizer, set_lr
from .cut import build_stages
from .driver import EvalPoint, PipelineDriver, TrainResult
from .schedule import LrDecay, Schedule, batch_order
from .settings import StageSettings
from .stage import Stage

__all__ = ["evaluate_model", "run_pipeline", "spawn_stages", "train_backprop"]


async def spawn_stages(
    system: ActorSystem,
    model: nn.Sequential,
    groups: Sequence[Sequence[int]],
    settings: StageSettings,
    in_features: int,
    *,
    seed: int = 0,
    mailbox_size: int = 64,
    prefix: str = "stage",
) -> list[ActorRef]:
    """Cut ``model`` and spawn one :class:`Stage` per group of layers, named ``{prefix}-{k}``.

    Stages are not restarted on failure (a fresh instance would have lost its
    wiring and optimizer state): they stop, and the driver reports it.
    """
    specs = build_stages(model, groups, settings, in_features, seed=seed)
    return [
        await system.spawn(Stage, *spec.args(), **spec.kwargs(), name=f"{prefix}-{k}", mailbox_size=mailbox_size,
                           supervision=Directive.STOP)
        for k, spec in enumerate(specs)
    ]


async def run_pipeline(
    model: nn.Sequential,
    groups: Sequence[Sequence[int]],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    settings: StageSettings,
    epochs: int,
    batch_size: int,
    seed: int = 0,
    max_in_flight: int = 8,
    micro_batches: int = 1,
    eval_x: torch.Tensor | None = None,
    eval_y: torch.Tensor | None = None,
    evals_per_epoch: int = 1,
    method: str | None = None,
    lr_decay: LrDecay | None = None,
) -> TrainResult:
    """Train ``model`` as a pipeline of stages in one in-process :class:`ActorSystem`.

    The schedule is the rule's (:meth:`Schedule.for_rule`): ``micro_batches``
    applies to a flushing rule only. ``lr_decay``: every stage's lr over the
    run (:class:`LrDecay`).
    """
    schedule = Schedule.for_rule(settings.rule, max_in_flight=max_in_flight, micro_batches=micro_batches)
    settings = replace(settings, max_in_flight=max_in_flight)  # SpecTrain's prior version gap
    async with ActorSystem() as system:
        refs = await spawn_stages(
            system, model, groups, settings, int(x.shape[1]), seed=seed, mailbox_size=schedule.stage_mailbox_size()
        )
        async with PipelineDriver(system, refs, schedule, synthetic_inputs=settings.synthetic_inputs) as driver:
            return await driver.train(
                x,
                y,
                epochs=epochs,
                batch_size=batch_size,
                seed=seed,
                eval_x=eval_x,
                eval_y=eval_y,
                evals_per_epoch=evals_per_epoch,
                method=method or settings.rule,
                lr_decay=lr_decay,
            )


def evaluate_model(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of a whole model, in eval mode."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(x)
    finally:
        model.train(was_training)
    labels = y.long()
    return float((logits.argmax(dim=1) == labels).float().mean()), float(F.cross_entropy(logits, labels))


def train_backprop(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    seed: int = 0,
    lr: float = 1e-3,
    optimizer: str = "adam",
    momentum: float = 0.0,
    eval_x: torch.Tensor | None = None,
    eval_y: torch.Tensor | None = None,
    evals_per_epoch: int = 1,
    lr_decay: LrDecay | None = None,
) -> TrainResult:
    """Sequential backprop in this thread: the reference the pipelines are measured against.

    Same batch order as :class:`PipelineDriver` for the same ``seed``; ``lr_decay`` as :func:`run_pipeline`'s.
    """
    params = list(model.parameters())
    opt = make_optimizer(params, optimizer, lr, momentum=momentum)
    n = int(x.shape[0])
    eval_every = max(1, math.ceil(n / batch_size) // max(1, evals_per_epoch))
    history: list[EvalPoint] = []
    wall, samples, loss_sum, loss_count = 0.0, 0, 0.0, 0
    started = time.perf_counter()
    for step, (_, idx) in enumerate(batch_order(n, batch_size, epochs, seed)):
        if lr_decay is not None:
            set_lr(opt, lr * lr_decay.scale(samples / (n * epochs)))
        loss = F.cross_entropy(model(x[idx]), y[idx].long())
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        samples += int(idx.shape[0])
        loss_sum += float(loss.detach())
        loss_count += 1
        if eval_x is not None and eval_y is not None and (step + 1) % eval_every == 0:
            wall += time.perf_counter() - started
            accuracy, eval_loss = evaluate_model(model, eval_x, eval_y)
            history.append(EvalPoint(wall, samples, samples / n, accuracy, eval_loss, loss_sum / loss_count))
            loss_sum, loss_count = 0.0, 0
            started = time.perf_counter()
    wall += time.perf_counter() - started
    if eval_x is not None and eval_y is not None and (not history or history[-1].samples != samples):
        accuracy, eval_loss = evaluate_model(model, eval_x, eval_y)
        history.append(
            EvalPoint(wall, samples, samples / n, accuracy, eval_loss, loss_sum / loss_count if loss_count else float("nan"))
        )
    return TrainResult("backprop", history, samples, wall)
