"""Compiling a job config into the typed specs its workers receive (once, on the coordinator)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..train.schedules import ScheduleSpec
from ..train.specs import CodecSpec, DataSpec, ModelSpec, OptimizerSpec

if TYPE_CHECKING:
    from .config import Config

__all__ = ["codec_spec", "data_spec", "model_spec", "optimizer_spec", "schedule_spec"]


def model_spec(config: Config) -> ModelSpec:
    return ModelSpec(config.model.factory, dict(config.model.kwargs), config.job.seed)


def data_spec(config: Config) -> DataSpec:
    d = config.data
    return DataSpec(d.dataset, d.reader_kwargs(), d.n_train, d.n_test, config.job.seed, d.batch_size,
                    config.n_data_shards, schedule_spec(config), d.order, d.block_rows, d.shuffle_window)


def schedule_spec(config: Config) -> ScheduleSpec | None:
    """``[schedule]`` for the workers (None when the batch size is fixed)."""
    s = config.schedule
    if s.kind == "fixed":
        return None
    return ScheduleSpec(s.kind, s.start or config.data.batch_size, s.end, s.every_epochs, s.factor,
                        theta=s.theta, chunks=s.chunks, test_every=s.test_every)


def optimizer_spec(config: Config) -> OptimizerSpec:
    o = config.optimizer
    return OptimizerSpec(o.name, o.lr, o.momentum, o.betas, o.epsilon, o.weight_decay, o.clip_norm)


def codec_spec(name: str, tau: float | None, block: int, delta_tau: float | None = None,
               resync_every: int = 100) -> CodecSpec:
    """``delta_tau`` None: pulled deltas take a threshold from the parameters' scale (see :class:`CodecSpec`)."""
    return CodecSpec(name, tau if tau is not None else 1e-3, block, delta_tau, resync_every)
