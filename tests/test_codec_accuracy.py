"""Compression both ways keeps the accuracy of uncompressed training (issue #26).

Real Downpour jobs through the launcher (coordinator, 2 PS shards and 4 replicas,
each its own process) on mnist5k: the threshold codec at several push ``tau`` with
every other key default, against ``codec = "none"`` (see below). The default threshold of the
pulled parameter deltas used to be ``tau`` itself: with tau 0.2 each pull moved a
replica's weights in steps of 0.2 and it trained on a copy far from the shard's
(58% held out after 3 epochs, 70% after 8, against 92%). It is now 10% of the
shard's parameter RMS (:class:`~dniasync.train.compression.DeltaCodec`).

Measured on a 2-core machine shared with other jobs (10 epochs, final held-out
accuracy; bytes pulled against the same pulls dense; the last column: the
same pushes, every pull dense):

========  ==========================  ============  ===================
codec     accuracy                    pulled bytes  dense pulls
========  ==========================  ============  ===================
none      0.905 0.922 0.925 0.927     1x
tau 0.01  0.905 0.915 0.928 0.917     1/18
tau 0.05  0.928 0.926 0.921 0.919     1/21
tau 0.2   0.910 0.902 0.908 0.904     1/38          0.899 0.899
========  ==========================  ============  ===================

(On a faster host since, tau 0.01 ends further under: see :data:`SMALL_TAU_MARGIN`.)
The bar is 3 points under the reference, each run scored by the mean of its last 3 evaluations (the spread between runs of one setting
reaches 2). tau 0.01, 0.02 (the example's) and 0.05 are held against uncompressed. tau 0.2 ends 2-3
points under uncompressed with any pulls, the cost of its pushes (1,600x fewer
bytes pushed), so it is held against the same pushes with every pull dense
(``resync_every = 1``): what the pulled deltas cost. Under the old default
(``delta_tau = tau``) tau 0.05 ended 8 points short (3 epochs) and tau 0.2 over
20 (0.705 after 8 epochs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _jobs import run_job
from dniasync.train.compression import AUTO_DELTA_TAU_FRACTION, DeltaCodec

JOB = """
[job]
name = "{name}"
mode = "downpour"
seed = 0
output_dir = "{out}"

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
n_replicas = 4
n_ps_shards = 2
{codec}

[stop]
max_epochs = 10
max_seconds = 240

[eval]
every_steps = 125
"""

N_PARAMS = 784 * 64 + 64 + 64 * 10 + 10
MARGIN = 0.03
"""How far under the uncompressed run's held-out accuracy a compressed run may end."""
SMALL_TAU_MARGIN = 0.05
"""The same for tau 0.01, which costs more than the larger ones: each push moves an element by at most tau, so
Adagrad's large first gradients take the most pushes to arrive. Measured on an "AMD EPYC" host (10 runs of each,
two test files at a time; mean of the last 3 evaluations): none 0.915-0.927, tau 0.01 0.888-0.908 (1.2-3.8 points
under the run beside it, median 2.8), tau 0.02 (the example's) 0.909-0.923, tau 0.05 0.921-0.929. 5 points: above
the measured gaps; the bug this test was written for cost 8-20."""
LAST_ROWS = 3
"""Each run's accuracy is the mean of its last evaluations (one an epoch: every 125 steps of the 4 replicas
together, so the rows compared are at the same points of training in every run): a single asynchronous run's last
row moves by a point or two from one evaluation to the next (a CI run under load: 0.900 against 0.931). One a
second, as before, made the rows depend on the machine's speed: a 10-epoch job takes 2-3 s, and a CI run compared
one run's rows at 26,824 / 39,984 / 41,792 samples (0.884) with the other's at 23,208 / 37,336 / 41,216 (0.918)."""


def end_accuracy(doc: dict[str, Any]) -> float:
    """The mean held-out accuracy of a run's last ``LAST_ROWS`` evaluations, the final one included."""
    rows = [row["accuracy"] for row in doc["history"]][-LAST_ROWS:]
    assert rows and rows[-1] == doc["final_accuracy"], doc["history"]
    return float(np.mean(rows))


def run_codec_job(tmp_path: Path, name: str, codec: str) -> dict[str, Any]:
    doc, _ = run_job(tmp_path, name, JOB, codec=codec)
    assert doc["stop_reason"] == "trained 10 epochs", doc["stop_reason"]
    return doc


