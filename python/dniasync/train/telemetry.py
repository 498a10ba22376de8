"""Metric families of the training actors (replicas, PS shards, pipeline stages) and their collectors.

An actor registers itself once it starts (a no-op on a node without metrics);
the collectors read the counters it keeps anyway, at scrape time. The state
types are structural so this module imports no training code (nor torch).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final, Protocol

from prometheus_client.metrics_core import HistogramMetricFamily, Metric, SummaryMetricFamily

from ..actors import ActorRef, ActorSystem
from ..metrics import Families, Tracker, add_sample, cumulative_buckets, track

__all__ = [
    "FAMILIES",
    "PS_REJECT_REASONS",
    "PS_SHARDS",
    "REPLICAS",
    "SANDBLASTER",
    "STAGES",
    "PSShardState",
    "ReplicaState",
    "SandblasterState",
    "StageCounters",
    "track_ps_shard",
    "track_replica",
    "track_sandblaster",
    "track_stage",
]

FAMILIES = Families()
# -- replicas -------------------------------------------------------------------------
REPLICA_STEPS = FAMILIES.counter("dniasync_replica_steps_total", "Optimizer steps (mini-batches) run by replicas.")
REPLICA_SAMPLES = FAMILIES.counter("dniasync_replica_samples_total", "Training samples processed by replicas.")
REPLICA_PUSHES = FAMILIES.counter("dniasync_replica_pushes_total", "Gradient pushes sent to the PS shards.")
REPLICA_PULLS = FAMILIES.counter("dniasync_replica_pulls_total", "Parameter pulls from PS shards.")
REPLICA_BYTES = FAMILIES.counter("dniasync_replica_bytes_total",
                                 "Payload bytes of gradients pushed and parameters pulled (direction: push, pull).",
                                 "direction")
REPLICA_DENSE_BYTES = FAMILIES.counter("dniasync_replica_push_dense_bytes_total",
                                       "Bytes the pushed gradients would take as dense float32 (before compression).")
REPLICA_COMPRESSION = FAMILIES.gauge("dniasync_replica_compression_ratio",
                                     "Dense float32 gradient bytes per byte pushed, since start (1 = uncompressed).")
REPLICA_LOSS = FAMILIES.gauge("dniasync_replica_loss", "Mean training loss of recent mini-batches.")
# -- parameter-server shards ------------------------------------------------------------
PS_APPLIED = FAMILIES.counter("dniasync_ps_updates_applied_total", "Pushes applied by a PS shard.", "shard")
PS_REJECTED = FAMILIES.counter(
    "dniasync_ps_updates_rejected_total",
    "Pushes rejected by a PS shard, by reason (stale, duplicate, zombie, nonfinite, bad_payload).", "shard", "reason")
PS_PULLS = FAMILIES.counter("dniasync_ps_pulls_total", "Pulls answered by a PS shard.", "shard")
PS_VERSION = FAMILIES.gauge("dniasync_ps_version", "Parameter version of a PS shard (bumped per applied update).",
                            "shard")
PS_PARAMETERS = FAMILIES.gauge("dniasync_ps_parameters", "Parameters held by a PS shard.", "shard")
PS_SAMPLES = FAMILIES.counter("dniasync_ps_samples_total", "Training samples behind the pushes a shard applied.",
                              "shard")
PS_BYTES = FAMILIES.counter(
    "dniasync_ps_bytes_total",
    "Payload bytes a PS shard received in pushes and sent in pulls (direction: received, sent).", "shard", "direction")
PS_STALENESS = FAMILIES.histogram(
    "dniasync_ps_staleness_versions",
    "Staleness of pushes: shard version now minus the version the gradient was computed on.", "shard")
# -- pipeline stages (DNI and real-gradient rules) -----------------------------------------
STAGE_STEPS = FAMILIES.counter("dniasync_stage_steps_total", "Optimizer steps of a pipeline stage.", "stage")
STAGE_STEP_TIME = FAMILIES.summary("dniasync_stage_step_seconds",
                                 "Time a stage spends on one forward message (forward, update, sends).", "stage")
STAGE_SG_LOSS = FAMILIES.gauge("dniasync_dni_sg_loss",
                             "Latest regression loss of a stage's synthetic-gradient model.", "stage")
STAGE_SG_STEPS = FAMILIES.counter("dniasync_dni_sg_steps_total",
                                "Training steps of a stage's synthetic-gradient model.", "stage")
STAGE_QUEUE = FAMILIES.gauge("dniasync_stage_queue_messages", "Messages waiting in a stage's mailbox.",
                           "stage")
STAGE_EVICTIONS = FAMILIES.counter("dniasync_stage_evictions_total",
                                 "Batches a stage evicted before their gradient came back.", "stage")
STAGE_LATE = FAMILIES.counter("dniasync_stage_late_gradients_total",
                            "Gradients that arrived after their batch was evicted.", "stage")
STAGE_SG_STALENESS = FAMILIES.summary(
    "dniasync_dni_sg_staleness_updates",
    "Updates a stage made between a batch's forward and the SG fit on its true gradient.", "stage")

STAGE_COMPUTE = FAMILIES.summary(
    "dniasync_stage_compute_seconds",
    "Forward plus backward time a stage spends in its own layers per trained batch (measured per layer; what "
    "regrouping balances).", "stage")
STAGE_VERSION_GAP = FAMILIES.summary(
    "dniasync_stage_version_gap_updates",
    "Updates a stage made between a batch's forward and the return of its true gradient (its version gap).", "stage")
STAGE_STASH_BYTES = FAMILIES.gauge("dniasync_stage_stash_bytes",
                                 "Bytes of weight versions a stage holds for batches in flight (rule stash).", "stage")
STAGE_ESTIMATE_ERROR = FAMILIES.gauge(
    "dniasync_stage_estimate_error_ratio",
    "Relative error of what a stage steps on instead of the truth: |M - g| / |g| of its SG model (dni, cdni), "
    "|W_predicted - W| / |W_forward - W| of its weight prediction (spectrain).", "stage")
STAGE_LAYERS = FAMILIES.gauge("dniasync_stage_layers", "Layers a stage holds now (regrouping moves them).", "stage")
STAGE_LAYER_MOVES = FAMILIES.counter("dniasync_stage_layer_moves_total",
                                   "Layers a stage gave to a neighbour or took from one (direction: out, in).",
                                   "stage", "direction")
# -- Sandblaster L-BFGS (the coordinator's driver) ---------------------------------------
SB_ITERATIONS = FAMILIES.counter("dniasync_sandblaster_iterations_total", "L-BFGS iterations Sandblaster completed.")
SB_LOSS = FAMILIES.gauge("dniasync_sandblaster_train_loss",
                         "Full-batch training loss at Sandblaster's latest L-BFGS iterate.")
SB_GRADIENTS = FAMILIES.counter("dniasync_sandblaster_batch_gradients_total",
                                "Full-batch gradients Sandblaster computed (one per loss evaluation).")
SB_LINE_SEARCH = FAMILIES.counter("dniasync_sandblaster_line_search_evaluations_total",
                                  "Loss evaluations Sandblaster's line searches made.")
SB_REISSUED = FAMILIES.counter("dniasync_sandblaster_portions_reissued_total",
                               "Portions of a batch handed out again (backup tasks and a lost replica's).")
SB_BACKUPS = FAMILIES.counter("dniasync_sandblaster_backup_tasks_total",
                              "Backup copies of outstanding portions handed to idle replicas near a batch's end.")
SB_DUPLICATES = FAMILIES.counter("dniasync_sandblaster_duplicates_dropped_total",
                                 "Portion results dropped because another replica's result had won.")
SB_COMMAND_BYTES = FAMILIES.counter("dniasync_sandblaster_command_bytes_total",
                                    "Bytes of the coordinator's commands to the PS shards and of their replies.")
# -- peer to peer (train/sync/p2p.py: one peer's side) -----------------------------------
P2P_BYTES = FAMILIES.counter(
    "dniasync_p2p_bytes_total",
    "Payload bytes of peer-to-peer updates and dense copies (direction: sent, received).", "direction")
P2P_UPDATES = FAMILIES.counter(
    "dniasync_p2p_updates_total",
    "Peer-to-peer updates: own sent (sent), forwarded for others (forwarded), received new (received), "
    "received again (duplicate), applied to the shared copy (applied), not sent to a silent or full peer (skipped); "
    "steps whose change waited for a later update while a link was busy (held: flow control); own updates "
    "of held steps coded when the trainer stopped (flushed); own updates that carried only as many codes as their "
    "links' cap (capped).",
    "event")
P2P_DENSE = FAMILIES.counter("dniasync_p2p_dense_copies_total",
                             "Dense copies of the shared weights a peer took from a neighbour, gave one, or asked for in vain "
                             "(role: taken, given, failed).",
                             "role")
P2P_PEERS = FAMILIES.gauge("dniasync_p2p_peers_alive", "Peers in this peer's view of the membership (itself included).")
P2P_LAG = FAMILIES.gauge("dniasync_p2p_lag_updates",
                         "Updates of live peers known to exist that this peer's shared copy lacks.")

PS_REJECT_REASONS: Final = ("stale", "duplicate", "zombie", "nonfinite", "bad_payload")


# What the collectors read: read-only members, so an actor may keep them as attributes or properties.
class ReplicaState(Protocol):
    @property
    def ref(self) -> ActorRef: ...
    @property
    def steps(self) -> int: ...
    @property
    def samples(self) -> int: ...
    @property
    def pushes(self) -> int: ...
    @property
    def pulls(self) -> int: ...
    @property
    def bytes_pushed(self) -> int: ...
    @property
    def bytes_pulled(self) -> int: ...
    @property
    def dense_bytes_pushed(self) -> int: ...
    @property
    def loss(self) -> float: ...


class PSShardState(Protocol):
    @property
    def ref(self) -> ActorRef: ...
    @property
    def shard(self) -> int: ...
    @property
    def n(self) -> int: ...
    @property
    def applied(self) -> int: ...
    @property
    def pulls(self) -> int: ...
    @property
    def samples(self) -> int: ...
    @property
    def rejected(self) -> Mapping[str, int]: ...
    @property
    def staleness_counts(self) -> Sequence[int]: ...
    @property
    def staleness_sum(self) -> int: ...
    @property
    def bytes_in(self) -> int: ...
    @property
    def bytes_out(self) -> int: ...
    @property
    def version(self) -> int: ...


class StageCounters(Protocol):
    @property
    def ref(self) -> ActorRef: ...
    @property
    def steps(self) -> int: ...
    @property
    def evictions(self) -> int: ...
    @property
    def late_gradients(self) -> int: ...
    @property
    def staleness_sum(self) -> int: ...
    @property
    def forward_seconds(self) -> float: ...
    @property
    def forwards(self) -> int: ...
    @property
    def sg(self) -> Any:
        """None, or the SG model: ``steps`` and ``losses`` (a bounded deque appended from a worker thread)."""
    @property
    def compute_seconds(self) -> float: ...
    @property
    def compute_batches(self) -> int: ...
    @property
    def rule(self) -> Any:
        """The stage's update rule: ``stash_bytes()`` and ``diagnostics()``."""
    @property
    def n_layers(self) -> int: ...
    @property
    def layers_in(self) -> int: ...
    @property
    def layers_out(self) -> int: ...


