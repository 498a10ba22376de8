"""The coordinator's built-in live page, loaded in headless Chromium during a real run."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from _observability import DNI_JOB, LocalCluster, fetch, need

SERIES = ("accuracy", "loss", "samples_per_s", "staleness_mean", "pushed_bytes_per_s", "pulled_bytes_per_s")


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    need("chromium", "chromium")
    tmp = tmp_path_factory.mktemp("live")
    cluster = LocalCluster(tmp, "live-job")
    try:
        address = cluster.page_address()
        wait_for_data(cluster, address)
        yield address, tmp
    finally:
        cluster.stop()


def wait_for_data(cluster: LocalCluster, address: str, timeout: float = 60) -> dict[str, Any]:
    """``/api/status`` once the run has a few evaluations and samples to chart."""
    deadline = time.monotonic() + timeout
    while True:
        status: dict[str, Any] = json.loads(fetch(f"http://{address}/api/status"))
        trained = [p for p in status["history"] if p["samples"] > 0]
        if len(trained) >= 3 and len(status["series"]) >= 3:
            return status
        assert time.monotonic() < deadline, f"no data on the page:\n{status}\n{cluster.output()}"
        time.sleep(0.5)


def chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [need("chromium", "chromium"), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--user-data-dir={tmp / 'chromium-profile'}", "--virtual-time-budget=4000", *args],
        capture_output=True, text=True, timeout=90,
    )


def test_status_endpoint_lists_members_and_series(page: tuple[str, Path]) -> None:
    address, _ = page
    status = json.loads(fetch(f"http://{address}/api/status"))
    assert sorted(m["role"] for m in status["members"]) == ["coordinator", "ps", "ps", "worker", "worker"]
    assert all(m["alive"] for m in status["members"])
    assert status["job"]["state"] == "training" and status["job"]["mode"] == "downpour"
    assert list(status["replicas"].values()) == ["alive", "alive"]
    trained = [p for p in status["history"] if p["samples"] > 0]
    assert [p["samples"] for p in trained] == sorted(p["samples"] for p in trained)
    assert all(0.0 <= p["accuracy"] <= 1.0 for p in trained)
    assert max(p["accuracy"] for p in trained) > 0.1  # it learned something: chance is 0.1 (how much depends on load)
    assert status["series"][-1]["samples_per_s"] > 0
    assert sum(status["staleness"]["counts"]) > 0
    # Downpour's panels: the PS's staleness, bytes and staleness histogram
    assert [p["key"] for p in status["panels"]] == ["samples", "staleness", "bytes", "staleness_histogram"]
    # the first coordinator runs the job; its shards have one copy each: no chains (tests/test_ps_replicas.py has them)
    assert status["coordinator"] == {"address": address, "epoch": 1} and status["ps_chains"] == []


def test_charts_draw_data_in_headless_chromium(page: tuple[str, Path]) -> None:
    address, tmp = page
    done = chromium(tmp, "--dump-dom", f"http://{address}/")
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    for name in SERIES:
        match = re.search(rf'<polyline points="([^"]*)"[^>]*data-series="{name}" data-points="(\d+)"', dom)
        assert match, f"no {name} line in the page:\n{dom[:3000]}"
        assert int(match.group(2)) >= 2 and match.group(1).count(",") >= 2, (name, match.group(0))
    assert re.search(r'data-series="staleness-0" data-count="[1-9]', dom), "empty staleness histogram"
    assert dom.count('class="up"') >= 5 + 2  # members and replicas, all up
    assert f'coordinator <b id="coordinator">{address} · epoch 1</b>' in dom, dom[:3000]
    assert re.search(r'<section [^>]*id="chains-section" hidden', dom)  # no replicated PS shards: no table

    shot = tmp / "live.png"
    done = chromium(tmp, "--window-size=1400,1000", f"--screenshot={shot}", f"http://{address}/")
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    # the accuracy line (green #2a9d5b) and the samples/s line (blue #2f6fdf) are really drawn
    colours = {(0x2A, 0x9D, 0x5B): 0, (0x2F, 0x6F, 0xDF): 0}
    for count, pixel in image.getcolors(1 << 24) or []:
        for colour in colours:
            if sum(abs(a - b) for a, b in zip(pixel, colour)) < 40:
                colours[colour] += count
    assert all(count > 150 for count in colours.values()), colours


def test_page_refuses_foreign_host_names(page: tuple[str, Path]) -> None:
    address, _ = page
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://{address}/api/status", headers={"Host": "attacker.example"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=5)
    assert err.value.code == 403


def test_page_shows_a_dni_job_and_its_stages(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, "live-dni", job=DNI_JOB)
    try:
        address = cluster.page_address()
        status = wait_for_data(cluster, address)
        assert sorted(m["role"] for m in status["members"]) == ["coordinator", "worker", "worker"]
        assert status["job"]["mode"] == "pipeline" and status["job"]["state"] == "training"
        groups = status["replicas"]
        assert len(groups) == 2 and all(name.startswith("stage-") for name in groups), groups
        assert list(groups.values()) == ["alive", "alive"]
        assert status["history"][-1]["accuracy"] > 0.3
        assert status["series"][-1]["samples_per_s"] > 0
        assert status["job"]["split"] == "0-1 | 2-4"
        # cDNI: stage 0 steps on synthetic gradients, with a version gap and a measured SG error; the last stage
        # steps on the loss's own gradient
        gaps, errors = (status["job"][k].split(" | ") for k in ("stage_version_gap", "stage_estimate_error"))
        assert len(gaps) == 2 and float(gaps[0]) >= 0.0, status["job"]
        assert math.isfinite(float(errors[0])) and errors[1] == "-", status["job"]
        assert status["job"]["stage_stash_bytes"] == "0 | 0"
        assert status["ps_chains"] == [] and status["coordinator"] == {"address": address, "epoch": 1}
        # the pipeline's own panels (no PS here: none of Downpour's), charted per stage
        assert [p["key"] for p in status["panels"]] == ["samples", "stage_version_gap", "stage_busy"]
        deadline = time.monotonic() + 60
        while not any(isinstance(p.get("stage_busy_ms"), list) and len(p["stage_busy_ms"]) == 2
                      and all(v is not None and v > 0 for v in p["stage_busy_ms"]) for p in status["series"]):
            assert time.monotonic() < deadline, status["series"][-5:]
            time.sleep(0.5)
            status = json.loads(fetch(f"http://{address}/api/status"))
        assert all("staleness_mean" not in p for p in status["series"])
        # the launcher's progress bar counts the job's members in its mode's own word
        bars = [line for line in cluster.output().splitlines() if "samples/s |" in line]
        assert bars and all(re.search(r"\| stages \d/2 \|", line) for line in bars), bars

        if shutil.which("chromium"):
            done = chromium(tmp_path, "--dump-dom", f"http://{address}/")
            assert done.returncode == 0, done.stderr[-2000:]
            assert '<h2 style="margin-top:12px" id="replicas-title">Stages</h2>' in done.stdout
            for name in groups:
                assert name in done.stdout
            assert "stage 0: layers 0-1" in done.stdout and "stage 1: layers 2-4" in done.stdout
            assert "version gap" in done.stdout and "estimate error" in done.stdout
            for series in ("stage_version_gap-0", "stage_busy_ms-0", "stage_busy_ms-1"):
                assert re.search(rf'data-series="{series}" data-points="[1-9]', done.stdout), series
            assert 'id="chart-staleness"' not in done.stdout and 'id="chart-bytes"' not in done.stdout
            assert re.search(r'<section [^>]*id="chains-section" hidden', done.stdout)  # no replicated PS shards
    finally:
        cluster.stop()


def serve_page(status: dict[str, Any]) -> tuple[ThreadingHTTPServer, str]:
    """The live page's own HTML, fed ``status`` as ``/api/status`` (no cluster: what the page draws from it)."""
    html = resources.files("dniasync.node").joinpath("live.html").read_bytes()
    body = json.dumps(status).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            data, kind = (html, "text/html") if self.path == "/" else (body, "application/json")
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.server_address[1]}"


