"""Batch-size schedules: stepwise growth, lr scaling, Byrd's norm test, and their use with a data cursor."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _jobs import launch_two_at_a_time, summary, write_job
from dniasync.train.data import DataCursor, ShardPlan
from dniasync.train.schedules import BatchSchedule, NormTest, ScheduleSpec

Jobs = dict[str, tuple[subprocess.CompletedProcess[str], Path]]
"""The module's jobs once run: ``{name: (the launcher's process, the job's output directory)}``."""


def test_stepwise_growth_doubles_every_k_epochs_up_to_end_and_keeps_lr_by_default() -> None:
    s = BatchSchedule(ScheduleSpec("stepwise", start=32, end=512, every_epochs=2))
    assert [s.batch_size(e) for e in (0, 1.99, 2, 4, 6, 8, 30)] == [32, 32, 64, 128, 256, 512, 512]
    assert s.lr_factor(8) == 1.0
    linear = BatchSchedule(ScheduleSpec("stepwise", start=32, end=512, every_epochs=2, lr_scaling="linear"))
    assert linear.lr_factor(4) == 4.0
    root = BatchSchedule(ScheduleSpec("stepwise", start=32, end=512, every_epochs=2, lr_scaling="sqrt"))
    assert root.lr_factor(4) == pytest.approx(2.0)
    assert BatchSchedule(ScheduleSpec("fixed", start=64, end=64)).batch_size(100) == 64


def test_bad_schedules_are_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        ScheduleSpec("sometimes")
    with pytest.raises(ValueError, match="start"):
        ScheduleSpec("stepwise", start=600, end=512)
    with pytest.raises(ValueError, match="lr_scaling"):
        ScheduleSpec("stepwise", lr_scaling="cubic")


def test_the_norm_test_grows_the_sample_only_when_the_gradient_is_noisy() -> None:
    rng = np.random.default_rng(0)
    mean = np.ones(50)
    quiet = [mean + 0.01 * rng.normal(size=50) for _ in range(4)]
    noisy = [mean + 5.0 * rng.normal(size=50) for _ in range(4)]
    schedule = BatchSchedule(ScheduleSpec("dynamic", start=32, end=512, theta=0.5))
    assert schedule.observe(0.1, quiet, 8) == 32  # the test passes: the sample stays
    grown = schedule.observe(0.2, noisy, 8)
    assert 32 < grown <= 512 and schedule.grown == [(0.2, grown)]
    assert NormTest(0.5).wanted(noisy, 8) > NormTest(5.0).wanted(noisy, 8)  # a looser test asks for less
    strict = BatchSchedule(ScheduleSpec("dynamic", start=32, end=512, theta=0.05))
    assert strict.observe(0.3, noisy, 8) == 512  # capped at end


def test_the_norm_test_from_squared_norms_alone_asks_what_it_asks_from_the_vectors() -> None:
    rng = np.random.default_rng(1)
    parts = [np.ones(40) + 2.0 * rng.normal(size=40) for _ in range(5)]
    mean = np.mean(parts, axis=0)
    sum_sq = float(sum(g @ g for g in parts))
    assert NormTest(0.5).wanted_from_norms(sum_sq, float(mean @ mean), 5, 8) == pytest.approx(
        NormTest(0.5).wanted(parts, 8), rel=1e-9)
    assert NormTest(0.5).wanted_from_norms(sum_sq, float(mean @ mean), 1, 8) == 0.0  # one part: no spread


def test_a_cursor_walks_an_epoch_with_a_growing_batch() -> None:
    plan = ShardPlan(1000, 1, seed=0)
    schedule = BatchSchedule(ScheduleSpec("stepwise", start=100, end=400, every_epochs=1))
    cursor, sizes, seen = DataCursor(0), [], []
    while cursor.epoch < 3:
        epoch = cursor.epoch + cursor.position / plan.shard_size(0)
        indices, cursor = plan.next_batch(cursor, schedule.batch_size(epoch))
        sizes.append(len(indices))
        seen.append(indices)
    assert sizes[:10] == [100] * 10 and max(sizes) == 400
    assert sorted(np.concatenate(seen[:10]).tolist()) == list(range(1000))  # epoch 0 covered once


JOB = """
[job]
name = "{name}"
mode = "downpour"
seed = 1
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"
kwargs = {{ sizes = [64, 32, 10] }}

[data]
dataset = "digits"
n_train = 1400
n_test = 397
batch_size = 16

[optimizer]
name = "adagrad"
lr = 0.05

[downpour]
n_replicas = 2
n_ps_shards = 1

[stop]
max_epochs = 4
max_seconds = 300

[eval]
every_seconds = 1.0
{schedule}
"""


