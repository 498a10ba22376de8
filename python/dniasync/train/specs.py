"""Typed specs of what a worker needs: the model, the data, the optimizer, a PS shard, a replica.

The job runner compiles them once from the job config and sends them in its
assignments; a worker builds from them and never reads the TOML config. They
are registered messages (plain fields, arrays and refs), so they travel
through the remote codec like any other message, never pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _core
from ..actors import ActorRef, message
from .data import DatasetError, MemoryRows, ShardPlan, TrainRows, is_converted, load_dataset, open_split, split
from .schedules import ScheduleSpec

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "CodecSpec",
    "DataSpec",
    "LocalSpec",
    "ModelSpec",
    "OptimizerSpec",
    "P2PSpec",
    "PSLinkSpec",
    "ReplicaSpec",
    "ShardResume",
    "ShardSpec",
    "SharedStoreSpec",
    "StagesSpec",
]


@message("dniasync.train.ModelSpec")
@dataclass(frozen=True)
class ModelSpec:
    """``factory(**kwargs)``, initialised from ``seed``: every process builds the same model."""

    factory: str
    kwargs: dict[str, Any]
    seed: int

    def build(self) -> nn.Module:
        from .models import build_model

        return build_model(self.factory, self.kwargs, seed=self.seed)


@message("dniasync.train.DataSpec")
@dataclass(frozen=True)
class DataSpec:
    """The data set, its seeded train/held-out split, the batch size and the number of training shards."""

    dataset: str
    reader: dict[str, Any]
    """Keyword arguments of :func:`~dniasync.train.data.load_dataset`."""
    n_train: int
    n_test: int
    seed: int
    batch_size: int
    n_shards: int
    schedule: ScheduleSpec | None = None
    """How the batch size grows (None: ``batch_size`` throughout)."""
    shuffle: str = "global"
    """The split's and the shards' order (:class:`~dniasync.train.data.RowOrder`, :class:`ShardPlan`)."""
    block: int = 64
    window: int = 16

    def open_split(self, held_out: bool = True) -> tuple[TrainRows, torch.Tensor, torch.Tensor]:
        """(training rows, held-out x, held-out y): a converted set's training rows stay on disk, mapped;
        ``held_out=False``: its held-out rows are not read (a trainer never evaluates)."""
        import torch

        train, x_test, y_test = open_split(self.dataset, self.reader, self.n_train, self.n_test, self.seed,
                                           shuffle=self.shuffle, block=self.block, held_out=held_out)
        return train, torch.from_numpy(x_test), torch.from_numpy(y_test)

    def load_split(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(train x, train y, held-out x, held-out y) as tensors, all in memory.

        Only for in-memory sources: a converted set is refused (read it by shard, :meth:`open_split`).
        """
        import torch

        if is_converted(self.dataset):
            raise DatasetError(f"{self.dataset} is a converted data set, read by shard and never loaded whole; "
                               "this method (Sandblaster, compare's baseline) needs an in-memory source")
        if self.shuffle != "global":
            train_rows, x_test, y_test = self.open_split()
            assert isinstance(train_rows, MemoryRows)
            return torch.from_numpy(train_rows.x), torch.from_numpy(train_rows.y), x_test, y_test
        train, test = split(load_dataset(self.dataset, **self.reader), self.n_train, self.n_test, self.seed)
        return (torch.from_numpy(train.x), torch.from_numpy(train.y), torch.from_numpy(test.x),
                torch.from_numpy(test.y))

    def shard_plan(self) -> ShardPlan:
        return ShardPlan(self.n_train, self.n_shards, self.seed, self.shuffle, self.block, self.window)


@message("dniasync.train.OptimizerSpec")
@dataclass(frozen=True)
class OptimizerSpec:
    """The update rule and its hyper-parameters (``eps`` resolved to the optimizer's default)."""

    name: str
    lr: float
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_norm: float | None = None

    def store(self, segments: list[tuple[str, int]], *, shm_name: str | None = None) -> _core.ParamStore:
        """A new ``ParamStore`` holding ``segments`` and this optimizer's state (in ``/dev/shm`` if named)."""
        return _core.ParamStore(segments, self.name, momentum=self.momentum, beta1=self.betas[0],  # type: ignore[arg-type]
                                beta2=self.betas[1], eps=self.eps, weight_decay=self.weight_decay, shm_name=shm_name)

    def attach(self, shm_name: str, segments: list[tuple[str, int]]) -> _core.ParamStore:
        """The store another process created as ``shm_name`` (the same segments and optimizer)."""
        return _core.ParamStore.attach(shm_name, segments, self.name, momentum=self.momentum,  # type: ignore[arg-type]
                                       beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                                       weight_decay=self.weight_decay)


