"""Every Prometheus metric of dniasync, defined once, and the collectors that fill them.

Each node has its own :class:`NodeMetrics` (its own ``CollectorRegistry``),
served at ``/metrics`` on the node's aiohttp app. Nothing is counted twice:
the collectors *read* the plain counters the runtime already keeps (the
transport's :class:`~dniasync.remote.RemoteCounters`, a PS shard's
``applied``/``rejected``/staleness buckets, a replica's ``steps``...) when
Prometheus scrapes, so metrics cost nothing on the hot path. The one
per-event figure, remote ask latency, is a few list increments in the
transport, switched on only when a node's metrics are attached.

Training code registers its state objects with the node it runs on::

    metrics.track_ps_shard(self.system, self, STALENESS_BUCKETS)   # in PSShard.on_start

which is a no-op in a system without metrics (a test, an embedded library
use). ``actors`` never imports this module; it stays usable alone.
"""

from __future__ import annotations

import platform
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from .actors import ActorRef, ActorSystem, SystemListener

if TYPE_CHECKING:
    from .remote import AskLatency, WebSocketTransport

__all__ = [
    "METRICS",
    "MetricDef",
    "NodeMetrics",
    "for_system",
    "track_layer_group",
    "track_ps_shard",
    "track_replica",
    "track_trainer",
]

METRICS_PATH: Final = "/metrics"


@dataclass(frozen=True)
class MetricDef:
    """One metric: its full exposed name, type, help text and (bounded) label names."""

    name: str
    kind: str  # counter | gauge | histogram | summary
    help: str
    labels: tuple[str, ...] = ()

    def family(self) -> Metric:
        labels = list(self.labels)
        if self.kind == "counter":
            return CounterMetricFamily(self.name, self.help, labels=labels)
        if self.kind == "gauge":
            return GaugeMetricFamily(self.name, self.help, labels=labels)
        if self.kind == "histogram":
            return HistogramMetricFamily(self.name, self.help, labels=labels)
        return SummaryMetricFamily(self.name, self.help, labels=labels)


def _m(name: str, kind: str, help: str, *labels: str) -> MetricDef:
    return MetricDef(name, kind, help, labels)


# -- node ---------------------------------------------------------------------------
BUILD_INFO = _m("dniasync_build_info", "gauge", "Versions this node runs (always 1).",
                "version", "core_version", "python_version", "torch_version")
NODE_INFO = _m("dniasync_node_info", "gauge", "The role of this node (always 1).", "role")
# -- actors -------------------------------------------------------------------------
ACTORS_RUNNING = _m("dniasync_actor_running", "gauge", "Actors running on this node.")
ACTOR_RESTARTS = _m("dniasync_actor_restarts_total", "counter", "Actor restarts by a supervisor on this node.")
ACTOR_STOPS = _m("dniasync_actor_stops_total", "counter", "Actors that stopped for good on this node.")
ACTOR_DROPPED = _m("dniasync_actor_dropped_messages_total", "counter",
                   "Messages discarded from the mailboxes of actors that stopped.")
MAILBOX_DEPTH = _m("dniasync_actor_mailbox_messages", "gauge", "Messages queued in all mailboxes of this node.")
MAILBOX_MAX = _m("dniasync_actor_mailbox_max_messages", "gauge", "Messages queued in this node's fullest mailbox.")
# -- remote -------------------------------------------------------------------------
REMOTE_BYTES = _m("dniasync_remote_bytes_total", "counter",
                  "Websocket bytes exchanged with other nodes (direction: sent, received).", "direction")
REMOTE_FRAMES = _m("dniasync_remote_frames_total", "counter",
                   "Wire frames exchanged with other nodes (direction: sent, received).", "direction")
REMOTE_DECODE_ERRORS = _m("dniasync_remote_decode_errors_total", "counter",
                          "Frames or messages from other nodes that could not be decoded.")
REMOTE_AUTH_FAILURES = _m("dniasync_remote_auth_failures_total", "counter",
                          "Connection attempts refused by auth (either side).")
