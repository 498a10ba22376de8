"""The job runner's state survives what fails around it: real processes, real signals, real sockets."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dniasync.cluster.job import PS_LOST_AFTER_S
from dniasync.node._zygote import SHARED_ENV

from _jobs import listening, node

JOB = """
[job]
name = "{name}"
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
max_seconds = {seconds}

[eval]
every_seconds = 0.5
"""


def start(tmp_path: Path, name: str, seconds: float, env: dict[str, str] | None = None,
          ) -> tuple[subprocess.Popen[str], Path]:
    out = tmp_path / name
    config = tmp_path / f"{name}.toml"
    config.write_text(JOB.format(name=name, out=out, seconds=seconds))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    return launcher, out


def wait_training(out: Path, timeout: float = 120) -> list[dict[str, Any]]:
    """The launcher's children once the coordinator has evaluated weights that saw training."""
    deadline = time.monotonic() + timeout
    log = out / "logs" / "coordinator0.log"
    while time.monotonic() < deadline:
        if log.exists() and any("eval:" in line and " 0 samples" not in line for line in log.read_text().splitlines()):
            return list(json.loads((out / "cluster.json").read_text())["children"])
        time.sleep(0.2)
    raise AssertionError("the job never trained")


def hosting(children: list[dict[str, Any]], actor: str, timeout: float = 60) -> dict[str, Any]:
    """The child process whose log says it hosts ``actor`` (which PS process gets which shard is a race)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in children:
            if f"hosting {actor}" in Path(child["log"]).read_text():
                return child
        time.sleep(0.1)
    raise AssertionError(f"no process says it hosts {actor}")


def summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())  # type: ignore[no-any-return]


def test_a_ps_shard_frozen_for_10_s_does_not_stop_the_job_or_its_stop_rules(tmp_path: Path) -> None:
    launcher, out = start(tmp_path, "freeze", seconds=20)
    try:
        ps = [c for c in wait_training(out) if c["role"] == "ps"][0]
        os.kill(ps["pid"], signal.SIGSTOP)
        time.sleep(10)
        os.kill(ps["pid"], signal.SIGCONT)
        stdout, stderr = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, stdout + stderr
    doc = summary(out)
    assert doc["stop_reason"] == "ran 20 s"  # the time limit held while the shard was frozen
    kinds = [e["kind"] for e in doc["events"]]
    assert "ps_down" in kinds and "ps_up" in kinds and "ps_lost" not in kinds
    assert "replica_failed" not in kinds  # replicas waiting on the frozen shard still report: they are alive
    down = next(e for e in doc["events"] if e["kind"] == "ps_down")
    assert doc["history"][-1]["samples"] > max(p["samples"] for p in doc["history"] if p["wall_s"] <= down["wall_s"])


def test_a_killed_ps_shard_nobody_restarts_ends_the_job_naming_it_and_leaves_a_summary(tmp_path: Path) -> None:
    out = tmp_path / "kill"
    config = tmp_path / "kill.toml"
    config.write_text(JOB.format(name="kill", out=out, seconds=300))
    logs = {name: tmp_path / f"{name}.log" for name in ("coordinator", "ps0", "ps1", "worker0", "worker1")}
    coordinator = node("coordinator", "--config", str(config), log=logs["coordinator"])
    others: dict[str, subprocess.Popen[bytes]] = {}
    try:
        join = ["--join", listening(logs["coordinator"])]
        others = {name: node(name.rstrip("01"), *join, log=logs[name]) for name in ("ps0", "ps1", "worker0", "worker1")}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not re.search(r"eval: .* [1-9]\d* samples", logs["coordinator"].read_text()):
            time.sleep(0.2)
        victim = "ps0" if "hosting ps-1@" in logs["ps0"].read_text() else "ps1"  # whichever hosts shard 1
        others[victim].kill()
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (out / "summary.json").exists():
            time.sleep(0.2)
    finally:
        for proc in [coordinator, *others.values()]:
            proc.terminate()
        for proc in [coordinator, *others.values()]:
            proc.wait(timeout=60)
    doc = summary(out)
    assert doc["stop_reason"].startswith("failed: PS shard 1 at ps-1@127.0.0.1:"), doc["stop_reason"]
    lost = [e for e in doc["events"] if e["kind"] == "ps_lost"]
    assert len(lost) == 1 and lost[0]["shard"] == 1
    down = next(e for e in doc["events"] if e["kind"] == "ps_down" and e["shard"] == 1)
    assert lost[0]["wall_s"] - down["wall_s"] >= PS_LOST_AFTER_S  # held on for a freeze's worth first
    assert doc["wall_s"] < 300  # it ended on the failure, not on the time limit
    for name in ("worker0", "worker1"):  # failed pulls back off, and their warnings collapse into few lines
        warnings = [line for line in logs[name].read_text().splitlines() if "shard 1 failed" in line]
        assert 1 <= len(warnings) <= 10, warnings


@pytest.mark.parametrize("server", ["own", "shared"])
def test_a_killed_launcher_leaves_no_process_behind(tmp_path: Path, server: str, shared_fork_server: str) -> None:
    """With a fork server of its own (started by the launcher) or one the shared server forked for it
    (``DNIASYNC_FORK_SERVER``): that server and the job's processes go with the launcher; the shared one stays."""
    env = dict(os.environ)
    if server == "own":
        env.pop(SHARED_ENV, None)
    shared = _listener(shared_fork_server)
    launcher, out = start(tmp_path, "orphans", seconds=300, env=env)
    try:
        children = wait_training(out)
        # on loopback every process is forked by the launcher's fork server (one process, not the launcher)
        parents = {_parent(c["pid"]) for c in children}
        grandparents = {_parent(pid) for pid in parents}
    finally:
        launcher.kill()
        launcher.communicate()
    assert len(parents) == 1 and launcher.pid not in parents, parents
    assert grandparents == ({launcher.pid} if server == "own" else {shared}), (grandparents, launcher.pid, shared)
    (forks,) = parents
    pids = [forks, *(c["pid"] for c in children)]  # the server goes with the launcher, its children with it
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_running(pid) for pid in pids):
        time.sleep(0.2)
    assert not [pid for pid in pids if _running(pid)]
    assert _running(shared)


