"""Peer-to-peer weight sharing (Strom 2015, the y2 cluster): no PS, every peer sends every other its updates.

Each peer keeps two copies of the weights: the **shared copy** ``w`` (what
every peer converges on) and the **local** weights the model trains (views of
a local :class:`~dniasync._core.ParamStore` that runs the job's optimizer).
With ``local_steps = 1`` a step leaves the local weights as they are
(``ParamStore.step_into``) and its change is what the next update codes; the
local weights take every update as ``w`` does (the same adds: they stay equal,
while a step runs too, as Hogwild's steps read weights that updates land in),
so a step costs no dense copy. (Restarting them from ``w`` after every step,
as before, cost two dense copies and a dense subtraction a step: one peer on
the 784-2048-2048-10 MLP ran at 0.74x the samples/s.) A step flow control
holds (below) is applied to the local weights, which are set from ``w`` again
once its update is sent. With ``local_steps = H`` (DiLoCo) the model trains
the local weights for H inner steps, and their change ``local - base`` is
coded. The codec (``threshold``: +-tau per element that
crossed it, the rest kept in this peer's residual; ``none``: dense float32)
makes an :class:`Update` with the next sequence number of this peer. The peer
applies exactly that update to its own ``w`` and sends it to the others; every
update it receives is applied once (a ledger per origin drops duplicates), so
all copies hold the same sum of updates, only in flight apart. With H > 1 the updates are pseudo-gradients: received ones wait,
and at each outer step the outer optimizer (Nesterov) applies the peer's own
and those received since its last one, each over N (the live peers as its
origin saw them when it coded it: the weight travels with the update): one
DiLoCo round when each peer sent one, and the same total on every peer however
the asynchrony groups them and whatever each peer's view of the membership
(the momentum's timing aside).

Who sends to whom: with ``fanout = 0`` the origin sends to every peer. With
``fanout = k`` each update travels down a k-ary tree over the ring of peers
(sorted by address) rooted at its origin: the peer at ring distance r from
the origin forwards it to distances ``r*k + 1 .. r*k + k``; k = 1 is a chain.
Every update reaches every peer whose view of the membership agrees; the
ledger repairs what a changing membership, a lost message or a slow peer left
out:

- every ``tick_s`` each peer tells every other how many updates it has sent
  (:class:`Ledger`; as of the last tick its link to that peer was idle, so an
  update still on its way is not announced yet) and the oldest it still
  keeps (an origin keeps its latest updates, ``keep_bytes`` of them); an
  update of a live origin missing from a ledger for two ticks is asked for
  again from its origin (:class:`Resend`);
- a peer missing more than ``max_lag`` updates (frozen, cut off, late), one
  its origin no longer keeps, or one still missing after
  ``RESEND_PATIENCE_S`` of asking, takes a dense copy of the shared weights,
  with their ledger, from the origin it misses most of (whose copy holds every
  update of its own) (:class:`DenseRequest`), re-applies its own updates the
  copy lacks, and goes on. A few missing updates are thus repaired by resends
  alone: a copy is the whole model, and on a slow link it costs seconds. The
  copy is fetched beside the inbox, which goes on applying updates and
  answering the others' requests meanwhile (two peers asking each other for
  a copy must not wait on each other); it gets ``DENSE_TIMEOUT_S`` plus the
  time its size takes at ``DENSE_MIN_RATE`` bytes/s, and after a copy that
  timed out the next waits that transfer time (a late reply still fills the
  link);
- a peer never waits for another: sends are ``tell_nowait`` (a full outbox
  drops the update, counted), and nothing is sent to a peer silent for
  ``silent_s``: no message of its own and nothing at all on the link from its
  node for that long (it catches up through its ledger once back);
- flow control: a peer codes its next update only while no live peer it
  sends to has more than ``max_unsent_bytes`` from it still on the way
  (:meth:`~dniasync.actors.ActorRef.unsent_bytes`: queued, buffered, or in
  the kernel and not yet acknowledged); until then it trains on, and the
  next update carries the change of every step since (what one threshold
  update cannot carry stays in the codec's residual). On a link slower than
  the peer computes, updates grow further apart instead of queueing without
  bound, and the ledgers and replies behind them stay timely.

A joining peer (``P2PSpec.warm``) takes a dense copy before its first step.
The membership is the job runner's (:class:`Peers`), plus any peer heard
from directly that the runner has not taken out (a peer whose inbox was not
up yet when a change was told still learns of the others). The peer's
messages arrive at a child actor of its trainer
(:class:`PeerInbox`, named :func:`inbox_name`), so the trainer itself needs
no handler for them; the job runner sends it membership changes
(:class:`Peers`) and asks it for a copy (the one peer an evaluation scores), a
count-sketch of its shared copy (:class:`SketchRequest`: every peer, for the
consensus distance; :mod:`dniasync.train.sketch`) and statistics
(:class:`P2PStatsRequest`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import torch
from numpy.typing import NDArray
from prometheus_client.metrics_core import Metric
from torch import nn

from ... import _core
from ...actors import Actor, ActorError, ActorRef, ActorSystem, AskTimeout, handler, message
from ...metrics import Tracker, add_sample, track
from ..compression import CompressedTensor, ThresholdCodec, make_codec
from ..flat import FlatModel, flatten_parameters
from ..sketch import CountSketch
from ..specs import P2PSpec
from ..telemetry import P2P_BYTES, P2P_DENSE, P2P_LAG, P2P_PEERS, P2P_UPDATES
from .base import SyncContext, SyncKind, SyncStats, register
from .outer import OuterOptimizer

if TYPE_CHECKING:
    from .base import WeightSync

__all__ = [
    "P2P_SEGMENT",
    "DenseCopy",
    "DenseRequest",
    "Ledger",
    "P2PStatsRequest",
    "P2PSync",
    "PeerInbox",
    "Peers",
    "Resend",
    "Sketch",
    "SketchRequest",
    "Update",
    "inbox_name",
]

log = logging.getLogger("dniasync.train.sync.p2p")

P2P_SEGMENT: Final = "params"
DENSE_COPY_COOLDOWN_S: Final = 1.0
"""A peer takes at most one dense copy per this interval (the copy itself repairs what it can)."""
RESEND_PATIENCE_S: Final = 5.0
"""An update its origin still keeps is asked for again for this long before a dense copy replaces it (while its
origin's link is busy a resend waits: on a saturated link that can take many ticks)."""
DENSE_TIMEOUT_S: Final = 10.0
DENSE_MIN_RATE: Final = 1 << 20
"""Bytes/s a dense copy is given on top of ``DENSE_TIMEOUT_S`` (a 23 MB model: 22 s more)."""
LINK_POLL_S: Final = 0.002
"""How often a peer waiting for its busy links (local steps, held too long) looks at them again."""
LINK_WAIT_MAX_S: Final = 1.0
"""The longest one such wait: the trainer's messages (a stop) queue behind the step that waits, so after this it
takes one more step (held) and waits again."""


def inbox_name(trainer: str) -> str:
    """The name of the actor that receives the peer messages of ``trainer`` (on the trainer's node)."""
    return f"p2p-{trainer}"


# -- wire ---------------------------------------------------------------------------------
@message("dniasync.train.sync.p2p.Update")
@dataclass(frozen=True)
class Update:
    """One peer's coded update (``seq``-th of ``origin``); ``sender`` is the peer it came from directly."""

    origin: str
    """The origin's inbox address and incarnation, ``address#incarnation``."""
    seq: int
    codec: str
    payload: np.ndarray
    sender: str
    weight: float = 0.0
    """Local steps: what this pseudo-gradient weighs in every copy's outer step, 1/N of its origin's membership
    when it was coded (0: one step per update, or a sender that set none: the receiver's 1/N). Set once, by the
    origin, so every copy applies the same total however the peers' views of the membership differ for a while (a
    peer starting before the last joined, or one declared dead while starved of CPU and taken back)."""


@message("dniasync.train.sync.p2p.Peers")
@dataclass(frozen=True)
class Peers:
    """The job runner's view of the live peers' inboxes (a membership change, or its periodic repeat)."""

    epoch: int
    peers: list[ActorRef]


@message("dniasync.train.sync.p2p.Ledger")
@dataclass(frozen=True)
class Ledger:
    """Periodic, to every peer: ``origin`` has sent ``sent`` updates (and is alive); it keeps those from
    ``kept_from`` on (an older one missing can only come with a dense copy)."""

    origin: str
    sent: int
    kept_from: int = 1


@message("dniasync.train.sync.p2p.Resend")
@dataclass(frozen=True)
class Resend:
    """Ask an origin to send its updates ``seqs`` again, to ``requester`` directly."""

    requester: ActorRef
    seqs: list[int]


@message("dniasync.train.sync.p2p.DenseRequest")
@dataclass(frozen=True)
class DenseRequest:
    """Ask a peer for its shared weights and the ledger they stand for (a :class:`DenseCopy`)."""


@message("dniasync.train.sync.p2p.DenseCopy")
@dataclass(frozen=True)
class DenseCopy:
    """A peer's shared weights; ``ledger``: origin -> ``[have, *extra]`` (every update up to ``have``, and those)."""

    peer: str
    values: np.ndarray
    ledger: dict[str, list[int]]
    steps: int


@message("dniasync.train.sync.p2p.SketchRequest")
@dataclass(frozen=True)
class SketchRequest:
    """Ask a peer for the count-sketch of its shared weights in ``k`` buckets hashed by ``seed`` (a :class:`Sketch`)."""

    seed: int
    k: int


@message("dniasync.train.sync.p2p.Sketch")
@dataclass(frozen=True)
class Sketch:
    """A peer's shared weights, sketched (:class:`~dniasync.train.sketch.CountSketch`): ``k`` float64 sums.

    ``origin`` and ``sent`` name the peer's own updates; ``ledger``: the updates the sketched weights hold, as in
    a :class:`DenseCopy`, so the job can tell how many updates in flight keep two copies apart.
    """

    peer: str
    values: np.ndarray
    steps: int
    origin: str
    sent: int
    ledger: dict[str, list[int]]


@message("dniasync.train.sync.p2p.P2PStatsRequest")
@dataclass(frozen=True)
class P2PStatsRequest:
    """Ask a peer for its counters and ledger (a plain dict, see :meth:`P2PSync.report`)."""


@message("dniasync.train.sync.p2p.Tick")
@dataclass(frozen=True)
class _Tick:
    pass


# -- the ledger -------------------------------------------------------------------------------
@dataclass
class _Received:
    """Which updates of one origin are in the shared copy: all up to ``have``, and ``extra`` above it."""

    have: int = 0
    extra: set[int] = field(default_factory=set)
    high: int = 0
    """The highest seq known to exist (received, or announced by the origin's :class:`Ledger`)."""

    def __contains__(self, seq: int) -> bool:
        return seq <= self.have or seq in self.extra

    def add(self, seq: int) -> None:
        self.extra.add(seq)
        while self.have + 1 in self.extra:
            self.have += 1
            self.extra.discard(self.have)
        self.high = max(self.high, seq)

    def missing(self) -> list[int]:
        return [s for s in range(self.have + 1, self.high + 1) if s not in self.extra]

    def count(self) -> int:
        return self.have + len(self.extra)

    def wire(self) -> list[int]:
        return [self.have, *sorted(self.extra)]

    @classmethod
    def from_wire(cls, entry: Sequence[int]) -> _Received:
        got = cls(int(entry[0]), {int(s) for s in entry[1:]})
        got.high = max([got.have, *got.extra])
        return got


# -- metrics (the families: dniasync.train.telemetry) ------------------------------------------------
def _collect(system: ActorSystem, syncs: Sequence[P2PSync]) -> Iterator[Metric]:
    families = {d: d.family() for d in (P2P_BYTES, P2P_UPDATES, P2P_DENSE)}
    for sync in syncs:
        c = sync.counters
        add_sample(families[P2P_BYTES], ["sent"], c.bytes_sent)
        add_sample(families[P2P_BYTES], ["received"], c.bytes_received)
        for event in ("sent", "forwarded", "received", "duplicate", "applied", "skipped", "held", "flushed",
                      "capped"):
            add_sample(families[P2P_UPDATES], [event], getattr(c, event))
        add_sample(families[P2P_DENSE], ["taken"], c.dense_taken)
        add_sample(families[P2P_DENSE], ["given"], c.dense_given)
        add_sample(families[P2P_DENSE], ["failed"], c.dense_failed)
    yield from families.values()
    if syncs:
        yield P2P_PEERS.single(len(syncs[0].members))
        yield P2P_LAG.single(sum(s.lag() for s in syncs))


PEERS: Final[Tracker[P2PSync]] = Tracker("p2p_peers", _collect)


@dataclass
class _Counters:
    sent: int = 0
    forwarded: int = 0
    received: int = 0
    duplicate: int = 0
    applied: int = 0
    skipped: int = 0
    held: int = 0
    """Steps whose change waited for a later update: a link was still busy with earlier ones (flow control)."""
    flushed: int = 0
    """Own updates coded when the trainer stopped, of steps flow control held (no step coded them)."""
    waited_ms: int = 0
    """Milliseconds the trainer waited for busy links after H steps held (``_wait_for_links``; local steps or
    the ``threshold`` codec)."""
    capped: int = 0
    """Updates that carried only the cap's bytes of their codes (the rest went with later ones; see ``_code``)."""
    resends_asked: int = 0
    resent: int = 0
    dense_taken: int = 0
    dense_given: int = 0
    dense_failed: int = 0
    """Dense copies asked for that did not come (timed out, or the peer was gone)."""
    lost_own: int = 0
    """Own updates a dense copy lacked that were no longer kept to re-apply."""
    bytes_sent: int = 0
    bytes_received: int = 0
    dense_bytes_sent: int = 0
    """What the own updates sent would take as float32."""


# -- the sync ------------------------------------------------------------------------------
class P2PSync:
    """One peer's side of peer-to-peer sharing (see the module's docstring); built by :func:`_build`."""

    pulls_params = False

    def __init__(self, spec: P2PSpec, model: nn.Module, ctx: SyncContext) -> None:
        if spec.codec not in ("threshold", "none"):
            raise ValueError(f"p2p codec must be 'threshold' or 'none', got {spec.codec!r}")
        if spec.local_steps < 1 or spec.max_lag < 1 or spec.fanout < 0:
            raise ValueError("p2p needs local_steps >= 1, max_lag >= 1 and fanout >= 0")
        self.spec = spec
        self.ctx = ctx
        init = flatten_parameters(model)
        self.n = int(init.size)
        self.store = ctx.optimizer.store([(P2P_SEGMENT, self.n)])
        self.store.write(P2P_SEGMENT, init)
        self._flat = FlatModel(model, self.store.view(P2P_SEGMENT))
        self.direct = spec.local_steps == 1
        """One step per update: a step leaves the model's weights as they are (``ParamStore.step_into``), its change
        is coded, and the model's weights take every update as the shared copy does (the same adds, so they stay
        equal); no dense copy or subtraction per step. (With local steps the model trains its own weights for H
        steps, restarted from the shared copy after each outer step.)"""
        self._shared = _core.ParamStore([(P2P_SEGMENT, self.n)], "sgd", nonfinite="allow")
        self._shared.write(P2P_SEGMENT, init)
        self.w: NDArray[np.float32] = self._shared.view(P2P_SEGMENT)
        """The shared copy: the sum of every update applied (own and received). A view of a store of its own, so
        that an update goes in by the codec's add in Rust (a threshold update: its codes' elements only): 11 ns a
        code against numpy's indexed add's 40 (775,000 codes over 5.8M weights), the same bits."""
        self.base: NDArray[np.float32] = np.empty(0, np.float32) if self.direct else init.copy()
        """Local steps: ``w`` when the local weights were last set to it (``local - base`` is this peer's own
        progress)."""
        self.change: NDArray[np.float32] = np.zeros(self.n if self.direct else 0, np.float32)
        """One step per update: the change of the steps not yet coded (those flow control held, and the last)."""
        self._local_apart = False
        """One step per update: the model's weights differ from the shared copy (held steps' progress, or a dense
        copy replaced the shared one): set from it at the next point no step runs."""
        self._step_out: NDArray[np.float32] = np.zeros(self.n if self.direct else 0, np.float32)
        """The last step's change, as ``step_into`` writes it (swapped with :attr:`change` when that holds none)."""
        self.lr = ctx.optimizer.lr
        self.scale = 1.0
        self.codec = make_codec(spec.codec, self.n, tau=spec.tau)  # type: ignore[arg-type]
        self.inner = 0
        """Inner steps taken since the last update was coded."""
        self.steps = 0
        self._coded: list[CompressedTensor] = []
        """Own updates coded on the worker thread, applied and sent by :meth:`sync` on the loop."""
        self._cap_from = 0
        """The weight index the next capped update's codes start from."""
        self._cap = spec.update_cap_bytes
        """The most bytes of codes the next update carries (see :meth:`_code`)."""
        self.seq = 0
        self._own: deque[tuple[int, str, np.ndarray, float]] = deque()
        """This peer's latest updates (seq, codec, payload, weight), ``keep_bytes`` of them, for resends."""
        self._own_bytes = 0
        self.ledger: dict[str, _Received] = {}
        self._pending: list[tuple[str, int, NDArray[np.float32], float]] = []
        """With local steps: received pseudo-gradients waiting for the next outer step (origin, seq, update,
        weight)."""
        self._outer: OuterOptimizer | None = None
        self.counters = _Counters()
        self.epoch = spec.epoch
        self.me = ""
        """This peer's inbox address (set once the inbox runs)."""
        self.origin = ""
        self.members: list[str] = []
        """Inbox addresses of the live peers, sorted (this one's included)."""
        self._refs: dict[str, ActorRef] = {}
        self._gone: set[str] = set()
        """Peers the job runner took out of the membership (a late word from them does not bring them back)."""
        self._initial_peers = list(spec.peers)
        self.heard: dict[str, float] = {}
        self.announced: dict[str, int] = {}
        """origin -> the sent count its last :class:`Ledger` announced."""
        self._kept_from: dict[str, int] = {}
        """origin -> the oldest of its updates it still keeps, as its latest :class:`Ledger` said."""
        self._left: dict[str, int] = {}
        """peer address -> this peer's sent count when its link to that peer was last found idle (what a
        :class:`Ledger` to it announces)."""
        self._asked: dict[tuple[str, int], int] = {}
        """(origin, seq) -> resends asked for it so far."""
        self._missing_before: set[tuple[str, int]] = set()
        self._last_copy = -1e9
        self._copy_wait = DENSE_COPY_COOLDOWN_S
        """Seconds from the last dense copy (taken or failed) to the next: longer after a failed one."""
        self._copying: asyncio.Task[bool] | None = None
        """The dense copy being fetched (beside the inbox, which goes on receiving meanwhile)."""
        self._sketcher: CountSketch | None = None
        """Built at the first :class:`SketchRequest` and kept: the job asks with the same seed and k every time."""
        self.inbox: ActorRef | None = None
        self._started = False
        self._closed = False
        self._restart_pending = False
        self._stopped = False
        """The trainer stopped training (:meth:`flush`) and has not stepped since: received updates go in at once."""

    # -- WeightSync: the trainer's side -------------------------------------------------
    @property
    def flat(self) -> FlatModel:
        return self._flat

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return None

    def zero_grad(self) -> None:
        for p in self._flat.model.parameters():
            p.grad = None

    def step(self, lr_scale: float = 1.0) -> None:
        """Worker thread: the local optimizer steps the local weights; every H steps their change is coded.

        One step per update: the weights are the shared copy and the step leaves them (see :attr:`direct`); its
        change is added to what earlier held steps left in :attr:`change`."""
        self._flat.accumulate_grad()
        lr = self.lr * self.scale * lr_scale
        delta = self._step_out
        if self.direct:
            self.store.step_into(P2P_SEGMENT, self._flat.grad.numpy(), lr, delta)
            if self.inner:  # steps held before: this one's change joins theirs
                np.add(self.change, delta, out=self.change)
            else:
                self.change, self._step_out = delta, self.change
        else:
            self.store.step(P2P_SEGMENT, self._flat.grad.numpy(), lr)
        self._flat.grad.zero_()
        self.steps += 1
        self.inner += 1
        if self.inner >= self.spec.local_steps:
            if self._links_busy():
                self.counters.held += 1  # the next update carries this step's change too
                self._cap = max(self.spec.update_cap_bytes, self._cap // 2)
                if self.direct:  # meanwhile the model trains on from its own progress
                    self.store.add(P2P_SEGMENT, delta)
                    self._local_apart = True
                return
            self.inner = 0
            self._coded.append(self._code(self._own_change()))
            self._cap = min(2 * self._cap, 4 * self.n)  # the links took the last update in time: a larger next

    def _own_change(self) -> NDArray[np.float32]:
        """Worker thread: this peer's own change since its last update (which the next one codes)."""
        return self.change if self.direct else self.store.view(P2P_SEGMENT) - self.base

    def _code(self, change: NDArray[np.float32]) -> CompressedTensor:
        """Worker thread: the next update coding ``change`` (what the codec leaves out stays in its residual).

        A threshold update carries at most the cap's bytes of codes: those of the weights from where the last capped
        one ended on (round-robin); the other weights that reached ``tau`` keep it in the residual for the next
        updates. The cap follows the links: it starts at ``update_cap_bytes``, doubles with each update coded while
        they were idle (up to the whole model), and halves, to no less than ``update_cap_bytes``, with each step
        held because one was busy. (Adagrad's first steps move nearly every weight past ``tau``: uncapped, the first
        update is the size of the model, and on a slow link it holds back everything behind it for as long as it
        takes; a fixed small cap, on a fast link, keeps the shared copy far behind what the peers learn.)"""
        codec = self.codec
        if not isinstance(codec, ThresholdCodec):
            return codec.compress(change)
        coded, nxt = codec.compress_capped(change, max(1, self._cap // 4), self._cap_from)
        if nxt != self._cap_from:
            self._cap_from = nxt
            self.counters.capped += 1
        return coded

    def _links_busy(self) -> bool:
        """Worker thread: a live peer this one sends its updates to has more than ``max_unsent_bytes`` from it
        still on the way. (Peers silent for ``silent_s`` are not sent to, so they hold nothing back.)"""
        now = self.ctx.clock()
        refs = self._refs
        for address in self._targets(self.me):
            ref = refs.get(address)
            if ref is not None and not self._silent(address, now) and ref.unsent_bytes() > self.spec.max_unsent_bytes:
                return True
        return False

    def steps_per_call(self, steps: int) -> int:
        return max(1, self.spec.local_steps - self.inner)

    async def ready(self) -> None:
        if not self._started:
            self._started = True
            await self._start()
        self._stopped = False
        if self._restart_pending and not self._coded and self.inner == 0:  # no step runs now: safe to restart
            self._restart_local()

    async def sync(self, samples: int) -> None:
        """Loop: apply the coded own updates to the shared copy, send them, restart the local weights from it."""
        if not self._coded:
            if self.inner >= self.spec.local_steps:  # this peer's update held
                if not self.direct and self._pending:
                    self._take_while_held()
                waits = not self.direct or isinstance(self.codec, ThresholdCodec)
                if waits and self.inner >= 2 * self.spec.local_steps:
                    await self._wait_for_links()
            return
        coded, self._coded = self._coded, []
        for compressed in coded:
            self.seq += 1
            payload = compressed.payload
            weight = 0.0 if self.spec.local_steps == 1 else 1.0 / max(len(self.members), 1)
            self._keep(self.seq, compressed.codec, payload, weight)
            update = Update(self.origin, self.seq, compressed.codec, payload, self.me, weight)
            self.counters.sent += 1
            self.counters.dense_bytes_sent += 4 * self.n
            self._spread(update, own=True)
            if self.spec.local_steps == 1:
                self._apply(self.origin, self.seq, compressed.codec, payload)
            else:
                self._outer_step(self._decode(compressed.codec, payload), weight)
                self._mark(self.origin, self.seq)
        self._restart_local()

    def _keep(self, seq: int, codec: str, payload: np.ndarray, weight: float) -> None:
        self._own.append((seq, codec, payload, weight))
        self._own_bytes += int(payload.nbytes)
        while self._own_bytes > self.spec.keep_bytes and len(self._own) > 1:
            self._own_bytes -= int(self._own.popleft()[2].nbytes)

    def _restart_local(self) -> None:
        """The local weights from the shared copy (one step per update: only where they differ from it)."""
        self._restart_pending = False
        if not self.direct:
            np.copyto(self.base, self.w)
        elif not self._local_apart:
            return
        self._local_apart = False
        self.store.write(P2P_SEGMENT, self.w)

    def scale_lr(self, scale: float) -> None:
        self.scale = scale

    def lr_now(self) -> float:
        return self.lr * self.scale

    async def flush(self) -> None:
        """The trainer stops training: a change flow control held goes now, and from now on (until it steps again)
        every received update is applied as it arrives, as those waiting for an outer step are now (local steps:
        no outer step comes any more), so that once every update has landed every copy holds them all."""
        if self.inner >= self.spec.local_steps:  # steps flow control held back: their change goes now
            self.inner = 0
            self._coded.append(self._code(self._own_change()))
            self.counters.flushed += 1
        await self.sync(0)
        self._stopped = True
        self._apply_pending()

    async def _wait_for_links(self) -> None:
        """Held for H steps more (local steps, or the ``threshold`` codec): no more steps until the links take the
        update (or the peers they lead to fall silent, or the node closes). A peer's pseudo-gradient weighs 1/N
        wherever it lands, so one that trained alone for hundreds of steps (its loop, which drains its links and
        takes the others' updates, starved by its own steps) ends as a quarter of a model that drifted apart: on a
        loaded 2-core machine 4 peers of a small MLP sent 31 updates in 2,517 steps and the job ended at 0.762
        against 0.908 with one step per update. With one step per update a held step stays in the local weights in
        full and every received update lands in them, so those peers train on, unless their codec is ``threshold``:
        an update moves each weight by at most tau whatever number of steps it carries, so what a held peer learned
        piles up in its codec's residual, never reaching the shared copy (on a loaded 2-core machine 2 peers sent 20
        and 34 updates in 773 and 574 steps, their residuals' mean 0.020 against 0.002 in a run that flowed, and the
        job ended at 0.842 against 0.93); they wait too. At most :data:`LINK_WAIT_MAX_S` at a time (the trainer's
        own messages wait)."""
        started = self.ctx.clock()
        while self._links_busy() and not self._closed and self.ctx.clock() - started < LINK_WAIT_MAX_S:
            await asyncio.sleep(LINK_POLL_S)
        self.counters.waited_ms += round(1000 * (self.ctx.clock() - started))

    def _take_while_held(self) -> None:
        """Local steps, this peer's update held by flow control (a link busy): the received pseudo-gradients go in
        now, as at the stop (:meth:`_apply_pending`), and the local weights and their base move with the shared
        copy, so this peer's own progress (``local - base``) stays for its next update. A held peer thus trains on
        from what the others learned, as with one step per update (where received updates land in the local weights
        too). Before, it trained alone on its shard until its links were idle (on a loaded 2-core machine 4 peers of
        an MLP held 670-1,198 of 1,500 steps, and ended 3-5 points under one step per update); a peer whose links
        stay busy H steps more then waits for them (:meth:`_wait_for_links`)."""
        before = self.w.copy()
        self._apply_pending()
        moved = self.w - before
        self.base += moved
        self.store.add(P2P_SEGMENT, moved)

    def _apply_pending(self) -> None:
        """Local steps, training stopped or this peer's update held: the received pseudo-gradients waiting, each over
        N, without the outer momentum (no outer step comes, or none yet, to give it; with the default momentum 0 the
        same as an outer step would), each at its own weight (:attr:`Update.weight`)."""
        if not self._pending:
            return
        for _, _, update, weight in self._pending:
            self.w += np.float32(self.spec.outer_lr * weight) * update
        self._pending.clear()

    def relinked(self, layers: nn.Module) -> WeightSync:
        raise NotImplementedError("p2p sharing is for data-parallel replicas: their layers never move")

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {"shared": torch.from_numpy(self.w.copy())}
        for slot in range(1, self.store.state_slots + 1):
            out[f"state{slot}"] = torch.from_numpy(self.store.view(P2P_SEGMENT, state=slot).copy())
        out["steps"] = torch.tensor(self.store.steps(P2P_SEGMENT), dtype=torch.int64)  # Adam's bias correction
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        np.copyto(self.w, state["shared"].numpy())
        if self.direct:
            self.inner = 0  # a change held for the next update goes, as the local weights' progress goes below
            self._local_apart = True
        for slot in range(1, self.store.state_slots + 1):
            self.store.write(P2P_SEGMENT, state[f"state{slot}"].numpy(), state=slot)
        if "steps" in state:  # saved since Adam's count is (before, it started again)
            self.store.set_steps(P2P_SEGMENT, int(state["steps"]))
        self._restart_local()

    def stats(self) -> SyncStats:
        c = self.counters
        extra = {"updates_received": c.received, "updates_applied": c.applied, "updates_forwarded": c.forwarded,
                 "updates_skipped": c.skipped, "updates_held": c.held,
                 "dense_copies": c.dense_taken, "lag": self.lag()}
        return SyncStats(
            bytes_pushed=c.bytes_sent, bytes_pulled=c.bytes_received, dense_bytes_pushed=c.dense_bytes_sent,
            pushes=c.sent, pulls=c.dense_taken, extra={k: v for k, v in extra.items() if v},
        )

    async def close(self) -> None:
        self._closed = True
        if self.inbox is not None:
            self.inbox = None
        copying, self._copying = self._copying, None
        if copying is not None and not copying.done():
            copying.cancel()
            await asyncio.gather(copying, return_exceptions=True)

    # -- start: the inbox, and a late joiner's dense copy -----------------------------------
    async def _start(self) -> None:
        actor = self.ctx.actor
        if actor is not None:
            self.inbox = await actor.spawn(PeerInbox, self, name=inbox_name(self.ctx.name))
            self.me = self.inbox.address
            track(actor.system, PEERS, self.inbox, self)
        else:  # no actor to receive with: a lone peer (a test of the sync alone)
            self.me = inbox_name(self.ctx.name)
        self.origin = f"{self.me}#{self.ctx.incarnation}"
        self._set_members(self._initial_peers)
        if self.spec.warm:
            for peer in self._initial_peers:
                if peer.address != self.me and await self._copy_from(peer):
                    break
            else:
                log.warning("peer %s: no peer gave a dense copy; starting from the initial weights", self.me)

    # -- membership ----------------------------------------------------------------------
    def _set_members(self, refs: Iterable[ActorRef]) -> None:
        now = self.ctx.clock()
        self._refs = {ref.address: ref for ref in refs if ref.address != self.me}
        for address in self._refs:
            self.heard.setdefault(address, now)  # a newcomer gets silent_s before it counts as silent
        self.members = sorted({*self._refs, self.me})

    def on_peers(self, msg: Peers) -> None:
        if msg.epoch < self.epoch:
            return
        self.epoch = msg.epoch
        listed = {ref.address for ref in msg.peers}
        self._gone |= set(self._refs) - listed
        self._gone -= listed
        self._set_members(msg.peers)

    def _heard_from(self, address: str, origin: str | None = None) -> None:
        """A message came from ``address``: a peer the membership lacks joins it (unless the runner took it out)."""
        self.heard[address] = self.ctx.clock()
        actor = self.ctx.actor
        if address not in self._refs and address != self.me and address not in self._gone and actor is not None:
            self._set_members([*self._refs.values(), actor.system.ref(address)])

    def _silent(self, address: str, now: float) -> bool:
        """Nothing came from ``address`` for ``silent_s``: neither a message of its own nor anything at all on the
        link from its node (:meth:`~dniasync.actors.ActorRef.silent_for`). The link's word counts because a peer
        whose inbox is behind (a slow node, every link saturated) reads its peers' messages late, yet their frames
        still arrive: such a peer is not silent, and cutting it off would only make it take a dense copy later."""
        if now - self.heard.get(address, now) <= self.spec.silent_s:
            return False
        ref = self._refs.get(address)
        return ref is None or ref.silent_for() > self.spec.silent_s

    def _alive_origin(self, origin: str) -> bool:
        return origin.partition("#")[0] in self.members

    # -- spreading ------------------------------------------------------------------------
    def _targets(self, origin_address: str) -> list[str]:
        """Where a holder of an update of ``origin_address`` sends it: its children in the origin's tree."""
        members, k = self.members, self.spec.fanout
        if self.me not in members or origin_address not in members:
            return [] if origin_address != self.me else [m for m in members if m != self.me]
        n = len(members)
        root, mine = members.index(origin_address), members.index(self.me)
        r = (mine - root) % n
        if k == 0 or k >= n - 1:
            return [m for m in members if m != self.me] if r == 0 else []
        return [members[(root + child) % n] for child in range(r * k + 1, min(r * k + k, n - 1) + 1)]

    def _spread(self, update: Update, *, own: bool) -> None:
        origin_address = update.origin.partition("#")[0]
        targets = self._targets(origin_address)
        out = Update(update.origin, update.seq, update.codec, update.payload, self.me, update.weight)
        now = self.ctx.clock()
        for address in targets:
            if self._silent(address, now):
                self.counters.skipped += 1  # a silent peer catches up from its ledger once back
                continue
            if self._tell(self._refs[address], out):
                self.counters.bytes_sent += int(update.payload.nbytes)
                if not own:
                    self.counters.forwarded += 1
            else:
                self.counters.skipped += 1

    def _tell(self, ref: ActorRef, msg: Any) -> bool:
        try:
            ref.tell_nowait(msg)
        except ActorError as exc:
            log.debug("peer %s: %s to %s not sent: %s", self.me, type(msg).__name__, ref, exc)
            return False
        return True

    # -- receiving ------------------------------------------------------------------------
    def on_update(self, msg: Update) -> None:
        self._heard_from(msg.sender)
        self.counters.bytes_received += int(msg.payload.nbytes)
        got = self.ledger.get(msg.origin)
        if got is not None and msg.seq in got:
            self.counters.duplicate += 1
            return
        weight = self._weight_of(msg)  # refused before it is counted, forwarded or applied
        self.counters.received += 1
        self._spread(msg, own=False)
        if self.spec.local_steps == 1:
            self._apply(msg.origin, msg.seq, msg.codec, msg.payload)
        else:
            self._pending.append((msg.origin, msg.seq, self._decode(msg.codec, msg.payload), weight))
            self._mark(msg.origin, msg.seq)
            if self._stopped:
                self._apply_pending()

    def _weight_of(self, msg: Update) -> float:
        """The outer-step weight of a received pseudo-gradient: the one its origin set, else 1/N here."""
        if not (math.isfinite(msg.weight) and 0.0 <= msg.weight <= 1.0):
            raise ValueError(f"peer {self.me}: an update of {msg.origin} weighs {msg.weight}, not within [0, 1]")
        return msg.weight or 1.0 / max(len(self.members), 1)

    def _compressed(self, codec: str, payload: np.ndarray) -> CompressedTensor:
        if codec != self.spec.codec:
            raise ValueError(f"peer {self.me}: an update coded with {codec!r}, this job codes with {self.spec.codec!r}")
        return CompressedTensor(codec, (self.n,), np.ascontiguousarray(payload, dtype=np.uint8))

    def _decode(self, codec: str, payload: np.ndarray) -> NDArray[np.float32]:
        return self.codec.extract(self._compressed(codec, payload))

    def _apply(self, origin: str, seq: int, codec: str, payload: np.ndarray) -> None:
        """Add one update to the shared copy (only the coded elements, for ``threshold``) and mark it."""
        coded = self._compressed(codec, payload)
        self.codec.add_to(self._shared, P2P_SEGMENT, coded)
        if self.direct:  # the model's weights take it too, the same adds (a step running meanwhile only reads them)
            self.codec.add_to(self.store, P2P_SEGMENT, coded)
        self._mark(origin, seq)

    def _mark(self, origin: str, seq: int) -> None:
        self.ledger.setdefault(origin, _Received()).add(seq)
        self.counters.applied += 1

    def _outer_step(self, own: NDArray[np.float32], weight: float) -> None:
        """Local steps: the outer optimizer applies this peer's and the waiting received updates, each at its weight
        (1/N of its origin's membership when coded)."""
        if self._outer is None:
            self._outer = OuterOptimizer(self.n, lr=self.spec.outer_lr, momentum=self.spec.outer_momentum)
        # each pseudo-gradient weighs the same wherever it lands: every peer applies the same total whatever it
        # groups (dividing by the updates at hand instead gave a slow peer, holding many, a different total; and
        # dividing by each receiver's own N, copies whose views of the membership differed for a while drifted apart)
        mean = own * np.float32(weight)
        for _, _, update, w in self._pending:
            mean += np.float32(w) * update
        self._pending.clear()
        self._outer.step(self.w, -mean, out=self.w)  # the pseudo-gradient is minus the change

    def on_ledger(self, msg: Ledger) -> None:
        self._heard_from(msg.origin.partition("#")[0])
        self.announced[msg.origin] = max(self.announced.get(msg.origin, 0), msg.sent)
        self._kept_from[msg.origin] = max(self._kept_from.get(msg.origin, 1), msg.kept_from)
        got = self.ledger.setdefault(msg.origin, _Received())
        got.high = max(got.high, msg.sent)

    def on_resend(self, msg: Resend) -> None:
        self._heard_from(msg.requester.address)
        if msg.requester.unsent_bytes() > self.spec.max_unsent_bytes:
            return  # the link is still busy, likely with what is asked for: asked again next tick if still missing
        kept = {seq: (codec, payload, weight) for seq, codec, payload, weight in self._own}
        for seq in msg.seqs:
            if seq in kept:
                codec, payload, weight = kept[seq]
                if self._tell(msg.requester, Update(self.origin, seq, codec, payload, self.me, weight)):
                    self.counters.resent += 1
                    self.counters.bytes_sent += int(payload.nbytes)

    # -- dense copies ------------------------------------------------------------------------
    def _ledger_of_weights(self) -> dict[str, list[int]]:
        """The ledger the shared weights stand for, on the wire (received updates still waiting excluded)."""
        ledger = {o: _Received(r.have, set(r.extra), r.high) for o, r in self.ledger.items()}
        for origin, seq, _, _ in self._pending:
            got = ledger[origin]
            if seq <= got.have:
                got.extra |= set(range(seq + 1, got.have + 1))
                got.have = seq - 1
            got.extra.discard(seq)
        return {o: r.wire() for o, r in ledger.items()}

    def dense_copy(self) -> DenseCopy:
        """The shared weights and the ledger they stand for (received updates still waiting excluded)."""
        self.counters.dense_given += 1
        self.counters.bytes_sent += 4 * self.n
        return DenseCopy(self.me, self.w.copy(), self._ledger_of_weights(), self.steps)

    def sketch(self, msg: SketchRequest) -> Sketch:
        """The count-sketch of the shared weights (received updates still waiting excluded, as in a dense copy)."""
        sketcher = self._sketcher
        if sketcher is None or (sketcher.seed, sketcher.k) != (msg.seed, msg.k):
            sketcher = self._sketcher = CountSketch(self.n, msg.k, msg.seed)
        return Sketch(self.me, sketcher(self.w), self.steps, self.origin, self.seq, self._ledger_of_weights())

    def _copy_seconds(self) -> float:
        """What a dense copy is given: ``DENSE_TIMEOUT_S`` and the time its size takes at ``DENSE_MIN_RATE``."""
        return DENSE_TIMEOUT_S + 4 * self.n / DENSE_MIN_RATE

    async def _copy_from(self, peer: ActorRef) -> bool:
        """Take ``peer``'s shared weights and ledger; re-apply own updates the copy lacks. False if it failed.

        Updates received while the copy was on its way and not in it are missing again afterwards (the ledger is
        the copy's, their seqs are known): the tick asks for them like any other. A copy that timed out may still
        come, filling the link it was asked over: the next waits the time its size takes there."""
        try:
            reply = await peer.ask(DenseRequest(), timeout=self._copy_seconds())
        except ActorError as exc:
            log.info("peer %s: no dense copy from %s: %s", self.me, peer, exc)
            self.counters.dense_failed += 1
            if isinstance(exc, AskTimeout):
                self._copy_wait = max(self._copy_wait, DENSE_COPY_COOLDOWN_S + 4 * self.n / DENSE_MIN_RATE)
            return False
        if not isinstance(reply, DenseCopy) or reply.values.shape != (self.n,):
            log.warning("peer %s: %s answered a dense copy request with %r", self.me, peer, type(reply).__name__)
            return False
        if self._closed:
            return False
        self._last_copy = self.ctx.clock()
        self._copy_wait = DENSE_COPY_COOLDOWN_S
        highs = {o: r.high for o, r in self.ledger.items()}
        np.copyto(self.w, reply.values)
        self._local_apart = True
        self.ledger = {o: _Received.from_wire(entry) for o, entry in reply.ledger.items()}
        for origin, high in highs.items():
            got = self.ledger.setdefault(origin, _Received())
            got.high = max(got.high, high)
        self._pending.clear()
        mine = self.ledger.setdefault(self.origin, _Received())
        kept = {seq: (codec, payload, weight) for seq, codec, payload, weight in self._own}
        for seq in range(1, self.seq + 1):
            if seq in mine:
                continue
            if seq in kept:
                codec, payload, weight = kept[seq]
                if self.spec.local_steps == 1:
                    self._apply(self.origin, seq, codec, payload)
                else:  # a pseudo-gradient the copy lacks goes in with the next outer step
                    self._pending.append((self.origin, seq, self._decode(codec, payload), weight))
                    mine.add(seq)
            else:
                self.counters.lost_own += 1
                mine.add(seq)
        self._asked.clear()
        self._missing_before.clear()
        self.counters.dense_taken += 1
        self.counters.bytes_received += int(reply.values.nbytes)
        self._restart_pending = True  # the trainer restarts from the copy between two steps (ready or sync)
        if self._stopped:
            self._apply_pending()
        log.info("peer %s: took a dense copy from %s (%d steps there)", self.me, reply.peer, reply.steps)
        return True

    # -- the tick: announce, find what is missing, repair -------------------------------------------
    def lag(self) -> int:
        """Updates of live peers known to exist that the shared copy lacks."""
        return sum(len(r.missing()) for o, r in self.ledger.items() if self._alive_origin(o) and o != self.origin)

    async def tick(self) -> None:
        if self._closed or self.inbox is None:
            return
        for address, ref in self._refs.items():
            # announce to a peer only the updates that have left for it: on a slow link a Ledger overtakes the
            # update it counts, and the peer would ask again for what is only still on its way
            if ref.unsent_bytes() <= self.spec.max_unsent_bytes:
                self._left[address] = self.seq
            self._tell(ref, Ledger(self.origin, self._left.get(address, 0), self._own[0][0] if self._own else 1))
        copying = self._copying
        if copying is not None:
            if not copying.done():
                return  # a dense copy is on its way: it changes what is missing
            self._copying = None
            if not copying.cancelled() and copying.exception() is not None:
                log.error("peer %s: a dense copy failed", self.me, exc_info=copying.exception())
        missing = {(o, s) for o, r in self.ledger.items() if self._alive_origin(o) and o != self.origin
                   for s in r.missing()}
        now = self.ctx.clock()
        patience = max(2, round(RESEND_PATIENCE_S / self.spec.tick_s))
        # not kept: missing for a whole tick too (with fanout an update can come by another peer after its origin's
        # ledger), and older than what its origin keeps
        stuck = [origin for origin, seq in missing
                 if ((origin, seq) in self._missing_before and seq < self._kept_from.get(origin, 1))
                 or self._asked.get((origin, seq), 0) >= patience]
        if (len(missing) > self.spec.max_lag or stuck) and now - self._last_copy >= self._copy_wait:
            counts: dict[str, int] = {}
            for origin, _ in missing:
                counts[origin] = counts.get(origin, 0) + 1
            source = stuck[0] if stuck else max(counts, key=lambda o: counts[o])
            log.info("peer %s: %d updates missing (%d no longer kept or asked for too long): a dense copy from %s",
                     self.me, len(missing), len(stuck), source)
            self._copying = asyncio.ensure_future(self._copy_from_neighbour(source.partition("#")[0]))
            return
        ask: dict[str, list[int]] = {}
        for origin, seq in sorted(missing & self._missing_before):  # missing for a whole tick: not in flight
            ask.setdefault(origin, []).append(seq)
            self._asked[(origin, seq)] = self._asked.get((origin, seq), 0) + 1
        self._missing_before = missing
        if self.inbox is not None:
            for origin, seqs in ask.items():
                target = self._refs.get(origin.partition("#")[0])
                if target is not None and self._tell(target, Resend(self.inbox, seqs)):
                    self.counters.resends_asked += len(seqs)

    async def _copy_from_neighbour(self, first: str) -> bool:
        """A dense copy from ``first`` (the origin missed most: its copy holds all its own updates), else from another
        peer. If none gave one the next try comes after the cooldown, or after a timed-out copy's transfer time."""
        others = [a for a in self._refs if a != first]
        random.shuffle(others)
        self._copy_wait = DENSE_COPY_COOLDOWN_S
        for address in [first, *others] if first in self._refs else others:
            ref = self._refs.get(address)
            if ref is not None and await self._copy_from(ref):
                return True
        self._last_copy = self.ctx.clock()
        return False

    def report(self) -> dict[str, Any]:
        """Counters and ledger for the job runner: what this peer sent, and which updates its copy holds."""
        c = self.counters
        return {
            "peer": self.me, "origin": self.origin, "sent": self.seq, "steps": self.steps,
            "ledger": {o: r.count() for o, r in self.ledger.items()},
            "complete": {o: r.have for o, r in self.ledger.items()},
            "lag": self.lag(), "members": list(self.members), "stopped": self._stopped,
            "counters": {name: int(getattr(c, name)) for name in c.__dataclass_fields__},
        }


class PeerInbox(Actor):
    """Receives a peer's messages for its :class:`P2PSync` (a child of the trainer, named :func:`inbox_name`)."""

    mailbox_size = 4096

    def __init__(self, sync: P2PSync) -> None:
        self.sync = sync

    async def on_start(self) -> None:
        self.send_later(self.sync.spec.tick_s * random.uniform(0.5, 1.0), _Tick())

    @handler
    def update(self, msg: Update) -> None:
        self.sync.on_update(msg)

    @handler
    def peers(self, msg: Peers) -> None:
        self.sync.on_peers(msg)

    @handler
    def ledger(self, msg: Ledger) -> None:
        self.sync.on_ledger(msg)

    @handler
    def resend(self, msg: Resend) -> None:
        self.sync.on_resend(msg)

    @handler
    def dense(self, msg: DenseRequest) -> DenseCopy:
        return self.sync.dense_copy()

    @handler
    def sketch(self, msg: SketchRequest) -> Sketch:
        return self.sync.sketch(msg)

    @handler
    def stats(self, msg: P2PStatsRequest) -> dict[str, Any]:
        return self.sync.report()

    @handler
    async def tick(self, msg: _Tick) -> None:
        started = time.monotonic()
        try:
            await self.sync.tick()
        finally:
            spent = time.monotonic() - started
            self.send_later(max(0.0, self.sync.spec.tick_s - spent), _Tick())


def _build(spec: P2PSpec, model: nn.Module, ctx: SyncContext) -> P2PSync:
    return P2PSync(spec, model, ctx)


register(SyncKind("p2p", P2PSpec, _build, needs_ps=False, owns_optimizer=False,
                  doc="peer to peer (Strom 2015): each peer's quantized updates reach every other (sent to all, or "
                      "gossiped down a tree), no PS; the peer's own ParamStore runs [optimizer] on its local steps"))