def y_ticks(dom: str, chart: str) -> list[str]:
    svg = re.search(rf'<svg [^>]*id="{chart}"[^>]*>(.*?)</svg>', dom, re.S)
    assert svg, f"no {chart} in the page"
    return re.findall(r'class="axis y-tick"[^>]*>([^<]*)<', svg.group(1))


def test_a_pipeline_page_draws_its_modes_panels_with_distinct_ticks(tmp_path: Path) -> None:
    from dniasync.cluster.modes.pipeline import STAGE_PANELS
    from dniasync.cluster.panels import SAMPLES

    need("chromium", "chromium")
    t = [float(i) for i in range(1, 9)]
    status = {
        "node": "127.0.0.1:1", "role": "coordinator", "updated": 1.0, "peers": {}, "members": [],
        "job": {"name": "p", "mode": "pipeline", "state": "training", "wall_s": 8.0, "samples": 800, "epochs": 1.0,
                "max_epochs": 10, "accuracy": 0.9688, "loss": 0.1, "samples_per_s": 100.0, "member_kind": "stage",
                "split": "0-1 | 2-4"},
        "replicas": {"stage-0@a": "alive", "stage-1@b": "alive"},
        # accuracy between 95.1% and 96.9%: a tick every half point, which whole numbers would label 95, 95, 96, ...
        "history": [{"wall_s": x, "samples": 100 * i, "accuracy": 0.9512 + 0.0176 * i / 7, "loss": 0.1}
                    for i, x in enumerate(t)],
        "series": [{"t": x, "samples_per_s": 3000 + 10 * i, "stage_version_gap": [1.5 + 0.01 * i, 0.0],
                    "stage_busy_ms": [30.0 + i, None if i == 3 else 28.0]} for i, x in enumerate(t)],
        "panels": [asdict(p) for p in (SAMPLES, *STAGE_PANELS)],
        "staleness": {"buckets": ["0", "+Inf"], "counts": [0, 0]},
        # the page draws what the status lists: a standby that took the job over (epoch 2), a PS chain whose
        # copy 0 is down and whose restarted copy 2 takes the state at the tail
        "coordinator": {"address": "127.0.0.1:9", "epoch": 2},
        "ps_chains": [{"shard": 0, "view": 3, "length": 2, "copies": [
            {"copy": 1, "address": "127.0.0.1:3", "state": "live"},
            {"copy": 2, "address": "127.0.0.1:4", "state": "catching up"},
            {"copy": 0, "address": "127.0.0.1:2", "state": "down"}]}],
    }
    server, address = serve_page(status)
    try:
        done = chromium(tmp_path, "--dump-dom", f"http://{address}/")
    finally:
        server.shutdown()
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    for chart in ("chart-accuracy", "chart-loss", "chart-samples", *(f"chart-{p.key}" for p in STAGE_PANELS)):
        ticks = y_ticks(dom, chart)
        assert len(ticks) >= 2 and len(set(ticks)) == len(ticks), (chart, ticks)
    assert y_ticks(dom, "chart-accuracy") == ["95.0", "95.5", "96.0", "96.5", "97.0"]
    assert y_ticks(dom, "chart-samples") == ["0", "1k", "2k", "3k", "4k"]
    # the pipeline's own panels, one line per stage; none of Downpour's (staleness, bytes, histogram)
    for series in ("stage_version_gap-0", "stage_version_gap-1", "stage_busy_ms-0", "stage_busy_ms-1"):
        assert re.search(rf'data-series="{series}" data-points="[1-9]', dom), series
    assert re.search(r'data-series="stage_busy_ms-1" data-points="7"', dom)  # the gap is left out
    shown = dom[dom.index("<main>"):dom.index("</main>")]
    assert "Staleness" not in shown and "waiting for data" not in shown and "no pushes yet" not in shown, shown
    assert '<h2 style="margin-top:12px" id="replicas-title">Stages</h2>' in shown
    assert '<b id="coordinator">127.0.0.1:9 · epoch 2</b>' in dom
    assert ('<tbody id="chains"><tr><td>shard 0</td><td>3</td><td>head</td><td>copy 1</td><td>127.0.0.1:3</td>'
            '<td class="up">live</td></tr><tr><td>shard 0</td><td>3</td><td>tail</td><td>copy 2</td>'
            '<td>127.0.0.1:4</td><td class="catching">catching up</td></tr><tr><td>shard 0</td><td>3</td><td>–</td>'
            '<td>copy 0</td><td>127.0.0.1:2</td><td class="down">down</td></tr></tbody>') in shown, shown
