"""Parameter-server shard: one contiguous slice of the model, updated asynchronously.

As in Downpour (Dean et al. 2012) each shard applies pushes on arrival with
its own optimizer (Adagrad by default), in place in a Rust ``ParamStore``,
and answers pulls with its parameters and their version. Quantized pushes
are applied straight into the store, never expanded into a dense buffer.
A sparse push (:mod:`~dniasync.train.sparse`: only an embedding table's
touched rows) is stepped over its spans alone, with the dense push's result.

With a codec, pulls are compressed too (:class:`~dniasync.train.messages.PullDelta`):
the shard keeps, per replica, the parameters that replica holds and answers with
the quantized difference to its own (:class:`~dniasync.train.compression.DeltaCodec`;
with ``threshold``, by default at a threshold of 10% of the shard's parameter RMS),
updating its copy by exactly what the replica adds; every ``resync_every``-th pull,
and whenever the replica's echo shows it missed an answer, the answer is dense.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _core
from ..actors import Actor, handler
from .compression import Codec, CompressedTensor, DeltaCodec, make_codec, values_digest
from .messages import (
    CoordinatorEpoch,
    Fence,
    Params,
    ParamsDelta,
    Pull,
    PullDelta,
    Push,
    Reshard,
    ShardSnapshot,
    ShardStats,
    SnapshotShard,
    fenced,
)
from .sparse import span_array, span_values
from .specs import OptimizerSpec, ShardSpec
from .staleness import PushLedger, PushVerdict, StalenessPolicy
from .telemetry import track_ps_shard

__all__ = ["PSShard", "make_store", "SEGMENT"]

log = logging.getLogger("dniasync.train.ps")

SEGMENT = "shard"
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)
"""Upper bounds of the staleness histogram kept per shard (the last bucket is open)."""


def make_store(optimizer: OptimizerSpec, n: int, segment: str = SEGMENT, shm_name: str | None = None) -> _core.ParamStore:
    """A one-segment store with ``optimizer``'s state."""
    return optimizer.store([(segment, n)], shm_name=shm_name)


@dataclass
class _Follower:
    """What one replica holds of this shard: the values of the last answer, and that answer's name."""

    incarnation: int
    seq: int
    known: np.ndarray
    deltas_since_dense: int = 0


