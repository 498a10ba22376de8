"""Metric families of the job (held-out evaluation, throughput, replicas, PS chains, the coordinator's epoch) and
the trainer collector.

The job runner registers itself once it starts (a no-op on a node without
metrics); its snapshot is read at scrape time. The state types are structural
so this module imports no training code (nor torch).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final, Protocol

from prometheus_client.metrics_core import Metric

from ..actors import ActorRef, ActorSystem
from ..metrics import Families, Tracker, track

__all__ = ["FAMILIES", "TRAINERS", "JobSnapshot", "TrainerState", "track_trainer"]

FAMILIES = Families()
TRAIN_ACCURACY = FAMILIES.gauge("dniasync_train_eval_accuracy_ratio", "Held-out accuracy at the last evaluation.")
TRAIN_LOSS = FAMILIES.gauge("dniasync_train_eval_loss", "Held-out cross-entropy loss at the last evaluation.")
TRAIN_EVALS = FAMILIES.counter("dniasync_train_evaluations_total", "Held-out evaluations run by the coordinator.")
TRAIN_SAMPLES = FAMILIES.counter("dniasync_train_samples_total", "Training samples processed by all replicas.")
TRAIN_SAMPLES_RATE = FAMILIES.gauge("dniasync_train_samples_per_second",
                                    "Cluster training throughput between the last two evaluations.")
TRAIN_EPOCHS = FAMILIES.gauge("dniasync_train_epochs", "Epochs of training data processed so far.")
TRAIN_WALL = FAMILIES.gauge("dniasync_train_wall_seconds", "Seconds since the job started training.")
TRAIN_REPLICAS_ALIVE = FAMILIES.gauge("dniasync_train_replicas_alive", "Replicas the coordinator considers alive.")
TRAIN_REPLICAS_DEAD = FAMILIES.gauge("dniasync_train_replicas_dead", "Replicas the coordinator declared dead.")
TRAIN_FINISHED = FAMILIES.gauge("dniasync_train_finished", "1 once the job has finished, else 0.")
# -- replicated PS shards and the coordinator (cluster/chains.py, cluster/standby.py) ----------
PS_CHAIN_LENGTH = FAMILIES.gauge(
    "dniasync_ps_chain_length",
    "Copies in the chain of each replicated PS shard (ps_replicas > 1), as the coordinator last named it.", "shard")
PS_CHAIN_VIEW = FAMILIES.gauge(
    "dniasync_ps_chain_view", "View number of each replicated PS shard's chain (1 once named; one more per change).",
    "shard")
PS_CHAIN_CHANGES = FAMILIES.counter(
    "dniasync_ps_chain_changes_total",
    "Chain views the coordinator installed after the first ones (a copy cut out, or joining at the tail).")
COORDINATOR_EPOCH = FAMILIES.gauge(
    "dniasync_coordinator_epoch",
    "Epoch of the coordinator running the job: 1, one more each time a standby coordinator took it over.")
# -- peer to peer (cluster/modes/p2p.py: the coordinator's view) ------------------------------
P2P_CONSENSUS = FAMILIES.gauge(
    "dniasync_p2p_consensus_distance_ratio",
    "Consensus distance at the last evaluation: max or mean over live peers of |w_i - mean w| / |mean w|, "
    "estimated from count-sketches (stat).",
    "stat")
P2P_JOB_PEERS = FAMILIES.gauge("dniasync_p2p_job_peers_alive", "Peers the coordinator considers alive.")


class JobSnapshot(Protocol):
    @property
    def state(self) -> str: ...
    @property
    def wall_s(self) -> float: ...
    @property
    def samples(self) -> int: ...
    @property
    def epochs(self) -> float: ...
    @property
    def accuracy(self) -> float | None: ...
    @property
    def loss(self) -> float | None: ...
    @property
    def samples_per_s(self) -> float: ...
    @property
    def replicas(self) -> dict[str, str]: ...
    @property
    def extra(self) -> Mapping[str, Any]: ...


class TrainerState(Protocol):
    @property
    def ref(self) -> ActorRef: ...

    def snapshot(self) -> JobSnapshot: ...

    @property
    def evaluations(self) -> int: ...

    @property
    def epoch(self) -> int:
        """The coordinator epoch the job runs as (1; a standby coordinator that takes it over runs the next)."""


def _collect_trainers(system: ActorSystem, trainers: Sequence[TrainerState]) -> Iterator[Metric]:
    snaps = [(t.snapshot(), t.evaluations) for t in trainers]
    accuracy = [s.accuracy for s, _ in snaps if s.accuracy is not None]
    loss = [s.loss for s, _ in snaps if s.loss is not None]
    if accuracy:
        yield TRAIN_ACCURACY.single(accuracy[0])
    if loss:
        yield TRAIN_LOSS.single(loss[0])
    yield TRAIN_EVALS.single(sum(n for _, n in snaps))
    yield TRAIN_SAMPLES.single(sum(s.samples for s, _ in snaps))
    yield TRAIN_SAMPLES_RATE.single(sum(s.samples_per_s for s, _ in snaps))
    yield TRAIN_EPOCHS.single(max(s.epochs for s, _ in snaps))
    yield TRAIN_WALL.single(max(s.wall_s for s, _ in snaps))
    statuses = [st for s, _ in snaps for st in s.replicas.values()]
    yield TRAIN_REPLICAS_ALIVE.single(statuses.count("alive"))
    yield TRAIN_REPLICAS_DEAD.single(len(statuses) - statuses.count("alive"))
    yield TRAIN_FINISHED.single(int(all(s.state == "finished" for s, _ in snaps)))
    chains = [chain for s, _ in snaps for chain in s.extra.get("ps_chains", ())]
    if chains:
        yield PS_CHAIN_LENGTH.labelled(((str(c["shard"]),), c["length"]) for c in chains)
        yield PS_CHAIN_VIEW.labelled(((str(c["shard"]),), c["view"]) for c in chains)
        yield PS_CHAIN_CHANGES.single(sum(s.extra.get("ps_chain_changes", 0) for s, _ in snaps))
    yield COORDINATOR_EPOCH.single(max(t.epoch for t in trainers))


TRAINERS: Final[Tracker[TrainerState]] = Tracker("trainers", _collect_trainers)


def track_trainer(system: ActorSystem, trainer: TrainerState) -> None:
    """Export the job's figures from the node ``system`` runs on (no-op without metrics)."""
    track(system, TRAINERS, trainer.ref, trainer)
