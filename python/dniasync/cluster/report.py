"""The run summary: held-out eval history, events, traffic, written as JSON and a PNG.

The coordinator owns one :class:`RunReport`. It appends an :class:`EvalPoint`
after every held-out evaluation and an :class:`Event` for anything a reader of
the run should know about (a replica failed, its shard was reassigned, a
replica joined), and adds up the bytes pushed to and pulled from the PS
shards. Times are wall-clock seconds since the run started, supplied by the
caller. The JSON holds plain types only (non-finite losses become ``null``)
and :func:`load_summary` reads it back.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import numpy as np

__all__ = [
    "EVENT_BATCH_SIZE",
    "EVENT_PS_RESTARTED",
    "EVENT_REPLICA_FAILED",
    "EVENT_REPLICA_JOINED",
    "EVENT_SHARD_REASSIGNED",
    "FINAL_WEIGHTS_FILE",
    "SUMMARY_FORMAT",
    "EvalPoint",
    "Event",
    "ReportError",
    "RunReport",
    "load_summary",
    "plot_reports",
]

SUMMARY_FORMAT: Final = 1
FINAL_WEIGHTS_FILE: Final = "final_weights.safetensors"
FILTERS_FILE: Final = "filters.png"
MAX_FILTERS: Final = 16
"""Filters drawn per row of a filters PNG."""
"""The model's weights at the last evaluation (state-dict names), beside the summary when the mode gives them."""

EVENT_REPLICA_FAILED: Final = "replica_failed"
EVENT_SHARD_REASSIGNED: Final = "shard_reassigned"
EVENT_REPLICA_JOINED: Final = "replica_joined"
EVENT_PS_RESTARTED: Final = "ps_restarted"
EVENT_BATCH_SIZE: Final = "batch_size"
"""A worker's mini-batch changed size (a ``[schedule]``)."""

Scalar = str | int | float | bool | None


class ReportError(ValueError):
    """A record would break the report's invariants, or a summary file is malformed."""


@dataclass(frozen=True)
class EvalPoint:
    """One held-out evaluation."""

    wall_s: float
    samples: int
    accuracy: float
    loss: float

    def to_dict(self) -> dict[str, Any]:
        """Plain data; a non-finite loss becomes None."""
        return {
            "wall_s": self.wall_s,
            "samples": self.samples,
            "accuracy": self.accuracy,
            "loss": self.loss if math.isfinite(self.loss) else None,
        }


@dataclass(frozen=True)
class Event:
    """Something that happened during the run, with plain-valued details."""

    wall_s: float
    kind: str
    details: Mapping[str, Scalar] = field(default_factory=lambda: MappingProxyType({}))

    def to_dict(self) -> dict[str, Any]:
        """Plain data."""
        return {"wall_s": self.wall_s, "kind": self.kind, **self.details}


def _check_scalar(name: str, value: object) -> Scalar:
    if value is None or isinstance(value, str | int | bool):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise ReportError(f"{name} must be a str, int, finite float, bool or None, got {value!r}")


