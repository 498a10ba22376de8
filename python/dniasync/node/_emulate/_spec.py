"""``--emulate NODES[:BANDWIDTH[:LATENCY]]``: the parsed spec and the time-dilation plan of a job."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

DEFAULT_BANDWIDTH = "1gbit"
DEFAULT_LATENCY = "0.2ms"
_RATE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(bit|kbit|mbit|gbit)$", re.IGNORECASE)
_TIME = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)(us|ms|s)$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class SpecError(ValueError):
    """A bad ``--emulate`` value; the message names the flag."""


@dataclass(frozen=True)
class EmulateSpec:
    nodes: int
    bandwidth_bps: float
    latency_s: float
    text: str

    @property
    def bandwidth(self) -> str:
        return self.text.split(":")[1] if self.text.count(":") >= 1 else DEFAULT_BANDWIDTH

    @property
    def latency(self) -> str:
        return self.text.split(":")[2] if self.text.count(":") >= 2 else DEFAULT_LATENCY


def parse_spec(text: str) -> EmulateSpec:
    """``4``, ``4:100mbit``, ``4:100mbit:5ms`` (bandwidth in bit/kbit/mbit/gbit per second, latency in us/ms/s)."""
    parts = text.split(":")
    if len(parts) > 3:
        raise SpecError(f"--emulate {text!r}: expected NODES[:BANDWIDTH[:LATENCY]], e.g. 4:100mbit:5ms")
    try:
        nodes = int(parts[0])
    except ValueError:
        raise SpecError(f"--emulate {text!r}: NODES must be a whole number, got {parts[0]!r}") from None
    if not 1 <= nodes <= 64:
        raise SpecError(f"--emulate {text!r}: NODES must be 1 to 64, got {nodes}")
    bandwidth = parts[1] if len(parts) > 1 else DEFAULT_BANDWIDTH
    match = _RATE.match(bandwidth)
    if match is None or float(match.group(1)) <= 0:
        raise SpecError(f"--emulate {text!r}: BANDWIDTH must be a positive rate such as 100mbit or 1gbit, "
                        f"got {bandwidth!r}")
    bps = float(match.group(1)) * _RATE_UNITS[match.group(2).lower()]
    if bps < 1e5:
        raise SpecError(f"--emulate {text!r}: BANDWIDTH must be at least 100kbit")
    latency = parts[2] if len(parts) > 2 else DEFAULT_LATENCY
    if latency == "0":
        seconds = 0.0
    else:
        tmatch = _TIME.match(latency)
        if tmatch is None:
            raise SpecError(f"--emulate {text!r}: LATENCY must be a time such as 5ms, 200us or 0, got {latency!r}")
        seconds = float(tmatch.group(1)) * _TIME_UNITS[tmatch.group(2).lower()]
    if seconds > 10:
        raise SpecError(f"--emulate {text!r}: LATENCY must be at most 10s")
    canonical = f"{nodes}:{bandwidth}:{latency}"
    return EmulateSpec(nodes, bps, seconds, canonical)


@dataclass(frozen=True)
class Plan:
    """How an emulated job runs on ``cores`` cores: each of its ``processes`` is a node of one core,
    held to ``cpu_share`` of a core, so the job runs ``dilation`` times slower than on real nodes and
    its links are shaped to the bandwidth / dilation and the latency x dilation."""

    spec: EmulateSpec
    processes: int
    cores: int
    detect_s: float = 3.0
    """The job's failure-detection interval (``[node] detect_s``) on real nodes."""

    @property
    def dilation(self) -> float:
        return max(1.0, self.processes / self.cores)

    @property
    def cpu_share(self) -> float:
        return min(1.0, self.cores / self.processes)

    @property
    def link_bps(self) -> float:
        return self.spec.bandwidth_bps / self.dilation

    @property
    def delay_s(self) -> float:
        return self.spec.latency_s * self.dilation

    @property
    def detect_after_s(self) -> float:
        """The detection interval the processes get: dilated too, so a node is declared down after the
        same emulated silence (a process on a fifth of a core answers heartbeats five times later)."""
        return self.detect_s * self.dilation

    def describe(self) -> dict[str, Any]:
        """The summary's ``emulation`` block."""
        return {
            "spec": self.spec.text,
            "nodes": self.spec.nodes,
            "processes": self.processes,
            "cores": self.cores,
            "cpu_share": self.cpu_share,
            "dilation": self.dilation,
            "bandwidth_bps": self.spec.bandwidth_bps,
            "latency_s": self.spec.latency_s,
            "shaped_bandwidth_bps": self.link_bps,
            "added_delay_s": self.delay_s,
            "detect_s": self.detect_after_s,
            "times": f"wall_s, samples_per_s, time_to_target_s and every history/event wall_s are divided "
                     f"by the dilation {self.dilation:g} (measured_wall_s is the clock's)",
        }