REMOTE_DROPPED_TELLS = _m("dniasync_remote_dropped_tells_total", "counter",
                          "Tells to or from other nodes dropped (peer down, actor gone).")
REMOTE_RECONNECTS = _m("dniasync_remote_reconnects_total", "counter", "Reconnections to a peer after it was down.")
REMOTE_PEERS_LOST = _m("dniasync_remote_peers_lost_total", "counter", "Times a peer was declared down.")
REMOTE_ACCEPTED = _m("dniasync_remote_connections_accepted_total", "counter", "Websocket connections accepted.")
REMOTE_PEERS_UP = _m("dniasync_remote_peers_up", "gauge", "Peers this node is connected to.")
REMOTE_PEERS_DOWN = _m("dniasync_remote_peers_down", "gauge", "Known peers that are down (reconnecting).")
REMOTE_ASK_LATENCY = _m("dniasync_remote_ask_duration_seconds", "histogram",
                        "Round trip of asks to actors on other nodes, by message type.", "msg_type")
# -- training: coordinator ---------------------------------------------------------
TRAIN_ACCURACY = _m("dniasync_train_eval_accuracy_ratio", "gauge", "Held-out accuracy at the last evaluation.")
TRAIN_LOSS = _m("dniasync_train_eval_loss", "gauge", "Held-out cross-entropy loss at the last evaluation.")
TRAIN_EVALS = _m("dniasync_train_evaluations_total", "counter", "Held-out evaluations run by the coordinator.")
TRAIN_SAMPLES = _m("dniasync_train_samples_total", "counter", "Training samples processed by all replicas.")
TRAIN_SAMPLES_RATE = _m("dniasync_train_samples_per_second", "gauge",
                        "Cluster training throughput between the last two evaluations.")
TRAIN_EPOCHS = _m("dniasync_train_epochs", "gauge", "Epochs of training data processed so far.")
TRAIN_WALL = _m("dniasync_train_wall_seconds", "gauge", "Seconds since the job started training.")
TRAIN_REPLICAS_ALIVE = _m("dniasync_train_replicas_alive", "gauge", "Replicas the coordinator considers alive.")
TRAIN_REPLICAS_DEAD = _m("dniasync_train_replicas_dead", "gauge", "Replicas the coordinator declared dead.")
TRAIN_FINISHED = _m("dniasync_train_finished", "gauge", "1 once the job has finished, else 0.")
# -- training: replicas --------------------------------------------------------------
REPLICA_STEPS = _m("dniasync_replica_steps_total", "counter", "Optimizer steps (mini-batches) run by replicas.")
REPLICA_SAMPLES = _m("dniasync_replica_samples_total", "counter", "Training samples processed by replicas.")
REPLICA_PUSHES = _m("dniasync_replica_pushes_total", "counter", "Gradient pushes sent to the PS shards.")
REPLICA_PULLS = _m("dniasync_replica_pulls_total", "counter", "Parameter pulls from PS shards.")
REPLICA_BYTES = _m("dniasync_replica_bytes_total", "counter",
                   "Payload bytes of gradients pushed and parameters pulled (direction: push, pull).", "direction")
REPLICA_DENSE_BYTES = _m("dniasync_replica_push_dense_bytes_total", "counter",
                         "Bytes the pushed gradients would take as dense float32 (before compression).")
REPLICA_COMPRESSION = _m("dniasync_replica_compression_ratio", "gauge",
                         "Dense float32 gradient bytes per byte pushed, since start (1 = uncompressed).")
REPLICA_LOSS = _m("dniasync_replica_loss", "gauge", "Mean training loss of recent mini-batches.")
# -- training: parameter-server shards ---------------------------------------------
PS_APPLIED = _m("dniasync_ps_updates_applied_total", "counter", "Pushes applied by a PS shard.", "shard")
PS_REJECTED = _m("dniasync_ps_updates_rejected_total", "counter",
                 "Pushes rejected by a PS shard, by reason (stale, duplicate, zombie, nonfinite, bad_payload).",
                 "shard", "reason")