class SandblasterState(Protocol):
    @property
    def ref(self) -> ActorRef: ...
    @property
    def board(self) -> Any:
        """The coordinator's figures: ``iterations``, ``loss``, ``evaluations``, ``line_search_evals``,
        ``command_bytes`` and ``queue`` (None, or ``reissued``, ``backups``, ``duplicates_dropped``)."""


def _collect_sandblaster(system: ActorSystem, drivers: Sequence[SandblasterState]) -> Iterator[Metric]:
    boards = [d.board for d in drivers]
    queues = [b.queue for b in boards if b.queue is not None]
    yield SB_ITERATIONS.single(sum(b.iterations for b in boards))
    losses = [b.loss for b in boards if math.isfinite(b.loss)]
    if losses:
        yield SB_LOSS.single(losses[0])
    yield SB_GRADIENTS.single(sum(b.evaluations for b in boards))
    yield SB_LINE_SEARCH.single(sum(b.line_search_evals for b in boards))
    yield SB_REISSUED.single(sum(q.reissued for q in queues))
    yield SB_BACKUPS.single(sum(q.backups for q in queues))
    yield SB_DUPLICATES.single(sum(q.duplicates_dropped for q in queues))
    yield SB_COMMAND_BYTES.single(sum(b.command_bytes for b in boards))


