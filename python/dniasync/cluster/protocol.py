"""Job-control messages: how worker hosts join a job and how anyone asks how it goes.

Every worker-side host (a PS node's or a worker node's) speaks the same three
steps with the job runner (named :data:`COORDINATOR_NAME` on the coordinator
node): :class:`JoinJob` until it gets an :class:`Assignment` (or a final
:class:`NoJob`), spawn what the assignment's spec says, then :class:`Ready`
with the refs of what it spawned. :class:`JobStatus` is answered by the runner
for the launcher's progress bar, the live page and the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..actors import ActorRef, message

__all__ = [
    "COORDINATOR_NAME",
    "Assignment",
    "FollowJob",
    "JobStatus",
    "JobState",
    "JobStatusReply",
    "JoinJob",
    "NoJob",
    "Ready",
]

COORDINATOR_NAME = "trainer"
"""Name of the job runner actor on the coordinator node."""


@message("dniasync.job.JoinJob")
@dataclass(frozen=True)
class JoinJob:
    """A host asks for work. ``role``: ``ps`` or ``worker``; ``member`` names the host (its actor address).

    A host that restarted joins with a new ``incarnation``: what its former
    incarnation held is then declared dead.
    """

    member: str
    role: str
    incarnation: int


@message("dniasync.job.Assignment")
@dataclass(frozen=True)
class Assignment:
    """What to host: ``spec`` is a registered spec message of the mode (a PS shard, a replica, stages)."""

    spec: Any


@message("dniasync.job.NoJob")
@dataclass(frozen=True)
class NoJob:
    """No work for you (yet): ``retry`` says whether asking again later may help."""

    reason: str
    retry: bool


@message("dniasync.job.Ready")
@dataclass(frozen=True)
class Ready:
    """Ask (answered with True): the host runs what it was assigned; ``refs`` are the actors it spawned.

    Idempotent, so a host repeats it until it is answered.
    """

    member: str
    incarnation: int
    refs: list[ActorRef]


@message("dniasync.job.JobStatus")
@dataclass(frozen=True)
class JobStatus:
    """Ask the job runner how the job is going."""


@message("dniasync.job.JobStatusReply")
@dataclass(frozen=True)
class JobStatusReply:
    job: str
    mode: str
    state: str
    """``waiting`` (for PS shards / workers), ``training``, ``finished``, ``failed``."""
    wall_s: float
    samples: int
    epochs: float
    max_epochs: int
    accuracy: float | None
    loss: float | None
    samples_per_s: float
    replicas: dict[str, str]
    """worker (replica, stage) -> ``alive`` / ``dead``."""
    summary: str
    """Path of the summary JSON once finished."""
    extra: dict[str, Any] = field(default_factory=dict)


@message("dniasync.job.FollowJob")
@dataclass(frozen=True)
class FollowJob:
    """Ask (a standby coordinator, twice a second): the job's state, to take it over if the runner dies."""


@message("dniasync.job.JobState")
@dataclass(frozen=True)
class JobState:
    """What a standby needs to go on with the job: ``document`` is JSON (report, clock, samples, the PS
    shards' and the mode's members with their refs' addresses); plain data, no pickle."""

    epoch: int
    state: str
    document: str
