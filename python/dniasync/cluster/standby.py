"""A standby coordinator: follows the job's runner and takes the job over when it dies.

With ``[job] standby = true`` a second coordinator process runs a
:class:`Standby` beside the job. Twice a second it asks the runner for the
job's state (:class:`~dniasync.cluster.protocol.FollowJob`: the report and
clock, the PS shards and the replicas with their addresses; the shards'
weights are not copied, the PS processes keep them). When the runner stays
silent for the detection interval (and the transport's failure detector
declares its node down), the standby claims the next coordinator
epoch (the epoch file in the job's output directory, written then renamed;
if another standby claimed it first, this one stands down) and starts a
:class:`~dniasync.cluster.job.JobRunner` of its own that adopts the job's
processes as they are: nothing restarts, the replicas go on training and
report to it once told (:class:`~dniasync.train.messages.CoordinatorEpoch`).

Fencing: every order a runner sends (stop, new data shards, a fence on the PS
shards) carries its epoch, and the replicas and shards refuse one below the
highest they have heard of; a runner that reads a later epoch in the epoch
file (it was frozen, or cut off, and woke up) writes nothing more, neither
checkpoints nor the summary.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Final

from ..actors import Actor, ActorError, ActorNotFound, handler, message
from . import durable
from .config import Config
from .protocol import COORDINATOR_NAME, FollowJob, JobState

__all__ = ["ASK_TIMEOUT_S", "FOLLOW_EVERY_S", "STANDBY_NAME", "Standby"]

log = logging.getLogger("dniasync.cluster.standby")

STANDBY_NAME: Final = "standby"
"""The name of the standby actor on a standby coordinator's node."""
FOLLOW_EVERY_S: Final = 0.5
"""How often a standby asks the runner for the job's state."""
ASK_TIMEOUT_S: Final = 1.0
"""A follow unanswered this long is a miss, not a death (the transport's failure detector decides that): short, so
the standby sees a declared death within about a second and a half."""


@message("dniasync.cluster.standby.Poll")
@dataclass(frozen=True)
class _Poll:
    pass


class Standby(Actor):
    """Follows the runner at ``active`` (``host:port``); takes the job over once it is silent ``detect_s``."""

    def __init__(self, config: Config, active: str, *, detect_s: float = 3.0, also_tell: tuple[str, ...] = ()) -> None:
        self.config = config
        self.active = active
        self.detect_s = detect_s
        self.also_tell = also_tell
        """Actor names on every node of the job told of the takeover too (the node's membership)."""
        self.state: JobState | None = None
        self._followed_at = 0.0
        self._last_answer = time.monotonic()
        self.took_over = False

    async def on_start(self) -> None:
        log.info("standby coordinator following %s", self.active)
        self.ref.tell_nowait(_Poll())

    @handler
    async def poll(self, msg: _Poll) -> None:
        runner = self.system.ref(f"{COORDINATOR_NAME}@{self.active}")
        try:
            reply = await runner.ask(FollowJob(), timeout=ASK_TIMEOUT_S)
        except ActorNotFound:
            reply = None  # its node answers without a runner: starting, or a coordinator node without a job
        except (ActorError, TimeoutError) as exc:
            reply = None
            log.debug("no answer from %s: %r", self.active, exc)
        now = time.monotonic()
        if isinstance(reply, JobState):
            self._last_answer = now
            if reply.state in ("finished", "failed"):
                log.info("the job has %s: nothing to stand by for", reply.state)
                return
            if reply.state == "training":  # placed and started: from now on it can be taken over
                if self.state is None:
                    log.info("following the job in training (coordinator epoch %d)", reply.epoch)
                self.state, self._followed_at = reply, now
        elif self.state is not None and now - self._last_answer >= self.detect_s and not runner.is_alive:
            # unanswered that long, and its node declared down by the failure detector (its connection dropped,
            # or not even a heartbeat came for the detection interval): a coordinator only slow to answer stays
            await self._take_over(self.state, now - self._last_answer)
            return
        self.send_later(FOLLOW_EVERY_S, _Poll())

    async def _take_over(self, state: JobState, silent_s: float) -> None:
        from .job import JobRunner, Takeover

        epoch = state.epoch + 1
        address = f"{COORDINATOR_NAME}@{self.ref.node}"
        if not await self.run_blocking(durable.claim_epoch, self.config, epoch, address):
            log.warning("coordinator epoch %d is already claimed (%s): standing down", epoch,
                        durable.epoch_now(self.config))
            return
        log.warning("the coordinator at %s has been silent %.1f s: taking the job over as epoch %d", self.active,
                    silent_s, epoch)
        document = json.loads(state.document)
        nodes = {a.partition("@")[2] for a in document["tell"]}
        document["tell"] = [*document["tell"], *(f"{name}@{node}" for node in sorted(nodes) for name in self.also_tell)]
        takeover = Takeover(epoch, f"{COORDINATOR_NAME}@{self.active}", document, self._followed_at)
        await self.system.spawn(JobRunner, self.config, takeover=takeover, name=COORDINATOR_NAME,
                                liveness_s=self.detect_s)
        self.took_over = True
