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
        if child["role"] == "worker" and log.exists() and f"hosting layer groups [{group}]" in log.read_text():
            return child  # type: ignore[no-any-return]
    return None


def _coordinator_says(out: Path, text: str) -> bool:
    log = out / "logs" / "coordinator0.log"
    return log.exists() and text in log.read_text()


def test_a_killed_stage_is_restarted_and_its_pipeline_finishes_from_its_checkpoint(tmp_path: Path) -> None:
    epochs = 100
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
    assert lost["group"].startswith("layer-group-") and lost["pipeline"] == 0
    restored = next(e for e in doc["events"] if e["kind"] == "pipeline_restored")
    assert restored["samples"] > 0  # it went back to a capture taken while training, not to the start
    assert restored["samples_lost"] >= 0
    assert doc["metrics"]["pipeline_restarts"] == 1
    assert victim["address"] not in restored["stages"]  # the stage lives in the restarted process now
    assert "restarting it" in stdout
    assert doc["final_accuracy"] >= 0.85, doc["history"]