PS_PULLS = _m("dniasync_ps_pulls_total", "counter", "Pulls answered by a PS shard.", "shard")
PS_VERSION = _m("dniasync_ps_version", "gauge", "Parameter version of a PS shard (bumped per applied update).",
                "shard")
PS_PARAMETERS = _m("dniasync_ps_parameters", "gauge", "Parameters held by a PS shard.", "shard")
PS_SAMPLES = _m("dniasync_ps_samples_total", "counter", "Training samples behind the pushes a shard applied.",
                "shard")
PS_BYTES = _m("dniasync_ps_bytes_total", "counter",
              "Payload bytes a PS shard received in pushes and sent in pulls (direction: received, sent).",
              "shard", "direction")
PS_STALENESS = _m("dniasync_ps_staleness_versions", "histogram",
                  "Staleness of pushes: shard version now minus the version the gradient was computed on.",
                  "shard")
# -- training: DNI layer groups ----------------------------------------------------
DNI_STEPS = _m("dniasync_dni_group_steps_total", "counter", "Optimizer steps of a layer group.", "group")
DNI_STEP_TIME = _m("dniasync_dni_group_step_seconds", "summary",
                   "Time a layer group spends on one forward message (forward, update, sends).", "group")
DNI_SG_LOSS = _m("dniasync_dni_sg_loss", "gauge",
                 "Latest regression loss of a group's synthetic-gradient model.", "group")
DNI_SG_STEPS = _m("dniasync_dni_sg_steps_total", "counter", "Training steps of a group's synthetic-gradient model.",
                  "group")
DNI_QUEUE = _m("dniasync_dni_group_queue_messages", "gauge", "Messages waiting in a layer group's mailbox.", "group")
DNI_EVICTIONS = _m("dniasync_dni_group_evictions_total", "counter",
                   "Batches a layer group evicted before their gradient came back.", "group")
DNI_LATE = _m("dniasync_dni_group_late_gradients_total", "counter",
              "Gradients that arrived after their batch was evicted.", "group")
DNI_SG_STALENESS = _m("dniasync_dni_sg_staleness_updates", "summary",
                      "Updates a layer group made between a batch's forward and the SG fit on its true gradient.",
                      "group")

METRICS: tuple[MetricDef, ...] = tuple(v for v in list(globals().values()) if isinstance(v, MetricDef))
"""Every metric dniasync exports, in definition order (the README lists them)."""

PS_REJECT_REASONS: Final = ("stale", "duplicate", "zombie", "nonfinite", "bad_payload")


# -- what training code registers (structural types: metrics imports no training code) --
class PSShardState(Protocol):
    @property
    def ref(self) -> ActorRef: ...

    shard: int
    n: int
    applied: int
    pulls: int
    samples: int
    rejected: dict[str, int]
    staleness_counts: list[int]
    staleness_sum: int
    bytes_in: int
    bytes_out: int

    @property
    def version(self) -> int: ...


class ReplicaState(Protocol):
    @property
    def ref(self) -> ActorRef: ...

    steps: int
    samples: int
    pushes: int
    pulls: int
    bytes_pushed: int
    bytes_pulled: int
    dense_bytes_pushed: int

    @property
    def loss(self) -> float: ...


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


class TrainerState(Protocol):
    @property
    def ref(self) -> ActorRef: ...

    def snapshot(self) -> JobSnapshot: ...

    @property
    def evaluations(self) -> int: ...


class RegressorState(Protocol):
    steps: int
    losses: Any  # a bounded deque of floats, appended from a worker thread


class LayerGroupState(Protocol):
    steps: int
    evictions: int
    late_gradients: int
    staleness_sum: int
    forward_seconds: float
    forwards: int
    sg: Any  # RegressorState | None

    @property
    def ref(self) -> ActorRef: ...


# -- per-node registry ----------------------------------------------------------------
class _Listener(SystemListener):
    def __init__(self) -> None:
        self.stops = 0
        self.dropped = 0

    def actor_stopped(self, address: str, actor_class: str, dropped: int) -> None:
        self.stops += 1
        self.dropped += dropped


_NODES: weakref.WeakKeyDictionary[ActorSystem, NodeMetrics] = weakref.WeakKeyDictionary()