@message("dniasync.train.CodecSpec")
@dataclass(frozen=True)
class CodecSpec:
    """How pushed gradients, and with a codec the pulled parameter deltas, are compressed.

    See :mod:`dniasync.train.compression`. With ``name`` other than ``"none"`` a PS shard
    answers a replica's pulls with quantized deltas, and every ``resync_every``-th pull of
    that replica densely. With ``threshold`` the deltas' threshold is ``delta_tau``, or by
    default (None) 10% of the shard's parameter RMS at each answer
    (:class:`~dniasync.train.compression.DeltaCodec`).
    """

    name: str = "none"
    tau: float = 1e-3
    block: int = 256
    delta_tau: float | None = None
    resync_every: int = 100


@message("dniasync.train.ShardResume")
@dataclass(frozen=True)
class ShardResume:
    """What a PS shard carries over a restart besides its parameters (see :class:`ShardSpec`)."""

    version: int
    """The version it continues from (never lower than any version it served before)."""
    state: list[np.ndarray]
    """The optimizer's state slots (Adagrad's accumulator, Adam's moments), in the store's order."""
    ledger: dict[str, list[int]]
    """replica -> [incarnation, seq] of the last push applied: pushes stay idempotent across the restart."""
    fenced: list[str]
    steps: int = 0
    """Optimizer steps ``state`` holds (Adam's bias-correction count), which the shard continues."""


@message("dniasync.train.ShardSpec")
@dataclass(frozen=True)
class ShardSpec:
    """A PS shard: parameters ``[offset, offset + len(values))`` of the flat vector, and how it updates.

    With ``resume`` it continues from a snapshot (a restart) instead of starting afresh.
    """

    shard: int
    offset: int
    values: np.ndarray
    optimizer: OptimizerSpec
    codec: CodecSpec = field(default_factory=CodecSpec)
    staleness: str = "none"
    max_staleness: int = 0
    resume: ShardResume | None = None


@message("dniasync.train.PSLinkSpec")
@dataclass(frozen=True)
class PSLinkSpec:
    """Downpour: pull from ``ps`` every ``n_fetch`` steps, push every ``n_push``; ``offsets[i]`` starts shard i.

    With ``local_steps = H > 1`` (DiLoCo, :mod:`dniasync.train.sync.outer`) the trainer steps its own
    ``inner`` optimizer, and every H steps pushes the pseudo-gradient (weights at the last pull minus now) and
    pulls; ``n_fetch`` and ``n_push`` are then 1 (the exchange is every H steps).
    """

    ps: list[ActorRef]
    offsets: list[int]
    n_fetch: int = 1
    n_push: int = 1
    codec: CodecSpec = field(default_factory=CodecSpec)
    local_steps: int = 1
    inner: OptimizerSpec | None = None
    """The trainer's optimizer between exchanges (required with ``local_steps > 1``)."""
    sparse: str = "never"
    """How the model's embedding tables are pushed: ``auto``, ``always`` or ``never`` sparse
    (:mod:`dniasync.train.sparse`; sparse only without a codec)."""


@message("dniasync.train.LocalSpec")
@dataclass(frozen=True)
class LocalSpec:
    """No sharing: the trainer's own torch optimizer (Adam or SGD, from its optimizer settings) steps its weights."""


@message("dniasync.train.SharedStoreSpec")
@dataclass(frozen=True)
class SharedStoreSpec:
    """The job's shared-memory store ``name``, stepped in place without locks by every trainer on the machine.

    ``n_fetch = n_push = 0`` (Hogwild): the model's parameters are views of the store and every step is applied
    at once. ``n_fetch, n_push >= 1`` (Downpour with the store as its parameter server): the trainer computes on
    its own copy, copied from the store every ``n_fetch`` steps, and applies its gradient summed over ``n_push``
    steps. ``sparse``: how the model's embedding tables are stepped (``auto``, ``always``, ``never``: only their
    touched rows, :mod:`dniasync.train.sparse`)."""

    name: str
    sparse: str = "auto"
    n_fetch: int = 0
    n_push: int = 0