REFERENCES = {
    "none": 'codec = "none"',
    "dense pulls, tau 0.2": 'codec = "threshold"\ntau = 0.2\nresync_every = 1',
}
"""What each compressed run is held against: uncompressed, or (where the pushes' own quantization costs more
than the margin) the same pushes with every pull dense, which isolates what the pulled deltas cost."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    done: dict[str, dict[str, Any]] = {}

    def run(kind: str) -> dict[str, Any]:
        if kind not in done:
            done[kind] = run_codec_job(tmp_path_factory.mktemp("reference"), "reference", REFERENCES[kind])
        return done[kind]
    return run


@pytest.mark.parametrize(("tau", "against", "margin"), [
    (0.01, "none", SMALL_TAU_MARGIN), (0.02, "none", MARGIN), (0.05, "none", MARGIN),
    (0.2, "dense pulls, tau 0.2", MARGIN)])
def test_threshold_both_ways_keeps_the_accuracy_of_dense_pulls_with_fewer_bytes(
        tmp_path: Path, reference: Any, tau: float, against: str, margin: float) -> None:
    doc = run_codec_job(tmp_path, f"threshold_{tau}", f'codec = "threshold"\ntau = {tau}')
    ref = reference(against)
    assert end_accuracy(doc) >= end_accuracy(ref) - margin, (
        f"tau {tau}: {end_accuracy(doc):.3f} against {end_accuracy(ref):.3f} ({against}), over the last "
        f"{LAST_ROWS} evaluations")
    metrics = doc["metrics"]
    # both shards answered deltas, most pulls; what those pulls would have taken dense (the shards hold halves)
    pulls = [metrics[f"ps{k}_dense_pulls"] + metrics[f"ps{k}_delta_pulls"] for k in (0, 1)]
    assert all(metrics[f"ps{k}_delta_pulls"] > 0.9 * pulls[k] for k in (0, 1)), metrics
    dense_pulled = sum(pulls) * 4 * (N_PARAMS // 2)
    assert 0 < doc["bytes_pulled"] < dense_pulled / 5, (doc["bytes_pulled"], dense_pulled)
    assert 0 < doc["bytes_pushed"] < metrics["dense_bytes_pushed"] / 10


# -- the default threshold itself, without processes --------------------------------------------------------------

def test_the_default_delta_threshold_is_a_tenth_of_the_parameter_rms_whatever_their_scale() -> None:
    rng = np.random.default_rng(0)
    n = 5000
    known = rng.normal(0, 0.02, n).astype(np.float32)
    current = known.copy()
    moved = rng.choice(n, 200, replace=False)
    current[moved] += rng.normal(0, 0.01, moved.size).astype(np.float32)
    shard, replica = DeltaCodec("threshold", n), DeltaCodec("threshold", n)
    for scale in (1.0, 1000.0):  # the same weights in other units: the same codes, the threshold scaled
        c, k = current * np.float32(scale), known * np.float32(scale)
        tau = shard.threshold_for(c)
        assert tau == pytest.approx(AUTO_DELTA_TAU_FRACTION * float(np.sqrt(np.mean(c.astype(np.float64) ** 2))),
                                    rel=1e-5)
        coded = shard.encode(c - k, tau)
        assert coded is not None and coded[0] == "threshold"
        parts = coded[1]
        assert 0 < sum(p.nbytes for p in parts) < c.nbytes / 4
        if scale == 1.0:
            first = [p.copy() for p in parts]
        else:
            assert all(np.array_equal(a, b) for a, b in zip(first, parts, strict=True))
        k_shard, k_replica = k.copy(), k.copy()
        k_shard += shard.decode(parts, tau)
        k_replica += replica.decode(parts, tau)  # the replica decodes with the value the answer carries
        np.testing.assert_array_equal(k_shard, k_replica)
        assert np.abs(c - k_shard).max() < tau * (1 + 1e-5)

    fixed = DeltaCodec("threshold", n, tau=0.2)  # an explicit delta_tau still wins
    assert fixed.threshold_for(current) == 0.2
    empty = fixed.encode(current - known, 0.2)  # nothing moved by 0.2: an empty delta
    assert empty is not None and empty[0] == "threshold" and sum(p.nbytes for p in empty[1]) == 0
    # parameters all zero (a shard of zero-initialised biases): no scale to take a threshold from, so dense
    zeros = np.zeros(n, dtype=np.float32)
    assert shard.threshold_for(zeros) == 0.0 and shard.encode(current, 0.0) is None


def test_a_threshold_delta_costs_five_bytes_per_moved_element_and_falls_back_to_int8_when_that_is_smaller() -> None:
    """An element that moved k thresholds is one index and one count (int8; int16 past 127); where most elements
    moved (early training), the int8 answer (a byte each, a quarter of a dense copy) is the smaller one."""
    rng = np.random.default_rng(3)
    n, tau = 10_000, 0.01
    shard, replica = DeltaCodec("threshold", n, tau=tau), DeltaCodec("threshold", n, tau=tau)
    for moved, scale, codec, width in ((500, 0.05, "threshold", 1), (500, 2.0, "threshold", 2),
                                       (n, 0.05, "int8", None)):
        diff = np.zeros(n, dtype=np.float32)
        hit = rng.choice(n, moved, replace=False)
        diff[hit] = rng.normal(0, scale, moved).astype(np.float32) + np.sign(rng.normal(size=moved)) * tau
        coded = shard.encode(diff, tau)
        assert coded is not None and coded[0] == codec
        name, parts = coded
        size = sum(p.nbytes for p in parts)
        if width is not None:
            reached = int((np.abs(diff) >= tau).sum())
            assert size == reached * (4 + width)
        else:
            assert size < n + 4 * (n // 256 + 1) + 1 < 4 * n / 3
        got_shard, got_replica = shard.decode(parts, tau, name), replica.decode(parts, tau, name)
        np.testing.assert_array_equal(got_shard, got_replica)  # both copies move alike, bit for bit
        bound = tau * (1 + 1e-5) if name == "threshold" else float(np.abs(diff).max()) / 254 * 1.001 + 1e-7
        assert np.abs(diff - got_shard).max() <= bound
