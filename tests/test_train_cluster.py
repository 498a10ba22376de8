"""Data-parallel training end to end: real processes, real sockets, the real launcher."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _jobs import launch, summary
from dniasync import Actor, ActorSystem, handler
from dniasync.cluster.config import parse_config
from dniasync.cluster.hosts import Host
from dniasync.cluster.job import JobRunner
from dniasync.cluster.protocol import COORDINATOR_NAME, JobStatus
from dniasync.train.messages import Progress, Push, ShardStats
from dniasync.train.ps import PSShard

ROOT = Path(__file__).resolve().parent.parent

DIGITS = """
[job]
name = "{name}"
mode = "{mode}"
seed = 3
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"

[model.kwargs]
sizes = [64, 64, 10]

[data]
dataset = "digits"
n_train = 1400
n_test = 397
batch_size = 32

[optimizer]
name = "{optimizer}"
lr = {lr}

{mode_section}

[stop]
max_epochs = {epochs}
{target}
max_seconds = 120

[eval]
every_seconds = 0.5
"""


def write_job(tmp_path: Path, name: str, mode: str = "downpour", *, epochs: int = 30, target: float | None = 0.9,
              mode_section: str | None = None) -> tuple[Path, Path]:
    out = tmp_path / name
    if mode_section is None:
        mode_section = ("[downpour]\nn_replicas = 2\nn_ps_shards = 2\n" if mode == "downpour"
                        else "[hogwild]\nn_workers = 2\n")
    text = DIGITS.format(
        name=name, mode=mode, out=out, epochs=epochs, mode_section=mode_section,
        optimizer="adagrad" if mode == "downpour" else "sgd", lr=0.05 if mode == "downpour" else 0.1,
        target="" if target is None else f"target_accuracy = {target}",
    )
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path, out


def test_downpour_with_threshold_codec_trains_digits_across_processes(tmp_path: Path) -> None:
    section = "[downpour]\nn_replicas = 2\nn_ps_shards = 2\ncodec = \"threshold\"\ntau = 0.01\nstaleness = \"inverse\""
    config, out = write_job(tmp_path, "dp", mode_section=section, epochs=8, target=None)
    proc = launch(config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = summary(out)
    assert doc["stop_reason"] == "trained 8 epochs"
    assert doc["final_accuracy"] >= 0.9
    assert (out / "accuracy.png").stat().st_size > 1000
    # pushes are quantized: the same replicas' reports count the bytes sent and what those pushes take dense
    # (over a fixed amount of training: early gradients pass the threshold more often than late ones)
    assert 0 < doc["bytes_pushed"] < doc["metrics"]["dense_bytes_pushed"] / 2
    assert doc["metrics"]["ps0_applied"] > 0 and doc["metrics"]["ps1_applied"] > 0
    assert "held-out accuracy" in proc.stdout
    # every child was stopped: none of the pids in cluster.json is still running
    for child in json.loads((out / "cluster.json").read_text())["children"]:
        assert not Path(f"/proc/{child['pid']}").exists() or _is_zombie(child["pid"])


def _is_zombie(pid: int) -> bool:
    try:
        return "State:\tZ" in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True


def test_hogwild_workers_share_one_store_across_processes(tmp_path: Path) -> None:
    config, out = write_job(tmp_path, "hw", mode="hogwild")
    proc = launch(config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = summary(out)
    assert doc["final_accuracy"] >= 0.9
    joined = [e for e in doc["events"] if e["kind"] == "replica_joined"]
    assert len(joined) == 2
    assert not list(Path("/dev/shm").glob("dniasync-hw-*"))  # the coordinator removed the shared store


def test_downpour_over_the_shared_store_trains_with_no_ps_process(tmp_path: Path) -> None:
    """examples/downpour_shm_mnist.toml as shipped (its output moved): measured 92.7-93.7% in 0.6-0.7 s."""
    out = tmp_path / "out"
    config = tmp_path / "downpour_shm_mnist.toml"
    config.write_text((ROOT / "examples" / "downpour_shm_mnist.toml").read_text()
                      .replace('output_dir = "runs/downpour_shm_mnist"', f'output_dir = "{out}"'))
    proc = launch(config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 PS shard(s), 2 replica(s)" in proc.stdout
    doc = summary(out)
    assert doc["final_accuracy"] >= 0.9, doc["history"]
    assert doc["bytes_pushed"] == 0 and doc["bytes_pulled"] == 0  # nothing went through a socket
    assert len([e for e in doc["events"] if e["kind"] == "replica_joined"]) == 2
    assert not list(Path("/dev/shm").glob("dniasync-downpour_shm_mnist-*"))  # the coordinator removed the store


def test_killed_replica_is_detected_and_its_shard_reassigned(tmp_path: Path) -> None:
    config, out = write_job(tmp_path, "kill", epochs=100_000, target=None)
    config.write_text(config.read_text().replace("max_seconds = 120", "max_seconds = 12"))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "dniasync.node", "--role", "local", "--config", str(config)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        victim = None
        while time.monotonic() < deadline and victim is None:
            logs = out / "logs"
            if (out / "cluster.json").exists() and logs.exists():
                workers = [c for c in json.loads((out / "cluster.json").read_text())["children"]
                           if c["role"] == "worker"]
                # kill once the victim is training (it logs its shards)
                if workers and "training shards" in Path(workers[0]["log"]).read_text():
                    victim = workers[0]
            time.sleep(0.2)
        assert victim is not None, "the replicas never started training"
        time.sleep(1.0)
        os.kill(victim["pid"], signal.SIGKILL)
        stdout, stderr = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, stdout + stderr
    doc = summary(out)
    kinds = [e["kind"] for e in doc["events"]]
    assert "replica_failed" in kinds and "shard_reassigned" in kinds
    failed = next(e for e in doc["events"] if e["kind"] == "replica_failed")
    moved = next(e for e in doc["events"] if e["kind"] == "shard_reassigned")
    assert moved["wall_s"] >= failed["wall_s"] and moved["to"] != failed["replica"]
    assert doc["stop_reason"] == "ran 12 s"
    survivor = moved["to"]
    assert survivor != failed["replica"]
    assert doc["final_accuracy"] >= 0.9


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (("n_ps_shards = 2", "n_ps_shard = 2"), "downpour.n_ps_shard"),
        (('factory = "dniasync.train.models:mlp"', 'factory = "dniasync.train.models:nope"'), "model.factory"),
        (("n_replicas = 2", "n_replicas = 5000"), "downpour.n_replicas"),
    ],
)
@pytest.mark.parametrize("role", ["local", "coordinator"])
def test_bad_job_configs_fail_at_start_naming_the_key(
    tmp_path: Path, edit: tuple[str, str], key: str, role: str
) -> None:
    config, out = write_job(tmp_path, "bad")
    config.write_text(config.read_text().replace(*edit))
    earlier = {out / "cluster.json": "an earlier run's", out / "logs" / "coordinator0.log": "an earlier run's log"}
    for path, text in earlier.items():  # the output directory of an earlier run of the job
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "dniasync.node", "--role", role, "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert key in proc.stderr
    assert proc.stderr.count(key) == 1, proc.stderr  # said once, by whichever process checks that rule
    # (the launcher checks what needs no model; the coordinator it starts, the rest, before it writes anything)
    assert {path: path.read_text() for path in earlier} == earlier
    assert sorted(p.name for p in out.rglob("*")) == ["cluster.json", "coordinator0.log", "logs"]


async def test_warm_start_late_replica_pulls_before_pushing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # every push the shard receives, with the version of the weights it was computed on (the last pull's; 0 if the
    # replica never pulled): what the late replica's pushes were based on does not depend on timing, their
    # staleness on arrival does (the first replica keeps pushing while the late one computes)
    pushes: list[tuple[str, int]] = []
    push = PSShard.push

    @functools.wraps(push)
    def recorded(self: PSShard, msg: Push) -> None:
        pushes.append((msg.replica, msg.version))
        push(self, msg)

    monkeypatch.setattr(PSShard, "push", recorded)
    raw = {
        "job": {"name": "warm", "mode": "downpour", "seed": 1, "output_dir": str(tmp_path / "warm")},
        "model": {"factory": "dniasync.train.models:mlp", "kwargs": {"sizes": [64, 32, 10]}},
        "data": {"dataset": "digits", "n_train": 1000, "n_test": 300, "batch_size": 16},
        "optimizer": {"name": "adagrad", "lr": 0.05},
        # a late replica that pushed without pulling would be ~warm_start_steps stale and dropped
        "downpour": {"n_replicas": 2, "n_ps_shards": 1, "warm_start_steps": 40},
        "stop": {"max_epochs": 30},
        "eval": {"every_seconds": 0.2},
    }
    config = parse_config(raw)
    finished = asyncio.Event()
    async with ActorSystem() as system:
        trainer = await system.spawn(JobRunner, config, finished=finished, name=COORDINATOR_NAME)
        await system.spawn(Host, f"{COORDINATOR_NAME}@local", "ps", name="ps-host")
        for i in range(2):
            await system.spawn(Host, f"{COORDINATOR_NAME}@local", "worker", retry_s=0.05, name=f"worker{i}")
        await asyncio.wait_for(finished.wait(), 120)
        status = await trainer.ask(JobStatus())
        stats = await system.lookup("ps-0").ask(ShardStats())
    joined = [e for e in summary(tmp_path / "warm")["events"] if e["kind"] == "replica_joined"]
    assert len(joined) == 2 and sorted(status.replicas) == ["replica-local-worker0", "replica-local-worker1"]
    # both joined and built their data and model at once; the second got its data shards, and took its first step,
    # once the first's progress report said it had taken its 40 steps alone
    first, second = joined[0]["replica"], joined[1]["replica"]
    before = next(i for i, (replica, _) in enumerate(pushes) if replica == second)
    assert all(replica == first for replica, _ in pushes[:before]) and before >= 40, before
    late = [version for replica, version in pushes if replica == second]
    # the shard had taken the first replica's warm-start pushes before the late replica's first pull reached it
    # (the same mailbox, in order): every push of the late one is based on weights it pulled, none on version 0
    assert late and min(late) > 0, late[:5]
    assert stats["applied"] == len(pushes) - sum(stats["rejected"].values())


def test_a_hogwild_checkpoint_keeps_adams_step_count(tmp_path: Path) -> None:
    """The shared store's checkpoint part holds its step count and a resumed job's store continues it (Adam's bias
    correction starts again at step 1 otherwise: the next steps 0.15-0.8x their size); the next step is the one the
    job would have taken. A checkpoint from before the count was saved takes the job's steps."""
    import numpy as np
    import tomllib

    from dniasync.cluster.modes._shared_store import SharedStoreJob
    from dniasync.train.checkpoint import CheckpointState, CheckpointStore, Part
    from dniasync.train.sync import HOGWILD_SEGMENT

    config_path, _ = write_job(tmp_path, "hwadam", mode="hogwild")
    raw = tomllib.loads(config_path.read_text())
    raw["optimizer"] = {"name": "adam", "lr": 0.01}
    jobs = []  # each its own store (named after its job and this process)
    for k in range(3):
        raw["job"]["name"] = f"hwadam{k}"
        jobs.append(SharedStoreJob(parse_config(raw), None, "off"))  # type: ignore[arg-type]
    first, second, third = jobs
    try:
        grad = np.linspace(-1, 1, first.n_params, dtype=np.float32)
        for k in range(12):
            first.store.step(HOGWILD_SEGMENT, grad * (k + 1), 0.01)
        meta, parts = first.checkpoint()
        assert parts["hogwild"].meta["steps"] == 12
        store = CheckpointStore(tmp_path / "ckpt", "hwadam", {})
        store.write(CheckpointState(parts, {"mode": {**meta, "steps": 12}}, wall_time_s=1.0))
        loaded = store.latest()
        assert loaded is not None
        second.restore(loaded)
        assert second.store.steps(HOGWILD_SEGMENT) == 12
        for job in (first, second):
            job.store.step(HOGWILD_SEGMENT, grad, 0.01)
        np.testing.assert_array_equal(second.store.view(HOGWILD_SEGMENT), first.store.view(HOGWILD_SEGMENT))
        # the part written before the count was: the job's steps stand in
        old = CheckpointStore(tmp_path / "old", "hwadam", {})
        old.write(CheckpointState({"hogwild": Part(parts["hogwild"].tensors)}, {"mode": {**meta, "steps": 12}},
                                  wall_time_s=1.0))
        loaded = old.latest()
        assert loaded is not None
        third.restore(loaded)
        assert third.store.steps(HOGWILD_SEGMENT) == 12
    finally:
        for job in jobs:
            asyncio.run(job.close())



