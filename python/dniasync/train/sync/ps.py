"""Sharing weights through PS shards: push the accumulated gradient, pull the shards' parameters.

:class:`ShardLink` is the push/pull client of one flat parameter vector cut
into PS shards: it pulls every shard into a local buffer (recording each
shard's version), and pushes an accumulated gradient to every shard,
compressed by a codec of its own (its residual stays here), as idempotent
``Push(replica, incarnation, seq, version, ...)`` messages. With a codec,
pulls are compressed as well: each shard answers a ``PullDelta`` with a
quantized delta the link adds to its buffer (a dense answer now and then, and
whenever the link missed one: see :mod:`dniasync.train.ps`); the version
recorded is the one of the state the answer brings the buffer to. A shard
that fails a pull or a push is retried with exponential backoff (0.05 s
doubling to 2 s), so a dead shard costs a few attempts per second, until it
answers a pull (a tell to a node that is down may vanish without an error);
its warnings are collapsed into one log line per interval with a count.
With ``sparse`` other than ``"never"`` (and no codec) the embedding tables'
untouched rows stay home: each shard gets the spans of its slice that are not
zero (:mod:`dniasync.train.sparse`).

:class:`PSSync` is the weight sync over such a link, the same for Downpour
replicas and replicated pipeline stages: the trainer's parameters are views
of the link's buffer, a step adds the gradients to an accumulator (the shards
run the optimizer), the accumulator is pushed every ``n_push`` steps and the
shards pulled every ``n_fetch``; the first batch waits for a first pull.

With ``local_steps = H > 1`` (DiLoCo: see :mod:`dniasync.train.sync.outer`)
the trainer steps its own inner optimizer (torch's counterpart of the job's
``[optimizer]``, :meth:`LocalOptimizer.for_spec`) instead, and every H steps
pushes the pseudo-gradient ``anchor - now`` through the same codec and
residual, puts its weights back to the anchor and pulls: the shards, which run
the outer optimizer (Nesterov), answer with the next anchor. The weights are
put back before the pull because a quantized pull is a delta from what the
shard last sent, i.e. from the anchor. A shard that misses the push loses those
H steps of its slice, as it would lose a gradient.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ...actors import ActorError, ActorRef, Backoff
from ..chain import pusher
from ..compression import CodecName, DeltaCodec, make_codec, values_digest
from ..flat import FlatModel, flatten_parameters, split_ranges
from ..messages import Params, ParamsDelta, Pull, PullDelta, Push
from ..sparse import SPARSE_MODES, EmbeddingTable, embedding_tables, spans_of, touched
from ..specs import CodecSpec, OptimizerSpec, PSLinkSpec
from .base import Clock, StepScales, SyncContext, SyncKind, SyncStats, register
from .local import LocalOptimizer
from .outer import LocalSteps

__all__ = ["CollapsedWarnings", "PSSync", "ShardLink"]

log = logging.getLogger("dniasync.train.sync.ps")


@dataclass
class _Run:
    """A run of failures of one operation: when it was last logged and how many were held back."""

    logged_at: float
    held: int = 0
    total: int = 1


class CollapsedWarnings:
    """One log line per run of failures: the first at once, then at most one per ``every_s`` with a count."""

    def __init__(self, logger: logging.Logger, *, every_s: float = 10.0, clock: Clock = time.monotonic) -> None:
        self.logger = logger
        self.every_s = every_s
        self._clock = clock
        self._runs: dict[str, _Run] = {}

    def failed(self, what: str, detail: str) -> None:
        """``what`` failed (again) with ``detail``."""
        now = self._clock()
        run = self._runs.get(what)
        if run is None:
            self._runs[what] = _Run(logged_at=now)
            self.logger.warning("%s failed: %s", what, detail)
            return
        run.total += 1
        run.held += 1
        if now - run.logged_at >= self.every_s:
            self.logger.warning("%s failed %d more times in %.0f s, last: %s", what, run.held, now - run.logged_at,
                                detail)
            run.logged_at, run.held = now, 0

    def recovered(self, what: str) -> None:
        """``what`` worked: end its run of failures (logged if there was one)."""
        run = self._runs.pop(what, None)
        if run is not None:
            self.logger.info("%s works again after %d failures", what, run.total)


class ShardLink:
    """Pulls and pushes one flat parameter vector cut into PS shards.

    ``ranges[i] = (offset, length)`` is the slice of ``buffer`` shard
    ``shards[i]`` holds. Counters: ``pulls`` (one per shard answered; of
    them ``dense_pulls`` and ``delta_pulls``), ``pushes`` (one per
    :meth:`push`), ``bytes_pulled``, ``bytes_pushed`` (payloads, and a sparse push's spans) and
    ``dense_bytes_pulled``, ``dense_bytes_pushed`` (what they would take as float32); ``sparse_pushes``
    (messages to a shard that were sparse).
    With ``codec`` other than ``"none"`` pulls ask for deltas (decoded with the threshold each answer carries).
    ``tables`` (embedding weights in the vector) and ``sparse`` (one of
    :data:`~dniasync.train.sparse.SPARSE_MODES`) make pushes sparse where they can be; only without a codec
    (``threshold`` sends indices already; ``onebit``'s carried error is per element of the whole slice).
    """

    def __init__(
        self,
        buffer: np.ndarray,
        ranges: Sequence[tuple[int, int]],
        shards: Sequence[ActorRef],
        *,
        replica: str,
        incarnation: int,
        codec: CodecName = "none",
        tau: float = 1e-3,
        block: int = 256,
        ask_timeout_s: float = 10.0,
        clock: Clock = time.monotonic,
        tables: Sequence[EmbeddingTable] = (),
        sparse: str = "never",
    ) -> None:
        if len(ranges) != len(shards):
            raise ValueError(f"{len(shards)} PS shards for {len(ranges)} parameter ranges")
        self.buffer = buffer
        self.ranges = list(ranges)
        self.shards = list(shards)
        self.replica = replica
        self.incarnation = incarnation
        self.ask_timeout_s = ask_timeout_s
        self.tables = list(tables)
        self.sparse = sparse if codec == "none" and self.tables else "never"
        if sparse not in SPARSE_MODES:
            raise ValueError(f"unknown sparse push mode {sparse!r}; expected one of {', '.join(SPARSE_MODES)}")
        self.codecs = [make_codec(codec, length, tau=tau, block=block) for _, length in self.ranges]
        self.deltas = ([DeltaCodec(codec, length, block=block) for _, length in self.ranges]
                       if codec != "none" else None)
        self._answers = [(0, 0)] * len(self.shards)
        """(stream, seq) of each shard's last answer applied, echoed in the next PullDelta."""
        self.dense_pulls = 0
        self.delta_pulls = 0
        self.dense_bytes_pulled = 0
        self.versions = [0] * len(self.shards)
        self.seq = 0
        self.pushes = 0
        self.pulls = 0
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self.dense_bytes_pushed = 0
        self.sparse_pushes = 0
        self._backoff = [Backoff(clock=clock) for _ in self.shards]
        self._warnings = CollapsedWarnings(log, clock=clock)

    def _what(self, i: int, op: str) -> str:
        return f"replica {self.replica}: {op} shard {i}"

    def _failed(self, i: int, op: str, exc: ActorError) -> None:
        delay = self._backoff[i].failed()
        self._warnings.failed(self._what(i, op), f"{exc} (next attempt in {delay:g} s)")

    def _answered(self, i: int) -> None:
        """Shard ``i`` answered a pull: it is back, for pushes too."""
        self._backoff[i].succeeded()
        for op in ("pull from", "push to"):
            self._warnings.recovered(self._what(i, op))

    async def pull(self) -> bool:
        """Pull every shard not backing off into the buffer; True if every shard answered."""
        answered = await asyncio.gather(*(self._pull_one(i) for i in range(len(self.shards))))
        return all(answered)

    async def _pull_one(self, i: int) -> bool:
        if not self._backoff[i].ready():
            return False
        offset, length = self.ranges[i]
        if self.deltas is None:
            ask: Pull | PullDelta = Pull()
        else:  # before a first answer, say what the copy holds (the seeded init: the shard may hold it too)
            first = self._answers[i] == (0, 0)
            digest = values_digest(self.buffer[offset:offset + length]) if first else ""
            ask = PullDelta(self.replica, self.incarnation, *self._answers[i], digest)
        try:
            reply = await self.shards[i].ask(ask, timeout=self.ask_timeout_s)
        except ActorError as exc:  # a delta it may have recorded is never applied: the next echo asks for dense
            self._failed(i, "pull from", exc)
            return False
        self._answered(i)
        target = self.buffer[offset:offset + length]  # the model's parameters are views of the buffer
        if isinstance(reply, Params):
            np.copyto(target, reply.values)
            self.bytes_pulled += int(reply.values.nbytes)
            self.dense_pulls += 1
        elif isinstance(reply, ParamsDelta) and self.deltas is not None:
            if reply.dense:
                np.copyto(target, reply.parts[0])
                self.dense_pulls += 1
            else:
                # the same float32 adds as the shard's copy (a threshold link's answer may be its int8 fallback)
                target += self.deltas[i].decode(reply.parts, reply.tau, reply.codec)
                self.delta_pulls += 1
            self._answers[i] = (int(reply.stream), int(reply.seq))
            self.bytes_pulled += sum(int(part.nbytes) for part in reply.parts)
        else:
            raise TypeError(f"shard {i} answered a pull with {type(reply).__name__}")
        self.versions[i] = int(reply.version)
        self.dense_bytes_pulled += 4 * length
        self.pulls += 1
        return True

    async def push(self, grad: np.ndarray, samples: int, *, lr_scale: float = 1.0) -> None:
        """Push ``grad`` (the whole flat vector) to every shard, to be applied with the shard's lr times
        ``lr_scale``; a shard backing off misses this one."""
        self.seq += 1
        keep = touched(grad, self.tables, self.sparse) if self.sparse != "never" else None
        for i, (offset, length) in enumerate(self.ranges):
            if not self._backoff[i].ready():
                continue
            mine = keep[offset:offset + length] if keep is not None else None
            if mine is None or mine.all():
                compressed = self.codecs[i].compress(grad[offset:offset + length])
                push = Push(self.replica, self.incarnation, self.seq, self.versions[i], compressed.codec,
                            compressed.payload, samples, lr_scale=lr_scale)
                nbytes = compressed.nbytes
            else:
                spans = spans_of(mine)
                values = grad[offset:offset + length][mine].view(np.uint8)
                push = Push(self.replica, self.incarnation, self.seq, self.versions[i], "none", values, samples,
                            spans, lr_scale)
                nbytes = int(values.nbytes + spans.nbytes)
            try:
                await self.shards[i].tell(push)
            except ActorError as exc:
                self._failed(i, "push to", exc)
                continue
            # no reset of the backoff here: a tell to a node that is down may be dropped without an error,
            # so only an answered pull proves the shard is back
            self.bytes_pushed += nbytes
            if push.spans is not None:
                self.sparse_pushes += 1
            self.dense_bytes_pushed += 4 * length
        self.pushes += 1


_COUNTERS = ("bytes_pushed", "bytes_pulled", "dense_bytes_pushed", "dense_bytes_pulled", "pushes", "pulls",
             "dense_pulls", "delta_pulls", "sparse_pushes")


class PSSync:
    """A trainer's parameters shared with other trainers through PS shards (Downpour; replicated stages).

    ``model``'s parameters become views of one flat buffer that pulls fill; a
    step adds the gradients to an accumulator instead of applying them (the
    shards run the optimizer). Every ``n_push`` steps the accumulator is
    pushed (with the samples it was computed on), every ``n_fetch`` steps the
    shards are pulled; the first batch waits for a first pull, so a trainer
    never pushes a gradient of weights the shards have not seen (unless they
    cannot be reached: then it starts from its own, built from the same factory
    and seed, and keeps retrying before each batch). A pull that does not reach
    every shard is retried after every run of steps until it does (the link's
    backoff spaces the attempts). ``offsets[i]`` starts shard i's slice (None:
    the vector cut evenly).

    ``local_steps > 1`` with an ``inner`` optimizer: local steps, as the module
    says (``n_fetch`` and ``n_push`` must then be 1). ``sparse``: how the
    model's embedding tables are pushed (:class:`ShardLink`).
    """

    pulls_params = True

    def __init__(
        self,
        model: nn.Module,
        shards: Sequence[ActorRef],
        *,
        name: str,
        incarnation: int,
        offsets: Sequence[int] | None = None,
        n_fetch: int = 1,
        n_push: int = 1,
        codec: CodecSpec = CodecSpec(),
        local_steps: int = 1,
        inner: OptimizerSpec | None = None,
        ask_timeout_s: float = 10.0,
        clock: Clock = time.monotonic,
        sparse: str = "never",
    ) -> None:
        if n_fetch < 1 or n_push < 1:
            raise ValueError(f"n_fetch and n_push must be >= 1, got {n_fetch} and {n_push}")
        if local_steps > 1 and (inner is None or n_fetch != 1 or n_push != 1):
            raise ValueError("local steps need an inner optimizer and n_fetch = n_push = 1 (they exchange every "
                             f"local_steps = {local_steps} steps)")
        buffer = flatten_parameters(model)
        self.flat = FlatModel(model, buffer)
        if offsets is None:
            ranges = split_ranges(self.flat.n, len(shards))
        else:
            bounds = [*offsets, self.flat.n]
            ranges = [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(len(offsets))]
        if len(shards) > len(ranges):  # replicated shards: each one's copies, shard-major, reached as one chain
            from .chain import chain_refs

            shards = chain_refs(shards, len(ranges), replica=name, clock=clock)
        self.link = ShardLink(buffer, ranges, shards, replica=name, incarnation=incarnation,
                              codec=codec.name, tau=codec.tau, block=codec.block,  # type: ignore[arg-type]
                              ask_timeout_s=ask_timeout_s, clock=clock, tables=embedding_tables(model),
                              sparse=sparse)
        self.n_fetch = n_fetch
        self.n_push = n_push
        self.inner: LocalOptimizer | None = None
        """The trainer's own optimizer between exchanges (local steps only)."""
        self.local: LocalSteps | None = None
        if local_steps > 1:
            assert inner is not None
            self.inner = LocalOptimizer.for_spec(model.parameters(), inner)
            self.local = LocalSteps(buffer, local_steps)
        self._name, self._codec, self._ask_timeout_s, self._clock = name, codec, ask_timeout_s, clock
        self._sparse = sparse
        self.steps = 0
        self._gate = StepScales()
        """The lr scales of the steps since the last push: the shards apply it with their lr times the mean."""
        self._scale = 1.0
        """:meth:`scale_lr`'s, on every step."""
        self._params = list(model.parameters())
        self._pending = 0
        """Steps accumulated since the last push."""
        self._samples_pending = 0
        self._steps_synced = 0
        self._since_fetch = 0
        self._pulled = False

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return None if self.inner is None else self.inner.optimizer

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def step(self, lr_scale: float = 1.0) -> None:
        if self.inner is None:
            self.flat.accumulate_grad()
            self._gate.add(lr_scale * self._scale)
        else:
            self.inner.step(lr_scale)
            self.zero_grad()  # a replica does not clear .grad before its next backward: accumulate_grad does
        self._pending += 1
        self.steps += 1

    def steps_per_call(self, steps: int) -> int:
        # a thread hop costs ~0.1 ms: run every step up to the next pull or push in one
        if self.local is not None:
            return self.local.local_steps - self._pending
        return min(self.n_push - steps % self.n_push, self.n_fetch - steps % self.n_fetch)

    def scale_lr(self, scale: float) -> None:
        if self.inner is not None:  # local steps: the inner optimizer is the trainer's own
            self.inner.scale_lr(scale)
        else:  # the shards apply their lr times the scale each push carries
            self._scale = scale

    def lr_now(self) -> float:
        return float("nan") if self.inner is None else self.inner.lr_now()

    async def _pull(self) -> None:
        if await self.link.pull():
            self._pulled = True
            self._since_fetch = 0
        if self.local is not None:  # what was pulled (or, for a shard that did not answer, kept) is the anchor
            self.local.reset(self.link.buffer)

    async def ready(self) -> None:
        if not self._pulled and not (self.local is not None and self._pending):  # never amid local steps
            await self._pull()

    async def _push(self) -> None:
        if self.local is None:
            await self.link.push(self.flat.grad.numpy(), self._samples_pending, lr_scale=self._gate.take())
            self.flat.grad.zero_()
        else:
            pseudo = self.local.pseudo_gradient(self.link.buffer, out=self.flat.grad.numpy())
            await self.link.push(pseudo, self._samples_pending)
            np.copyto(self.link.buffer, self.local.anchor)  # a pulled delta applies to what the shard last sent
            self.flat.grad.zero_()
        self._pending = self._samples_pending = 0

    async def sync(self, samples: int) -> None:
        self._samples_pending += samples
        new_steps = self.steps - self._steps_synced
        self._steps_synced = self.steps
        if not new_steps:
            return
        if self.local is not None:
            if self._pending >= self.local.local_steps:
                await self._push()
                await self._pull()
            return
        if self._pending >= self.n_push:
            await self._push()
        self._since_fetch += new_steps
        if self._since_fetch >= self.n_fetch:
            await self._pull()

    async def flush(self) -> None:
        """Push what has accumulated since the last push now (before the shards are re-partitioned); with local
        steps, pull the new anchor too."""
        if self._pending:
            await self._push()
            if self.local is not None:
                await self._pull()

    def relinked(self, layers: nn.Module) -> PSSync:
        """The same link settings for ``layers`` (after layers moved in or out): a new incarnation that pulls its
        shards' new slice (cut evenly) before its first batch. Call :meth:`flush` first: accumulated gradients do
        not carry."""
        if self.local is not None:
            raise NotImplementedError("local steps are for data-parallel replicas: their layers never move")
        fresh = PSSync(layers, self.link.shards, name=self._name, n_fetch=self.n_fetch, n_push=self.n_push,
                       incarnation=max(self.link.incarnation + 1, time.time_ns() // 1000), codec=self._codec,
                       ask_timeout_s=self._ask_timeout_s, clock=self._clock, sparse=self._sparse)
        fresh.steps = fresh._steps_synced = self.steps
        fresh._scale = self._scale
        for counter in _COUNTERS:
            setattr(fresh.link, counter, getattr(self.link, counter))
        return fresh

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The inner optimizer's state with local steps; else nothing: the shards hold (and checkpoint) the
        parameters and the optimizer. The anchor is the next pull."""
        return {} if self.inner is None else self.inner.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.inner is not None:
            self.inner.load_state_dict(state)

    def stats(self) -> SyncStats:
        link = self.link
        return SyncStats(
            link.bytes_pushed, link.bytes_pulled, link.dense_bytes_pushed, link.pushes, link.pulls,
            list(link.versions),
            {"dense_bytes_pulled": link.dense_bytes_pulled, "dense_pulls": link.dense_pulls,
             "delta_pulls": link.delta_pulls, "sparse_pushes": link.sparse_pushes},
            pusher(link.replica, link.incarnation),
        )

    async def close(self) -> None:
        return


def _build(spec: PSLinkSpec, model: nn.Module, ctx: SyncContext) -> PSSync:
    return PSSync(model, spec.ps, name=ctx.name, incarnation=ctx.incarnation, offsets=spec.offsets,
                  n_fetch=spec.n_fetch, n_push=spec.n_push, codec=spec.codec, local_steps=spec.local_steps,
                  inner=spec.inner, ask_timeout_s=ctx.ask_timeout_s, clock=ctx.clock, sparse=spec.sparse)


register(SyncKind("ps", PSLinkSpec, _build, needs_ps=True, owns_optimizer=False,
                  doc="Downpour: push the accumulated gradient every n_push steps, pull every n_fetch, to PS shards "
                      "that run the optimizer (codec and residual on the pushes, quantized deltas down); with local_steps H > 1, "
                      "an inner optimizer steps the replica and the pseudo-gradient is pushed every H steps"))
