"""Worker-side hosting: one "ask until assigned" client for every node that serves a job.

A :class:`Host` runs on each PS and worker node. It asks the job runner for
work (:class:`~dniasync.cluster.protocol.JoinJob`) with jittered exponential
backoff until it is assigned, lets the job's mode spawn what the assignment's
spec describes, and reports the spawned refs
(:class:`~dniasync.cluster.protocol.Ready`) until the runner acknowledges.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..actors import Actor, ActorError, ActorNotFound, ActorRef, AskTimeout, Backoff, handler, message
from ..train.messages import CoordinatorEpoch, fenced
from .protocol import Assignment, JoinJob, NoJob, Ready

__all__ = ["Host"]

log = logging.getLogger("dniasync.cluster.hosts")

JOIN_TIMEOUT_S = 10.0
"""The first wait for the runner's answer to a join; it doubles after each wait that ran out, up to
``MAX_JOIN_TIMEOUT_S``. A PS host's answer carries its shard's initial values: 8 shards of a 23 MB model from
one coordinator take about 2 s at 100 Mbit/s and 16 s on that link emulated 8.5 times slower. Past a fixed
10 s wait every host asked again, the runner queued the same values again behind the first answers, and the
link never caught up: the job never started."""
MAX_JOIN_TIMEOUT_S = 300.0


@message("dniasync.cluster.hosts.Attempt")
@dataclass(frozen=True)
class _Attempt:
    pass


class Host(Actor):
    """Asks the runner at ``coordinator`` (``trainer@host:port``) for a ``role`` to serve, then serves it."""

    def __init__(self, coordinator: str, role: str, *, retry_s: float = 0.2, max_retry_s: float = 2.0) -> None:
        self.coordinator_address = coordinator
        self.role = role
        self._backoff = Backoff(retry_s, max_retry_s, jitter=0.2)
        self.incarnation = time.time_ns() // 1000
        self._join_timeout_s = JOIN_TIMEOUT_S
        self.ready: Ready | None = None
        """What to tell the runner once it answers (a busy machine may drop a connection meanwhile)."""
        self.hosted: list[ActorRef] = []
        self.epoch = 0
        """The highest coordinator epoch heard from (a standby that took over raises it)."""

    async def on_start(self) -> None:
        self.ref.tell_nowait(_Attempt())

    def _retry(self) -> None:
        self.send_later(self._backoff.failed(), _Attempt())

    @handler
    async def attempt(self, msg: _Attempt) -> None:
        runner = self.system.ref(self.coordinator_address)
        if self.ready is not None:
            await self._announce(runner, self.ready)
            return
        try:
            reply = await runner.ask(JoinJob(self.ref.address, self.role, self.incarnation),
                                     timeout=self._join_timeout_s)
        except ActorNotFound:
            log.info("%s host: the coordinator runs no training job; idle", self.role)
            return
        except ActorError as exc:
            if isinstance(exc, AskTimeout):  # an answer may be on its way: wait longer for the next one
                self._join_timeout_s = min(2 * self._join_timeout_s, MAX_JOIN_TIMEOUT_S)
            log.info("%s host: coordinator not reachable yet (%s); retrying", self.role, exc)
            self._retry()
            return
        if isinstance(reply, NoJob):
            if reply.retry:
                self._retry()
            else:
                log.info("%s host: nothing to host: %s", self.role, reply.reason)
            return
        assert isinstance(reply, Assignment)
        from .modes import host_spec

        self.hosted = await host_spec(self, reply.spec)
        log.info("%s host: hosting %s", self.role, ", ".join(ref.address for ref in self.hosted))
        self._backoff.succeeded()
        self.ready = Ready(self.ref.address, self.incarnation, list(self.hosted))
        await self._announce(runner, self.ready)

    @handler
    def coordinator_epoch(self, msg: CoordinatorEpoch) -> None:
        """A standby coordinator took the job over: ask it from now on."""
        if not fenced(msg.epoch, self.epoch):
            self.epoch, self.coordinator_address = msg.epoch, msg.runner

    async def _announce(self, runner: ActorRef, ready: Ready) -> None:
        try:
            await runner.ask(ready, timeout=10.0)
        except ActorError as exc:
            log.info("%s host: could not report ready (%s); retrying", self.role, exc)
            self._retry()
