"""One node's registry: the node and actor-runtime families, and the state subsystems track for scrapes."""

from __future__ import annotations

import platform
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..actors import ActorRef, ActorSystem, SystemListener
from ._family import Families
from ._remote import AskLatencyStats, TransportStats, collect_remote

__all__ = ["FAMILIES", "NodeMetrics", "Tracker", "for_system", "track"]

FAMILIES = Families()
BUILD_INFO = FAMILIES.gauge("dniasync_build_info", "Versions this node runs (always 1).",
                            "version", "core_version", "python_version", "torch_version")
NODE_INFO = FAMILIES.gauge("dniasync_node_info", "The role of this node (always 1).", "role")
ACTORS_RUNNING = FAMILIES.gauge("dniasync_actor_running", "Actors running on this node.")
ACTOR_RESTARTS = FAMILIES.counter("dniasync_actor_restarts_total", "Actor restarts by a supervisor on this node.")
ACTOR_STOPS = FAMILIES.counter("dniasync_actor_stops_total", "Actors that stopped for good on this node.")
ACTOR_DROPPED = FAMILIES.counter("dniasync_actor_dropped_messages_total",
                                 "Messages discarded from the mailboxes of actors that stopped.")
MAILBOX_DEPTH = FAMILIES.gauge("dniasync_actor_mailbox_messages", "Messages queued in all mailboxes of this node.")
MAILBOX_MAX = FAMILIES.gauge("dniasync_actor_mailbox_max_messages", "Messages queued in this node's fullest mailbox.")

S = TypeVar("S")


@dataclass(frozen=True, eq=False)
class Tracker(Generic[S]):
    """One kind of state a subsystem registers, and the collector that reads every registered one per scrape.

    ``collect(system, states)`` runs only while at least one is registered; it reads
    counters the subsystem keeps anyway, so tracking costs nothing on the hot path.
    """

    name: str
    collect: Callable[[ActorSystem, Sequence[S]], Iterable[Metric]]


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


def track(system: ActorSystem, tracker: Tracker[S], ref: ActorRef, state: S) -> None:
    """Register ``state`` (of the actor ``ref``) with the node ``system`` runs on; a no-op without metrics."""
    node = _NODES.get(system)
    if node is not None:
        node.track(tracker, ref, state)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    from .. import __version__, _core

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
    """One node's metrics: its own registry, and the state objects it reads at scrape time.

    ``dniasync.node.mount_metrics(app, metrics)`` serves them at ``GET /metrics``.
    """

    def __init__(self, system: ActorSystem, role: str, transport: TransportStats | None = None) -> None:
        if for_system(system) is not None:
            raise RuntimeError("this ActorSystem already has metrics attached")
        self.system = system
        self.role = role
        self.transport = transport
        self.ask_latency: AskLatencyStats | None = None
        if transport is not None:
            self.ask_latency = transport.enable_ask_latency()
        self._listener = _Listener()
        system.add_listener(self._listener)
        self._versions = _versions()
        self._tracked: dict[Tracker[Any], dict[str, Any]] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        ProcessCollector(registry=self.registry)
        _NODES[system] = self

    def track(self, tracker: Tracker[S], ref: ActorRef, state: S) -> None:
        """Read ``state`` at each scrape while ``ref`` runs (a restarted actor replaces its former state)."""
        self._tracked.setdefault(tracker, {})[ref.address] = state

    def tracked(self, tracker: Tracker[S]) -> list[S]:
        """The states of running actors registered under ``tracker``."""
        self._forget_stopped()
        return list(self._tracked.get(tracker, {}).values())

    def _forget_stopped(self) -> None:
        running = {ref.address for ref in self.system.actors()}
        for table in self._tracked.values():
            for address in [a for a in table if a not in running]:
                del table[address]

    def exposition(self) -> bytes:
        """The text exposition format of everything this node exports."""
        return generate_latest(self.registry)

    def collect(self) -> Iterable[Metric]:
        self._forget_stopped()
        yield from self._node()
        yield from self._actors()
        if self.transport is not None:
            yield from collect_remote(self.transport, self.ask_latency)
        for tracker, table in list(self._tracked.items()):
            if table:
                yield from tracker.collect(self.system, list(table.values()))

    def _node(self) -> Iterator[Metric]:
        build = BUILD_INFO.family()
        assert isinstance(build, GaugeMetricFamily)
        build.add_metric([self._versions[k] for k in BUILD_INFO.labels], 1)
        yield build
        yield NODE_INFO.labelled([((self.role,), 1)])

    def _actors(self) -> Iterator[Metric]:
        system = self.system
        refs = system.actors()
        depths = [system.mailbox_depth(ref) for ref in refs]
        yield ACTORS_RUNNING.single(len(refs))
        yield ACTOR_RESTARTS.single(system.restart_count)
        yield ACTOR_STOPS.single(self._listener.stops)
        yield ACTOR_DROPPED.single(self._listener.dropped)
        yield MAILBOX_DEPTH.single(sum(depths))
        yield MAILBOX_MAX.single(max(depths, default=0))
