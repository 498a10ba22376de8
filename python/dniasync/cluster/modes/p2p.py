"""Peer-to-peer data parallelism (Strom 2015, the y2 cluster): no PS, peers send each other their quantized updates.

Every worker process runs one :class:`~dniasync.train.replica.Replica` on its
own data shard, sharing its weights through the ``p2p`` weight sync
(:mod:`dniasync.train.sync.p2p`): what a peer sends and receives never passes
through the coordinator. The coordinator keeps job control only:

- it hands each joining worker a :class:`~dniasync.train.sync.p2p.P2PSpec`
  with the live peers' inboxes (``warm``: take a dense copy from one of them
  first, once any peer has trained), and tells every live peer the new
  membership (:class:`~dniasync.train.sync.p2p.Peers`) when a peer joins, dies
  or comes back, and every :data:`PEERS_REPEAT_S` in case a peer missed it;
- a peer silent past the liveness limit is declared dead (an event naming it),
  its data shard goes to a live peer, and the others stop sending to it; one
  that reports again (it was frozen) is taken back: it gets a data shard and
  the membership, and catches up from a neighbour's dense copy;
- each evaluation asks one live peer for its shared weights and scores them,
  and asks every live peer for a count-sketch of its own
  (:mod:`dniasync.train.sketch`: :data:`~dniasync.train.sketch.SKETCH_BUCKETS`
  float64 sums, 32 KiB, whatever the model's size; seeded by the job so every
  peer hashes alike) and records the **consensus distance**: the max and mean
  over live peers of ``||w_i - mean(w)|| / ||mean(w)||``, estimated from the
  sketches (the sketch is linear: the mean's sketch is the sketches' mean;
  within ~1.6% of the exact figure, one standard deviation).
  ``consensus.json`` beside the summary holds the series, each reading with
  ``lag_max``: the most updates any sketched copy lacked of those another
  held or their origin had sent (:func:`in_flight`; copies lacking none
  differ by float rounding only). Copying every peer's
  weights instead would cost N dense copies per evaluation on the training's
  links;
- at the end it waits (at most :data:`SETTLE_S`) for every live peer to have
  stopped (its held change sent; from then on it applies what it receives at
  once, with local steps too) and its ledger to hold every update the live
  peers sent; the last evaluation scores a copy then, so the final accuracy is
  of the weights every peer ends with. It then puts each peer's counters
  and ledger, the bytes sent per step and the consensus figures into the
  summary (``consensus_distance_settled``: the distance once settled, which
  only float rounding keeps above 0; from the sketches too, which give exactly
  0 for identical copies, so one dense copy is all an evaluation moves).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

import numpy as np
from msgspec import Meta
from prometheus_client.metrics_core import Metric

from ...actors import ActorError, ActorRef, ActorSystem
from ...metrics import Tracker, track
from ...train.messages import Progress, Shards
from ...train.specs import P2PSpec, ReplicaSpec
from .._schema import ConfigError, KeyProblem, Section
from ..mode_api import Hoster, Snapshot
from ..panels import Line, Panel
from ..protocol import Ready
from ..report import EVENT_REPLICA_JOINED
from ..telemetry import P2P_CONSENSUS, P2P_JOB_PEERS
from ._data_parallel import DataParallelJob, DataParallelMode, _Replica, host_replica
from ._peers import ask_peer_stats, inbox_of, ledgers_complete, tell_peers

if TYPE_CHECKING:
    from ...train.sync.p2p import Sketch
    from ..config import Config
    from ..mode_api import Runner
    from ..report import RunReport

__all__ = ["P2P", "P2PConfig", "PEERS_REPEAT_S", "SETTLE_S"]

log = logging.getLogger("dniasync.cluster.modes.p2p")

PEERS_REPEAT_S: Final = 1.0
"""The membership is told again this often (a peer whose inbox was not up yet at a change gets it)."""
SETTLE_S: Final = 10.0
"""At the end, how long the coordinator waits for every live peer's ledger to hold every update sent."""



