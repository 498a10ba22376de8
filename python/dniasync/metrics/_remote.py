"""Families of the websocket transport, read through a Protocol: ``remote`` may import only ``actors``,
and metrics must not import ``remote`` (it would pull aiohttp into ``train``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

from prometheus_client.metrics_core import HistogramMetricFamily, Metric

from ._family import Families, cumulative_buckets

__all__ = ["FAMILIES", "AskLatencyStats", "RemoteCountersView", "TransportStats", "collect_remote"]

FAMILIES = Families()
REMOTE_BYTES = FAMILIES.counter("dniasync_remote_bytes_total",
                                "Websocket bytes exchanged with other nodes (direction: sent, received).", "direction")
REMOTE_FRAMES = FAMILIES.counter("dniasync_remote_frames_total",
                                 "Wire frames exchanged with other nodes (direction: sent, received).", "direction")
REMOTE_DECODE_ERRORS = FAMILIES.counter("dniasync_remote_decode_errors_total",
                                        "Frames or messages from other nodes that could not be decoded.")
REMOTE_AUTH_FAILURES = FAMILIES.counter("dniasync_remote_auth_failures_total",
                                        "Connection attempts refused by auth (either side).")
REMOTE_DROPPED_TELLS = FAMILIES.counter("dniasync_remote_dropped_tells_total",
                                        "Tells to or from other nodes dropped (peer down, actor gone).")
REMOTE_RECONNECTS = FAMILIES.counter("dniasync_remote_reconnects_total", "Reconnections to a peer after it was down.")
REMOTE_PEERS_LOST = FAMILIES.counter("dniasync_remote_peers_lost_total", "Times a peer was declared down.")
REMOTE_ACCEPTED = FAMILIES.counter("dniasync_remote_connections_accepted_total", "Websocket connections accepted.")
REMOTE_PEERS_UP = FAMILIES.gauge("dniasync_remote_peers_up", "Peers this node is connected to.")
REMOTE_PEERS_DOWN = FAMILIES.gauge("dniasync_remote_peers_down", "Known peers that are down (reconnecting).")
REMOTE_ASK_LATENCY = FAMILIES.histogram("dniasync_remote_ask_duration_seconds",
                                        "Round trip of asks to actors on other nodes, by message type.", "msg_type")


class RemoteCountersView(Protocol):
    """What metrics reads of :class:`dniasync.remote.RemoteCounters`."""

    bytes_in: int
    bytes_out: int
    frames_in: int
    frames_out: int
    decode_errors: int
    auth_failures: int
    dropped_tells: int
    reconnects: int
    peers_lost: int
    connections_accepted: int


class AskLatencyStats(Protocol):
    """What metrics reads of :class:`dniasync.remote.AskLatency`."""

    @property
    def bounds(self) -> Sequence[float]: ...

    @property
    def by_type(self) -> Mapping[type, Sequence[float]]:
        """message class -> [count per bucket ..., count above the last bound, sum of seconds]."""
        ...


class TransportStats(Protocol):
    """What metrics reads of :class:`dniasync.remote.WebSocketTransport`."""

    @property
    def counters(self) -> RemoteCountersView: ...

    def peer_states(self) -> Mapping[str, str]: ...

    def enable_ask_latency(self) -> AskLatencyStats: ...


def collect_remote(transport: TransportStats, latency: AskLatencyStats | None) -> Iterator[Metric]:
    c = transport.counters
    yield REMOTE_BYTES.labelled([(("sent",), c.bytes_out), (("received",), c.bytes_in)])
    yield REMOTE_FRAMES.labelled([(("sent",), c.frames_out), (("received",), c.frames_in)])
    yield REMOTE_DECODE_ERRORS.single(c.decode_errors)
    yield REMOTE_AUTH_FAILURES.single(c.auth_failures)
    yield REMOTE_DROPPED_TELLS.single(c.dropped_tells)
    yield REMOTE_RECONNECTS.single(c.reconnects)
    yield REMOTE_PEERS_LOST.single(c.peers_lost)
    yield REMOTE_ACCEPTED.single(c.connections_accepted)
    states = list(transport.peer_states().values())
    yield REMOTE_PEERS_UP.single(states.count("up"))
    yield REMOTE_PEERS_DOWN.single(states.count("down"))
    hist = REMOTE_ASK_LATENCY.family()
    assert isinstance(hist, HistogramMetricFamily)
    if latency is not None:
        for msg_type, counts in list(latency.by_type.items()):
            hist.add_metric([msg_type.__name__], cumulative_buckets(latency.bounds, counts[:-1]), counts[-1])
    yield hist