@message("dniasync.train.P2PSpec")
@dataclass(frozen=True)
class P2PSpec:
    """Peer to peer (:mod:`dniasync.train.sync.p2p`): the peers known at assignment, how updates are coded and spread.

    Here, not beside its sync, so a worker node decodes its assignment before it imports torch.
    """

    peers: list[ActorRef]
    """The inboxes of the live peers (this one's own is added by itself)."""
    epoch: int = 0
    """The membership version ``peers`` is (a :class:`~dniasync.train.sync.p2p.Peers` of a lower epoch is ignored)."""
    codec: str = "threshold"
    tau: float = 1e-3
    fanout: int = 0
    """Peers an update goes to from each holder (a k-ary tree rooted at its origin); 0: the origin sends to all."""
    max_lag: int = 16
    """A peer missing more updates than this takes a dense copy from a neighbour."""
    local_steps: int = 1
    """H: inner optimizer steps between two updates; above 1 the updates are DiLoCo pseudo-gradients."""
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    """With ``outer_lr`` 1: plain averaging (``[sync]``'s defaults; DiLoCo's 0.7/0.9 cost accuracy here)."""
    warm: bool = False
    """Take a dense copy from a peer before the first step (a late joiner)."""
    tick_s: float = 0.25
    """How often a peer tells the others its sent count, checks its ledger and repairs it."""
    silent_s: float = 2.0
    """No updates are sent to a peer nothing was heard from for this long."""
    max_unsent_bytes: int = 256 << 10
    """Flow control: an update is coded only while no live peer it goes to has more than this many bytes from this
    one still on the way (queued, buffered, or sent and not yet acknowledged); else the change waits for a later
    update. (A quarter of a second of a 10 Mbit/s link.)"""
    keep_bytes: int = 32 << 20
    """Payload bytes of its own latest updates a peer keeps, to resend them and to re-apply them after a dense copy."""
    update_cap_bytes: int = 256 << 10
    """The least a threshold update may carry when its links are slow (``[sync] update_cap_bytes``; the cap doubles
    while they keep up: :meth:`~dniasync.train.sync.p2p.P2PSync._code`)."""


@message("dniasync.train.ReplicaSpec")
@dataclass(frozen=True)
class ReplicaSpec:
    """A data-parallel worker: what it trains, on which data shards, and how it shares its parameters."""

    model: ModelSpec
    data: DataSpec
    optimizer: OptimizerSpec
    cursors: list[list[int]]
    """``[shard, epoch, position]`` of each data shard it starts on."""
    sync: object
    """How it shares its weights: the spec of any registered weight sync (:data:`dniasync.train.sync.SYNCS`),
    e.g. :class:`PSLinkSpec` (Downpour) or :class:`SharedStoreSpec` (Hogwild)."""
    coordinator: str
    """Where its progress reports go (the job runner's address)."""
    report_every_samples: int = 0
    """Report also each time it has trained this many samples since its last report (0: on its clock only), so
    that the runner sees the epoch budget spent before a whole report interval of training has gone past it."""


@message("dniasync.train.StagesSpec")
@dataclass(frozen=True)
class StagesSpec:
    """The stages of pipeline ``pipeline`` that one worker hosts (``hosted``: indices into ``groups``)."""

    model: ModelSpec
    groups: list[list[int]]
    """The whole cut: layer indices of each stage."""
    hosted: list[int]
    pipeline: int
    replicas: int
    settings: dict[str, Any]
    """The fields of :class:`~dniasync.train.pipeline.StageSettings`."""
    in_features: int
    mailbox_size: int
    ps: list[ActorRef]
    """With ``replicas > 1`` and PS shards: the PS shard of each hosted stage (``ps_copies`` each: its copies, in
    chain order at first, stage-major)."""
    n_fetch: int = 1
    n_push: int = 1
    p2p: list[P2PSpec] = field(default_factory=list)
    """With ``replicas > 1`` and ``sync.kind = "p2p"``: each hosted stage's peers (that stage in the other pipelines)."""
    ps_copies: int = 1
    """Copies of each stage's PS shard (``[pipeline] ps_replicas``): a stage reaches them as one chain."""
    codec: CodecSpec = field(default_factory=CodecSpec)
    """With PS shards: how the hosted stages' pushes and pulls are compressed (``[pipeline] codec``)."""