class P2PConfig(Section, frozen=True):
    """Peers that send each other their quantized updates, no PS (mode `p2p`); gossip, lag and local steps: `[sync]`."""

    only_for = {"tau": ("codec", ("threshold",))}

    n_peers: Annotated[int, Meta(ge=1, description="peer processes, one data shard each; at most data.n_train")] = 2
    codec: Annotated[Literal["threshold", "none"], Meta(description=(
        "how a peer codes its update: `threshold` (Strom: +-tau per element whose accumulated change reached tau, "
        "the rest kept in the peer's residual) or `none` (dense float32)"))] = "threshold"
    tau: Annotated[float, Meta(gt=0.0, description=(
        "the threshold, in weight units (an update is a change of the weights, the lr already applied); "
        "required with `threshold`"))] | None = None

    wait_for_peers_s: Annotated[float, Meta(ge=0.0, description=(
        "seconds the peers that are ready (data and model built) wait for the others before they start training "
        "without them: the peers start together once all n_peers are ready, and the job's clock with them; a peer "
        "ready later starts at once, from a neighbour's copy. 0: each starts when it is ready"))] = 60.0

    def __post_init__(self) -> None:
        if self.codec == "threshold" and self.tau is None:
            raise KeyProblem("tau", "missing required key '{key}'")