class RunReport:
    """Append-only record of one training run."""

    def __init__(
        self,
        job: str,
        mode: str,
        *,
        target_accuracy: float | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.job = job
        self.mode = mode
        self.target_accuracy = target_accuracy
        # Round-tripped through JSON now so a non-plain config fails here, not at write time.
        self.config: dict[str, Any] = json.loads(json.dumps(config or {}, allow_nan=False))
        self._history: list[EvalPoint] = []
        self._events: list[Event] = []
        self._metrics: dict[str, Scalar] = {}
        self.bytes_pushed = 0
        self.bytes_pulled = 0
        self.wall_s = 0.0
        self.samples = 0
        self.stop_reason: str | None = None
        self._final_weights: dict[str, Any] = {}

    # ---------------------------------------------------------------- recording

    def record_eval(self, wall_s: float, samples: int, accuracy: float, loss: float) -> EvalPoint:
        """Append one evaluation; time and samples may not go backwards. One dated as the last one (both
        scored after the stop, when time and samples stand still) replaces it: its weights were taken later."""
        if not (math.isfinite(wall_s) and wall_s >= 0):
            raise ReportError(f"wall_s must be a finite number >= 0, got {wall_s}")
        if samples < 0:
            raise ReportError(f"samples must be >= 0, got {samples}")
        if not 0.0 <= accuracy <= 1.0:
            raise ReportError(f"accuracy must be in [0, 1], got {accuracy}")
        if self._history:
            last = self._history[-1]
            if wall_s < last.wall_s or samples < last.samples:
                raise ReportError(
                    f"eval at {wall_s} s / {samples} samples is before the last one "
                    f"({last.wall_s} s / {last.samples} samples)"
                )
        point = EvalPoint(float(wall_s), int(samples), float(accuracy), float(loss))
        if self._history and (self._history[-1].wall_s, self._history[-1].samples) == (point.wall_s, point.samples):
            self._history[-1] = point  # the same date (both after the stop): the later weights replace the earlier
        else:
            self._history.append(point)
        self.wall_s = max(self.wall_s, point.wall_s)
        self.samples = max(self.samples, point.samples)
        return point

    def record_event(self, wall_s: float, kind: str, **details: Scalar) -> Event:
        """Append an event such as :data:`EVENT_REPLICA_FAILED` with plain-valued details."""
        if not (math.isfinite(wall_s) and wall_s >= 0):
            raise ReportError(f"wall_s must be a finite number >= 0, got {wall_s}")
        if not kind:
            raise ReportError("event kind must not be empty")
        clean = {k: _check_scalar(f"event detail {k!r}", v) for k, v in details.items()}
        for reserved in ("wall_s", "kind"):
            if reserved in clean:
                raise ReportError(f"event detail may not be called {reserved!r}")
        event = Event(float(wall_s), kind, MappingProxyType(clean))
        self._events.append(event)
        self.wall_s = max(self.wall_s, event.wall_s)
        return event

    def add_bytes(self, *, pushed: int = 0, pulled: int = 0) -> None:
        """Count payload bytes pushed to and pulled from the PS shards."""
        if pushed < 0 or pulled < 0:
            raise ReportError(f"byte counts must be >= 0, got pushed={pushed} pulled={pulled}")
        self.bytes_pushed += pushed
        self.bytes_pulled += pulled

    def set_metric(self, name: str, value: Scalar) -> None:
        """Set a named run-level number (samples/s, pushes dropped, ...); last value wins."""
        self._metrics[name] = _check_scalar(f"metric {name!r}", value)

    def set_final_weights(self, arrays: Mapping[str, Any]) -> None:
        """The evaluated model's final weights (state-dict name -> numpy array), for :data:`FINAL_WEIGHTS_FILE`."""
        self._final_weights = dict(arrays)

    def finish(self, wall_s: float, samples: int, reason: str) -> None:
        """Record the run's end: total time, total samples, why it stopped."""
        if wall_s < self.wall_s or samples < self.samples:
            raise ReportError(
                f"finish at {wall_s} s / {samples} samples is before the last record "
                f"({self.wall_s} s / {self.samples} samples)"
            )
        self.wall_s, self.samples, self.stop_reason = float(wall_s), int(samples), reason

    # ---------------------------------------------------------------- reading

    @property
    def history(self) -> tuple[EvalPoint, ...]:
        """Evaluations in the order recorded."""
        return tuple(self._history)

    @property
    def events(self) -> tuple[Event, ...]:
        """Events in the order recorded."""
        return tuple(self._events)

    @property
    def metrics(self) -> Mapping[str, Scalar]:
        """Run-level numbers set with :meth:`set_metric`."""
        return MappingProxyType(self._metrics)

    def best_accuracy(self) -> float | None:
        """Highest held-out accuracy seen, or None before any evaluation."""
        return max((p.accuracy for p in self._history), default=None)

    def first_reaching(self, accuracy: float) -> EvalPoint | None:
        """The first evaluation at or above ``accuracy``."""
        return next((p for p in self._history if p.accuracy >= accuracy), None)

    def accuracy_at_samples(self, samples: int) -> float | None:
        """Accuracy of the last evaluation taken with at most ``samples`` seen."""
        before = [p for p in self._history if p.samples <= samples]
        return before[-1].accuracy if before else None

    # ---------------------------------------------------------------- output

    def to_dict(self) -> dict[str, Any]:
        """The summary as plain JSON-ready data."""
        final = self._history[-1] if self._history else None
        target = self.first_reaching(self.target_accuracy) if self.target_accuracy else None
        return {
            "format": SUMMARY_FORMAT,
            "job": self.job,
            "mode": self.mode,
            "stop_reason": self.stop_reason,
            "wall_s": self.wall_s,
            "samples": self.samples,
            "samples_per_s": self.samples / self.wall_s if self.wall_s > 0 else None,
            "final_accuracy": final.accuracy if final else None,
            "final_loss": final.to_dict()["loss"] if final else None,
            "best_accuracy": self.best_accuracy(),
            "target_accuracy": self.target_accuracy,
            "time_to_target_s": target.wall_s if target else None,
            "samples_to_target": target.samples if target else None,
            "bytes_pushed": self.bytes_pushed,
            "bytes_pulled": self.bytes_pulled,
            "metrics": dict(self._metrics),
            "history": [p.to_dict() for p in self._history],
            "events": [e.to_dict() for e in self._events],
            "config": self.config,
        }

    def write_summary(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` as JSON atomically (temp file, fsync, rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    def plot(self, path: str | Path) -> Path:
        """PNG of held-out accuracy and loss against wall time (see :func:`plot_reports`)."""
        return plot_reports([self], path)

    def write_outputs(self, out_dir: str | Path) -> Path:
        """A job's outputs in ``out_dir``: ``summary.json``, ``accuracy.png``, and with final weights set,
        those (``final_weights.safetensors``) and, where the first layer's weights make images (a conv
        layer, or a linear layer over a square image), ``filters.png``; the summary's path."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.plot(out / "accuracy.png")
        if self._final_weights:
            import safetensors.numpy

            tmp = out / f".{FINAL_WEIGHTS_FILE}.tmp"
            safetensors.numpy.save_file(self._final_weights, str(tmp))
            tmp.replace(out / FINAL_WEIGHTS_FILE)
            filters = first_layer({k: np.asarray(v) for k, v in self._final_weights.items()})
            if filters is not None:
                plot_filter_rows([(f"{self.job} ({self.mode})", filters[:MAX_FILTERS])], out / FILTERS_FILE)
        return self.write_summary(out / "summary.json")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunReport:
        """Rebuild a report from :meth:`to_dict` output."""
        try:
            if data["format"] != SUMMARY_FORMAT:
                raise ReportError(f"summary format {data['format']!r}, expected {SUMMARY_FORMAT}")
            report = cls(
                data["job"], data["mode"],
                target_accuracy=data["target_accuracy"], config=data["config"],
            )
            for p in data["history"]:
                loss = math.nan if p["loss"] is None else p["loss"]
                report.record_eval(p["wall_s"], p["samples"], p["accuracy"], loss)
            for e in data["events"]:
                details = {k: v for k, v in e.items() if k not in ("wall_s", "kind")}
                report.record_event(e["wall_s"], e["kind"], **details)
            report.add_bytes(pushed=data["bytes_pushed"], pulled=data["bytes_pulled"])
            for name, value in data["metrics"].items():
                report.set_metric(name, value)
            report.wall_s, report.samples = float(data["wall_s"]), int(data["samples"])
            report.stop_reason = data["stop_reason"]
        except (KeyError, TypeError, AttributeError) as e:
            raise ReportError(f"malformed summary: {e!r}") from None
        return report


def load_summary(path: str | Path) -> RunReport:
    """Read a summary JSON written by :meth:`RunReport.write_summary`."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path}: summary must be a JSON object")
    return RunReport.from_dict(data)


def first_layer(weights: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """The first layer's filters as images (filters, height, width): a conv layer's kernels (mean over input
    channels), or a linear layer's rows when its inputs make a square image; None otherwise."""
    for name, w in weights.items():
        if not name.endswith("weight"):
            continue
        if w.ndim == 4:
            return np.asarray(w.mean(axis=1))
        if w.ndim == 2:
            side = math.isqrt(w.shape[1])
            return np.asarray(w.reshape(w.shape[0], side, side)) if side * side == w.shape[1] else None
        return None
    return None


def plot_filter_rows(rows: Sequence[tuple[str, np.ndarray]], path: str | Path) -> Path:
    """A PNG of first-layer filters: a row per (label, filters (n, height, width)), each filter scaled to its
    own range (red +, blue -). The job's ``filters.png``, and ``compare``'s with a row per method."""
    from matplotlib.figure import Figure

    cols = max(len(f) for _, f in rows)
    fig = Figure(figsize=(1.0 * cols + 2.2, 1.1 * len(rows) + 0.6))
    axes: Any = fig.subplots(len(rows), cols, squeeze=False)
    for i, (label, filters) in enumerate(rows):
        for j in range(cols):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            if j < len(filters):
                f = filters[j]
                scale = float(np.abs(f).max()) or 1.0
                ax.imshow(f, cmap="RdBu_r", vmin=-scale, vmax=scale, interpolation="nearest")
            else:
                ax.axis("off")
        axes[i][0].set_ylabel(label, rotation=0, ha="right", va="center", fontsize="small")
    fig.suptitle("first-layer filters at the end of training (each scaled to its own range; red +, blue -)")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=80, format="png")
    return out


def plot_reports(
    reports: Sequence[RunReport], path: str | Path, labels: Sequence[str] | None = None
) -> Path:
    """One PNG: held-out accuracy (top) and loss (bottom) against wall time, a line per run.

    Dotted vertical lines mark each run's events; a dashed line marks the target accuracy.
    """
    # A bare Figure renders through the Agg canvas without pyplot's global state or backend.
    from matplotlib.figure import Figure

    if labels is not None and len(labels) != len(reports):
        raise ReportError(f"{len(labels)} labels for {len(reports)} reports")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(7, 6))
    ax_acc, ax_loss = fig.subplots(2, 1, sharex=True)
    targets: set[float] = set()
    for i, report in enumerate(reports):
        label = labels[i] if labels is not None else report.job
        times = [p.wall_s for p in report.history]
        (line,) = ax_acc.plot(times, [p.accuracy for p in report.history], marker=".", label=label)
        ax_loss.plot(times, [p.loss for p in report.history], marker=".", color=line.get_color())
        for event in report.events:  # failures and reassignments, where they happened
            for ax in (ax_acc, ax_loss):
                ax.axvline(event.wall_s, color=line.get_color(), linestyle=":", linewidth=1)
        if report.target_accuracy is not None:
            targets.add(report.target_accuracy)
    for target in sorted(targets):
        ax_acc.axhline(target, color="grey", linestyle="--", linewidth=1)
    ax_acc.set_ylabel("held-out accuracy")
    ax_acc.grid(alpha=0.3)
    ax_acc.legend(loc="lower right")
    ax_loss.set_ylabel("held-out loss")
    ax_loss.set_xlabel("wall time (s)")
    ax_loss.grid(alpha=0.3)
    fig.suptitle(reports[0].job if len(reports) == 1 else f"{len(reports)} runs")
    fig.tight_layout()
    fig.savefig(path, dpi=100, format="png")
    return path