def _collect_replicas(system: ActorSystem, reps: Sequence[ReplicaState]) -> Iterator[Metric]:
    pushed = sum(r.bytes_pushed for r in reps)
    dense = sum(r.dense_bytes_pushed for r in reps)
    yield REPLICA_STEPS.single(sum(r.steps for r in reps))
    yield REPLICA_SAMPLES.single(sum(r.samples for r in reps))
    yield REPLICA_PUSHES.single(sum(r.pushes for r in reps))
    yield REPLICA_PULLS.single(sum(r.pulls for r in reps))
    yield REPLICA_BYTES.labelled([(("push",), pushed), (("pull",), sum(r.bytes_pulled for r in reps))])
    yield REPLICA_DENSE_BYTES.single(dense)
    if pushed:  # Hogwild workers push nothing: no ratio to report
        yield REPLICA_COMPRESSION.single(dense / pushed)
    losses = [r.loss for r in reps if r.loss == r.loss]  # NaN until the first report
    if losses:
        yield REPLICA_LOSS.single(sum(losses) / len(losses))


def _collect_ps_shards(system: ActorSystem,
                       shards: Sequence[tuple[PSShardState, tuple[int, ...]]]) -> Iterator[Metric]:
    families = {d: d.family() for d in (PS_APPLIED, PS_REJECTED, PS_PULLS, PS_VERSION, PS_PARAMETERS,
                                         PS_SAMPLES, PS_BYTES, PS_STALENESS)}
    for shard, buckets in shards:
        label = str(shard.shard)
        add_sample(families[PS_APPLIED], [label], shard.applied)
        for reason in PS_REJECT_REASONS:
            add_sample(families[PS_REJECTED], [label, reason], shard.rejected.get(reason, 0))
        add_sample(families[PS_PULLS], [label], shard.pulls)
        add_sample(families[PS_VERSION], [label], shard.version)
        add_sample(families[PS_PARAMETERS], [label], shard.n)
        add_sample(families[PS_SAMPLES], [label], shard.samples)
        add_sample(families[PS_BYTES], [label, "received"], shard.bytes_in)
        add_sample(families[PS_BYTES], [label, "sent"], shard.bytes_out)
        hist = families[PS_STALENESS]
        assert isinstance(hist, HistogramMetricFamily)
        hist.add_metric([label], cumulative_buckets(buckets, shard.staleness_counts), shard.staleness_sum)
    yield from families.values()