class PSShard(Actor):
    """Owns parameters ``[offset, offset + len(values))`` of the flat model vector."""

    mailbox_size = 256

    def __init__(self, spec: ShardSpec) -> None:
        self.shard = spec.shard
        self.spec = spec
        self.lr = spec.optimizer.lr
        self.staleness = StalenessPolicy(spec.staleness, spec.max_staleness)
        self._hold(spec.values)
        self.resync_every = max(1, spec.codec.resync_every)
        self.followers: dict[str, _Follower] = {}
        self.stream = time.time_ns() // 1000
        """This incarnation's name for its answers: a replica's echo from an earlier one never matches."""
        self._seq = 0
        self.ledger = PushLedger()
        self.fenced: set[str] = set()
        self.epoch = 0
        """The highest coordinator epoch heard from: a fence from a lower one is refused."""
        resume = spec.resume
        if resume is not None:
            for slot, values in enumerate(resume.state, start=1):
                self.store.write(SEGMENT, np.ascontiguousarray(values, dtype=np.float32).reshape(-1), state=slot)
            self.store.set_steps(SEGMENT, resume.steps)
            self.ledger = PushLedger.restore(resume.ledger)
            self.fenced = set(resume.fenced)
        # versions continue from the snapshot's: a restart never makes one go back
        self._version_offset = (resume.version if resume is not None else 0) - self.store.version(SEGMENT)
        self.applied = 0
        self.lr_last = float("nan")
        """The lr the last applied push was applied with (the shard's, times the push's ``lr_scale``)."""
        self.rejected: dict[str, int] = {"stale": 0, "duplicate": 0, "zombie": 0, "nonfinite": 0, "bad_payload": 0}
        self.staleness_counts = [0] * (len(STALENESS_BUCKETS) + 1)
        self.staleness_sum = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.samples = 0
        self.pulls = 0
        self.dense_pulls = 0
        self.delta_pulls = 0

    def _hold(self, values: np.ndarray) -> None:
        """A fresh store and codecs for ``values`` (at version 0 of the store; the caller sets the offset)."""
        self.n = int(values.size)
        self.store = make_store(self.spec.optimizer, self.n)
        self.store.write(SEGMENT, np.ascontiguousarray(values, dtype=np.float32).reshape(-1))
        self.codecs: dict[str, Codec] = {"none": make_codec("none", self.n)}
        codec = self.spec.codec
        if codec.name != "none":
            self.codecs[codec.name] = make_codec(codec.name, self.n, tau=codec.tau, block=codec.block)  # type: ignore[arg-type]
        self.delta_codec = (DeltaCodec(codec.name, self.n, tau=codec.delta_tau, block=codec.block)  # type: ignore[arg-type]
                            if codec.name != "none" else None)
        # the values this shard starts from (a replica holding them gets a delta, not a copy, at its first pull)
        self._start = (np.ascontiguousarray(values, dtype=np.float32).reshape(-1).copy()
                       if self.delta_codec is not None else None)
        self._start_digest = values_digest(self._start) if self._start is not None else ""

    async def on_start(self) -> None:
        track_ps_shard(self.system, self, STALENESS_BUCKETS)

    @handler
    def reshard(self, msg: Reshard) -> dict[str, Any]:
        if msg.version < self.version:
            raise ValueError(f"shard {self.shard}: cannot go back from version {self.version} to {msg.version}")
        self._hold(msg.values)
        for slot, values in enumerate(msg.state, start=1):
            self.store.write(SEGMENT, np.ascontiguousarray(values, dtype=np.float32).reshape(-1), state=slot)
        self.store.set_steps(SEGMENT, msg.steps)
        self._version_offset = msg.version - self.store.version(SEGMENT)
        self.followers.clear()  # what each replica held is of the old slice: the next answers are dense
        self.stream = max(self.stream + 1, time.time_ns() // 1000)
        log.info("shard %d now holds %d parameters (version %d)", self.shard, self.n, self.version)
        return self.stats(ShardStats())

    @property
    def version(self) -> int:
        return self.store.version(SEGMENT) + self._version_offset

    @handler
    def push(self, msg: Push) -> None:
        self.bytes_in += int(msg.payload.nbytes) + (int(msg.spans.nbytes) if msg.spans is not None else 0)
        if msg.replica in self.fenced:
            self.rejected["zombie"] += 1
            return
        verdict = self.ledger.check(msg.replica, msg.incarnation, msg.seq)
        if verdict is not PushVerdict.NEW:
            self.rejected[verdict.value] += 1
            return
        self.ledger.record(msg.replica, msg.incarnation, msg.seq)
        version = self.version
        decision = self.staleness.decide(self.lr, version, min(msg.version, version))
        self._observe_staleness(decision.staleness)
        if not decision.apply:
            self.rejected["stale"] += 1
            return
        codec = self.codecs.get(msg.codec)
        if codec is None:
            self.rejected["bad_payload"] += 1
            log.warning("shard %d: push from %s with codec %r, expected %r", self.shard, msg.replica, msg.codec,
                        self.spec.codec.name)
            return
        payload = np.ascontiguousarray(msg.payload, dtype=np.uint8).reshape(-1)
        lr = decision.lr * msg.lr_scale
        try:
            if not (math.isfinite(msg.lr_scale) and msg.lr_scale >= 0.0):
                raise ValueError(f"lr_scale must be finite and >= 0, got {msg.lr_scale}")
            if msg.spans is None:
                codec.apply(self.store, SEGMENT, CompressedTensor(msg.codec, (self.n,), payload), lr)
            elif msg.codec != "none":
                raise ValueError(f"a sparse push carries float32 values (codec 'none'), not {msg.codec!r}")
            else:
                self.store.step_spans(SEGMENT, span_array(msg.spans), span_values(payload), lr)
        except _core.NonFiniteGradientError:
            self.rejected["nonfinite"] += 1
            return
        except (ValueError, TypeError) as exc:
            self.rejected["bad_payload"] += 1
            log.warning("shard %d: bad push from %s: %s", self.shard, msg.replica, exc)
            return
        self.applied += 1
        self.lr_last = lr
        self.samples += msg.samples

    def _observe_staleness(self, staleness: int) -> None:
        self.staleness_sum += staleness
        for i, bound in enumerate(STALENESS_BUCKETS):
            if staleness <= bound:
                self.staleness_counts[i] += 1
                return
        self.staleness_counts[-1] += 1

    @handler
    def pull(self, msg: Pull) -> Params:
        out = np.empty(self.n, dtype=np.float32)
        version = self.store.read_into(SEGMENT, out) + self._version_offset
        self.bytes_out += int(out.nbytes)
        self.pulls += 1
        return Params(self.shard, version, out)

    @handler
    def pull_delta(self, msg: PullDelta) -> ParamsDelta:
        current = np.empty(self.n, dtype=np.float32)
        version = self.store.read_into(SEGMENT, current) + self._version_offset
        self.pulls += 1
        self._seq += 1
        follower = self.followers.get(msg.replica)
        coded = None
        tau = 0.0
        holds = (follower is not None and msg.stream == self.stream and msg.incarnation == follower.incarnation
                 and msg.seq == follower.seq)
        if (not holds and self._start is not None and msg.digest == self._start_digest
                and (msg.stream, msg.seq) == (0, 0)):
            # a first pull from a replica whose copy is what this shard started from: code the change since then
            follower = _Follower(msg.incarnation, 0, self._start.copy())
            self.followers[msg.replica] = follower
            holds = True
        if (self.delta_codec is not None and follower is not None and holds
                and follower.deltas_since_dense + 1 < self.resync_every):
            tau = self.delta_codec.threshold_for(current)
            coded = self.delta_codec.encode(current - follower.known, tau)
        if coded is None or follower is None:
            # a copy: a local replica receives ``current`` itself, and ``known`` changes in place
            self.followers[msg.replica] = _Follower(msg.incarnation, self._seq, current.copy())
            self.bytes_out += int(current.nbytes)
            self.dense_pulls += 1
            return ParamsDelta(self.shard, version, self.stream, self._seq, True, "none", [current])
        assert self.delta_codec is not None
        codec, parts = coded
        follower.known += self.delta_codec.decode(parts, tau, codec)  # exactly what the replica adds to its copy
        follower.seq = self._seq
        follower.deltas_since_dense += 1
        self.bytes_out += sum(int(part.nbytes) for part in parts)
        self.delta_pulls += 1
        return ParamsDelta(self.shard, version, self.stream, self._seq, False, codec, parts, tau)

    @handler
    def snapshot(self, msg: SnapshotShard) -> ShardSnapshot:
        values = np.empty(self.n, dtype=np.float32)
        version = self.store.read_into(SEGMENT, values) + self._version_offset
        state = []
        for slot in range(1, self.store.state_slots + 1):
            buffer = np.empty(self.n, dtype=np.float32)
            self.store.read_into(SEGMENT, buffer, state=slot)
            state.append(buffer)
        return ShardSnapshot(self.shard, values, version, state, self.ledger.snapshot(), sorted(self.fenced),
                             self.store.steps(SEGMENT))

    @handler
    def coordinator_epoch(self, msg: CoordinatorEpoch) -> None:
        self.epoch = max(self.epoch, msg.epoch)

    @handler
    def fence(self, msg: Fence) -> None:
        if fenced(msg.epoch, self.epoch):
            log.warning("PS shard %d: refused a fence of %s from coordinator epoch %d (now %d)", self.shard,
                        msg.replica, msg.epoch, self.epoch)
            return
        self.fenced.add(msg.replica)
        self.followers.pop(msg.replica, None)

    @handler
    def stats(self, msg: ShardStats) -> dict[str, Any]:
        return {
            "shard": self.shard,
            "version": self.version,
            "applied": self.applied,
            "lr_last": self.lr_last,
            "samples": self.samples,
            "rejected": dict(self.rejected),
            "staleness_buckets": list(STALENESS_BUCKETS),
            "staleness_counts": list(self.staleness_counts),
            "staleness_sum": self.staleness_sum,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "dense_pulls": self.dense_pulls,
            "delta_pulls": self.delta_pulls,
        }
