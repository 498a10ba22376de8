"""The charts of the coordinator's live page that a mode declares (``Mode.panels``).

Once a second the live page samples the running job's *figures*: the runner's
``wall_s``, ``samples``, ``bytes_pushed`` and ``bytes_pulled``; the PS shards'
``staleness_sum`` and ``staleness_count`` (when the job has shards); and every
number, or list of numbers, in the mode's status extras (``ModeJob.extra``).
A :class:`Panel` charts :class:`Line` s computed from two consecutive samples;
a list figure gives one line per member (a stage, a peer). So a mode adds a
chart by putting its counters into ``extra()`` and a ``Panel`` into
``panels()``; the page needs no change (the p2p mode, for instance: a
``consensus_distance`` number with ``per=None`` and a ``peer_bytes`` list of
byte counters per peer, charted per second).

A leaf: it imports nothing of the cluster, so the mode contract and the node both read it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BYTES", "PS_PANELS", "SAMPLES", "STALENESS", "STALENESS_HISTOGRAM", "Line", "Panel"]


@dataclass(frozen=True)
class Line:
    """One series: ``figure``'s change over ``per``'s change between two samples, times ``scale``.

    ``per="wall_s"`` makes a rate per second; ``per=None`` charts the figure as it is. A sample where ``per`` did
    not grow (or a figure is missing) leaves a gap.
    """

    name: str
    """The series' key in ``/api/status`` (and its ``data-series`` on the page)."""
    figure: str
    per: str | None = "wall_s"
    label: str = ""
    """The legend; a list figure's members are labelled ``"<label> <k>"``."""
    scale: float = 1.0


@dataclass(frozen=True)
class Panel:
    """One chart: its ``lines`` over time, or (``histogram``) the bars of the status's histogram of that name."""

    key: str
    title: str
    lines: tuple[Line, ...] = ()
    histogram: str | None = None
    """A ``{"buckets": [...], "counts": [...]}`` entry of the status (the page keeps ``staleness``)."""
    unit: str = ""
    """Appended to the panel's current value (``B/s``)."""


SAMPLES = Panel("samples", "Samples / s", (Line("samples_per_s", "samples"),))
"""Every job's throughput (the page shows it for every mode, beside accuracy and loss)."""

STALENESS = Panel("staleness", "Staleness (mean versions behind)",
                  (Line("staleness_mean", "staleness_sum", per="staleness_count"),))
BYTES = Panel("bytes", "Bytes / s", (Line("pushed_bytes_per_s", "bytes_pushed", label="gradients pushed"),
                                    Line("pulled_bytes_per_s", "bytes_pulled", label="parameters pulled")), unit="B/s")
STALENESS_HISTOGRAM = Panel("staleness_histogram", "Staleness histogram (all pushes)", histogram="staleness")
PS_PANELS = (STALENESS, BYTES, STALENESS_HISTOGRAM)
"""What a job that pushes to PS shards shows: staleness, push and pull bytes, and the staleness histogram."""