def for_system(system: ActorSystem) -> NodeMetrics | None:
    """The metrics attached to ``system``, if any."""
    return _NODES.get(system)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__, _core

    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "none"
    return {
        "version": __version__,
        "core_version": str(getattr(_core, "__version__", "unknown")),
        "python_version": platform.python_version(),
        "torch_version": torch_version,
    }


class NodeMetrics(Collector):
    """One node's metrics: its registry, and the state objects it reads at scrape time.

    ::

        metrics = NodeMetrics(system, role="worker", transport=transport)
        metrics.mount(transport.app)        # GET /metrics, before transport.start()
    """

    def __init__(self, system: ActorSystem, role: str, transport: WebSocketTransport | None = None) -> None:
        if for_system(system) is not None:
            raise RuntimeError("this ActorSystem already has metrics attached")
        self.system = system
        self.role = role
        self.transport = transport
        self.ask_latency: AskLatency | None = None
        if transport is not None:
            self.ask_latency = transport.enable_ask_latency()
        self._listener = _Listener()
        system.add_listener(self._listener)
        self._versions = _versions()
        self._trainers: dict[str, TrainerState] = {}
        self._replicas: dict[str, ReplicaState] = {}
        self._shards: dict[str, tuple[PSShardState, tuple[int, ...]]] = {}
        self._groups: dict[str, LayerGroupState] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        ProcessCollector(registry=self.registry)
        _NODES[system] = self

    # -- registration (by address: a restarted actor replaces its former instance) --
    def track_trainer(self, trainer: TrainerState) -> None:
        self._trainers[trainer.ref.address] = trainer

    def track_replica(self, replica: ReplicaState) -> None:
        self._replicas[replica.ref.address] = replica

    def track_ps_shard(self, shard: PSShardState, buckets: Sequence[int]) -> None:
        """``buckets``: upper bounds of ``shard.staleness_counts`` (one more count: the open bucket)."""
        self._shards[shard.ref.address] = (shard, tuple(buckets))

    def track_layer_group(self, group: LayerGroupState) -> None:
        self._groups[group.ref.address] = group

    def trainers(self) -> list[TrainerState]:
        self._forget_stopped()
        return list(self._trainers.values())

    def _forget_stopped(self) -> None:
        running = {ref.address for ref in self.system.actors()}
        tables: tuple[dict[str, Any], ...] = (self._trainers, self._replicas, self._shards, self._groups)
        for table in tables:
            for address in [a for a in table if a not in running]:
                del table[address]

    # -- serving ----------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The text exposition format of everything this node exports."""
        return generate_latest(self.registry)

    def mount(self, app: web.Application) -> None:
        """Serve ``GET /metrics`` on ``app`` (the node's one aiohttp application)."""
        app.router.add_get(METRICS_PATH, self._handle)

    async def _handle(self, request: web.Request) -> web.Response:
        body = self.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    # -- collecting ---------------------------------------------------------------------
    def collect(self) -> Iterable[Metric]:
        self._forget_stopped()
        yield from self._node()
        yield from self._actors()
        if self.transport is not None:
            yield from self._remote(self.transport)
        yield from self._training()
        yield from self._ps()
        yield from self._dni()

    def _node(self) -> Iterator[Metric]:
        build = BUILD_INFO.family()
        assert isinstance(build, GaugeMetricFamily)
        build.add_metric([self._versions[k] for k in BUILD_INFO.labels], 1)
        node = NODE_INFO.family()
        assert isinstance(node, GaugeMetricFamily)
        node.add_metric([self.role], 1)
        yield build
        yield node

    def _actors(self) -> Iterator[Metric]:
        system = self.system
        refs = system.actors()
        depths = [system.mailbox_depth(ref) for ref in refs]
        yield _one(ACTORS_RUNNING, len(refs))
        yield _one(ACTOR_RESTARTS, system.restart_count)
        yield _one(ACTOR_STOPS, self._listener.stops)
        yield _one(ACTOR_DROPPED, self._listener.dropped)
        yield _one(MAILBOX_DEPTH, sum(depths))
        yield _one(MAILBOX_MAX, max(depths, default=0))

    def _remote(self, transport: WebSocketTransport) -> Iterator[Metric]:
        c = transport.counters
        yield _labelled(REMOTE_BYTES, [(("sent",), c.bytes_out), (("received",), c.bytes_in)])
        yield _labelled(REMOTE_FRAMES, [(("sent",), c.frames_out), (("received",), c.frames_in)])
        yield _one(REMOTE_DECODE_ERRORS, c.decode_errors)
        yield _one(REMOTE_AUTH_FAILURES, c.auth_failures)
        yield _one(REMOTE_DROPPED_TELLS, c.dropped_tells)
        yield _one(REMOTE_RECONNECTS, c.reconnects)
        yield _one(REMOTE_PEERS_LOST, c.peers_lost)
        yield _one(REMOTE_ACCEPTED, c.connections_accepted)
        states = list(transport.peer_states().values())
        yield _one(REMOTE_PEERS_UP, states.count("up"))
        yield _one(REMOTE_PEERS_DOWN, states.count("down"))
        hist = REMOTE_ASK_LATENCY.family()
        assert isinstance(hist, HistogramMetricFamily)
        latency = self.ask_latency
        if latency is not None:
            for msg_type, counts in list(latency.by_type.items()):
                hist.add_metric([msg_type.__name__], _cumulative(latency.bounds, counts[:-1]), counts[-1])
        yield hist

    def _training(self) -> Iterator[Metric]:
        if self._trainers:
            snaps = [(t.snapshot(), t.evaluations) for t in self._trainers.values()]
            accuracy = [s.accuracy for s, _ in snaps if s.accuracy is not None]
            loss = [s.loss for s, _ in snaps if s.loss is not None]
            if accuracy:
                yield _one(TRAIN_ACCURACY, accuracy[0])
            if loss:
                yield _one(TRAIN_LOSS, loss[0])
            yield _one(TRAIN_EVALS, sum(n for _, n in snaps))
            yield _one(TRAIN_SAMPLES, sum(s.samples for s, _ in snaps))
            yield _one(TRAIN_SAMPLES_RATE, sum(s.samples_per_s for s, _ in snaps))
            yield _one(TRAIN_EPOCHS, max(s.epochs for s, _ in snaps))
            yield _one(TRAIN_WALL, max(s.wall_s for s, _ in snaps))
            statuses = [st for s, _ in snaps for st in s.replicas.values()]
            yield _one(TRAIN_REPLICAS_ALIVE, statuses.count("alive"))
            yield _one(TRAIN_REPLICAS_DEAD, len(statuses) - statuses.count("alive"))
            yield _one(TRAIN_FINISHED, int(all(s.state == "finished" for s, _ in snaps)))
        if self._replicas:
            reps = list(self._replicas.values())
            pushed = sum(r.bytes_pushed for r in reps)
            dense = sum(r.dense_bytes_pushed for r in reps)
            yield _one(REPLICA_STEPS, sum(r.steps for r in reps))
            yield _one(REPLICA_SAMPLES, sum(r.samples for r in reps))
            yield _one(REPLICA_PUSHES, sum(r.pushes for r in reps))
            yield _one(REPLICA_PULLS, sum(r.pulls for r in reps))
            yield _labelled(REPLICA_BYTES, [(("push",), pushed), (("pull",), sum(r.bytes_pulled for r in reps))])
            yield _one(REPLICA_DENSE_BYTES, dense)
            if pushed:  # Hogwild workers push nothing: no ratio to report
                yield _one(REPLICA_COMPRESSION, dense / pushed)
            losses = [r.loss for r in reps if r.loss == r.loss]  # NaN until the first report
            if losses:
                yield _one(REPLICA_LOSS, sum(losses) / len(losses))

    def _ps(self) -> Iterator[Metric]:
        if not self._shards:
            return
        families = {d: d.family() for d in (PS_APPLIED, PS_REJECTED, PS_PULLS, PS_VERSION, PS_PARAMETERS,
                                             PS_SAMPLES, PS_BYTES, PS_STALENESS)}
        for shard, buckets in self._shards.values():
            label = str(shard.shard)
            _add(families[PS_APPLIED], [label], shard.applied)
            for reason in PS_REJECT_REASONS:
                _add(families[PS_REJECTED], [label, reason], shard.rejected.get(reason, 0))
            _add(families[PS_PULLS], [label], shard.pulls)
            _add(families[PS_VERSION], [label], shard.version)
            _add(families[PS_PARAMETERS], [label], shard.n)
            _add(families[PS_SAMPLES], [label], shard.samples)
            _add(families[PS_BYTES], [label, "received"], shard.bytes_in)
            _add(families[PS_BYTES], [label, "sent"], shard.bytes_out)
            hist = families[PS_STALENESS]
            assert isinstance(hist, HistogramMetricFamily)
            hist.add_metric([label], _cumulative(buckets, shard.staleness_counts), shard.staleness_sum)
        yield from families.values()

    def _dni(self) -> Iterator[Metric]:
        if not self._groups:
            return
        families = {d: d.family() for d in (DNI_STEPS, DNI_STEP_TIME, DNI_SG_LOSS, DNI_SG_STEPS, DNI_QUEUE,
                                             DNI_EVICTIONS, DNI_LATE, DNI_SG_STALENESS)}
        for group in self._groups.values():
            label = [group.ref.name]
            _add(families[DNI_STEPS], label, group.steps)
            summary = families[DNI_STEP_TIME]
            assert isinstance(summary, SummaryMetricFamily)
            summary.add_metric(label, group.forwards, group.forward_seconds)
            _add(families[DNI_QUEUE], label, self.system.mailbox_depth(group.ref))
            _add(families[DNI_EVICTIONS], label, group.evictions)
            _add(families[DNI_LATE], label, group.late_gradients)
            sg = group.sg
            if sg is not None:
                _add(families[DNI_SG_STEPS], label, sg.steps)
                staleness = families[DNI_SG_STALENESS]
                assert isinstance(staleness, SummaryMetricFamily)
                staleness.add_metric(label, sg.steps, group.staleness_sum)
                try:
                    _add(families[DNI_SG_LOSS], label, float(sg.losses[-1]))
                except IndexError:  # not trained yet
                    pass
        yield from families.values()