class _P2PJob(DataParallelJob):
    def __init__(self, config: Config, runner: Runner) -> None:
        super().__init__(config, runner)
        self.settings: P2PConfig = config.settings
        self.epoch = 0
        self._told_at = 0.0
        self._t0 = time.monotonic()
        self.consensus: list[dict[str, float]] = []
        """One entry per evaluation with two or more copies: seconds, samples, max, mean, peers."""
        self._peer_stats: dict[str, dict[str, Any]] = {}
        self._stopped = False
        self._settled: tuple[dict[str, dict[str, Any]], bool] | None = None
        """The peers' stats once settled after the stop (the last evaluation waits for it; the summary reads it)."""
        self._settle_s: float | None = None
        """How long the last evaluation waited for the copies to settle (that evaluation is dated at the stop)."""
        self.wait_for_trainers_s = self.settings.wait_for_peers_s
        self.trainers = "peers"
        track(runner.system, _JOBS, runner.ref, self)

    # -- membership ------------------------------------------------------------------------
    def _inbox(self, state: _Replica) -> ActorRef:
        assert state.ref is not None
        return inbox_of(self.runner.system, state.ref)

    def _live(self) -> list[tuple[str, _Replica]]:
        return [(n, r) for n, r in sorted(self.replicas.items()) if r.status == "alive" and r.ref is not None]

    def sync_spec(self) -> P2PSpec:
        live = self._live()
        s, sync = self.settings, self.config.sync
        return P2PSpec([self._inbox(r) for _, r in live], self.epoch, s.codec, s.tau or 1e-3, sync.fanout,
                       sync.max_lag, sync.local_steps, sync.outer_lr, sync.outer_momentum,
                       warm=any(r.steps > 0 for _, r in live), update_cap_bytes=sync.update_cap_bytes)

    def _tell_peers(self, *, changed: bool) -> None:
        if changed:
            self.epoch += 1
        self._told_at = time.monotonic()
        tell_peers([self._inbox(r) for _, r in self._live()], self.epoch)

    async def ready(self, ready: Ready) -> None:
        await super().ready(ready)
        self._tell_peers(changed=True)

    def _declare_dead(self, name: str, why: str) -> None:
        alive = self.replicas[name].status == "alive"
        super()._declare_dead(name, why)
        if alive:
            self._tell_peers(changed=True)

    def check(self, now: float) -> None:
        super().check(now)
        if now - self._told_at >= PEERS_REPEAT_S:
            self._tell_peers(changed=False)

    def progress(self, msg: Progress) -> None:
        state = self.replicas.get(msg.replica)
        if state is not None and state.incarnation == msg.incarnation and state.status == "dead" \
                and not self.runner.ending:
            self._take_back(msg.replica, state)
        super().progress(msg)

    def _take_back(self, name: str, state: _Replica) -> None:
        """A peer declared dead reports again (it was frozen, or cut off): a data shard and the membership again."""
        free = [s for s, owner in self.owners.items() if owner is None]
        shards = {free[0]} if free else self._take_one_for(name)
        for s in shards:
            self.owners[s] = name
        state.status, state.shards, state.last_seen = "alive", shards, time.monotonic()
        self.runner.event(EVENT_REPLICA_JOINED, replica=name, shards=",".join(map(str, sorted(shards))),
                          reason="reported again after it was declared dead", cluster_steps=self.steps())
        log.info("peer %s is back; data shards %s", name, sorted(shards))
        if state.ref is not None:
            try:
                state.ref.tell_nowait(Shards(self.cursors_of(state), self.runner.epoch))
            except ActorError as exc:
                log.warning("could not hand shards to %s: %s", name, exc)
        self._tell_peers(changed=True)

    # -- evaluation and consensus ------------------------------------------------------------
    async def stop(self, reason: str) -> None:
        await super().stop(reason)
        self._stopped = True

    async def snapshot(self) -> Snapshot:
        """One live peer's weights, scored; the consensus distance over every live peer from their sketches.

        After the stop (the last evaluation) the copies settle first: every update sent has landed in every copy,
        the last ones too (a peer's held change goes at its stop, and received ones go in at once from then on), so
        the job's final accuracy is that of the weights every peer holds, not of one peer caught mid-exchange."""
        if self._stopped and self._settled is None:
            start = time.monotonic()
            self._settled = await self._settled_stats()
            self._settle_s = time.monotonic() - start
        live = self._live()
        if not live:
            raise ActorError("no live peer to take weights from")
        if self._stopped:  # settled (consensus_distance_settled says how far apart): the series is of training
            return Snapshot(await self._dense_copy(live))
        copy, sketches = await asyncio.gather(self._dense_copy(live), self._sketches(live))
        if len(sketches) >= 2:
            self.consensus.append({"seconds": time.monotonic() - self._t0, "samples": float(self.samples()),
                                   **consensus_distance([s.values for s in sketches]), "peers": float(len(sketches)),
                                   "lag_max": float(max(in_flight(sketches)))})
        return Snapshot(copy)

    async def _dense_copy(self, live: Sequence[tuple[str, _Replica]]) -> np.ndarray:
        """The shared weights of the first live peer that gives them (one copy, whatever the number of peers)."""
        from ...train.sync.p2p import DenseCopy, DenseRequest

        error: BaseException | None = None
        for _, state in live:
            try:
                reply = await self._inbox(state).ask(DenseRequest(), timeout=self.config.eval.timeout_s)
            except ActorError as exc:
                error = exc
                continue
            if isinstance(reply, DenseCopy):
                return reply.values
        raise error if isinstance(error, ActorError) else ActorError("no peer answered with its weights")

    async def _sketches(self, live: Sequence[tuple[str, _Replica]]) -> list[Sketch]:
        """Every live peer's count-sketch that arrived (a peer that fails to answer is left out of the distance)."""
        from ...train.sketch import SKETCH_BUCKETS
        from ...train.sync.p2p import Sketch, SketchRequest

        ask = SketchRequest(self.config.job.seed, SKETCH_BUCKETS)
        replies = await asyncio.gather(*(self._inbox(r).ask(ask, timeout=self.config.eval.timeout_s) for _, r in live),
                                       return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException) and not isinstance(reply, ActorError):
                raise reply
        return [r for r in replies if isinstance(r, Sketch)]

    # -- ending ------------------------------------------------------------------------------
    async def _ask_stats(self) -> dict[str, dict[str, Any]]:
        live = self._live()
        replies = await ask_peer_stats([self._inbox(r) for _, r in live])
        return {name: reply for (name, _), reply in zip(live, replies, strict=True) if reply is not None}

    async def _settled_stats(self) -> tuple[dict[str, dict[str, Any]], bool]:
        """Every live peer's stats once each ledger holds every update the live peers sent (or after SETTLE_S)."""
        deadline = time.monotonic() + SETTLE_S
        before: dict[str, int] | None = None
        while True:
            self._tell_peers(changed=False)  # the runner's ticks have stopped: the membership goes on being told
            stats = await self._ask_stats()
            complete = ledgers_complete(stats)
            sent = {s["origin"]: int(s["sent"]) for s in stats.values()}
            # and nothing sent since the last ask: a peer may still take a step after StopTraining was told; and
            # every peer has stopped (it then sent its held change, and applies what it receives at once)
            stopped = all(s.get("stopped", True) for s in stats.values())
            if (complete and stopped and sent == before) or time.monotonic() >= deadline:
                return stats, complete
            before = sent
            await asyncio.sleep(0.2)

    async def record(self, report: RunReport) -> None:
        await super().record(report)
        stats, complete = self._settled or await self._settled_stats()
        self._peer_stats = stats
        live = self._live()
        report.set_metric("peers_alive", len(live))
        report.set_metric("peers_dead", sum(r.status != "alive" for r in self.replicas.values()))
        steps = self.steps()
        report.set_metric("bytes_sent_per_step", report.bytes_pushed / steps if steps else 0.0)
        report.set_metric("dense_bytes_per_step", 4.0 * self.n_params)
        report.set_metric("p2p_ledgers_complete", complete)
        if self._settle_s is not None:
            report.set_metric("settle_s", self._settle_s)
        origins = {s["origin"]: name for name, s in stats.items()}
        for name, s in stats.items():
            report.set_metric(f"p2p/{name}/sent", int(s["sent"]))
            report.set_metric(f"p2p/{name}/steps", int(s["steps"]))
            report.set_metric(f"p2p/{name}/stopped", bool(s.get("stopped", True)))  # applies what it receives
            for counter in ("dense_taken", "dense_given", "dense_failed", "received", "duplicate", "forwarded",
                            "skipped", "held", "flushed", "capped", "resends_asked", "resent", "lost_own", "waited_ms"):
                report.set_metric(f"p2p/{name}/{counter}", int(s["counters"][counter]))
            for origin, count in s["ledger"].items():
                if origin in origins:
                    report.set_metric(f"p2p/{name}/has/{origins[origin]}", int(count))
        if self.consensus:
            last = self.consensus[-1]
            report.set_metric("consensus_distance_max", last["max"])
            report.set_metric("consensus_distance_mean", last["mean"])
            report.set_metric("consensus_distance_max_peak", max(c["max"] for c in self.consensus))
            report.set_metric("consensus_distance_mean_avg",
                              sum(c["mean"] for c in self.consensus) / len(self.consensus))
        report.set_metric("consensus_evaluations", len(self.consensus))
        # once settled, every live peer's copy holds the same updates: what is left is float rounding (the sketch
        # of identical copies is identical, so this is 0 then, not 0 +- the sketch's error)
        sketches = await self._sketches(live)
        if len(sketches) >= 2:
            report.set_metric("consensus_distance_settled", consensus_distance([s.values for s in sketches])["max"])
        else:
            log.warning("no settled consensus distance: %d of %d live peers sent a sketch", len(sketches), len(live))
        out = Path(self.config.output_dir)
        await self.runner.run_blocking(_write_json, out / "consensus.json", self.consensus)

    def extra(self) -> dict[str, Any]:
        out = super().extra()
        out["peers_alive"] = len(self._live())
        if self.consensus:
            out["consensus_distance_max"] = self.consensus[-1]["max"]
        return out


