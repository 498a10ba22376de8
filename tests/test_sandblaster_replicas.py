"""Replicated Sandblaster shards (``[sandblaster] ps_replicas``): a copy killed mid-run loses nothing.

One real job through the local launcher: two shards, two copies each; the
chaos tool's ``kill_ps_copy`` SIGKILLs a copy once L-BFGS has run a few iterations.
The launcher starts it again, the coordinator gives it a live copy's state
before a batch and commands it from then on (the replicas are frozen until
it is back in its shard's view, so the job cannot end before it rejoins). Since every command reached a
live copy in the same order, the iterates are those of the single-process
L-BFGS, as on an undisturbed job (``test_sandblaster``), and the copies hold
the same parameters at the end.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import time
from pathlib import Path

from test_sandblaster import assert_same_iterates, finish, launch, wait_iterations, workers, write_job

from dniasync.chaos._tool import Chaos
from dniasync.cluster.chains import copies_placed


def wait_back_in_view(log: Path, shard: int, timeout: float = 60) -> None:
    """Until the coordinator's ``log`` shows a view of ``shard`` with two copies again (the restarted one is up)."""
    pattern = re.compile(rf"PS shard {shard}: chain view \d+ is \S+ -> \S+")
    deadline = time.monotonic() + timeout
    while not pattern.search(log.read_text()):
        assert time.monotonic() < deadline, f"shard {shard}'s restarted copy never came back in {timeout} s"
        time.sleep(0.05)


def test_a_copy_killed_mid_run_loses_nothing_and_rejoins_with_the_same_state(tmp_path: Path) -> None:
    config, out = write_job(tmp_path, "copies", sizes="[784, 32, 10]", portion=50)
    config.write_text(config.read_text().replace("[sandblaster]\n", "[sandblaster]\nps_replicas = 2\n"))
    launcher = launch(config)
    try:
        wait_iterations(out, 3)
        placed = copies_placed((out / "logs" / "coordinator0.log").read_text())
        assert sorted(placed.values()) == [(0, 0), (0, 1), (1, 0), (1, 1)], placed
        frozen = [int(c["pid"]) for c in workers(out)]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            chaos = Chaos(out, ["kill_ps_copy"], seed=1, out=io.StringIO())
            asyncio.run(chaos.check_replicated())  # it refuses a job without replicated shards
            fault = asyncio.run(chaos.inject("kill_ps_copy"))
            assert fault["kind"] == "kill_ps_copy", fault
            shard, copy = fault["shard"], fault["copy"]
            wait_back_in_view(out / "logs" / "coordinator0.log", shard)
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        doc = finish(launcher, out)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    # nothing lost: every iterate is the single-process L-BFGS's (as unreplicated and undisturbed)
    assert_same_iterates(out, doc, config)
    assert doc["final_accuracy"] > 0.8
    events = doc["events"]
    down = [e for e in events if e["kind"] == "ps_copy_down"]
    joined = [e for e in events if e["kind"] == "ps_copy_joined"]
    assert [e["shard"] for e in down] == [shard], events
    assert [(e["shard"], e["copy"]) for e in joined] == [(shard, copy)], events
    m = doc["metrics"]
    assert m["ps_copies_lost"] == 1 and m["ps_copies_rejoined"] == 1
    assert m["ps_copy_transfers"] == 1 and m["ps_copy_disagreements"] == 0
    # the copy that came back is commanded again, and every shard's copies hold the same parameters
    assert all(m[f"ps{k}_copy{j}_commanded"] == 1 for k in (0, 1) for j in (0, 1)), m
    assert m[f"ps{shard}_copy{copy}_transfers"] == 1
    for k in (0, 1):
        assert m[f"ps{k}_copy0_x_sha256"] == m[f"ps{k}_copy1_x_sha256"]
    assert m["ps_copies_identical"] == 1
