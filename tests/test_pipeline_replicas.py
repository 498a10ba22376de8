"""Replicated pipelines over replicated PS shards (``[pipeline] ps_replicas``): a copy's death loses nothing.

One real DNI x Downpour job (2 pipelines of 2 stages, each stage's PS shard in
2 copies) through the launcher: the head copy of stage 0's shard is killed
with SIGKILL, and both copies of stage 1's shard are frozen together (SIGSTOP)
past the failure detector's interval, so that shard's chain is left with no
copy until they answer again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _jobs import trained_log
from dniasync.cluster.chains import copies_placed
from test_dni_cluster import write_job

SECONDS = 16


def _ps_pids(out: Path) -> dict[tuple[int, int], int]:
    """(shard, copy) -> pid of the PS process hosting it, once the job trains."""
    placed = copies_placed(trained_log(out / "logs" / "coordinator0.log"))
    children = json.loads((out / "cluster.json").read_text())["children"]
    pid = {c["address"]: int(c["pid"]) for c in children if c["role"] == "ps"}
    return {where: pid[address] for address, where in placed.items()}


def test_stage_shards_in_two_copies_lose_no_acknowledged_push_to_a_kill_or_a_freeze_of_both_copies(
        tmp_path: Path) -> None:
    config, out = write_job(tmp_path, "chains", epochs=100_000, seconds=SECONDS, extra="replicas = 2\nps_replicas = 2\n")
    launcher = subprocess.Popen([sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "logs" / "coordinator0.log"
    frozen: list[int] = []
    try:
        pids = _ps_pids(out)
        assert sorted(pids) == [(0, 0), (0, 1), (1, 0), (1, 1)], pids
        os.kill(pids[0, 0], signal.SIGKILL)
        frozen = [pids[1, 0], pids[1, 1]]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while log.read_text().count("PS shard 1: the copy at") < 2:  # both cut out: the chain is empty
            assert time.monotonic() < deadline, "the frozen copies were never missed"
            time.sleep(0.1)
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        frozen = []
        stdout, stderr = launcher.communicate(timeout=240)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, stdout + stderr
    doc = json.loads((out / "summary.json").read_text())
    assert doc["stop_reason"] == f"ran {SECONDS} s", doc["stop_reason"]
    down = sorted(e["shard"] for e in doc["events"] if e["kind"] == "ps_copy_down")
    assert down == [0, 1, 1], doc["events"]
    assert "ps_lost" not in [e["kind"] for e in doc["events"]]
    text = log.read_text()
    assert "PS shard 1: the copy at" in text and "answers again: it heads the chain anew" in text, text[-3000:]
    metrics = doc["metrics"]
    # nothing lost: every push a stage saw acknowledged is in every copy that holds its shard at the end
    assert metrics["ps_acknowledged_pushes"] > 0
    assert metrics["ps_acknowledged_pushes_kept"] == metrics["ps_acknowledged_pushes"], metrics
    # both copies of stage 1's shard are back in its chain, at one version
    assert metrics["ps1_copy0_in_chain"] == metrics["ps1_copy1_in_chain"] == 1, metrics
    assert metrics["ps1_copy0_version"] == metrics["ps1_copy1_version"], metrics
    assert all(metrics[f"ps{k}_copy{j}_divergent"] == 0 for k in (0, 1) for j in (0, 1)
               if f"ps{k}_copy{j}_divergent" in metrics), metrics
    worker_logs = "".join(p.read_text() for p in (out / "logs").glob("worker*.log"))
    assert "version went back" not in worker_logs  # pulls read the tail: versions never go back
    assert "failed for" not in worker_logs  # no push or pull gave up
    assert doc["final_accuracy"] >= 0.8, doc["history"]