def _listener(path: str) -> int:
    """The pid of the process listening on the Unix socket ``path``."""
    inode = next(line.split()[6] for line in Path("/proc/net/unix").read_text().splitlines()[1:]
                 if line.split()[-1] == path and line.split()[3] == "00010000")  # __SO_ACCEPTCON: the listener
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if any(os.readlink(fd) == f"socket:[{inode}]" for fd in (entry / "fd").iterdir()):
                    return int(entry.name)
            except OSError:
                continue
    raise AssertionError(f"nobody listens on {path}")


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_ctrl_c_leaves_a_summary_of_what_ran(tmp_path: Path) -> None:
    launcher, out = start(tmp_path, "interrupt", seconds=300)
    try:
        wait_training(out)
        launcher.send_signal(signal.SIGINT)
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, stdout + stderr
    doc = summary(out)
    assert doc["stop_reason"].startswith("stopped: the coordinator was shut down"), doc["stop_reason"]
    assert doc["samples"] > 0 and doc["history"]
    assert (out / "accuracy.png").exists()
    assert str(out / "summary.json") in stdout


def trained_snapshot(log: Path, timeout: float = 120) -> None:
    """Wait for the coordinator's first snapshot in which every PS shard has taken a push."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists():
            for versions in re.findall(r"snapshot of 2 PS shard\(s\), versions \{0: (\d+), 1: (\d+)\}", log.read_text()):
                if min(int(v) for v in versions) >= 1:
                    return
        time.sleep(0.05)
    raise AssertionError("no snapshot of trained shards")


def test_a_killed_ps_shard_is_restarted_from_its_snapshot_and_the_job_reaches_its_target(tmp_path: Path) -> None:
    # The shard is killed at the first snapshot of trained weights (~12,000 samples in, accuracy ~0.85). At this
    # learning rate the target takes ~200,000 samples, and no evaluation scores while a shard is down (it needs every
    # shard's weights), so the job cannot end before the restart. At lr 0.05 it reached 0.95 within 40,000 samples,
    # sometimes before the kill, and then nothing was restarted.
    out = tmp_path / "restart"
    config = tmp_path / "restart.toml"
    text = (JOB.format(name="restart", out=out, seconds=240).replace("lr = 0.05", "lr = 0.005")
            .replace("max_epochs = 100000", "max_epochs = 100000\ntarget_accuracy = 0.93"))
    config.write_text(text + "\n[checkpoint]\nevery_seconds = 0.5\n")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        log = out / "logs" / "coordinator0.log"
        trained_snapshot(log)
        children = list(json.loads((out / "cluster.json").read_text())["children"])
        victim = hosting(children, "ps-1@")
        os.kill(victim["pid"], signal.SIGKILL)
        stdout, stderr = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, stdout + stderr
    doc = summary(out)
    assert doc["stop_reason"] == "reached target accuracy 0.93"
    restarted = [e for e in doc["events"] if e["kind"] == "ps_restarted"]
    assert len(restarted) == 1 and restarted[0]["shard"] == 1
    assert restarted[0]["snapshot_version"] >= 1  # it came back from a snapshot, not from scratch
    assert restarted[0]["version"] > restarted[0]["snapshot_version"]  # versions go on upward
    assert doc["metrics"]["ps1_version"] >= restarted[0]["version"]
    assert "restarting it" in stdout


def test_a_job_whose_coordinator_was_killed_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "resume"
    config = tmp_path / "resume.toml"
    config.write_text(JOB.format(name="resume", out=out, seconds=300).replace("max_epochs = 100000", "max_epochs = 150")
                      + "\n[checkpoint]\nevery_seconds = 0.5\n")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        children = wait_training(out)
        log = out / "logs" / "coordinator0.log"
        seen = len(log.read_text())  # checkpoints written after an evaluation of trained weights
        deadline = time.monotonic() + 120
        while log.read_text()[seen:].count("checkpoint ckpt-") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        coordinator = next(c for c in children if c["role"] == "coordinator")
        os.kill(coordinator["pid"], signal.SIGKILL)
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1 and not (out / "summary.json").exists(), stdout + stderr
    resumed = subprocess.run(
        [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config), "--resume"],
        capture_output=True, text=True, timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    doc = summary(out)
    assert doc["stop_reason"] == "trained 150 epochs"
    events = [e["kind"] for e in doc["events"]]
    assert events.count("replica_joined") == 4 and "resumed" in events  # the first run's events are kept
    resumed_at = next(e for e in doc["events"] if e["kind"] == "resumed")
    walls = [p["wall_s"] for p in doc["history"]]
    samples = [p["samples"] for p in doc["history"]]
    assert walls == sorted(walls) and samples == sorted(samples)  # one continuous history
    assert any(p["wall_s"] < resumed_at["wall_s"] for p in doc["history"])  # with the first run's evaluations
    assert doc["samples"] >= 150 * 1400 and doc["final_accuracy"] >= 0.9


def test_resuming_under_another_config_fails_naming_the_difference(tmp_path: Path) -> None:
    out = tmp_path / "differ"
    config = tmp_path / "differ.toml"
    text = JOB.format(name="differ", out=out, seconds=300).replace("max_epochs = 100000", "max_epochs = 3")
    config.write_text(text + "\n[checkpoint]\nevery_seconds = 0.2\n")
    first = subprocess.run([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    config.write_text(text.replace("lr = 0.05", "lr = 0.02") + "\n[checkpoint]\nevery_seconds = 0.2\n")
    again = subprocess.run(
        [sys.executable, "-m", "dniasync.node", "--role", "coordinator", "--config", str(config), "--resume"],
        capture_output=True, text=True, timeout=120,
    )
    assert again.returncode == 2, again.stdout + again.stderr
    assert "optimizer.lr: 0.05 in the checkpoint, 0.02 now" in again.stderr


def test_resume_of_a_job_with_no_checkpoint_says_so_and_exits_2(tmp_path: Path) -> None:
    """The coordinator's own error (no checkpoint in the store), not a launcher traceback; nothing written."""
    out = tmp_path / "never"
    config = tmp_path / "never.toml"
    config.write_text(JOB.format(name="never", out=out, seconds=300))
    resumed = subprocess.run([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config),
                              "--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 2, resumed.stdout + resumed.stderr
    assert "cannot resume job never: no checkpoint in" in resumed.stderr
    assert "Traceback" not in resumed.stderr + resumed.stdout
    assert not (out / "summary.json").exists()