def in_flight(sketches: Sequence[Sketch]) -> list[int]:
    """For each sketched copy, the updates it lacks of those another copy holds or their origin had sent.

    Every update of an origin up to the highest any copy holds (or the origin had sent when it answered) counts;
    copies lacking none hold the same updates and are the same but for float rounding (with local steps, but for
    the outer optimizer's order): these updates alone keep copies apart.
    """
    known: dict[str, int] = {}
    for s in sketches:
        known[s.origin] = max(known.get(s.origin, 0), s.sent)
        for origin, entry in s.ledger.items():
            known[origin] = max(known.get(origin, 0), *entry)
    lags = []
    for s in sketches:
        held = {o: e[0] + len(e) - 1 for o, e in s.ledger.items()}  # [have, *extra]: all up to have, and those
        lags.append(sum(n - held.get(o, 0) for o, n in known.items() if o != s.origin))
    return lags


def consensus_distance(copies: Sequence[np.ndarray]) -> dict[str, float]:
    """Max and mean over ``copies`` of ``||w_i - mean||/ ||mean||`` (0 for identical copies).

    The copies may be the weights or any linear sketch of them (the same for each): :meth:`_P2PJob.snapshot`
    passes count-sketches.
    """
    stacked = np.stack([np.asarray(c, dtype=np.float64) for c in copies])
    mean = stacked.mean(axis=0)
    norm = float(np.linalg.norm(mean)) or 1.0
    distances = [float(np.linalg.norm(row - mean)) / norm for row in stacked]
    return {"max": max(distances), "mean": sum(distances) / len(distances)}


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n", encoding="utf-8")