DYNAMIC = "[schedule]\nkind = 'dynamic'\nend = 256\ntheta = 0.25\nchunks = 4\ntest_every = 5\n"
HOGWILD = JOB.replace('mode = "downpour"', 'mode = "hogwild"').replace(
    "[downpour]\nn_replicas = 2\nn_ps_shards = 1\n", "")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    """Every job of the module, launched two at a time (each stops at a count of epochs or L-BFGS iterations, never
    at a time, so running beside another changes how long it takes, not what it does): ``{name: (launcher, out)}``."""
    tmp = tmp_path_factory.mktemp("schedules")
    texts = {
        "fixed": JOB.replace("{schedule}", ""),
        "grown": JOB.replace("{schedule}", "[schedule]\nkind = 'stepwise'\nend = 128\nevery_epochs = 1.0\n"),
        "downpour": JOB.replace("{schedule}", DYNAMIC),
        "hogwild": HOGWILD.replace("{schedule}", "[hogwild]\nn_workers = 2\n" + DYNAMIC),
        "pipeline": PIPELINE_JOB,
        "pipeline_dynamic": PIPELINE_JOB.replace('kind = "stepwise"\nend = 128\nevery_epochs = 1.0',
                                                 'kind = "dynamic"\nend = 256\ntheta = 0.25\ntest_every = 5'),
        "sandblaster": SANDBLASTER_JOB,
        "sandblaster_dynamic": SANDBLASTER_JOB.replace(
            'kind = "stepwise"\nstart = 150\nend = 1400\nevery_epochs = 2.0',
            'kind = "dynamic"\nstart = 200\nend = 1400\ntheta = 0.25'),
    }
    configs = {name: write_job(tmp, name, text)[0] for name, text in texts.items()}
    done = launch_two_at_a_time(configs)
    return {name: (done[name], tmp / name) for name in texts}


def finished(jobs: Jobs, name: str, stop_reason: str) -> dict[str, Any]:
    """The summary of the module's job ``name``, checked to have exited 0 for ``stop_reason``."""
    proc, out = jobs[name]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = summary(out)
    assert doc["stop_reason"] == stop_reason, doc["stop_reason"]
    return doc


def test_a_downpour_job_with_a_stepwise_schedule_takes_fewer_larger_steps(jobs: Jobs) -> None:
    fixed, grown = (finished(jobs, name, "trained 4 epochs") for name in ("fixed", "grown"))

    def per_push(doc: dict[str, Any]) -> float:  # n_push = 1: one push per step
        # both counted by the shard: the job's sample count is the coordinator's, from progress reports up to
        # 0.25 s old, and these jobs train in about that (a fresh CI run once saw 21 samples per push this way)
        return float(doc["metrics"]["ps0_samples"]) / doc["metrics"]["ps0_applied"]

    assert per_push(fixed) <= 16
    # epochs 0, 1, 2, 3 at 16, 32, 64, 128 per step: 4 epochs in 2 * (44 + 22 + 11 + 6) steps, ~34 per step
    assert per_push(grown) > 1.5 * per_push(fixed)
    assert grown["final_accuracy"] > 0.5


@pytest.mark.parametrize("mode", ["downpour", "hogwild"])
def test_dynamic_sampling_grows_each_workers_batch_when_its_norm_test_fails(mode: str, jobs: Jobs) -> None:
    doc = finished(jobs, mode, "trained 4 epochs")
    grown: dict[str, list[int]] = {}
    for e in doc["events"]:
        if e["kind"] == "batch_size":
            grown.setdefault(e["replica"], []).append(e["batch_size"])
    assert grown, "no worker's batch grew"
    for sizes in grown.values():  # from data.batch_size (16) up, never down, at most end (the first report may
        # come before or after the first test)
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes) and 16 <= sizes[0] and 16 < sizes[-1] <= 256
    if mode == "downpour":  # fewer, larger steps than data.batch_size's 16 per push
        assert doc["metrics"]["ps0_samples"] / doc["metrics"]["ps0_applied"] > 16
    assert doc["final_accuracy"] > 0.5


def test_every_mode_reads_the_schedule_section_and_a_bad_end_is_refused() -> None:
    from dniasync.cluster.config import ConfigError, parse_config

    for mode in ("downpour", "hogwild", "pipeline", "sandblaster"):
        raw = {"job": {"name": "x", "mode": mode}, "model": {"factory": "dniasync.train.models:mlp"},
               "data": {"dataset": "digits", "n_train": 100, "n_test": 10}, "schedule": {"kind": "stepwise"}}
        if mode == "pipeline":
            raw["pipeline"], raw["optimizer"] = {"groups": [[0, 1], [2]]}, {"name": "adam"}
        assert parse_config(raw, resolve=False).schedule.kind == "stepwise"
    raw["schedule"] = {"kind": "stepwise", "start": 64, "end": 32}
    with pytest.raises(ConfigError, match="schedule.end"):
        parse_config(raw, resolve=False)
    raw["schedule"] = {"kind": "dynamic", "chunks": 1}
    with pytest.raises(ConfigError, match="chunks"):
        parse_config(raw, resolve=False)
    raw["schedule"] = {"kind": "dynamic", "theta": 0.3}
    assert parse_config(raw, resolve=False).schedule.theta == 0.3  # sandblaster's


