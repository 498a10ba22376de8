"""The chaos tool: its fault proxy on real sockets, and a Downpour job that survives every kind of fault it injects."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dniasync.chaos import PROXY_ENV, ChaosControl, FaultProxy
from dniasync.chaos._tool import DEFAULT_FAULTS, control

JOB = """
[job]
name = "chaos"
mode = "downpour"
seed = 5
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"
kwargs = {{ sizes = [64, 32, 10] }}

[data]
dataset = "digits"
n_train = 1400
n_test = 397
batch_size = 32

[optimizer]
name = "adagrad"
lr = 0.05

[downpour]
n_replicas = 2
n_ps_shards = 2

[stop]
max_epochs = 100000
max_seconds = 1800

[eval]
every_seconds = 0.5

[checkpoint]
every_seconds = 2
"""


async def _echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def test_the_proxy_forwards_resets_and_holds_bytes_through_a_black_hole() -> None:
    server = await _echo_server()
    port = server.sockets[0].getsockname()[1]
    chaos = ChaosControl()
    await chaos.start()
    proxy: FaultProxy = await chaos.add("link", f"127.0.0.1:{port}")
    try:
        host, _, pport = proxy.address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(pport))
        writer.write(b"hello")
        assert await asyncio.wait_for(reader.readexactly(5), 30) == b"hello"

        reply = await control(chaos.address, {"fault": "blackhole", "link": "link", "seconds": 600})
        assert reply["ok"]
        payload = os.urandom(200_000)
        writer.write(payload)
        with pytest.raises(TimeoutError):  # nothing passes while the hole lasts (it lasts 600 s)
            await asyncio.wait_for(reader.readexactly(1), 0.5)
        assert (await control(chaos.address, {"fault": "clear", "link": "link"}))["ok"]
        assert await asyncio.wait_for(reader.readexactly(len(payload)), 30) == payload  # held, not lost

        reply = await control(chaos.address, {"fault": "reset", "link": "link"})
        assert reply == {"ok": True, "connections": 1}
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(reader.readexactly(1), 30)
        writer.close()

        reply = await control(chaos.address, {"fault": "flood", "link": "link"})
        assert not reply["ok"] and "unknown fault" in reply["error"]
        reply = await control(chaos.address, {"fault": "reset", "link": "nowhere"})
        assert not reply["ok"] and "link" in reply["error"]
        links = (await control(chaos.address, {"fault": "links"}))["links"]
        assert links["link"]["accepted"] == 1 and links["link"]["target"] == f"127.0.0.1:{port}"
    finally:
        await chaos.close()
        server.close()
        await server.wait_closed()


def _history(out: Path) -> list[dict[str, Any]]:
    summary = json.loads((out / "summary.json").read_text())
    return list(summary["history"])


def _training_samples(out: Path) -> int:
    """Samples of the last evaluation the coordinator logged (0 before any)."""
    log = (out / "logs" / "coordinator0.log").read_text()
    lines = [line for line in log.splitlines() if "eval:" in line]
    if not lines:
        return 0
    return int(lines[-1].split(" s, ")[1].split(" samples")[0])


def test_a_downpour_job_survives_every_fault_the_chaos_tool_injects(tmp_path: Path) -> None:
    out = tmp_path / "job"
    config = tmp_path / "job.toml"
    config.write_text(JOB.format(out=out))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, PROXY_ENV: "1"},
    )
    faults = [f for f in DEFAULT_FAULTS if f != "delay"]
    try:
        chaos = subprocess.run(
            [sys.executable, "-m", "dniasync.chaos", "--job-dir", str(out), "--faults", ",".join(faults),
             "--count", str(len(faults)), "--first", "8", "--every", "8", "--freeze-s", "5", "--blackhole-s", "4",
             "--settle-s", "8", "--seed", "1", "--wait", "300", "--report", str(tmp_path / "chaos.json")],
            capture_output=True, text=True, timeout=900,
        )
        assert chaos.returncode == 0, chaos.stderr
        report = json.loads((tmp_path / "chaos.json").read_text())
        assert sorted(f["kind"] for f in report["faults"]) == sorted(faults), report["faults"]
        assert launcher.poll() is None, "the job ended under the faults"

        # training goes on after the last fault: evaluations of more samples than when it was injected
        after_faults = _training_samples(out)
        deadline = time.monotonic() + 300
        while _training_samples(out) <= after_faults:
            assert time.monotonic() < deadline, "no training after the last fault"
            assert launcher.poll() is None, "the job ended after the faults"
            time.sleep(0.5)

        # soak: every surviving process is back near its resources before the faults
        soak = report["soak"]
        assert {p["before"]["role"] for p in soak.values()} >= {"launcher", "coordinator"}
        for pid, p in soak.items():
            before, after = p["before"], p["after"]
            assert after["open_fds"] <= before["open_fds"] + 16, (pid, p)
            assert after["rss_bytes"] <= 1.5 * before["rss_bytes"] + 64 * 2**20, (pid, p)
            if "asyncio_tasks" in before:
                assert after["asyncio_tasks"] <= before["asyncio_tasks"] + 16, (pid, p)
    finally:
        launcher.send_signal(signal.SIGINT)
        stdout, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 130, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stop_reason"].startswith("stopped"), summary["stop_reason"]
    kinds = [e["kind"] for e in summary["events"]]
    assert "ps_restarted" in kinds and "replica_failed" in kinds, kinds
    assert "job_failed" not in kinds and "ps_lost" not in kinds, kinds
    assert summary["best_accuracy"] > 0.8
    restarted = [e for e in summary["events"] if e["kind"] == "ps_restarted"]
    assert all(e["version"] > e["snapshot_version"] for e in restarted)
    log = (tmp_path / "job" / "chaos.jsonl").read_text().splitlines()
    assert [json.loads(line)["kind"] for line in log][0] == "start"


def test_a_run_whose_job_ends_before_a_fault_settles_says_its_soak_checked_nothing(tmp_path: Path) -> None:
    """The job stops (max_seconds) while the soak waits for its fault to settle: no reading after a fault was
    taken while the job ran, and the report and stderr say so instead of an empty soak passing as checked."""
    out = tmp_path / "job"
    config = tmp_path / "job.toml"
    config.write_text(JOB.format(out=out).replace("max_seconds = 1800", "max_seconds = 12"))
    launcher = subprocess.Popen([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    # meanwhile, against the same job (no replicated PS shards): kill_ps_copy is refused, naming what it needs
    refused = subprocess.Popen([sys.executable, "-m", "dniasync.chaos", "--job-dir", str(out), "--faults",
                                "kill_ps_copy", "--count", "1", "--first", "0", "--wait", "300"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # and kill_coordinator, without a standby coordinator to take the job over
    no_standby = subprocess.Popen([sys.executable, "-m", "dniasync.chaos", "--job-dir", str(out), "--faults",
                                   "kill_coordinator", "--count", "1", "--first", "0", "--wait", "300"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        chaos = subprocess.run(
            [sys.executable, "-m", "dniasync.chaos", "--job-dir", str(out), "--faults", "kill_replica", "--count", "1",
             "--first", "1", "--settle-s", "3600", "--wait", "300", "--report", str(tmp_path / "chaos.json")],
            capture_output=True, text=True, timeout=600,
        )
        _, refusal = refused.communicate(timeout=300)
        _, refusal_standby = no_standby.communicate(timeout=300)
    finally:
        launcher.wait(timeout=300)
        for proc in (refused, no_standby):
            if proc.poll() is None:
                proc.kill()
    assert refused.returncode == 2, refusal
    assert "kill_ps_copy needs replicated PS shards" in refusal and "ps_replicas" in refusal, refusal
    assert no_standby.returncode == 2, refusal_standby
    assert "kill_coordinator needs a standby coordinator" in refusal_standby, refusal_standby
    assert "job.standby" in refusal_standby or "[job] standby" in refusal_standby
    assert chaos.returncode == 0, chaos.stderr
    report = json.loads((tmp_path / "chaos.json").read_text())
    assert [f["kind"] for f in report["faults"]] == ["kill_replica"]
    assert report["soak"] == {} and report["soak_checked"] is False
    assert "ended before a fault had settled" in report["soak_unchecked_why"]
    assert "no soak check" in chaos.stderr
    log = [json.loads(line) for line in (out / "chaos.jsonl").read_text().splitlines()]
    assert log[-1]["kind"] == "soak" and log[-1]["checked"] is False
