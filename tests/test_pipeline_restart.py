"""A pipeline stage that dies is restarted in place: its pipeline rolls back to its last capture and goes on.

Real launcher, real worker processes, real SIGKILL; no timing assertion: the
run must end with every sample of the data order trained exactly once in the
final model's lineage (the rollback's re-driven batches counted once).
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

from test_dni_cluster import write_job


def _worker_hosting(out: Path, group: int) -> dict[str, Any] | None:
    if not (out / "cluster.json").exists():
        return None
    for child in json.loads((out / "cluster.json").read_text())["children"]:
        log = Path(child["log"])
        if child["role"] == "worker" and log.exists() and f"hosting stages [{group}]" in log.read_text():
            return child  # type: ignore[no-any-return]
    return None


def _coordinator_says(out: Path, text: str) -> bool:
    log = out / "logs" / "coordinator0.log"
    return log.exists() and text in log.read_text()


def test_a_killed_stage_is_restarted_and_its_pipeline_finishes_from_its_checkpoint(tmp_path: Path) -> None:
    epochs = 60
    config, out = write_job(tmp_path, "stagekill", epochs=epochs, seconds=900)
    config.write_text(config.read_text() + "\n[checkpoint]\nevery_seconds = 1.0\n")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 180
        victim = None
        while time.monotonic() < deadline and victim is None:
            # kill once the pipeline has trained a while: its third checkpoint is written, and an evaluation
            if _coordinator_says(out, "checkpoint ckpt-00000003") and _coordinator_says(out, "eval:"):
                victim = _worker_hosting(out, 1)
            time.sleep(0.1)
        assert victim is not None, "the pipeline never checkpointed"
        os.kill(victim["pid"], signal.SIGKILL)
        stdout, stderr = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, stdout + stderr
    doc = json.loads((out / "summary.json").read_text())
    assert doc["stop_reason"] == f"trained {epochs} epochs", doc["stop_reason"]
    # every batch of the data order is in the final model once: the rolled-back ones were trained again, counted once
    assert doc["samples"] == epochs * 1400
    kinds = [e["kind"] for e in doc["events"]]
    assert "stage_lost" in kinds and "pipeline_restored" in kinds, kinds
    lost = next(e for e in doc["events"] if e["kind"] == "stage_lost")
    assert lost["stage"].startswith("stage-") and lost["pipeline"] == 0
    restored = next(e for e in doc["events"] if e["kind"] == "pipeline_restored")
    assert restored["samples"] > 0  # it went back to a capture taken while training, not to the start
    assert restored["samples_lost"] >= 0
    assert doc["metrics"]["pipeline_restarts"] == 1
    assert victim["address"] not in restored["stages"]  # the stage lives in the restarted process now
    assert "restarting it" in stdout
    assert doc["final_accuracy"] >= 0.85, doc["history"]


def test_a_stage_that_keeps_dying_fails_the_job_naming_its_process(tmp_path: Path) -> None:
    """The bounded-restart rule holds for stages too: the fourth death of one slot's process within the window
    ends the run, naming the process and its log, with a summary of what ran."""
    config, out = write_job(tmp_path, "stagedies", epochs=100_000, seconds=600)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 180
        victim = None
        while time.monotonic() < deadline and victim is None:
            if _coordinator_says(out, "eval:"):
                victim = _worker_hosting(out, 1)
            time.sleep(0.1)
        assert victim is not None, "the pipeline never started training"
        slot, killed = victim["slot"], set()
        while launcher.poll() is None and time.monotonic() < deadline + 300:
            # kill whatever process holds the slot now, as soon as it appears: restarts come faster than the window
            for child in json.loads((out / "cluster.json").read_text())["children"]:
                if child["slot"] == slot and child["pid"] not in killed:
                    killed.add(child["pid"])
                    try:
                        os.kill(child["pid"], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            time.sleep(0.05)
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 1, stdout + stderr
    assert f"worker process {slot}" in stderr and "keeps failing" in stderr, stderr
    assert len(killed) == 4  # the first death and three restarts
    doc = json.loads((out / "summary.json").read_text())
    assert doc["stop_reason"].startswith("stopped"), doc["stop_reason"]


def test_a_pipeline_job_whose_coordinator_was_killed_resumes_with_its_stages_states(tmp_path: Path) -> None:
    epochs = 60
    config, out = write_job(tmp_path, "piperesume", epochs=epochs, seconds=900)
    config.write_text(config.read_text() + "\n[checkpoint]\nevery_seconds = 1.0\n")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (
                _coordinator_says(out, "checkpoint ckpt-00000003") and _coordinator_says(out, "eval:")):
            time.sleep(0.1)
        coordinator = next(c for c in json.loads((out / "cluster.json").read_text())["children"]
                           if c["role"] == "coordinator")
        os.kill(coordinator["pid"], signal.SIGKILL)
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 1 and not (out / "summary.json").exists(), stdout + stderr
    latest = sorted((out / "checkpoints").glob("ckpt-*"))[-1]
    manifest = json.loads((latest / "manifest.json").read_text())
    assert {"stage-0-0", "stage-0-1"} <= set(manifest["parts"]), manifest["parts"]
    assert manifest["meta"]["mode"]["groups"] == [[0, 1], [2]]  # the split is in the job's state
    resumed = subprocess.run(
        [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config), "--resume"],
        capture_output=True, text=True, timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "every stage loaded its state from the checkpoint" in (out / "logs" / "coordinator0.log").read_text()
    doc = json.loads((out / "summary.json").read_text())
    assert doc["stop_reason"] == f"trained {epochs} epochs"
    assert doc["samples"] == epochs * 1400  # the data order went on from the checkpoint's cursor
    resumed_at = next(e for e in doc["events"] if e["kind"] == "resumed")
    walls = [p["wall_s"] for p in doc["history"]]
    samples = [p["samples"] for p in doc["history"]]
    assert walls == sorted(walls) and samples == sorted(samples)  # one continuous history
    assert any(p["wall_s"] < resumed_at["wall_s"] for p in doc["history"])
    assert doc["final_accuracy"] >= 0.85, doc["history"]


def test_a_stage_frozen_for_10_s_does_not_end_the_run(tmp_path: Path) -> None:
    """A frozen stage process either comes back in time, or is declared dead, ended and restarted (its
    pipeline rolled back): either way the run trains its whole budget."""
    epochs = 60
    config, out = write_job(tmp_path, "stagefreeze", epochs=epochs, seconds=900)
    config.write_text(config.read_text() + "\n[checkpoint]\nevery_seconds = 1.0\n")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 180
        victim = None
        while time.monotonic() < deadline and victim is None:
            if _coordinator_says(out, "checkpoint ckpt-00000003") and _coordinator_says(out, "eval:"):
                victim = _worker_hosting(out, 0)
            time.sleep(0.1)
        assert victim is not None, "the pipeline never checkpointed"
        os.kill(victim["pid"], signal.SIGSTOP)
        time.sleep(10)
        try:
            os.kill(victim["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass  # declared dead while frozen: the launcher ended it (and started another)
        stdout, stderr = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, stdout + stderr
    doc = json.loads((out / "summary.json").read_text())
    assert doc["stop_reason"] == f"trained {epochs} epochs", doc["stop_reason"]
    assert doc["samples"] == epochs * 1400
    assert doc["final_accuracy"] >= 0.85, doc["history"]


def test_a_killed_replicated_stage_is_restarted_and_pulls_from_its_ps_shard(tmp_path: Path) -> None:
    """DNI x Downpour (2 pipelines, a PS shard per stage): the pipeline of the killed stage rolls back and goes on."""
    epochs = 60
    config, out = write_job(tmp_path, "replicated", epochs=epochs, seconds=900, extra="replicas = 2\n")
    config.write_text(config.read_text() + "\n[checkpoint]\nevery_seconds = 1.0\n")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 180
        victim = None
        while time.monotonic() < deadline and victim is None:
            if _coordinator_says(out, "checkpoint ckpt-00000003") and _coordinator_says(out, "eval:"):
                victim = _worker_hosting(out, 1)
            time.sleep(0.1)
        assert victim is not None, "the pipelines never checkpointed"
        os.kill(victim["pid"], signal.SIGKILL)
        stdout, stderr = launcher.communicate(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, stdout + stderr
    doc = json.loads((out / "summary.json").read_text())
    assert doc["stop_reason"] == f"trained {epochs} epochs", doc["stop_reason"]
    assert doc["samples"] == epochs * 1400
    assert [e["kind"] for e in doc["events"]].count("pipeline_restored") == 1
    assert doc["final_accuracy"] >= 0.8, doc["history"]
