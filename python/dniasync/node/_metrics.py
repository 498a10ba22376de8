"""The node's ``GET /metrics`` on its aiohttp app, and the catalogue of every metric dniasync exports.

The families declared here read what only the node sees: the remote guard's
counters (``remote`` may not import ``metrics``, so they are read from the
transport's plain counters at scrape time) and the event loop's task count,
which a soak check compares before and after faults.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterable
from typing import Any, Final

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ..cluster import telemetry as job_telemetry
from ..metrics import NODE_FAMILIES, REMOTE_FAMILIES, Families, MetricDef, NodeMetrics
from ..train import telemetry as train_telemetry

__all__ = ["FAMILIES", "metric_catalogue", "mount_metrics"]

METRICS_PATH: Final = "/metrics"

FAMILIES = Families()
ASYNCIO_TASKS = FAMILIES.gauge("dniasync_node_asyncio_tasks", "Asyncio tasks alive on this node's event loop.")
GUARD_REFUSED = FAMILIES.counter("dniasync_remote_connections_refused_total",
                                 "Connections reset on accept: the listener was at a connection cap with none to evict.")
GUARD_EVICTED = FAMILIES.counter("dniasync_remote_connections_evicted_total",
                                 "Unauthenticated connections closed to make room at a connection cap.")
GUARD_TIMED_OUT = FAMILIES.counter("dniasync_remote_connections_timed_out_total",
                                   "Connections closed because their request headers did not arrive in time.")

_MOUNTED: weakref.WeakSet[NodeMetrics] = weakref.WeakSet()


class _NodeCollector(Collector):
    """Reads the guard's counters and the loop's tasks at each scrape (on the loop: /metrics is served there)."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        try:
            tasks = len(asyncio.all_tasks())
        except RuntimeError:  # scraped from outside a loop (a test reading the registry directly)
            tasks = 0
        yield ASYNCIO_TASKS.single(tasks)
        transport: Any = self.metrics.transport
        counters = getattr(transport, "counters", None)
        if counters is not None:
            yield GUARD_REFUSED.single(getattr(counters, "connections_refused", 0))
            yield GUARD_EVICTED.single(getattr(counters, "connections_evicted", 0))
            yield GUARD_TIMED_OUT.single(getattr(counters, "connections_timed_out", 0))


def mount_metrics(app: web.Application, metrics: NodeMetrics) -> None:
    """Serve ``GET /metrics`` from ``metrics`` on ``app`` (the node's one aiohttp application, before it starts)."""
    if metrics not in _MOUNTED:
        _MOUNTED.add(metrics)
        metrics.registry.register(_NodeCollector(metrics))

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    app.router.add_get(METRICS_PATH, handle)


def metric_catalogue() -> tuple[MetricDef, ...]:
    """Every metric dniasync exports, subsystem by subsystem in the README's order."""
    return (*NODE_FAMILIES, *FAMILIES, *REMOTE_FAMILIES, *job_telemetry.FAMILIES, *train_telemetry.FAMILIES)
