"""What Downpour and Hogwild share on the coordinator: replicas, their data shards, their liveness.

Each worker host gets one replica with one data shard (its cursor included).
A replica reports its counters (:class:`~dniasync.train.messages.Progress`);
one that stays silent past the liveness limit is declared dead, fenced on the
PS shards, and its data shards go to the live replica with the fewest, from
the cursor it last reported. A host that joins again with a new incarnation
replaces its former replica the same way.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ...actors import ActorError, ActorRef, Directive
from ...train.data import DataCursor
from ...train.messages import CoordinatorEpoch, Fence, Progress, Shards, StopTraining
from ...train.specs import ReplicaSpec
from ..mode_api import Snapshot
from ..plan import data_spec, model_spec, optimizer_spec
from ..protocol import Assignment, JoinJob, NoJob, Ready
from ..report import EVENT_BATCH_SIZE, EVENT_REPLICA_FAILED, EVENT_REPLICA_JOINED, EVENT_SHARD_REASSIGNED, RunReport

if TYPE_CHECKING:
    from torch import nn

    from ...train.checkpoint import LoadedCheckpoint, Part
    from ..config import Config
    from ..hosts import Host
    from ..mode_api import Runner

__all__ = [
    "FIRST_PROGRESS_GRACE_S", "WORKER_HOST", "DataParallelJob", "DataParallelMode", "host_replica", "replica_name",
]

log = logging.getLogger("dniasync.cluster.modes")

FIRST_PROGRESS_GRACE_S = 60.0
"""A replica that was assigned gets this long to load its data and report once."""
SLOW_FACTOR = 4
"""A silent replica whose node still answers heartbeats is given this many liveness periods."""
REPORTS_PER_BUDGET = 100
"""Progress reports each replica sends over its share of the epoch budget beside those on its clock (see
:meth:`DataParallelJob.report_every_samples`): the job stops within about a hundredth of it past the budget."""


WORKER_HOST = "worker-host"
"""The name of the host actor on a worker node."""


def replica_name(member: str) -> str:
    """``replica-<host>-<port>`` for the host ``worker-host@host:port``; other hosts add their name."""
    host, _, node = member.partition("@")
    slug = node.replace(":", "-")
    return f"replica-{slug}" if host == WORKER_HOST else f"replica-{slug}-{host}"


class DataParallelMode:
    """What the data-parallel modes answer alike: one replica per worker process, started again as a new one."""

    member_kind = "replica"
    regroups = False
    takes_local_steps = False

    def restarts_workers(self, config: Config) -> bool:
        return True

    def preload(self, config: Config) -> tuple[str, ...]:
        return ()  # the replicas' optimizers are the store's (Rust), not torch's

    def worker_state(self, members: Mapping[str, str], address: str) -> str | None:
        return members.get(replica_name(f"{WORKER_HOST}@{address}"))


@dataclass
class _Replica:
    member: str
    incarnation: int
    assigned: float
    shards: set[int] = field(default_factory=set)
    ref: ActorRef | None = None
    last_seen: float = 0.0
    reported: bool = False
    status: str = "alive"
    samples: int = 0
    steps: int = 0
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    dense_bytes_pushed: int = 0
    batch_size: int = 0


class DataParallelJob:
    """The replicas of a data-parallel job; subclasses say how parameters are shared and evaluated."""

    warm_start_steps = 0
    wait_for_trainers_s = 0.0
    """Seconds the first trainers ready wait for the others so that they all start together (each mode's
    ``wait_for_replicas_s``, ``wait_for_workers_s``, ``wait_for_peers_s``); 0, or a warm start: each starts when it
    is ready."""
    trainers = "replicas"
    """What the mode calls its trainers, in the log."""

    def __init__(self, config: Config, runner: Runner) -> None:
        import torch

        from ...train.flat import FlatModel, flatten_parameters

        torch.set_num_threads(1)
        self.config = config
        self.runner = runner
        self.model_spec, self.data_spec, self.optimizer_spec = model_spec(config), data_spec(config), optimizer_spec(config)
        model: nn.Module = self.model_spec.build()
        self.initial = flatten_parameters(model)
        self.n_params = int(self.initial.size)
        _, self.x_test, self.y_test = self.data_spec.open_split()  # a converted set stays mapped
        self.eval_buffer = self.initial.copy()
        self.eval_flat = FlatModel(model, self.eval_buffer)
        self.replicas: dict[str, _Replica] = {}
        """replica name -> its state"""
        self.owners: dict[int, str | None] = {s: None for s in range(config.n_data_shards)}
        self.cursors = {s: DataCursor(s) for s in range(config.n_data_shards)}
        self.samples_before = 0
        self.steps_before = 0
        """What earlier runs of a resumed job trained."""
        self.unreported: set[str] = set()
        """Replicas adopted from a coordinator this one took the job over from that have not reported to it yet."""
        self._held: set[str] = set()
        """Trainers assigned without their data shards until they start together (``wait_for_trainers_s``)."""
        self._all_started = False
        self._first_ready: float | None = None
        self._warming: str | None = None
        """With a warm start (and the trainers waiting for each other): the trainer training alone, the others ready
        and held until it has taken ``warm_start_steps`` steps (or is gone)."""

    def sync_spec(self) -> object:
        """The spec of the replicas' weight sync (any registered kind's: ``ReplicaSpec.sync``); each mode narrows it."""
        raise NotImplementedError

    def ps_shards(self) -> list[Any]:
        return []

    # -- replicas -------------------------------------------------------------------
    def assign(self, join: JoinJob) -> Assignment | NoJob:
        name = replica_name(join.member)
        warm = self.warm_start_steps
        if warm and not self.wait_for_trainers_s and self.replicas and name not in self.replicas \
                and not any(r.steps >= warm for r in self.replicas.values()):
            return NoJob(f"warm start: the first replica runs {warm} steps alone", retry=True)
        old = self.replicas.get(name)
        now = time.monotonic()
        if old is None or old.incarnation != join.incarnation or old.status != "alive":
            if old is not None:
                self._declare_dead(name, "joined again with a new incarnation")
            free = [s for s, owner in self.owners.items() if owner is None]
            shards = {free[0]} if free else self._take_one_for(name)
            for s in shards:
                self.owners[s] = name
            self.replicas[name] = _Replica(join.member, join.incarnation, now, shards, last_seen=now)
            self.runner.event(EVENT_REPLICA_JOINED, replica=name, shards=",".join(map(str, sorted(shards))),
                              cluster_steps=self.steps())
            log.info("replica %s joined; data shards %s", name, sorted(shards))
        state = self.replicas[name]
        cursors = self.cursors_of(state)
        if self._holding():  # its data shards are in the books, not yet in its spec: they come when all start
            self._held.add(name)
            cursors = []
        return Assignment(ReplicaSpec(self.model_spec, self.data_spec, self.optimizer_spec, cursors,
                                      self.sync_spec(), self.runner.ref.address, self.report_every_samples()))

    def report_every_samples(self) -> int:
        """How often (in samples) each replica reports beside its clock: :data:`REPORTS_PER_BUDGET` times over its
        share of the epoch budget. A short job trains several epochs in one report interval (0.25 s); reports on
        the clock alone let it train up to an interval past ``stop.max_epochs`` (48,272 samples for 40,000)."""
        return max(1, -(-self.config.sample_budget // (self.config.n_data_shards * REPORTS_PER_BUDGET)))

    async def ready(self, ready: Ready) -> None:
        state = self.replicas.get(replica_name(ready.member))
        if state is not None and state.incarnation == ready.incarnation and ready.refs:
            state.ref = ready.refs[0]
            if self.runner.epoch > 1:  # orders from an earlier coordinator that woke up are refused from now on
                state.ref.tell_nowait(CoordinatorEpoch(self.runner.epoch, self.runner.ref.address))
            self.start(replica_name(ready.member), state)
            if self.runner.ending:  # it came up after the job ended: it has nothing to train
                await self.stop_one(state, "the job has ended")

    # -- starting together ---------------------------------------------------------------
    def _holding(self) -> bool:
        return self.wait_for_trainers_s > 0 and (not self._all_started or self._warming is not None)

    def start(self, name: str, state: _Replica) -> None:
        """Replica ``name`` has its data and model. While the trainers wait for each other it waits too, and all start
        once every one is ready; otherwise (no waiting, or it came after the wait) it starts now, and the clock with
        the first."""
        if not self._holding():
            self._hand_shards(name)
            self.runner.mark_started()
            return
        if self._all_started:  # started, in the warm start: it waits for its end (``_end_warm_start``)
            return
        if self._first_ready is None:
            self._first_ready = time.monotonic()
        ready = sum(r.ref is not None for n, r in self.replicas.items() if n in self._held and r.status == "alive")
        if ready >= self.config.n_data_shards:
            self._start_all(f"all {ready} {self.trainers} are ready")

    def _start_all(self, why: str) -> None:
        """Every ready trainer gets its data shards, and the clock starts. With a warm start only the first that
        joined does: the others, ready too, get theirs once it has taken ``warm_start_steps`` steps."""
        self._all_started = True
        log.info("%s start training: %s", self.trainers, why)
        first = next((n for n, r in self.replicas.items() if n in self._held and r.ref is not None), None)
        if self.warm_start_steps and first is not None:
            self._warming = first
            log.info("warm start: %s trains alone for %d steps", first, self.warm_start_steps)
            self._hand_shards(first)
        else:
            for name in sorted(self._held):
                self._hand_shards(name)
        self.runner.mark_started()

    def _end_warm_start(self, why: str) -> None:
        self._warming = None
        log.info("warm start ends: %s; the other %s start", why, self.trainers)
        for name in sorted(self._held):
            self._hand_shards(name)

    def _hand_shards(self, name: str) -> None:
        """A held trainer that is ready gets its data shards (one not ready yet gets them when it is)."""
        state = self.replicas.get(name)
        if name not in self._held or state is None or state.ref is None:
            return
        self._held.discard(name)
        if state.status != "alive" or not state.shards:
            return
        try:
            state.ref.tell_nowait(Shards(self.cursors_of(state), self.runner.epoch))
        except ActorError as exc:
            log.warning("could not hand data shards to %s: %s", name, exc)

    def cursors_of(self, state: _Replica) -> list[list[int]]:
        """``[shard, epoch, position]`` of each data shard ``state`` owns, where it stands now."""
        return [[c.shard, c.epoch, c.position] for s in sorted(state.shards) for c in [self.cursors[s]]]

    def progress(self, msg: Progress) -> None:
        state = self.replicas.get(msg.replica)
        if state is None or state.incarnation != msg.incarnation or state.status != "alive":
            return  # a fenced replica's late words
        state.last_seen = time.monotonic()
        state.reported = True
        self.unreported.discard(msg.replica)
        if msg.samples < state.samples:
            return  # an older report overtaken by a newer one (its counters only grow): nothing newer in it
        self.runner.report.add_bytes(pushed=msg.bytes_pushed - state.bytes_pushed,
                                     pulled=msg.bytes_pulled - state.bytes_pulled)
        state.samples, state.steps = msg.samples, msg.steps
        if self._warming == msg.replica and msg.steps >= self.warm_start_steps:
            self._end_warm_start(f"{msg.replica} took {msg.steps} steps")
        state.bytes_pushed, state.bytes_pulled = msg.bytes_pushed, msg.bytes_pulled
        state.dense_bytes_pushed = msg.dense_bytes_pushed
        if msg.batch_size and msg.batch_size != state.batch_size:
            if self.runner.config.schedule.kind != "fixed":  # a schedule grew it
                self.runner.event(EVENT_BATCH_SIZE, replica=msg.replica, samples=msg.samples,
                                  batch_size=msg.batch_size)
            state.batch_size = msg.batch_size
        for shard, epoch, position in msg.cursors:
            if self.owners.get(shard) == msg.replica:
                self.cursors[shard] = DataCursor(shard, epoch, position)

    def check(self, now: float) -> None:
        if self._holding() and self._first_ready is not None and now - self._first_ready >= self.wait_for_trainers_s:
            ready = sum(self.replicas[n].ref is not None for n in self._held if n in self.replicas)
            self._start_all(f"{ready} of {self.config.n_data_shards} {self.trainers} ready after "
                            f"{self.wait_for_trainers_s:g} s")
        warming = self.replicas.get(self._warming) if self._warming is not None else None
        if self._warming is not None and (warming is None or warming.status != "alive"):
            self._end_warm_start(f"{self._warming} is gone")
        for name, state in list(self.replicas.items()):
            if state.status != "alive":
                continue
            silent = now - state.last_seen
            if not state.reported:
                dead = silent > FIRST_PROGRESS_GRACE_S
            else:  # a node the transport sees is only slow: give it longer before fencing it for good
                node_up = state.ref is None or state.ref.is_alive
                dead = silent > self.runner.liveness_s * (SLOW_FACTOR if node_up else 1)
            if dead:
                self._declare_dead(name, f"silent for {silent:.1f} s")

    def _declare_dead(self, name: str, why: str) -> None:
        state = self.replicas[name]
        if state.status != "alive":
            return
        state.status = "dead"
        self.unreported.discard(name)
        log.warning("replica %s declared dead (%s); its data shards %s are reassigned", name, why, sorted(state.shards))
        self.runner.event(EVENT_REPLICA_FAILED, replica=name, reason=why)
        for ps in self.runner.ps:
            if ps is not None:
                try:
                    ps.tell_nowait(Fence(name, self.runner.epoch))
                except ActorError as exc:
                    log.warning("could not fence %s on %s: %s", name, ps, exc)
        for shard in sorted(state.shards):
            self.owners[shard] = None
        state.shards = set()
        self._reassign()

    def _take_one_for(self, name: str) -> set[int]:
        """A data shard for a joining replica when none is free: one from the live replica with the most, if it has
        two or more (a replica restarted after a failure gets back the share the survivors took over)."""
        alive = [(n, r) for n, r in self.replicas.items() if r.status == "alive" and len(r.shards) >= 2]
        if not alive:
            return set()
        donor_name, donor = max(alive, key=lambda item: (len(item[1].shards), item[0]))
        shard = max(donor.shards)
        donor.shards.discard(shard)
        self.runner.event(EVENT_SHARD_REASSIGNED, shard=shard, to=name, epoch=self.cursors[shard].epoch,
                          position=self.cursors[shard].position)
        if donor.ref is not None:
            try:
                donor.ref.tell_nowait(Shards(self.cursors_of(donor), self.runner.epoch))
            except ActorError as exc:
                log.warning("could not take shard %d from %s: %s", shard, donor_name, exc)
        return {shard}

    def _reassign(self) -> None:
        orphans = [s for s, owner in self.owners.items() if owner is None]
        alive = [(n, r) for n, r in self.replicas.items() if r.status == "alive"]
        if not orphans or not alive:
            return
        changed: set[str] = set()
        for shard in orphans:
            name, state = min(alive, key=lambda item: (len(item[1].shards), item[0]))
            state.shards.add(shard)
            self.owners[shard] = name
            changed.add(name)
            cursor = self.cursors[shard]
            self.runner.event(EVENT_SHARD_REASSIGNED, shard=shard, to=name, epoch=cursor.epoch,
                              position=cursor.position)
            log.info("data shard %d goes to %s from epoch %d position %d", shard, name, cursor.epoch, cursor.position)
        for name in changed:
            state = self.replicas[name]
            if state.ref is None:
                continue  # it starts with the cursors of its assignment
            try:
                state.ref.tell_nowait(Shards(self.cursors_of(state), self.runner.epoch))
            except ActorError as exc:
                log.warning("could not hand shards to %s: %s", name, exc)

    # -- a standby coordinator's view ----------------------------------------------------
    def follow(self) -> dict[str, Any]:
        """The replicas, data shards and cursors as JSON: what a standby coordinator adopts if this one dies."""
        return {
            "replicas": {name: {"member": r.member, "incarnation": r.incarnation, "shards": sorted(r.shards),
                                "ref": r.ref.address if r.ref is not None else "", "reported": r.reported,
                                "status": r.status, "samples": r.samples, "steps": r.steps,
                                "bytes_pushed": r.bytes_pushed, "bytes_pulled": r.bytes_pulled,
                                "dense_bytes_pushed": r.dense_bytes_pushed, "batch_size": r.batch_size}
                         for name, r in self.replicas.items()},
            "cursors": [[c.shard, c.epoch, c.position] for c in self.cursors.values()],
            "samples_before": self.samples_before, "steps_before": self.steps_before,
        }

    def adopt(self, doc: dict[str, Any]) -> None:
        """Go on with the replicas :meth:`follow` described: the same processes train on, now reporting here."""
        self._all_started = True  # they are training already: nothing to wait for
        self._warming = None
        now = time.monotonic()
        self.cursors = {s: DataCursor(s, e, p) for s, e, p in doc["cursors"]}
        self.samples_before, self.steps_before = int(doc["samples_before"]), int(doc["steps_before"])
        self.owners = {s: None for s in self.owners}
        for name, r in doc["replicas"].items():
            ref = self.runner.system.ref(r["ref"]) if r["ref"] else None
            state = _Replica(r["member"], int(r["incarnation"]), now, set(r["shards"]), ref, last_seen=now,
                             reported=bool(r["reported"]), status=r["status"], samples=int(r["samples"]),
                             steps=int(r["steps"]), bytes_pushed=int(r["bytes_pushed"]),
                             bytes_pulled=int(r["bytes_pulled"]), dense_bytes_pushed=int(r["dense_bytes_pushed"]),
                             batch_size=int(r["batch_size"]))
            self.replicas[name] = state
            if state.status == "alive":
                self.unreported.add(name)
                for shard in state.shards:
                    self.owners[shard] = name
        self._reassign()  # a data shard the dead coordinator had not handed on yet

    def reported(self) -> bool:
        return not self.unreported

    def addresses(self) -> list[str]:
        """The actors a new coordinator tells of itself: each replica and its host."""
        return [a for r in self.replicas.values() if r.status == "alive"
                for a in (r.member, r.ref.address if r.ref is not None else "") if a]

    # -- figures ----------------------------------------------------------------------
    def samples(self) -> int:
        return self.samples_before + sum(r.samples for r in self.replicas.values())

    def steps(self) -> int:
        return self.steps_before + sum(r.steps for r in self.replicas.values())

    def checkpoint(self) -> tuple[dict[str, Any], dict[str, Part]]:
        meta = {"cursors": [[c.shard, c.epoch, c.position] for c in self.cursors.values()],
                "samples": self.samples(), "steps": self.steps()}
        return meta, {}

    def restore(self, loaded: LoadedCheckpoint) -> None:
        meta = loaded.meta["mode"]
        self.cursors = {s: DataCursor(s, e, p) for s, e, p in meta["cursors"]}
        self.samples_before, self.steps_before = int(meta["samples"]), int(meta["steps"])

    def done(self) -> str | None:
        return None

    def members(self) -> dict[str, str]:
        return {n: r.status for n, r in self.replicas.items()}

    def extra(self) -> dict[str, Any]:
        return {"dense_bytes_pushed": sum(r.dense_bytes_pushed for r in self.replicas.values())}

    # -- evaluation ---------------------------------------------------------------------
    async def score(self, snapshot: Snapshot) -> tuple[float, float]:
        from ...train.flat import evaluate

        np.copyto(self.eval_buffer, snapshot.weights)
        return await self.runner.run_blocking(evaluate, self.eval_flat.model, self.x_test, self.y_test,
                                             threads=snapshot.threads)

    # -- ending -----------------------------------------------------------------------
    async def stop(self, reason: str) -> None:
        for state in self.replicas.values():
            if state.status == "alive":
                await self.stop_one(state, reason)

    async def stop_one(self, state: _Replica, reason: str) -> None:
        if state.ref is not None:
            try:
                state.ref.tell_nowait(StopTraining(reason, self.runner.epoch))
            except ActorError:
                pass

    async def record(self, report: RunReport) -> None:
        from ...train.flat import model_arrays

        report.set_metric("dense_bytes_pushed", sum(r.dense_bytes_pushed for r in self.replicas.values()))
        report.set_final_weights(model_arrays(self.eval_flat.model))  # the weights the last evaluation scored

    async def close(self) -> None:
        return


async def host_replica(host: Host, spec: ReplicaSpec) -> list[ActorRef]:
    """On a worker node: the replica of ``spec``, a child of ``host``.

    Not restarted if it fails: its data shards go to the others from their last reported cursors.
    """
    module = await host.run_blocking(importlib.import_module, "dniasync.train.replica")  # torch: seconds
    return [await host.spawn(module.Replica, spec, incarnation=host.incarnation, name=replica_name(host.ref.address),
                             supervision=Directive.STOP)]