class _Runner(Actor):
    """Stands for the job runner: keeps every progress report."""

    def __init__(self, reports: list[Progress], enough: asyncio.Event, samples: int) -> None:
        self.reports, self.enough, self.samples = reports, enough, samples

    @handler
    def progress(self, msg: Progress) -> None:
        self.reports.append(msg)
        if msg.samples >= self.samples:
            self.enough.set()


async def test_a_replica_reports_each_time_it_has_trained_report_every_samples(tmp_path: Path) -> None:
    """Beside its clock, a replica reports once it has trained ``report_every_samples`` since its last report, so
    the runner sees an epoch budget spent within about that many samples a replica (a short job trains several
    epochs in one 0.25 s report interval). The clock is set to an hour here: every report seen is one of these."""
    import tomllib

    from dniasync.cluster.modes._shared_store import SharedStoreJob
    from dniasync.train.replica import Replica
    from dniasync.train.specs import ReplicaSpec

    config_path, _ = write_job(tmp_path, "reports", mode="hogwild")
    job = SharedStoreJob(parse_config(tomllib.loads(config_path.read_text())), None, "off")  # type: ignore[arg-type]
    reports: list[Progress] = []
    enough = asyncio.Event()
    try:
        async with ActorSystem() as system:
            runner = await system.spawn(_Runner, reports, enough, 3000, name="runner")
            spec = ReplicaSpec(job.model_spec, job.data_spec, job.optimizer_spec, [[0, 0, 0]], job.sync_spec(),
                               runner.address, report_every_samples=300)
            await system.spawn(Replica, spec, progress_every_s=3600.0, name="replica")
            await asyncio.wait_for(enough.wait(), 60)
    finally:
        await job.close()
    samples = [0] + [r.samples for r in reports]
    gaps = [b - a for a, b in zip(samples, samples[1:])]
    # a step trains 8 batches of at most 32 (the shared store's steps per call): a report comes at the first step
    # that takes the count 300 or more past the last report
    assert len(gaps) >= 5 and all(300 <= gap < 300 + 8 * 32 for gap in gaps), gaps
    assert [r.steps for r in reports] == sorted(r.steps for r in reports)
