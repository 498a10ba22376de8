"""Metrics of one node, in process: what /metrics serves is what the runtime counted, and promtool accepts it."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dniasync import Actor, ActorSystem, handler, message
from dniasync.metrics import NodeMetrics
from dniasync.node import metric_catalogue, mount_metrics
from dniasync.remote import WebSocketTransport
from dniasync.train.messages import Params, Pull, Push
from dniasync.train.ps import PSShard
from dniasync.train.specs import OptimizerSpec, ShardSpec

ROOT = Path(__file__).resolve().parent.parent
ALLOWED_LABELS = {"role", "msg_type", "direction", "stage", "shard", "reason", "event", "stat",
                  "version", "core_version", "python_version", "torch_version"}
NAME = re.compile(r"^dniasync_[a-z][a-z0-9]*_[a-z0-9_]+$")


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian package 'prometheus'; .ci/run installs it)")
    return path


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@message("tests.metrics.Boom")
@dataclass(frozen=True)
class Boom:
    pass


class Fragile(Actor):
    @handler
    def boom(self, msg: Boom) -> None:
        raise RuntimeError("boom")


def test_every_metric_is_named_by_the_convention() -> None:
    names = [m.name for m in metric_catalogue()]
    assert len(names) == len(set(names)), "a metric is defined twice"
    assert len(names) >= 40
    for m in metric_catalogue():
        assert NAME.match(m.name), m.name
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        assert set(m.labels) <= ALLOWED_LABELS, (m.name, m.labels)
        assert not m.name.endswith(("_ms", "_milliseconds", "_kb", "_mb")), m.name
        assert m.help.endswith("."), m.name


async def test_metrics_endpoint_serves_what_the_runtime_counted(tmp_path: Path) -> None:
    async with ActorSystem() as ps_system, ActorSystem() as worker_system:
        ps_node = WebSocketTransport(ps_system)
        mount_metrics(ps_node.app, NodeMetrics(ps_system, "ps", ps_node))
        worker_node = WebSocketTransport(worker_system)
        mount_metrics(worker_node.app, NodeMetrics(worker_system, "worker", worker_node))
        async with ps_node, worker_node:
            spec = ShardSpec(3, 0, np.zeros(8, np.float32), OptimizerSpec("adagrad", 0.1))
            shard = await ps_system.spawn(PSShard, spec, name="ps-3")
            fragile = await ps_system.spawn(Fragile, name="fragile")
            remote = worker_system.ref(f"ps-3@{ps_node.address}")
            grad = np.ones(8, np.float32).view(np.uint8)
            start: Params = await remote.ask(Pull(), timeout=5.0)  # the initial write is version 1
            v = start.version
            await remote.tell(Push("r", 1, 1, v, "none", grad, 32))  # fresh: staleness 0
            await remote.tell(Push("r", 1, 1, v, "none", grad, 32))  # duplicate seq: rejected
            await remote.tell(Push("r", 1, 2, v, "none", grad, 32))  # one version behind: staleness 1
            params: Params = await remote.ask(Pull(), timeout=5.0)
            assert params.version == v + 2
            await fragile.tell(Boom())
            for _ in range(200):
                if ps_system.restart_count:
                    break
                await asyncio.sleep(0.01)

            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://{ps_node.address}/metrics") as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                    ps_text = await resp.text()
                async with http.get(f"http://{worker_node.address}/metrics") as resp:
                    worker_text = await resp.text()
            assert shard.is_alive

    ps = samples(ps_text)
    assert ps[("dniasync_node_info", (("role", "ps"),))] == 1
    assert ps[("dniasync_ps_updates_applied_total", (("shard", "3"),))] == 2
    assert ps[("dniasync_ps_updates_rejected_total", (("reason", "duplicate"), ("shard", "3")))] == 1
    assert ps[("dniasync_ps_updates_rejected_total", (("reason", "stale"), ("shard", "3")))] == 0
    assert ps[("dniasync_ps_pulls_total", (("shard", "3"),))] == 2
    assert ps[("dniasync_ps_version", (("shard", "3"),))] == v + 2
    assert ps[("dniasync_ps_samples_total", (("shard", "3"),))] == 64
    assert ps[("dniasync_ps_bytes_total", (("direction", "received"), ("shard", "3")))] == 3 * 32
    assert ps[("dniasync_ps_staleness_versions_bucket", (("le", "0.0"), ("shard", "3")))] == 1
    assert ps[("dniasync_ps_staleness_versions_bucket", (("le", "1.0"), ("shard", "3")))] == 2
    assert ps[("dniasync_ps_staleness_versions_bucket", (("le", "+Inf"), ("shard", "3")))] == 2
    assert ps[("dniasync_ps_staleness_versions_sum", (("shard", "3"),))] == 1
    assert ps[("dniasync_actor_restarts_total", ())] == 1
    assert ps[("dniasync_remote_peers_up", ())] == 1
    assert ps[("dniasync_remote_bytes_total", (("direction", "received"),))] > 3 * 32

    worker = samples(worker_text)
    assert worker[("dniasync_remote_ask_duration_seconds_count", (("msg_type", "Pull"),))] == 2
    assert 0 < worker[("dniasync_remote_ask_duration_seconds_sum", (("msg_type", "Pull"),))] < 5
    assert ("dniasync_ps_version", (("shard", "3"),)) not in worker
    build = [k for k in worker if k[0] == "dniasync_build_info"]
    assert len(build) == 1 and dict(build[0][1])["version"]

    tool = promtool()
    for text in (ps_text, worker_text):
        done = subprocess.run([tool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stdout + done.stderr


async def test_a_stopped_actor_leaves_the_exposition() -> None:
    async with ActorSystem() as system:
        node = NodeMetrics(system, "ps")
        spec = ShardSpec(5, 0, np.zeros(4, np.float32), OptimizerSpec("adagrad", 0.1))
        shard = await system.spawn(PSShard, spec, name="ps-5")
        assert ("dniasync_ps_parameters", (("shard", "5"),)) in samples(node.exposition().decode())
        await system.stop(shard)
        for _ in range(200):
            if not shard.is_alive:
                break
            await asyncio.sleep(0.01)
        after = samples(node.exposition().decode())
    assert not [k for k in after if k[0].startswith("dniasync_ps_")]
    assert after[("dniasync_actor_stops_total", ())] == 1


async def test_a_system_gets_metrics_attached_once() -> None:
    async with ActorSystem() as system:
        NodeMetrics(system, "worker")
        with pytest.raises(RuntimeError, match="already"):
            NodeMetrics(system, "worker")


def test_prometheus_config_is_valid() -> None:
    done = subprocess.run([promtool(), "check", "config", str(ROOT / "grafana" / "prometheus.yml")],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_metrics_reference_lists_every_metric() -> None:
    page = (ROOT / "docs" / "reference" / "metrics.md").read_text()
    missing = [m.name for m in metric_catalogue() if f"`{m.name}`" not in page]
    assert not missing, f"docs/reference/metrics.md does not list {missing}: python docs/scripts/gen_reference.py"
