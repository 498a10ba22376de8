"""Wire messages of data-parallel training (Downpour, Hogwild).

Plain fields and numpy arrays only: they travel through the remote codec
as a msgpack header plus raw tensor bytes, never pickled. Cursors travel as
``[shard, epoch, position]`` triples of ints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..actors import ActorRef, message

COORDINATOR_NAME = "trainer"
"""Name of the training coordinator actor (Downpour, Hogwild or DNI job) on the coordinator node."""

__all__ = [
    "COORDINATOR_NAME",
    "Assignment",
    "Fence",
    "JobStatus",
    "JobStatusReply",
    "NoJob",
    "PSAssignment",
    "PSJoin",
    "PSReady",
    "Params",
    "Progress",
    "Pull",
    "Push",
    "RegisterReplica",
    "ShardStats",
    "Shards",
    "StopTraining",
]


@message("dniasync.train.Pull")
@dataclass(frozen=True)
class Pull:
    """Ask a PS shard for its parameters."""


@message("dniasync.train.Params")
@dataclass(frozen=True)
class Params:
    """A PS shard's parameters and the version they are at."""

    shard: int
    version: int
    values: np.ndarray


@message("dniasync.train.Push")
@dataclass(frozen=True)
class Push:
    """An accumulated gradient for one PS shard, maybe quantized.

    ``(replica, incarnation, seq)`` makes it idempotent; ``version`` is the
    shard version the gradient was computed on (for staleness).
    """

    replica: str
    incarnation: int
    seq: int
    version: int
    codec: str
    payload: np.ndarray
    samples: int


@message("dniasync.train.Fence")
@dataclass(frozen=True)
class Fence:
    """Refuse every further push from this replica id (declared dead)."""

    replica: str


@message("dniasync.train.ShardStats")
@dataclass(frozen=True)
class ShardStats:
    """Ask a PS shard for its counters (a dict of plain numbers)."""


@message("dniasync.train.PSJoin")
@dataclass(frozen=True)
class PSJoin:
    """A PS node asks the coordinator which shard to host."""

    node: str


@message("dniasync.train.PSAssignment")
@dataclass(frozen=True)
class PSAssignment:
    shard: int
    offset: int
    values: np.ndarray
    job: str
    """The job config as JSON (``Config.to_dict()``)."""


@message("dniasync.train.PSReady")
@dataclass(frozen=True)
class PSReady:
    shard: int
    ref: ActorRef


@message("dniasync.train.NoJob")
@dataclass(frozen=True)
class NoJob:
    """No work for you (yet): ``retry`` says whether asking again later may help."""

    reason: str
    retry: bool


@message("dniasync.train.RegisterReplica")
@dataclass(frozen=True)
class RegisterReplica:
    replica: str
    incarnation: int
    ref: ActorRef


@message("dniasync.train.Assignment")
@dataclass(frozen=True)
class Assignment:
    """What a replica (or Hogwild worker) trains on and with whom it talks."""

    job: str
    cursors: list[list[int]]
    ps: list[ActorRef]
    ps_offsets: list[int]
    shm_name: str


@message("dniasync.train.Shards")
@dataclass(frozen=True)
class Shards:
    """The data shards a replica now owns, each with the cursor to resume from."""

    cursors: list[list[int]]


@message("dniasync.train.Progress")
@dataclass(frozen=True)
class Progress:
    """A replica's cumulative counters; also its liveness signal."""

    replica: str
    incarnation: int
    samples: int
    steps: int
    loss: float
    cursors: list[list[int]]
    bytes_pushed: int
    bytes_pulled: int
    pushes: int


@message("dniasync.train.StopTraining")
@dataclass(frozen=True)
class StopTraining:
    reason: str


@message("dniasync.train.JobStatus")
@dataclass(frozen=True)
class JobStatus:
    """Ask the coordinator how the job is going."""


@message("dniasync.train.JobStatusReply")
@dataclass(frozen=True)
class JobStatusReply:
    job: str
    mode: str
    state: str
    """``waiting`` (for PS shards / replicas), ``training``, ``finished``."""
    wall_s: float
    samples: int
    epochs: float
    max_epochs: int
    accuracy: float | None
    loss: float | None
    samples_per_s: float
    replicas: dict[str, str]
    """replica -> ``alive`` / ``dead`` / ``fenced``."""
    summary: str
    """Path of the summary JSON once finished."""
    extra: dict[str, Any] = field(default_factory=dict)
