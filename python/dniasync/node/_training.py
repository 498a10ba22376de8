"""Training on the node roles: the coordinator runs the job, PS and worker nodes serve it.

With a job config (``--config job.toml`` holding ``[job]``), the coordinator
node also runs the :class:`~dniasync.cluster.coordinator.TrainingCoordinator`;
every ``ps`` node runs a PS host that asks it for a shard to serve, and every
``worker`` node asks it once what the job is, then runs a replica that asks
it for data (Downpour, Hogwild) or a group host that asks it which layer
groups to host (DNI). Without a job they find no trainer and stay plain
cluster members.
"""

from __future__ import annotations

import asyncio
import logging
import tomllib
from dataclasses import dataclass

from ..actors import Actor, ActorError, ActorNotFound, handler, message
from ..cluster.config import load_config
from ..train.messages import COORDINATOR_NAME, JobStatus, JobStatusReply
from ._roles import NodeContext, register_role, start_coordinator, start_member

# torch and the training actors are imported only by nodes that train: a plain
# cluster member starts in a fraction of a second without them.

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
    import torch

    from ..cluster.coordinator import TrainingCoordinator
    from ..cluster.dni_job import DNIJob

    torch.set_num_threads(1)
    config = load_config(path)
    job = DNIJob if config.mode == "dni" else TrainingCoordinator
    await context.system.spawn(job, config, name=COORDINATOR_NAME)
    log.info("running job %s (%s) from %s", config.job.name, config.mode, path)


async def start_training_ps(context: NodeContext) -> None:
    from ..cluster.coordinator import PSHost

    await start_member(context)
    await context.system.spawn(PSHost, _trainer(context), name="ps-host")


@message("dniasync.node.WorkerBegin")
@dataclass(frozen=True)
class _Begin:
    pass


class WorkerHost(Actor):
    """Asks the coordinator's trainer once which kind of job runs, then starts this worker's part of it.

    A DNI job gets a :class:`GroupHost` (layer groups); any other job a
    :class:`Replica` named ``replica-<host>-<port>``.
    """

    def __init__(self, trainer: str, retry_s: float = 0.5) -> None:
        self.trainer = trainer
        self.retry_s = retry_s
        self.started = False

    async def on_start(self) -> None:
        self.ref.tell_nowait(_Begin())

    def _poke(self) -> None:
        try:
            self.ref.tell_nowait(_Begin())
        except ActorError:
            pass

    @handler
    async def begin(self, msg: _Begin) -> None:
        if self.started:
            return
        try:
            status = await self.system.ref(self.trainer).ask(JobStatus(), timeout=10.0)
        except ActorError as exc:
            if isinstance(exc, ActorNotFound):
                log.info("worker: the coordinator runs no training job; idle")
                return
            log.info("worker: coordinator not reachable yet (%s); retrying", exc)
            asyncio.get_running_loop().call_later(self.retry_s, self._poke)
            return
        assert isinstance(status, JobStatusReply)
        self.started = True
        import torch

        from ..cluster.dni_job import GroupHost
        from ..train.replica import Replica

        torch.set_num_threads(1)
        if status.mode == "dni":
            await self.system.spawn(GroupHost, self.trainer, name="group-host")
        else:
            await self.system.spawn(Replica, self.trainer, name=f"replica-{_slug(self.system.node)}")


async def start_training_worker(context: NodeContext) -> None:
    await start_member(context)
    await context.system.spawn(WorkerHost, _trainer(context), name="worker-host")


register_role("coordinator", start_training_coordinator)
register_role("ps", start_training_ps, needs_join=True)
register_role("worker", start_training_worker, needs_join=True)