def _collect(system: ActorSystem, jobs: Sequence[_P2PJob]) -> Iterator[Metric]:
    for job in jobs:
        yield P2P_JOB_PEERS.single(len(job._live()))
        if job.consensus:
            last = job.consensus[-1]
            yield P2P_CONSENSUS.labelled([(("max",), last["max"]), (("mean",), last["mean"])])


_JOBS: Final[Tracker[_P2PJob]] = Tracker("p2p_jobs", _collect)


class _P2P(DataParallelMode):
    name = "p2p"
    settings = P2PConfig
    shards_key = "p2p.n_peers"
    worker_kind = "peer"
    schedules = True
    takes_local_steps = True

    def data_shards(self, settings: P2PConfig) -> int:
        return settings.n_peers

    def syncs(self, settings: P2PConfig) -> tuple[str, ...]:
        return ("p2p",)

    def check(self, config: Config, raw: Mapping[str, Any]) -> None:
        sync = config.sync
        if sync.fanout > 0 and sync.fanout >= config.settings.n_peers:
            raise ConfigError(f"'sync.fanout' is {sync.fanout}, but a peer has only {config.settings.n_peers - 1} "
                              "others: use 0 (every peer)", "sync.fanout")

    def resolve(self, config: Config, model: Any) -> None:
        return

    def processes(self, config: Config) -> tuple[int, int]:
        return 0, config.settings.n_peers

    def summary_lines(self, config: Config, doc: Mapping[str, Any]) -> list[str]:
        metrics = doc.get("metrics", {})
        lines = [f"  bytes sent         {doc.get('bytes_pushed', 0):,} (codec {config.settings.codec}; "
                 f"{metrics.get('bytes_sent_per_step', 0):,.0f} per step, dense "
                 f"{metrics.get('dense_bytes_per_step', 0):,.0f})"]
        peak = metrics.get("consensus_distance_max_peak")
        if isinstance(peak, float) and math.isfinite(peak):
            lines.append(f"  consensus distance {metrics.get('consensus_distance_max', 0):.4f} max at the end, "
                         f"{peak:.4f} at worst")
        return lines

    def panels(self, config: Config) -> tuple[Panel, ...]:
        # bytes per peer: put a list of each peer's byte counter into extra() (say "peer_bytes") and chart
        # Line("peer_bytes_per_s", "peer_bytes", label="peer"): one line per peer
        return (Panel("consensus", "Consensus distance (max over peers)",
                      (Line("consensus_distance_max", "consensus_distance_max", per=None),)),
                Panel("bytes", "Bytes / s sent", (Line("sent_bytes_per_s", "bytes_pushed", label="sent"),), unit="B/s"))

    def job(self, config: Config, runner: Runner) -> _P2PJob:
        return _P2PJob(config, runner)

    def hosters(self) -> dict[type, Hoster]:
        return {ReplicaSpec: host_replica}


P2P = _P2P()
