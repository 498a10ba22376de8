"""Metric families: how a subsystem declares them, and the helpers its collector fills them with."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)

__all__ = ["Families", "MetricDef", "add_sample", "cumulative_buckets"]


@dataclass(frozen=True)
class MetricDef:
    """One metric: its full exposed name, type, help text and (bounded) label names."""

    name: str
    kind: str  # counter | gauge | histogram | summary
    help: str
    labels: tuple[str, ...] = ()

    def family(self) -> Metric:
        """An empty family of this metric, for one scrape."""
        labels = list(self.labels)
        if self.kind == "counter":
            return CounterMetricFamily(self.name, self.help, labels=labels)
        if self.kind == "gauge":
            return GaugeMetricFamily(self.name, self.help, labels=labels)
        if self.kind == "histogram":
            return HistogramMetricFamily(self.name, self.help, labels=labels)
        return SummaryMetricFamily(self.name, self.help, labels=labels)

    def single(self, value: float) -> Metric:
        """This (unlabelled counter or gauge) metric with one sample."""
        family = self.family()
        add_sample(family, [], value)
        return family

    def labelled(self, values: Iterable[tuple[Sequence[str], float]]) -> Metric:
        """This counter or gauge with one sample per ``(label values, value)``."""
        family = self.family()
        for labels, value in values:
            add_sample(family, list(labels), value)
        return family


class Families:
    """The metric families one subsystem declares, in declaration order (the README's order).

    ::

        FAMILIES = Families()
        STEPS = FAMILIES.counter("dniasync_replica_steps_total", "Optimizer steps run by replicas.")
    """

    def __init__(self) -> None:
        self._defs: list[MetricDef] = []

    def counter(self, name: str, help: str, *labels: str) -> MetricDef:
        return self._declare(MetricDef(name, "counter", help, labels))

    def gauge(self, name: str, help: str, *labels: str) -> MetricDef:
        return self._declare(MetricDef(name, "gauge", help, labels))

    def histogram(self, name: str, help: str, *labels: str) -> MetricDef:
        return self._declare(MetricDef(name, "histogram", help, labels))

    def summary(self, name: str, help: str, *labels: str) -> MetricDef:
        return self._declare(MetricDef(name, "summary", help, labels))

    def _declare(self, defn: MetricDef) -> MetricDef:
        self._defs.append(defn)
        return defn

    def __iter__(self) -> Iterator[MetricDef]:
        return iter(self._defs)


def add_sample(family: Metric, labels: list[str], value: float) -> None:
    """Add one sample to a counter or gauge family."""
    assert isinstance(family, (CounterMetricFamily, GaugeMetricFamily))
    family.add_metric(labels, value)


def cumulative_buckets(bounds: Sequence[float], counts: Sequence[float]) -> list[tuple[str, float]]:
    """Per-bucket counts (the last one open) -> Prometheus's cumulative ``(le, count)`` pairs."""
    out: list[tuple[str, float]] = []
    total = 0.0
    for bound, count in zip(bounds, counts):
        total += count
        out.append((str(float(bound)), total))
    out.append(("+Inf", total + sum(counts[len(bounds):])))
    return out