def _one(defn: MetricDef, value: float) -> Metric:
    family = defn.family()
    _add(family, [], value)
    return family


def _labelled(defn: MetricDef, values: Iterable[tuple[tuple[str, ...], float]]) -> Metric:
    family = defn.family()
    for labels, value in values:
        _add(family, list(labels), value)
    return family


def _add(family: Metric, labels: list[str], value: float) -> None:
    assert isinstance(family, (CounterMetricFamily, GaugeMetricFamily))
    family.add_metric(labels, value)


def _cumulative(bounds: Sequence[float], counts: Sequence[float]) -> list[tuple[str, float]]:
    """Per-bucket counts (the last one open) -> Prometheus's cumulative ``(le, count)`` pairs."""
    out: list[tuple[str, float]] = []
    total = 0.0
    for bound, count in zip(bounds, counts):
        total += count
        out.append((_le(bound), total))
    out.append(("+Inf", total + sum(counts[len(bounds):])))
    return out


def _le(bound: float) -> str:
    return str(float(bound))


# -- for training code: register with the node this actor runs on (no-op without metrics) --
def track_trainer(system: ActorSystem, trainer: TrainerState) -> None:
    node = _NODES.get(system)
    if node is not None:
        node.track_trainer(trainer)


def track_replica(system: ActorSystem, replica: ReplicaState) -> None:
    node = _NODES.get(system)
    if node is not None:
        node.track_replica(replica)


def track_ps_shard(system: ActorSystem, shard: PSShardState, buckets: Sequence[int]) -> None:
    node = _NODES.get(system)
    if node is not None:
        node.track_ps_shard(shard, buckets)


def track_layer_group(system: ActorSystem, group: LayerGroupState) -> None:
    node = _NODES.get(system)
    if node is not None:
        node.track_layer_group(group)
