"""The run summary records evaluations, events and traffic, and writes plain JSON and a PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from dniasync.cluster.report import (
    EVENT_REPLICA_FAILED,
    EVENT_SHARD_REASSIGNED,
    ReportError,
    RunReport,
    load_summary,
    plot_reports,
)


def _run() -> RunReport:
    report = RunReport("downpour_mnist", "downpour", target_accuracy=0.9, config={"job": {"seed": 0}})
    report.record_eval(1.0, 640, 0.62, 1.40)
    report.record_eval(2.0, 1280, 0.85, 0.60)
    report.record_event(2.5, EVENT_REPLICA_FAILED, replica=1, incarnation=0, reason="SIGKILL")
    report.record_event(2.6, EVENT_SHARD_REASSIGNED, shard=1, to_replica=0, epoch=1, position=96)
    report.record_eval(3.0, 1920, 0.91, 0.31)
    report.record_eval(4.0, 2560, 0.93, 0.25)
    report.add_bytes(pushed=1000, pulled=4000)
    report.add_bytes(pushed=24)
    report.set_metric("pushes_dropped_stale", 3)
    report.finish(4.5, 2600, "target_accuracy")
    return report


def test_summary_json_has_history_events_bytes_and_target(tmp_path: Path) -> None:
    path = _run().write_summary(tmp_path / "out" / "summary.json")
    data = json.loads(path.read_text())
    assert data["history"][1] == {"wall_s": 2.0, "samples": 1280, "accuracy": 0.85, "loss": 0.6}
    assert len(data["history"]) == 4
    assert data["events"][0] == {
        "wall_s": 2.5, "kind": "replica_failed", "replica": 1, "incarnation": 0, "reason": "SIGKILL",
    }
    assert data["events"][1]["kind"] == "shard_reassigned" and data["events"][1]["to_replica"] == 0
    assert (data["bytes_pushed"], data["bytes_pulled"]) == (1024, 4000)
    assert data["time_to_target_s"] == 3.0 and data["samples_to_target"] == 1920
    assert data["final_accuracy"] == 0.93 and data["best_accuracy"] == 0.93
    assert data["wall_s"] == 4.5 and data["samples"] == 2600
    assert data["samples_per_s"] == pytest.approx(2600 / 4.5)
    assert data["stop_reason"] == "target_accuracy"
    assert data["metrics"] == {"pushes_dropped_stale": 3}
    assert data["config"] == {"job": {"seed": 0}}
    assert [p.name for p in path.parent.iterdir()] == ["summary.json"]  # no temp file left


def test_summary_round_trips_through_load(tmp_path: Path) -> None:
    report = _run()
    report.record_eval(5.0, 2700, 0.5, math.inf)  # a diverged loss is written as null
    path = report.write_summary(tmp_path / "s.json")
    assert "Infinity" not in path.read_text()
    loaded = load_summary(path)
    assert loaded.to_dict() == report.to_dict()
    assert loaded.accuracy_at_samples(2000) == 0.91 and loaded.accuracy_at_samples(10) is None


def test_no_target_and_no_history() -> None:
    data = RunReport("j", "hogwild").to_dict()
    assert data["history"] == [] and data["time_to_target_s"] is None
    assert data["final_accuracy"] is None and data["samples_per_s"] is None


def test_an_evaluation_dated_as_the_last_one_replaces_it() -> None:
    # after the stop time and samples stand still: a closing evaluation of the final weights (taken after the one
    # in flight, whose weights were asked for before the last samples) has the same date and is the one kept
    report = _run()
    report.record_eval(4.5, 2600, 0.930, 0.25)
    report.record_eval(4.5, 2600, 0.931, 0.24)
    rows = report.to_dict()["history"]
    assert [(r["wall_s"], r["samples"], r["accuracy"]) for r in rows[-2:]] == [(4.0, 2560, 0.93), (4.5, 2600, 0.931)]
    assert report.to_dict()["final_accuracy"] == 0.931


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (lambda r: r.record_eval(1.5, 2000, 0.9, 0.1), "before the last one"),
        (lambda r: r.record_eval(5.0, 100, 0.9, 0.1), "before the last one"),
        (lambda r: r.record_eval(5.0, 3000, 1.2, 0.1), "accuracy must be in \\[0, 1\\]"),
        (lambda r: r.record_eval(-1.0, 3000, 0.5, 0.1), "wall_s must be"),
        (lambda r: r.record_event(5.0, "x", blob=[1, 2]), "event detail 'blob'"),
        (lambda r: r.record_event(5.0, "x", value=math.nan), "finite float"),
        (lambda r: r.record_event(5.0, ""), "kind must not be empty"),
        (lambda r: r.add_bytes(pushed=-1), "byte counts must be >= 0"),
        (lambda r: r.finish(1.0, 10, "early"), "before the last record"),
        (lambda r: r.set_metric("m", {"a": 1}), "metric 'm'"),
    ],
)
def test_records_are_checked(action, message: str) -> None:  # type: ignore[no-untyped-def]
    report = _run()
    before = report.to_dict()
    with pytest.raises(ReportError, match=message):
        action(report)
    assert report.to_dict() == before


def test_config_must_be_plain_data() -> None:
    with pytest.raises(TypeError):
        RunReport("j", "downpour", config={"x": object()})


def test_load_rejects_malformed_summaries(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text("[1, 2]")
    with pytest.raises(ReportError, match="JSON object"):
        load_summary(path)
    path.write_text('{"format": 1}')
    with pytest.raises(ReportError, match="malformed summary"):
        load_summary(path)
    path.write_text("{")
    with pytest.raises(ReportError, match="not JSON"):
        load_summary(path)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = _run().plot(tmp_path / "plots" / "run.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_plot_several_runs(tmp_path: Path) -> None:
    other = RunReport("threshold", "downpour")
    other.record_eval(1.0, 100, 0.5, 1.0)
    path = plot_reports([_run(), other], tmp_path / "both.png", labels=["dense", "threshold"])
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ReportError, match="1 labels for 2 reports"):
        plot_reports([_run(), other], tmp_path / "x.png", labels=["one"])


@pytest.mark.parametrize(("first", "drawn"), [((32, 784), True), ((8, 1, 5, 5), True), ((32, 64 * 3), False)])
def test_a_job_draws_its_first_layer_filters_where_they_make_images(tmp_path: Path, first: tuple[int, ...],
                                                                     drawn: bool) -> None:
    """An MLP over 28x28 digits (rows as 28x28 images) and a conv net (kernels) get ``filters.png`` beside their
    final weights; a first layer whose inputs are not a square image gets none."""
    import numpy as np

    report = _run()
    rng = np.random.default_rng(0)
    report.set_final_weights({"0.weight": rng.normal(size=first).astype(np.float32),
                              "0.bias": np.zeros(first[0], dtype=np.float32)})
    report.write_outputs(tmp_path)
    assert (tmp_path / "final_weights.safetensors").exists()
    png = tmp_path / "filters.png"
    assert png.exists() == drawn
    if drawn:
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5_000
