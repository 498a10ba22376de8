"""Training on the node roles: the coordinator runs the job, PS and worker nodes serve it.

With a job config (``--config job.toml`` holding ``[job]``), the coordinator
node also runs the :class:`~dniasync.cluster.coordinator.TrainingCoordinator`;
every ``ps`` node runs a PS host that asks it for a shard to serve, and every
``worker`` node runs a replica that asks it for data. Without a job they
find no trainer and stay plain cluster members.
"""

from __future__ import annotations

import logging
import tomllib

import torch

from ..cluster.config import load_config
from ..cluster.coordinator import COORDINATOR_NAME, PSHost, TrainingCoordinator
from ..train.replica import Replica
from ._roles import NodeContext, register_role, start_coordinator, start_member

__all__ = ["job_config_path", "start_training_coordinator", "start_training_ps", "start_training_worker"]

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


async def start_training_coordinator(context: NodeContext) -> None:
    await start_coordinator(context)
    path = job_config_path(context.options.get("config"))
    if path is None:
        return
    torch.set_num_threads(1)
    config = load_config(path)
    await context.system.spawn(TrainingCoordinator, config, name=COORDINATOR_NAME)
    log.info("running job %s (%s) from %s", config.job.name, config.mode, path)


async def start_training_ps(context: NodeContext) -> None:
    await start_member(context)
    await context.system.spawn(PSHost, _trainer(context), name="ps-host")


async def start_training_worker(context: NodeContext) -> None:
    await start_member(context)
    torch.set_num_threads(1)
    await context.system.spawn(Replica, _trainer(context), name=f"replica-{_slug(context.transport.address)}")


register_role("coordinator", start_training_coordinator)
register_role("ps", start_training_ps, needs_join=True)
register_role("worker", start_training_worker, needs_join=True)