PIPELINE_JOB = """
[job]
name = "{name}"
mode = "pipeline"
seed = 1
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"
kwargs = {{ sizes = [64, 32, 10] }}

[data]
dataset = "digits"
n_train = 1400
n_test = 397
batch_size = 16

[optimizer]
name = "adam"
lr = 0.001

[pipeline]
groups = [[0, 1], [2]]
method = "dni"

[stop]
max_epochs = 4
max_seconds = 300

[eval]
every_seconds = 1.0

[schedule]
kind = "stepwise"
end = 128
every_epochs = 1.0
"""


def test_a_pipeline_job_trains_on_the_batches_its_schedule_grows(jobs: Jobs) -> None:
    doc = finished(jobs, "pipeline", "trained 4 epochs")
    grown = [(e["epoch"], e["position"], e["batch_size"]) for e in doc["events"] if e["kind"] == "batch_size"]
    assert grown == [(0, 0, 16), (1, 0, 32), (2, 0, 64), (3, 0, 128)]
    # every batch reached the last stage, which steps once per batch: 88 + 44 + 22 + 11 batches, not 4 x 88
    assert doc["metrics"]["stage1_steps"] == sum(-(-1400 // size) for size in (16, 32, 64, 128))
    assert doc["samples"] == 4 * 1400


def test_a_pipeline_grows_its_batch_when_the_norm_test_at_its_last_stage_fails(jobs: Jobs) -> None:
    doc = finished(jobs, "pipeline_dynamic", "trained 4 epochs")
    sizes = [e["batch_size"] for e in doc["events"] if e["kind"] == "batch_size"]
    assert sizes[0] == 16 and len(sizes) >= 2, sizes  # the first batch's size, then at least one growth
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes) and sizes[-1] <= 256
    assert doc["metrics"]["stage1_steps"] < 4 * -(-1400 // 16)  # fewer, larger batches than 16 throughout
    assert doc["samples"] == 4 * 1400


SANDBLASTER_JOB = """
[job]
name = "{name}"
mode = "sandblaster"
seed = 1
output_dir = "{out}"

[model]
factory = "dniasync.train.models:mlp"
kwargs = {{ sizes = [64, 32, 10] }}

[data]
dataset = "digits"
n_train = 1400
n_test = 397

[sandblaster]
n_replicas = 2
n_ps_shards = 2
max_iterations = 40
tolerance_grad = 0.0
tolerance_change = 0.0
portion_size = 100

[stop]
max_epochs = 1000
max_seconds = 300

[eval]
every_seconds = 1.0

[schedule]
kind = "stepwise"
start = 150
end = 1400
every_epochs = 2.0
"""


def test_sandblaster_takes_its_loss_on_a_sample_that_grows_with_the_schedule(jobs: Jobs) -> None:
    doc = finished(jobs, "sandblaster", "L-BFGS stopped: max_iterations")
    m = doc["metrics"]
    changes = [tuple(int(v) for v in pair.split(":")) for pair in m["sample_sizes"].split(",")]
    # 150, 300, 600, 1200, 2400 in whole portions of 100 (150 rounds up), at most the 1,400 training examples;
    # doubling every 2 epochs of 1,400 examples
    assert [size for _, size in changes] == [200, 300, 600, 1200, 1400]
    iterations = [i for i, _ in changes]
    assert iterations[0] == 0 and iterations == sorted(iterations) and iterations[-1] <= 40
    assert [(e["iteration"], e["batch_size"]) for e in doc["events"] if e["kind"] == "batch_size"] == changes
    # the loss was taken on the samples: fewer examples than every evaluation over the whole training set
    assert doc["samples"] < m["evaluations"] * 1400
    assert m["sample_size"] == 1400 and m["iterations"] == 40


def test_sandblaster_grows_its_sample_when_the_norm_test_on_its_portions_fails(jobs: Jobs) -> None:
    doc = finished(jobs, "sandblaster_dynamic", "L-BFGS stopped: max_iterations")
    m = doc["metrics"]
    changes = [tuple(int(v) for v in pair.split(":")) for pair in m["sample_sizes"].split(",")]
    sizes = [size for _, size in changes]
    # the test runs on scalars: each portion's squared gradient norm and g·g from the shards
    assert sizes[0] == 200 and len(sizes) >= 2 and sizes == sorted(sizes) and sizes[-1] <= 1400
    assert all(size % 100 == 0 or size == 1400 for size in sizes)  # whole portions
    assert [(e["iteration"], e["batch_size"]) for e in doc["events"] if e["kind"] == "batch_size"] == changes
