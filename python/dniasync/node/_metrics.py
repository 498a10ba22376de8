"""The node's ``GET /metrics`` on its aiohttp app, and the catalogue of every metric dniasync exports."""

from __future__ import annotations

from typing import Final

from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from ..cluster import telemetry as job_telemetry
from ..metrics import NODE_FAMILIES, REMOTE_FAMILIES, MetricDef, NodeMetrics
from ..train import telemetry as train_telemetry

__all__ = ["metric_catalogue", "mount_metrics"]

METRICS_PATH: Final = "/metrics"


def mount_metrics(app: web.Application, metrics: NodeMetrics) -> None:
    """Serve ``GET /metrics`` from ``metrics`` on ``app`` (the node's one aiohttp application, before it starts)."""

    async def handle(request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    app.router.add_get(METRICS_PATH, handle)


def metric_catalogue() -> tuple[MetricDef, ...]:
    """Every metric dniasync exports, subsystem by subsystem in the README's order."""
    return (*NODE_FAMILIES, *REMOTE_FAMILIES, *job_telemetry.FAMILIES, *train_telemetry.FAMILIES)
