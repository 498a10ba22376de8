"""Training on the node roles: the coordinator runs the job, PS and worker nodes serve it.

With a job config (``--config job.toml`` holding ``[job]``), the coordinator
node also runs the :class:`~dniasync.cluster.job.JobRunner`; every ``ps`` and
``worker`` node runs a :class:`~dniasync.cluster.hosts.Host` that asks it for
work and hosts what the job's mode assigns (a PS shard, a replica, stages).
Without a job they find no trainer and stay plain cluster members.
"""

from __future__ import annotations

import logging
import tomllib
from typing import TYPE_CHECKING

from ..cluster.chains import SPARE_HOST, SPARE_POLL_S
from ..cluster.config import Config, load_config
from ..cluster.hosts import Host
from ..cluster.modes._data_parallel import WORKER_HOST
from ..cluster.protocol import COORDINATOR_NAME
from ._membership import MEMBERSHIP
from ._roles import NodeContext, register_role, start_coordinator, start_member

if TYPE_CHECKING:
    from ..train.checkpoint import LoadedCheckpoint

# torch and the training actors are imported only by nodes that train: a plain
# cluster member starts in a fraction of a second without them.

__all__ = ["job_config_path", "start_training_coordinator", "start_training_ps", "start_training_standby",
           "start_training_worker"]

log = logging.getLogger("dniasync.node")


def job_config_path(path: str | None) -> str | None:
    """``path`` if it is a training job config (has a ``[job]`` table)."""
    if not path:
        return None
    with open(path, "rb") as fh:
        return path if "job" in tomllib.load(fh) else None


def _trainer(context: NodeContext) -> str:
    assert context.join is not None
    return f"{COORDINATOR_NAME}@{context.join}"


def _slug(address: str) -> str:
    return address.replace(":", "-")


class ResumeError(RuntimeError):
    """``--resume`` cannot continue this job: no checkpoint, or one of another job or config."""


def _last_checkpoint(config: Config) -> LoadedCheckpoint:
    from ..cluster.durable import checkpoint_store
    from ..train.checkpoint import CheckpointError

    store = checkpoint_store(config)
    try:
        loaded = store.latest()
    except CheckpointError as exc:
        raise ResumeError(f"cannot resume job {config.job.name}: {exc}") from None
    if loaded is None:
        raise ResumeError(f"cannot resume job {config.job.name}: no checkpoint in {store.root}")
    return loaded


async def start_training_coordinator(context: NodeContext) -> None:
    await start_coordinator(context)
    path = job_config_path(context.options.get("config"))
    if path is None:
        return
    import torch

    from ..cluster.job import JobRunner

    torch.set_num_threads(1)
    config = load_config(path)
    loaded = _last_checkpoint(config) if context.options.get("resume") else None
    await context.system.spawn(JobRunner, config, resume_from=loaded, name=COORDINATOR_NAME,
                               liveness_s=context.options["settings"].detect_s)
    log.info("running job %s (%s) from %s", config.job.name, config.mode, path)


async def start_training_standby(context: NodeContext) -> None:
    """A standby coordinator: follows the job's runner at ``--join`` and takes the job over if it dies."""
    from ..cluster.standby import STANDBY_NAME, Standby

    path = job_config_path(context.options.get("config"))
    if path is None or context.join is None:
        raise ResumeError("a standby coordinator needs the job's config (--config JOB.toml) and the coordinator "
                          "to follow (--join HOST:PORT)")
    import torch

    torch.set_num_threads(1)
    await start_coordinator(context)  # the cluster's members join its table once it takes over
    config = load_config(path)
    await context.system.spawn(Standby, config, context.join, detect_s=context.options["settings"].detect_s,
                               also_tell=(MEMBERSHIP,), name=STANDBY_NAME)
    log.info("standby coordinator for job %s, following %s", config.job.name, context.join)


async def start_training_ps(context: NodeContext) -> None:
    await start_member(context)
    await context.system.spawn(Host, _trainer(context), "ps", name="ps-host")


async def start_training_spare(context: NodeContext) -> None:
    """A spare PS node: it waits until a copy of a replicated PS shard dies, then takes its place."""
    await start_member(context)
    await context.system.spawn(Host, _trainer(context), "ps", max_retry_s=SPARE_POLL_S, name=SPARE_HOST)


async def start_training_worker(context: NodeContext) -> None:
    await start_member(context)
    await context.system.spawn(Host, _trainer(context), "worker", name=WORKER_HOST)


register_role("coordinator", start_training_coordinator)
register_role("standby", start_training_standby, needs_join=True)
register_role("ps", start_training_ps, needs_join=True)
register_role("worker", start_training_worker, needs_join=True)
register_role("spare", start_training_spare, needs_join=True)
