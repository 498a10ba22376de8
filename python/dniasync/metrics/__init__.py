"""Prometheus metrics of a node: one registry per node, filled at scrape time.

Each node has its own :class:`NodeMetrics` (its own ``CollectorRegistry``);
``dniasync.node`` serves it at ``/metrics``. Nothing is counted twice: the
collectors *read* the plain counters the runtime already keeps when
Prometheus scrapes, so metrics cost nothing on the hot path. The one
per-event figure, remote ask latency, is a few list increments in the
transport, switched on only when a node's metrics are attached.

This package declares the node, actor-runtime and transport families and
imports neither aiohttp nor ``remote`` (it reads the transport through
:class:`TransportStats`). Every other subsystem declares its families next
to its code and registers its state objects with a :class:`Tracker`::

    telemetry.track_ps_shard(self.system, self, STALENESS_BUCKETS)   # in PSShard.on_start

which is a no-op in a system without metrics (a test, an embedded library
use). ``actors`` never imports this package; it stays usable alone.
"""

from ._family import Families, MetricDef, add_sample, cumulative_buckets
from ._node import FAMILIES as NODE_FAMILIES
from ._node import NodeMetrics, Tracker, for_system, track
from ._remote import FAMILIES as REMOTE_FAMILIES
from ._remote import AskLatencyStats, RemoteCountersView, TransportStats

__all__ = [
    "NODE_FAMILIES",
    "REMOTE_FAMILIES",
    "AskLatencyStats",
    "Families",
    "MetricDef",
    "NodeMetrics",
    "RemoteCountersView",
    "Tracker",
    "TransportStats",
    "add_sample",
    "cumulative_buckets",
    "for_system",
    "track",
]