def _collect_stages(system: ActorSystem, stages: Sequence[StageCounters]) -> Iterator[Metric]:
    families = {d: d.family() for d in (STAGE_STEPS, STAGE_STEP_TIME, STAGE_SG_LOSS, STAGE_SG_STEPS, STAGE_QUEUE,
                                         STAGE_EVICTIONS, STAGE_LATE, STAGE_SG_STALENESS, STAGE_COMPUTE, STAGE_LAYERS,
                                         STAGE_LAYER_MOVES, STAGE_VERSION_GAP, STAGE_STASH_BYTES, STAGE_ESTIMATE_ERROR)}
    step_time = families[STAGE_STEP_TIME]
    staleness = families[STAGE_SG_STALENESS]
    compute = families[STAGE_COMPUTE]
    version_gap = families[STAGE_VERSION_GAP]
    assert isinstance(step_time, SummaryMetricFamily) and isinstance(staleness, SummaryMetricFamily)
    assert isinstance(compute, SummaryMetricFamily) and isinstance(version_gap, SummaryMetricFamily)
    for stage in stages:
        label = [stage.ref.name]
        add_sample(families[STAGE_STEPS], label, stage.steps)
        step_time.add_metric(label, stage.forwards, stage.forward_seconds)
        compute.add_metric(label, stage.compute_batches, stage.compute_seconds)
        add_sample(families[STAGE_LAYERS], label, stage.n_layers)
        add_sample(families[STAGE_LAYER_MOVES], [*label, "out"], stage.layers_out)
        add_sample(families[STAGE_LAYER_MOVES], [*label, "in"], stage.layers_in)
        add_sample(families[STAGE_QUEUE], label, system.mailbox_depth(stage.ref))
        add_sample(families[STAGE_EVICTIONS], label, stage.evictions)
        add_sample(families[STAGE_LATE], label, stage.late_gradients)
        sg = stage.sg
        # every returning true gradient adds to staleness_sum: SG fits (DNI) or steps (real-gradient rules)
        version_gap.add_metric(label, sg.steps if sg is not None else stage.steps, stage.staleness_sum)
        add_sample(families[STAGE_STASH_BYTES], label, stage.rule.stash_bytes()[0])
        ratio = stage.rule.diagnostics().get("estimate_error_ratio", math.nan)
        if math.isfinite(ratio):
            add_sample(families[STAGE_ESTIMATE_ERROR], label, ratio)
        if sg is not None:
            add_sample(families[STAGE_SG_STEPS], label, sg.steps)
            staleness.add_metric(label, sg.steps, stage.staleness_sum)
            try:
                add_sample(families[STAGE_SG_LOSS], label, float(sg.losses[-1]))
            except IndexError:  # not trained yet
                pass
    yield from families.values()


