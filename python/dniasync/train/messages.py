"""Wire messages of the PS shards and of data-parallel replicas (Downpour, Hogwild).

Plain fields and numpy arrays only: they travel through the remote codec
as a msgpack header plus raw tensor bytes, never pickled. Cursors travel as
``[shard, epoch, position]`` triples of ints.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..actors import message

__all__ = ["CoordinatorEpoch", "Fence", "Params", "ParamsDelta", "Progress", "Pull", "PullDelta", "Push", "Reshard",
           "ShardSnapshot", "ShardStats", "Shards", "SnapshotShard", "StopTraining", "fenced"]


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


@message("dniasync.train.PullDelta")
@dataclass(frozen=True)
class PullDelta:
    """Ask a PS shard for what changed since its last answer to this replica (a :class:`ParamsDelta`).

    ``stream`` and ``seq`` echo that answer (0 and 0 before the first): if they are not the
    shard's last answer to this replica's ``incarnation`` (a restart of either side, a lost
    reply), the replica does not hold what the shard thinks it holds, and the answer is dense.
    ``digest``, sent before the first answer: :func:`~dniasync.train.compression.values_digest`
    of the replica's copy of the shard's range. Where it is the digest of the values the shard
    started from (every process builds the same seeded model), the first answer is a delta
    from those instead of a dense copy.
    """

    replica: str
    incarnation: int
    stream: int
    seq: int
    digest: str = ""


@message("dniasync.train.ParamsDelta")
@dataclass(frozen=True)
class ParamsDelta:
    """A PS shard's parameters as of ``version``: dense, or a quantized delta to add to the previous answer's.

    ``dense``: ``parts`` is ``[values]`` (float32). Otherwise ``parts`` are the payloads of
    codec ``codec`` (the link's, or ``int8`` where a threshold delta would be larger) whose
    decode (:meth:`~dniasync.train.compression.DeltaCodec.decode`) the replica adds to its copy.
    ``stream`` (the shard's incarnation) and ``seq`` name this answer for the next :class:`PullDelta`. ``tau``: the threshold the shard coded this delta
    with (``threshold`` only; the shard chooses it per answer, the replica decodes with it).
    """

    shard: int
    version: int
    stream: int
    seq: int
    dense: bool
    codec: str
    parts: list[np.ndarray]
    tau: float = 0.0


@message("dniasync.train.Push")
@dataclass(frozen=True)
class Push:
    """An accumulated gradient for one PS shard, maybe quantized, maybe sparse.

    ``(replica, incarnation, seq)`` makes it idempotent; ``version`` is the
    shard version the gradient was computed on (for staleness). With ``spans``
    (a sparse push, :mod:`dniasync.train.sparse`: ``[k, 2]`` uint32
    ``(start, length)`` in the shard's slice, ascending and disjoint) ``codec``
    is ``"none"`` and ``payload`` holds the float32 values of the spans, one
    after the other; the gradient is zero elsewhere. The shard applies it with
    its lr times ``lr_scale`` (the mean of the trainer's per-step scales, e.g.
    the DNI gate; 1 by default), finite and >= 0.
    """

    replica: str
    incarnation: int
    seq: int
    version: int
    codec: str
    payload: np.ndarray
    samples: int
    spans: np.ndarray | None = None
    lr_scale: float = 1.0


@message("dniasync.train.Fence")
@dataclass(frozen=True)
class Fence:
    """Refuse every further push from this replica id (declared dead)."""

    replica: str
    epoch: int = 0
    """The coordinator epoch that sent it: one below the highest a receiver has seen is refused."""


@message("dniasync.train.SnapshotShard")
@dataclass(frozen=True)
class SnapshotShard:
    """Ask a PS shard for everything it needs to continue after a restart (a :class:`ShardSnapshot`)."""


@message("dniasync.train.ShardSnapshot")
@dataclass(frozen=True)
class ShardSnapshot:
    """A PS shard's parameters, optimizer state, version, push ledger and fenced replicas, taken at once."""

    shard: int
    values: np.ndarray
    version: int
    state: list[np.ndarray]
    ledger: dict[str, list[int]]
    fenced: list[str]
    steps: int
    """Optimizer steps its state holds (Adam's bias-correction count): a shard continuing from the snapshot
    continues the count, so its next step is the one this shard would have taken."""


@message("dniasync.train.Reshard")
@dataclass(frozen=True)
class Reshard:
    """Ask a PS shard to hold another slice of the model from now on (its layers moved between stages).

    ``values`` and ``state`` (the optimizer's slots) replace what it holds;
    it continues at ``version`` (never lower than any version it served) and
    with ``steps`` optimizer steps counted, keeps its push ledger and fenced
    replicas, and answers every replica's next pull densely. Answered with its
    stats.
    """

    values: np.ndarray
    state: list[np.ndarray]
    version: int
    steps: int


@message("dniasync.train.ShardStats")
@dataclass(frozen=True)
class ShardStats:
    """Ask a PS shard for its counters (a dict of plain numbers)."""


@message("dniasync.train.Shards")
@dataclass(frozen=True)
class Shards:
    """The data shards a replica now owns, each with the cursor to resume from."""

    cursors: list[list[int]]
    epoch: int = 0
    """The coordinator epoch that sent it (see :class:`CoordinatorEpoch`)."""


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
    dense_bytes_pushed: int
    """What the pushed gradients would take as dense float32: the compression claim is checked against it."""
    ps_versions: list[int]
    """The version of each PS shard it pulled last (a restarted shard continues above them)."""
    batch_size: int = 0
    """The size of its next mini-batch (a ``[schedule]`` grows it)."""


@message("dniasync.train.StopTraining")
@dataclass(frozen=True)
class StopTraining:
    reason: str
    epoch: int = 0
    """The coordinator epoch that sent it (see :class:`CoordinatorEpoch`)."""


@message("dniasync.train.CoordinatorEpoch")
@dataclass(frozen=True)
class CoordinatorEpoch:
    """A standby coordinator took the job over: report to ``runner`` from now on, and refuse every order
    (:class:`StopTraining`, :class:`Shards`, :class:`Fence`) that carries an epoch below ``epoch``: it comes
    from a coordinator that was taken for dead and woke up (fencing)."""

    epoch: int
    runner: str
    """The new job runner's address (``trainer@host:port``)."""


def fenced(epoch: int, known: int) -> bool:
    """An order from coordinator epoch ``epoch`` where ``known`` is the highest seen: refused if below it."""
    return epoch < known
