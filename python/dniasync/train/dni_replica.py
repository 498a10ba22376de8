"""DNI x Downpour: a layer group replicated R times, the replicas sharing parameters through a PS shard.

A :class:`ReplicatedLayerGroup` is a :class:`~dniasync.train.dni.LayerGroup`
whose optimizer step does not update its weights: it adds the step's gradient
(from the synthetic gradient, the real loss or, in the synchronous pipeline,
the true gradient) to an accumulator. After every ``n_push`` steps the
accumulated gradient goes to the group's :class:`~dniasync.train.ps.PSShard`
as a :class:`~dniasync.train.messages.Push`; every ``n_fetch`` steps the
replica pulls the shard's parameters into its own, as a Downpour replica
does. Synthetic-gradient and synthetic-input models stay local to each replica.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from ..actors import ActorRef, handler
from .compression import make_codec
from .dni import DNISettings, Forward, Gradient, GroupStats, LayerGroup, RawInput, StatsRequest, SyntheticGradient
from .flat import FlatModel, flatten_parameters
from .messages import Params, Pull, Push

__all__ = ["ReplicatedLayerGroup"]

log = logging.getLogger("dniasync.train.dni_replica")


class _AccumulateForPS(torch.optim.Optimizer):
    """An "optimizer" whose step adds the gradients to a :class:`FlatModel`'s accumulator.

    The PS shard applies the real optimizer; the replica only counts its steps.
    """

    def __init__(self, params: Iterable[nn.Parameter], flat: FlatModel) -> None:
        super().__init__(params, {})
        self.flat = flat
        self.pending = 0
        """Steps accumulated since the last push."""

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        self.flat.accumulate_grad()
        self.pending += 1


class ReplicatedLayerGroup(LayerGroup):
    """A layer group whose weights live on a PS shard shared with its other replicas.

    ``replica`` names it to the shard (pushes are idempotent per
    ``(replica, incarnation, seq)``). Before its first forward it pulls, so
    every replica starts from the shard's weights.
    """

    def __init__(
        self,
        layers: nn.Sequential,
        settings: DNISettings,
        in_features: int,
        out_features: int,
        raw_features: int,
        last: bool,
        seed: int,
        sg: SyntheticGradient | None,
        *,
        ps: ActorRef,
        replica: str,
        n_fetch: int = 1,
        n_push: int = 1,
        ask_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(layers, settings, in_features, out_features, raw_features, last, seed, sg)
        self.buffer = flatten_parameters(layers)
        self.flat = FlatModel(layers, self.buffer)
        self.accumulator = _AccumulateForPS(list(layers.parameters()), self.flat)
        self.optimizer = self.accumulator
        self.ps = ps
        self.replica = replica
        self.incarnation = time.time_ns() // 1000
        self.n_fetch = n_fetch
        self.n_push = n_push
        self.ask_timeout_s = ask_timeout_s
        self.codec = make_codec("none", self.flat.n)
        self.version = 0
        self.seq = 0
        self.pushes = 0
        self.pulls = 0
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self._since_fetch = 0
        self._fetched = False
        self._steps_synced = 0

    async def _pull(self) -> None:
        reply = await self.ps.ask(Pull(), timeout=self.ask_timeout_s)
        assert isinstance(reply, Params)
        np.copyto(self.buffer, reply.values)  # the layers' parameters are views of this buffer
        self.version = int(reply.version)
        self.pulls += 1
        self.bytes_pulled += int(reply.values.nbytes)
        self._since_fetch = 0
        self._fetched = True

    async def _push(self) -> None:
        grad = self.flat.grad.numpy()
        compressed = self.codec.compress(grad)
        self.seq += 1
        await self.ps.tell(
            Push(self.replica, self.incarnation, self.seq, self.version, compressed.codec, compressed.payload, 0)
        )
        self.flat.grad.zero_()
        self.accumulator.pending = 0
        self.pushes += 1
        self.bytes_pushed += compressed.nbytes

    async def _sync(self) -> None:
        """Push and pull as the steps taken since the last call require."""
        new_steps = self.steps - self._steps_synced
        self._steps_synced = self.steps
        if not new_steps:
            return
        if self.accumulator.pending >= self.n_push:
            await self._push()
        self._since_fetch += new_steps
        if self._since_fetch >= self.n_fetch:
            await self._pull()

    @handler
    async def forward(self, msg: Forward) -> None:
        if not self._fetched:
            await self._pull()  # never train on weights the shard has not seen
        await super().forward(msg)
        await self._sync()

    @handler
    async def gradient(self, msg: Gradient) -> None:
        await super().gradient(msg)
        await self._sync()

    @handler
    async def raw_input(self, msg: RawInput) -> None:
        if not self._fetched:
            await self._pull()
        await super().raw_input(msg)
        await self._sync()

    @handler
    def stats(self, msg: StatsRequest) -> GroupStats:
        return replace(super().stats(msg), bytes_pushed=self.bytes_pushed, bytes_pulled=self.bytes_pulled)
