"""A standby coordinator (``[job] standby = true``): the job survives its coordinator, and an old one is fenced.

Real jobs through the local launcher: the active coordinator is SIGKILLed (the
standby takes the job over with the same PS and replica processes, one summary
at the end), or frozen past the detection interval and woken once the standby
runs the job (it finds itself fenced and writes nothing). In one process: the
orders a PS shard takes (a fence) are refused from an epoch below the one it
was told of.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dniasync import ActorSystem
from dniasync.cluster.config import ConfigError, load_config
from dniasync.train.messages import CoordinatorEpoch, Fence, ShardSnapshot, SnapshotShard
from dniasync.train.ps import PSShard
from dniasync.train.specs import OptimizerSpec, ShardSpec

JOB = """
[job]
name = "{name}"
mode = "downpour"
seed = 0
output_dir = "{out}"
standby = true

[model]
factory = "dniasync.train.models:mlp"

[model.kwargs]
sizes = [784, 64, 10]

[data]
dataset = "mnist5k"
n_train = 4000
n_test = 1000
batch_size = 32

[optimizer]
name = "adagrad"
lr = 0.05

[downpour]
n_replicas = 2
n_ps_shards = 1

[stop]
max_epochs = {epochs}
max_seconds = {seconds}

[eval]
every_seconds = 1.0

[node]
detect_s = 5.0  # the standby's failure detector: a coordinator slowed by a loaded machine is not taken for dead
"""


def _start(tmp_path: Path, name: str, *, epochs: int, seconds: float) -> tuple[Path, subprocess.Popen[str]]:
    out = tmp_path / name
    config = tmp_path / f"{name}.toml"
    config.write_text(JOB.format(name=name, out=out, epochs=epochs, seconds=seconds))
    launcher = subprocess.Popen([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return out, launcher


def _wait_for(path: Path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{path.name} never said {text!r}"
        time.sleep(0.1)


def _training_coordinator(out: Path) -> int:
    """The active coordinator's pid, once the standby follows its job in training."""
    _wait_for(out / "logs" / "standby0.log", "following the job in training")
    children = json.loads((out / "cluster.json").read_text())["children"]
    return next(int(c["pid"]) for c in children if c["role"] == "coordinator")


def _finish(launcher: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        stdout, stderr = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, stdout + stderr
    return stdout, stderr


def _one_history(doc: dict[str, Any]) -> None:
    """One continuous summary: evaluation rows in time order, none twice."""
    walls = [p["wall_s"] for p in doc["history"]]
    samples = [p["samples"] for p in doc["history"]]
    assert walls == sorted(walls) and len(set(walls)) == len(walls), walls
    assert samples == sorted(samples), samples


def test_a_killed_coordinator_s_standby_finishes_the_job_with_the_same_processes(tmp_path: Path) -> None:
    """The chaos tool's ``kill_coordinator`` (SIGKILL of the active coordinator) mid-run."""
    out, launcher = _start(tmp_path, "killed", epochs=6, seconds=240)
    try:
        pid = _training_coordinator(out)
        chaos = subprocess.run(
            [sys.executable, "-m", "dniasync.chaos", "--job-dir", str(out), "--faults", "kill_coordinator",
             "--count", "1", "--first", "0", "--settle-s", "1", "--wait", "120", "--report", str(tmp_path / "c.json")],
            capture_output=True, text=True, timeout=300,
        )
    finally:
        stdout, _ = _finish(launcher)
    assert chaos.returncode == 0, chaos.stderr
    [fault] = json.loads((tmp_path / "c.json").read_text())["faults"]
    assert fault["kind"] == "kill_coordinator" and int(fault["pid"]) == pid, fault
    assert "took the job over" in stdout
    doc = json.loads((out / "summary.json").read_text())
    assert doc["stop_reason"] == "trained 6 epochs"
    assert doc["samples"] >= 6 * 4000
    [takeover] = [e for e in doc["events"] if e["kind"] == "coordinator_takeover"]
    assert takeover["epoch"] == 2
    kinds = [e["kind"] for e in doc["events"]]
    assert "ps_restarted" not in kinds and "replica_failed" not in kinds, kinds  # the same processes went on
    _one_history(doc)
    assert any(p["wall_s"] < takeover["wall_s"] for p in doc["history"])  # the dead one's rows are kept
    assert any(p["wall_s"] > takeover["wall_s"] for p in doc["history"])
    assert doc["final_accuracy"] >= 0.85
    assert (out / "coordinator.epoch").read_text().split()[0] == "2"
    for log in (out / "logs").glob("worker*.log"):  # each replica reported to the new one, which stopped it
        text = log.read_text()
        assert "coordinator epoch 2 at" in text, log
        assert "stopped training (trained 6 epochs)" in text, log
        assert "version went back" not in text


def test_a_frozen_coordinator_that_wakes_after_the_takeover_is_fenced_and_changes_nothing(tmp_path: Path) -> None:
    out, launcher = _start(tmp_path, "frozen", epochs=100_000, seconds=14)
    old_log = out / "logs" / "coordinator0.log"
    try:
        pid = _training_coordinator(out)
        os.kill(pid, signal.SIGSTOP)
        _wait_for(out / "logs" / "standby0.log", "took the job over")
        os.kill(pid, signal.SIGCONT)
        _wait_for(old_log, "fenced: coordinator epoch 2 runs job frozen")
    finally:
        _finish(launcher)
    doc = json.loads((out / "summary.json").read_text())
    assert doc["stop_reason"] == "ran 14 s"
    [takeover] = [e for e in doc["events"] if e["kind"] == "coordinator_takeover"]
    assert takeover["epoch"] == 2
    _one_history(doc)
    old = old_log.read_text()
    assert "summary in" not in old and "checkpoint " not in old.split("fenced:")[1]
    for log in (out / "logs").glob("worker*.log"):  # the woken one stopped nobody: the new one did, at the end
        assert log.read_text().count("stopped training") == 1, log
        assert "stopped training (ran 14 s)" in log.read_text(), log


async def test_a_ps_shard_refuses_a_fence_from_an_earlier_coordinator_epoch() -> None:
    async with ActorSystem() as system:
        spec = ShardSpec(0, 0, np.zeros(8, np.float32), OptimizerSpec("sgd", 0.1))
        shard = await system.spawn(PSShard, spec, name="ps-0")
        await shard.tell(Fence("replica-a", 1))
        await shard.tell(CoordinatorEpoch(2, "trainer@127.0.0.1:1"))
        await shard.tell(Fence("replica-b", 1))  # from the coordinator the standby took over from: refused
        await shard.tell(Fence("replica-c", 2))
        snap: ShardSnapshot = await shard.ask(SnapshotShard())
        assert snap.fenced == ["replica-a", "replica-c"]


@pytest.mark.parametrize(("extra", "named"), [
    ('[sync]\nkind = "shm"\n', "sync.kind 'shm'"),
    ("[downpour]\nps_replicas = 2\n", "ps_replicas = 2"),
])
def test_a_standby_is_refused_where_it_cannot_take_over(tmp_path: Path, extra: str, named: str) -> None:
    text = JOB.format(name="refused", out=tmp_path / "refused", epochs=1, seconds=10)
    if extra.startswith("[downpour]"):
        text = text.replace("n_ps_shards = 1\n", "n_ps_shards = 1\nps_replicas = 2\n")
    else:
        text = text.replace("n_ps_shards = 1\n", "") + extra
    path = tmp_path / "refused.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="job.standby") as caught:
        load_config(str(path), resolve=False)
    assert named in str(caught.value)
    proc = subprocess.run([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "job.standby" in proc.stderr, proc.stderr
