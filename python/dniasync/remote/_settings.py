"""Tunables of the remote layer and the counters it keeps per node."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ._codec import Limits

__all__ = ["RemoteCounters", "RemoteSettings"]


@dataclass(frozen=True)
class RemoteSettings:
    """How a node talks to its peers.

    A peer from which nothing (not even a heartbeat) arrived for ``detect_s``
    is declared down: asks to its actors fail at once with
    ``ActorUnreachable`` and tells are dropped (and counted) until it is back.
    """

    heartbeat_s: float = 0.5
    """Interval between heartbeats on an idle connection."""
    detect_s: float = 3.0
    """Silence after which a peer is declared down."""
    connect_timeout_s: float = 3.0
    """How long the first connection attempt to a node may take."""
    backoff_min_s: float = 0.1
    backoff_max_s: float = 5.0
    """Reconnect delays: jittered exponential between these."""
    give_up_s: float = 300.0
    """A peer unreachable for this long is forgotten (no more redialing) until referenced again."""
    outbox_size: int = 10_000
    """Frames queued for one peer by ``tell_nowait``/replies before ``MailboxFull``."""
    overflow_size: int = 10_000
    """Messages held for one full local mailbox before the connection stops reading."""
    close_timeout_s: float = 1.0
    """How long a closing websocket waits for the peer's close frame."""
    allowed_hosts: tuple[str, ...] | None = None
    """Host header names accepted on upgrade; None: loopback names on a loopback
    listener, anything on another (the token is the guard there)."""
    header_timeout_s: float = 10.0
    """A connection whose request headers are not complete this long after it was accepted, or
    after its previous response, is closed (slowloris, idle keep-alive, idle unauthenticated)."""
    max_connections: int = 1024
    """Connections open on the listener at once; past it the oldest unauthenticated one makes room."""
    max_connections_per_address: int = 64
    """Connections open from one peer address at once (same rule)."""
    handshake_timeout_s: float = 10.0
    """How long dialing a peer (challenge, then websocket upgrade) may take before it is abandoned."""
    startup_grace_s: float = 30.0
    """Silence tolerated from a peer that said it is still starting (heavy imports, model
    building) instead of ``detect_s``, until it says it is ready; the longer of the two applies."""
    shm: bool = True
    """Carry tensor payloads through shared memory when the peer proves it runs on this host
    (checked after auth at every connection; the socket carries everything otherwise)."""
    shm_ring_bytes: int = 32 << 20
    """Size of each shared-memory ring (one per connection and direction, touched only as used);
    payloads up to half of it go through it, bigger ones and overflow take the socket."""
    shm_min_bytes: int = 64 << 10
    """Payloads smaller than this stay on the socket (a copy through the ring would not pay)."""
    unix: bool = True
    """Between two nodes on one host, carry the websocket over a Unix socket (an abstract name the
    node offers in its challenge with its host identity; used when the dialer finds the same host and
    can reach it, else TCP; the same upgrade and proof either way)."""
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.detect_s:
            raise ValueError(f"need 0 < heartbeat_s < detect_s, got {self.heartbeat_s} and {self.detect_s}")
        if not 0 < self.backoff_min_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_min_s <= backoff_max_s")
        if self.header_timeout_s <= 0 or self.handshake_timeout_s <= 0:
            raise ValueError("need header_timeout_s > 0 and handshake_timeout_s > 0")
        if not 1 <= self.max_connections_per_address <= self.max_connections:
            raise ValueError("need 1 <= max_connections_per_address <= max_connections")
        if not 4096 <= self.shm_ring_bytes <= 1 << 34 or self.shm_min_bytes < 1:
            raise ValueError("need 4096 <= shm_ring_bytes <= 16 GiB and shm_min_bytes >= 1")


@dataclass
class RemoteCounters:
    """Plain counters of one node's remote traffic (monotonic, since start)."""

    bytes_in: int = 0
    bytes_out: int = 0
    frames_in: int = 0
    frames_out: int = 0
    decode_errors: int = 0
    auth_failures: int = 0
    dropped_tells: int = 0
    reconnects: int = 0
    peers_lost: int = 0
    connections_accepted: int = 0
    connections_refused: int = 0
    """Reset on accept: the listener was at a connection cap with nobody to evict."""
    connections_evicted: int = 0
    """Unauthenticated connections closed to make room for a newer one at a cap."""
    connections_timed_out: int = 0
    """Closed because their request headers did not arrive within ``header_timeout_s``."""
    shm_frames_out: int = 0
    """Frames whose payload went through a shared-memory ring (counted in ``frames_out`` too)."""
    shm_bytes_out: int = 0
    shm_frames_in: int = 0
    shm_fallbacks: int = 0
    """Payloads for a peer's ring that took the socket (too big for the ring, or it was full)."""

    def snapshot(self) -> dict[str, int]:
        return dataclasses.asdict(self)
