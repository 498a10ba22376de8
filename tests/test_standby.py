"""A standby coordinator (``[job] standby = true``): the job survives its coordinator, and an old one is fenced.

A real job through the local launcher whose coordinator is first frozen past
the detection interval and woken once the standby runs the job (it finds itself
fenced and writes nothing), then SIGKILLed by the chaos tool (the next standby
takes over): the same PS and replica processes train throughout, one summary at
the end. In one process: a PS shard refuses a fence from an epoch below the one
it was told of. And the jobs a standby cannot take over are refused.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from _jobs import trained_log
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


def _wait_for(path: Path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{path.name} never said {text!r}"
        time.sleep(0.1)


def _coordinator_pid(out: Path) -> int:
    children = json.loads((out / "cluster.json").read_text())["children"]
    return next(int(c["pid"]) for c in children if c["role"] == "coordinator")


def test_two_coordinator_faults_a_freeze_then_a_kill_are_taken_over_and_the_frozen_one_is_fenced(
        tmp_path: Path) -> None:
    """One job, two coordinator faults. The first coordinator is frozen (SIGSTOP) past the detection interval:
    its standby takes the job over as epoch 2; woken (SIGCONT), the old one finds itself fenced and changes nothing.
    Then the chaos tool's ``kill_coordinator`` SIGKILLs epoch 2: the new standby the launcher started takes over as
    epoch 3. The same PS and replica processes train throughout, and the job ends at its stop rule with one
    summary."""
    out = tmp_path / "standby"
    config = tmp_path / "standby.toml"
    config.write_text(JOB.format(name="standby", out=out, epochs=100_000, seconds=SECONDS))
    launcher = subprocess.Popen([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    logs = out / "logs"
    try:
        _wait_for(logs / "standby0.log", "following the job in training")
        trained_log(logs / "coordinator0.log")  # the first coordinator has history rows of its own to hand on
        first = _coordinator_pid(out)
        os.kill(first, signal.SIGSTOP)
        _wait_for(logs / "standby0.log", "took the job over")
        os.kill(first, signal.SIGCONT)
        _wait_for(logs / "coordinator0.log", "fenced: coordinator epoch 2 runs job standby")
        _wait_for(logs / "standby1.log", "following the job in training (coordinator epoch 2)")
        second = _coordinator_pid(out)
        chaos = subprocess.run(
            [sys.executable, "-m", "dniasync.chaos", "--job-dir", str(out), "--faults", "kill_coordinator",
             "--count", "1", "--first", "0", "--settle-s", "1", "--wait", "120", "--report", str(tmp_path / "c.json")],
            capture_output=True, text=True, timeout=300,
        )
        stdout, stderr = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, stdout + stderr
    assert chaos.returncode == 0, chaos.stderr
    [fault] = json.loads((tmp_path / "c.json").read_text())["faults"]
    assert fault["kind"] == "kill_coordinator" and int(fault["pid"]) == second != first, fault
    assert "stopped answering" in stdout and "exited (-9)" in stdout, stdout
    doc = json.loads((out / "summary.json").read_text())
    assert doc["stop_reason"] == f"ran {SECONDS:g} s"
    takeovers = [e for e in doc["events"] if e["kind"] == "coordinator_takeover"]
    assert [t["epoch"] for t in takeovers] == [2, 3], takeovers
    kinds = [e["kind"] for e in doc["events"]]
    assert "ps_restarted" not in kinds and "replica_failed" not in kinds, kinds  # the same processes went on
    walls = [p["wall_s"] for p in doc["history"]]  # one history: in time order, no row twice
    rows = [(p["wall_s"], p["samples"]) for p in doc["history"]]
    assert walls == sorted(walls) and len(set(rows)) == len(rows), rows
    samples = [p["samples"] for p in doc["history"]]
    assert samples == sorted(samples) and 0 not in samples, samples  # counts current after each takeover
    # the rows the first coordinator scored before the standby last followed it are kept, as it scored them
    scored = [int(m) for m in re.findall(r"eval: \S+ s, (\d+) samples", (logs / "coordinator0.log").read_text())]
    kept = [p["samples"] for p in doc["history"] if p["wall_s"] < takeovers[0]["wall_s"]]
    assert kept == scored[:len(kept)], (kept, scored)
    assert any(w > takeovers[1]["wall_s"] for w in walls)
    assert (out / "coordinator.epoch").read_text().split()[0] == "3"
    old = (logs / "coordinator0.log").read_text()  # the fenced one wrote no summary and no checkpoint
    assert "summary in" not in old and "checkpoint " not in old.split("fenced:")[1]
    for log in logs.glob("worker*.log"):  # each replica followed both takeovers and was stopped once, at the end
        text = log.read_text()
        assert "coordinator epoch 2 at" in text and "coordinator epoch 3 at" in text, log
        assert text.count("stopped training") == 1 and f"stopped training (ran {SECONDS:g} s)" in text, log
        assert "version went back" not in text


SECONDS = 25
"""The job's time limit: both takeovers (each the detection interval after its fault) land within it."""


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