REPLICAS: Final[Tracker[ReplicaState]] = Tracker("replicas", _collect_replicas)
PS_SHARDS: Final[Tracker[tuple[PSShardState, tuple[int, ...]]]] = Tracker("ps_shards", _collect_ps_shards)
STAGES: Final[Tracker[StageCounters]] = Tracker("stages", _collect_stages)
SANDBLASTER: Final[Tracker[SandblasterState]] = Tracker("sandblaster", _collect_sandblaster)


def track_replica(system: ActorSystem, replica: ReplicaState) -> None:
    """Export ``replica``'s counters from the node ``system`` runs on (no-op without metrics)."""
    track(system, REPLICAS, replica.ref, replica)


def track_ps_shard(system: ActorSystem, shard: PSShardState, buckets: Sequence[int]) -> None:
    """``buckets``: upper bounds of ``shard.staleness_counts`` (one more count: the open bucket)."""
    track(system, PS_SHARDS, shard.ref, (shard, tuple(buckets)))


def track_stage(system: ActorSystem, stage: StageCounters) -> None:
    """Export a pipeline stage's counters from the node ``system`` runs on."""
    track(system, STAGES, stage.ref, stage)


def track_sandblaster(system: ActorSystem, driver: SandblasterState) -> None:
    """Export the Sandblaster coordinator's L-BFGS figures from the node ``system`` runs on."""
    track(system, SANDBLASTER, driver.ref, driver)
