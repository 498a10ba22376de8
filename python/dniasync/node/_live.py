"""The coordinator's built-in live page: ``GET /`` (one static HTML file) fed by ``GET /api/status``.

No external service, no CDN, no build step: the page is hand-written HTML,
JS and inline SVG, and polls the JSON endpoint once a second. The series it
charts come from the same state the node's ``/metrics`` reads: the training
coordinator's job status and eval history, the byte counts it receives, the
mode's own figures (its status extras), and the PS shards' staleness
histograms (asked for each sample). Beside accuracy, loss and samples/s, the
charts are the panels the job's mode declares (``Mode.panels``, see
:mod:`dniasync.cluster.panels`): Downpour's staleness and bytes, a
pipeline's version gap and busy time per stage; the page draws whatever
panels the status lists. Its header names the coordinator running the job
(address and epoch: a standby that took over runs a later one), and a job
with replicated PS shards gets a "PS chains" table: each shard's copies in
chain order, those down or catching up, the view number.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict
from importlib import resources
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..actors import ActorError
from ..cluster.modes import get_mode
from ..cluster.panels import SAMPLES, Line, Panel
from ..cluster.telemetry import TRAINERS
from ..metrics import NodeMetrics
from ..remote import WebSocketTransport, is_loopback, parse_hostport
from ..train.messages import ShardStats
from ..train.ps import STALENESS_BUCKETS
from ._membership import GetMembers, Members
from ._roles import NodeContext

if TYPE_CHECKING:
    from ..cluster.job import JobRunner

__all__ = ["LivePage"]

log = logging.getLogger("dniasync.node")

_LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})

Figure = float | list[float]
"""A sampled figure: a counter or level, or one per member (stage, peer)."""


class LivePage:
    """Serves the live page on the coordinator node and keeps the series it charts.

    ``every_s``: sampling interval; ``keep``: samples kept (an hour at 1 s).
    """

    def __init__(self, transport: WebSocketTransport, metrics: NodeMetrics, *, every_s: float = 1.0,
                 keep: int = 3600) -> None:
        self.transport = transport
        self.context: NodeContext | None = None
        self.metrics = metrics
        self.every_s = every_s
        self.series: deque[dict[str, Any]] = deque(maxlen=keep)
        self.staleness_counts = [0] * (len(STALENESS_BUCKETS) + 1)
        self._last: tuple[float, dict[str, Figure]] | None = None  # wall seconds, figures
        self._html = resources.files(__package__).joinpath("live.html").read_bytes()

    def mount(self, app: web.Application) -> None:
        """Add ``GET /`` and ``GET /api/status`` to ``app`` (before the transport starts)."""
        app.router.add_get("/", self._page)
        app.router.add_get("/api/status", self._status)

    def start(self, context: NodeContext) -> None:
        """Once the node's roles run: sample in a task the transport owns (cancelled when it closes)."""
        self.context = context
        self.transport.spawn_task(self._sample_forever(), "live-page-sampler")

    # -- sampling -----------------------------------------------------------------------
    def _trainer(self) -> JobRunner | None:
        from ..cluster.job import JobRunner  # only the coordinator node needs torch

        for trainer in self.metrics.tracked(TRAINERS):
            if isinstance(trainer, JobRunner):
                return trainer
        return None

    async def _sample_forever(self) -> None:
        while True:
            try:
                await self.sample()
            except Exception:  # a bad sample must not end the page's series
                log.exception("live page: sampling failed")
            await asyncio.sleep(self.every_s)

    @staticmethod
    def panels(trainer: JobRunner) -> tuple[Panel, ...]:
        """The charts of ``trainer``'s job beside accuracy and loss: samples/s, then what its mode declares."""
        return (SAMPLES, *get_mode(trainer.config.mode).panels(trainer.config))

    async def sample(self) -> None:
        """Add one point to the series (only while the job trains): every line of the job's panels."""
        trainer = self._trainer()
        if trainer is None:
            return
        status = trainer.snapshot()
        if status.state != "training":
            return
        now: dict[str, Figure] = {**_figures(status.extra), "wall_s": status.wall_s, "samples": float(status.samples),
                                  **await self._staleness(trainer)}
        last, self._last = self._last, (status.wall_s, now)
        if last is None or status.wall_s <= last[0]:
            return
        point: dict[str, Any] = {"t": round(status.wall_s, 3)}
        for panel in self.panels(trainer):
            for line in panel.lines:
                point[line.name] = _change(line, now, last[1])
        self.series.append(point)

    async def _staleness(self, trainer: JobRunner) -> dict[str, Figure]:
        """Sum and count of push staleness over every PS shard (none if a shard did not answer, or keeps no staleness:
        Sandblaster's, whose batches are synchronous); refreshes the histogram."""
        shards = [ref for ref in trainer.ps if ref is not None]
        if not shards:
            return {}
        replies = await asyncio.gather(*(ref.ask(ShardStats(), timeout=2.0) for ref in shards), return_exceptions=True)
        stats = [r for r in replies if isinstance(r, dict)]
        if len(stats) != len(shards) or not all("staleness_counts" in s for s in stats):
            return {}  # a gap in the line, not a wrong mean
        self.staleness_counts = [sum(s["staleness_counts"][i] for s in stats) for i in range(len(self.staleness_counts))]
        return {"staleness_sum": float(sum(int(s["staleness_sum"]) for s in stats)),
                "staleness_count": float(sum(int(sum(s["staleness_counts"])) for s in stats))}

    # -- serving ------------------------------------------------------------------------
    def _allowed(self, request: web.Request) -> bool:
        """On a loopback listener (the node's, or its --metrics-listen), only loopback Host names
        (no DNS rebinding from a web page)."""
        local = request.transport.get_extra_info("sockname") if request.transport is not None else None
        host = str(local[0]) if isinstance(local, tuple) and local else parse_hostport(self.transport.address)[0]
        if not is_loopback(host):
            return True
        name = request.host.rsplit(":", 1)[0] if not request.host.endswith("]") else request.host
        return name.strip("[]") in _LOOPBACK_HOSTS

    async def _page(self, request: web.Request) -> web.Response:
        if not self._allowed(request):
            raise web.HTTPForbidden(text="dniasync: this node serves loopback Host names only\n")
        return web.Response(body=self._html, content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-store"})

    async def _status(self, request: web.Request) -> web.Response:
        if not self._allowed(request):
            raise web.HTTPForbidden(text="dniasync: this node serves loopback Host names only\n")
        return web.json_response(_finite(await self.status()), headers={"Cache-Control": "no-store"})

    async def status(self) -> dict[str, Any]:
        """What the page shows, as JSON-able data."""
        transport = self.transport
        context = self.context
        members: list[dict[str, Any]] = []
        if context is not None and context.membership is not None:
            try:
                reply: Members = await context.membership.ask(GetMembers(), timeout=2.0)
                members = [{"node": m.node, "role": m.role, "alive": m.alive} for m in reply.members]
            except ActorError as exc:
                log.debug("live page: no members: %s", exc)
        doc: dict[str, Any] = {
            "node": transport.address, "role": self.metrics.role, "updated": time.time(),
            "peers": transport.peer_states(), "members": members,
            "job": None, "coordinator": None, "ps_chains": [], "replicas": {}, "history": [],
            "series": list(self.series), "panels": [asdict(SAMPLES)],
            "staleness": {"buckets": [*map(str, STALENESS_BUCKETS), "+Inf"], "counts": list(self.staleness_counts)},
        }
        trainer = self._trainer()
        if trainer is not None:
            s = trainer.snapshot()
            doc["job"] = {
                "name": s.job, "mode": s.mode, "state": s.state, "wall_s": s.wall_s, "samples": s.samples,
                "epochs": s.epochs, "max_epochs": s.max_epochs, "accuracy": s.accuracy, "loss": s.loss,
                "samples_per_s": s.samples_per_s, "member_kind": get_mode(s.mode).member_kind,
                # pipelines: the split now ("0-2 | 3-4"), per stage its estimated ms per batch, version gap, stash
                # bytes and estimate error (same separator), regrouping moves;
                # Sandblaster: its L-BFGS progress in one line
                **{key: s.extra[key] for key in ("split", "stage_ms", "regroup_moves", "lbfgs", "stage_version_gap",
                                                 "stage_stash_bytes", "stage_estimate_error") if key in s.extra},
            }
            doc["coordinator"] = {"address": trainer.ref.node, "epoch": trainer.epoch}
            doc["ps_chains"] = s.extra.get("ps_chains", [])  # replicated PS shards: each one's chain now
            doc["panels"] = [asdict(panel) for panel in self.panels(trainer)]
            doc["replicas"] = dict(s.replicas)
            doc["history"] = [{"wall_s": p.wall_s, "samples": p.samples, "accuracy": p.accuracy, "loss": p.loss}
                              for p in trainer.report.history]
        return doc


def _figures(extra: Mapping[str, Any]) -> dict[str, Figure]:
    """The numbers, and lists of numbers, among a job's status extras."""
    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    out: dict[str, Figure] = {}
    for key, value in extra.items():
        if number(value):
            out[key] = float(value)
        elif isinstance(value, list) and value and all(number(v) for v in value):
            out[key] = [float(v) for v in value]
    return out


def _ratio(figure: float | None, before: float | None, per: float | None, per_before: float | None,
           scale: float) -> float | None:
    if figure is None or before is None or per is None or per_before is None or per <= per_before:
        return None
    return (figure - before) / (per - per_before) * scale


def _change(line: Line, now: Mapping[str, Figure], before: Mapping[str, Figure]) -> float | list[float | None] | None:
    """``line``'s value between two samples; a list (one per member) when its figure is one."""
    figure = now.get(line.figure)
    if figure is None:
        return None
    if line.per is None:
        return [v * line.scale for v in figure] if isinstance(figure, list) else figure * line.scale
    then, per, per_then = before.get(line.figure), now.get(line.per), before.get(line.per)
    if not isinstance(figure, list):
        if isinstance(then, list) or isinstance(per, list) or isinstance(per_then, list):
            return None
        return _ratio(figure, then, per, per_then, line.scale)
    n = len(figure)
    figures, thens, pers, per_thens = (_column(v, n) for v in (figure, then, per, per_then))
    if not len(thens) == len(pers) == len(per_thens) == n:  # members came or went: no figure this once
        return [None] * n
    return [_ratio(*row, line.scale) for row in zip(figures, thens, pers, per_thens, strict=True)]


def _column(value: Figure | None, n: int) -> list[float | None]:
    """A list figure as it is; a number (``wall_s``) or nothing applies to each of ``n`` members."""
    return [v for v in value] if isinstance(value, list) else [value] * n


def _finite(value: Any) -> Any:
    """NaN and infinities become null: JSON has no spelling for them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
