"""The job runner: one lifecycle for every training mode.

:class:`JobRunner` (named ``trainer`` on the coordinator node) owns what every
job has: placing the PS shards the mode asks for, answering the hosts that
join, the evaluation schedule, the stop rules, the run report, the status
reply and failure handling. What differs between modes — what a worker hosts,
how training starts, how weights are taken for evaluation, how samples are
counted — is the mode's :class:`~dniasync.cluster.mode_api.ModeJob`.

Its state survives the failure of anything it talks to: a failed ask is an
event in the run, never a reset of the lifecycle. Evaluations run in a task
of their own, so the stop rules (``max_seconds``, ``max_epochs``, the
target) are checked on time whatever an evaluation waits for. A PS shard
that stays unreachable for :data:`PS_LOST_AFTER_S` ends the job, as failed,
naming the shard; every ending writes the summary for the time that ran.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Final

from ..actors import Actor, ActorError, ActorRef, handler, message
from ..train.checkpoint import CheckpointError, LoadedCheckpoint
from ..train.messages import CoordinatorEpoch, Progress
from . import durable
from .config import Config
from .mode_api import Adoptable, JobFailed, ModeJob, Snapshot
from .modes import get_mode
from .protocol import Assignment, FollowJob, JobState, JobStatus, JobStatusReply, JoinJob, NoJob, Ready
from .report import RunReport
from .shards import ShardKeeper
from .telemetry import track_trainer

__all__ = ["EVENT_EVAL_FAILED", "EVENT_TAKEOVER", "MAX_DEFERRED_SNAPSHOTS", "PS_LOST_AFTER_S", "JobRunner", "Takeover"]

log = logging.getLogger("dniasync.cluster.job")

PS_LOST_AFTER_S: Final = 20.0
"""A PS shard unreachable this long ends the job (a freeze of a few seconds is survived)."""
MAX_DEFERRED_SNAPSHOTS: Final = 256
"""``eval.deferred`` keeps at most this many sets of weights; beyond, the oldest is scored at once."""
STOP_GRACE_S: Final = 10.0
"""How long a shutting-down coordinator may spend writing the summary of an unfinished job."""
STOPPED: Final = "stopped: the coordinator was shut down before the job ended"
TICK_S: Final = 0.25

EVENT_EVAL_FAILED: Final = "eval_failed"
EVENT_CHECKPOINT_FAILED: Final = "checkpoint_failed"
EVENT_RESUMED: Final = "resumed"
EVENT_JOB_FAILED: Final = "job_failed"
EVENT_TAKEOVER: Final = "coordinator_takeover"


@dataclass(frozen=True)
class Takeover:
    """What a standby coordinator hands the runner it starts: the dead one's last followed state."""

    epoch: int
    previous: str
    """The address of the runner it takes over from."""
    document: dict[str, Any]
    """:class:`~dniasync.cluster.protocol.JobState`'s document."""
    followed_at: float
    """``time.monotonic()`` when that state arrived."""


@message("dniasync.cluster.job.Tick")
@dataclass(frozen=True)
class _Tick:
    pass


class JobRunner(Actor):
    """Runs one job of any mode over the hosts that join it."""

    mailbox_size = 0

    def __init__(
        self,
        config: Config,
        *,
        liveness_s: float = 3.0,
        finished: asyncio.Event | None = None,
        resume_from: LoadedCheckpoint | None = None,
        takeover: Takeover | None = None,
    ) -> None:
        self.config = config
        self.resume_from = resume_from
        self.takeover = takeover
        self.epoch = takeover.epoch if takeover is not None else 1
        """The coordinator epoch this runner runs the job as (a standby that takes over runs the next)."""
        self.fenced = False
        """A later epoch took the job over: this runner changes nothing more."""
        self._wall_before = 0.0
        """Training time of the earlier runs of a resumed job."""
        self.liveness_s = liveness_s
        self.finished = finished or asyncio.Event()
        self.state = "waiting"
        self.started_at: float | None = None
        self.accuracy: float | None = None
        self.loss: float | None = None
        self.samples_per_s = 0.0
        self.summary_path = ""
        self._rate = (0.0, 0)
        self._next_eval_steps = config.eval.every_steps or 0
        self._last_eval_wall = 0.0
        self._eval_task: asyncio.Task[None] | None = None
        self._last_asked: int | None = None
        """The sample count when the latest weights this runner evaluated were asked for (dated at arrival)."""
        self._snapshot_task: asyncio.Task[None] | None = None
        self._deferred: deque[Snapshot] = deque()
        self._ending: asyncio.Task[None] | None = None
        self._wall_at_end: float | None = None

    # -- setup ------------------------------------------------------------------
    async def on_start(self) -> None:
        self.report = RunReport(self.config.job.name, self.config.mode,
                                target_accuracy=self.config.stop.target_accuracy, config=self.config.to_dict())
        self.job: ModeJob = await self.run_blocking(get_mode(self.config.mode).job, self.config, self)
        specs = self.job.ps_shards()
        self.store = durable.checkpoint_store(self.config)
        loaded = self.resume_from
        if self.takeover is None:
            if loaded is not None:
                self.epoch = durable.epoch_now(self.config) + 1
            await self.run_blocking(durable.claim_epoch, self.config, self.epoch, self.ref.address,
                                    fresh=loaded is None)
        else:  # a shard restarted after the takeover starts from the last checkpoint's snapshot, if there is one
            loaded = await self.run_blocking(self._latest_checkpoint)
        if loaded is not None:
            specs = await self.run_blocking(durable.resumed_specs, specs, loaded)
        keeper = getattr(self.job, "shard_keeper", ShardKeeper)  # replicated shards come with a keeper of their own
        self.shards: ShardKeeper = keeper(specs, self.event, lost_after_s=PS_LOST_AFTER_S, samples=self.samples)
        self._last_snapshot = time.monotonic()
        track_trainer(self.system, self)
        if self.takeover is not None:
            self._take_over(self.takeover)
        elif loaded is not None:
            try:
                self._resume(loaded)
            except JobFailed as exc:
                self._fail(exc)
                return
        self.ref.tell_nowait(_Tick())

    def _resume(self, loaded: LoadedCheckpoint) -> None:
        self.job.restore(loaded)
        durable.restore_report(self.report, loaded.meta)
        self._wall_before = float(loaded.meta["wall_s"])
        self.event(EVENT_RESUMED, checkpoint=str(loaded.path), samples=self.samples())
        log.info("resuming from %s: %.1f s and %d samples trained before", loaded.path, self._wall_before,
                 self.samples())

    def _latest_checkpoint(self) -> LoadedCheckpoint | None:
        try:
            return self.store.latest()
        except CheckpointError as exc:
            log.warning("no checkpoint to restart PS shards from after the takeover: %s", exc)
            return None

    def _take_over(self, takeover: Takeover) -> None:
        """Go on with the job a dead coordinator ran: its report, clock and members, the same processes."""
        doc = takeover.document
        durable.restore_report(self.report, doc["meta"])
        self.shards.adopt(self.system, doc["ps"])
        if not isinstance(self.job, Adoptable):  # config refuses job.standby for such modes: a defect if reached
            raise RuntimeError(f"mode {self.config.mode} cannot be taken over by a standby coordinator")
        self.job.adopt(doc["mode"])
        gap = time.monotonic() - takeover.followed_at
        self._wall_before = float(doc["meta"]["wall_s"]) + gap  # its members trained on meanwhile
        self.mark_started()
        self._last_eval_wall = float(doc["last_eval_wall"])
        self.event(EVENT_TAKEOVER, epoch=self.epoch, previous=takeover.previous, silent_s=round(gap, 3))
        log.warning("coordinator epoch %d: took the job over from %s (last heard %.1f s ago), %d samples trained",
                    self.epoch, takeover.previous, gap, self.samples())
        order = CoordinatorEpoch(self.epoch, self.ref.address)
        for address in doc["tell"]:  # every host, replica, PS shard and membership of the job
            try:
                self.system.ref(address).tell_nowait(order)
            except ActorError as exc:
                log.warning("could not tell %s of the new coordinator: %s", address, exc)

    def _check_fence(self) -> bool:
        """True (and nothing more is done) once a later coordinator epoch runs the job."""
        if not self.fenced and durable.epoch_now(self.config) > self.epoch:
            self.fenced = True
            self.state = "fenced"
            log.error("fenced: coordinator epoch %d runs job %s now; this one (epoch %d) changes nothing more",
                      durable.epoch_now(self.config), self.config.job.name, self.epoch)
            self.finished.set()
        return self.fenced

    @handler
    def follow(self, msg: FollowJob) -> JobState:
        doc = {
            "meta": durable.job_state(self.report, self.wall(), self.samples(), {}),
            "ps": self.shards.follow(),
            "mode": self.job.follow() if isinstance(self.job, Adoptable) else {},
            "tell": self._members_to_tell(),
            "last_eval_wall": self._last_eval_wall,
        }
        return JobState(self.epoch, self.state, json.dumps(doc))

    def _members_to_tell(self) -> list[str]:
        addresses = set(self.shards.addresses())
        if isinstance(self.job, Adoptable):
            addresses.update(self.job.addresses())
        return sorted(addresses)

    async def on_stop(self) -> None:
        """The node is shutting down (SIGTERM, Ctrl-C): whatever ran still gets its summary."""
        for task in (self._eval_task, self._snapshot_task):
            if task is not None and not task.done():
                task.cancel()
        if self._ending is None and self.started_at is not None:
            self._ending = asyncio.create_task(self._finish(STOPPED, "stopped", quick=True))
        if self._ending is not None:
            try:
                async with asyncio.timeout(STOP_GRACE_S):
                    await asyncio.shield(self._ending)
            except (TimeoutError, asyncio.CancelledError):
                log.warning("the summary could not be completed while stopping")
        await self.job.close()

    # -- clock ------------------------------------------------------------------
    def wall(self) -> float:
        """Seconds since training started (frozen once the job ended)."""
        if self._wall_at_end is not None:
            return self._wall_at_end
        return self._wall_before if self.started_at is None else time.monotonic() - self.started_at

    def mark_started(self) -> None:
        """Training has begun: the clock starts (called by the mode)."""
        if self.started_at is None:
            self.started_at = time.monotonic() - self._wall_before  # a resumed job's clock goes on
            self.state = "training"

    @property
    def ps(self) -> list[ActorRef | None]:
        """Each PS shard's ref (None until placed)."""
        return self.shards.refs

    @property
    def ending(self) -> bool:
        """The job has stopped training (its summary is being, or has been, written)."""
        return self._ending is not None

    def poke(self) -> None:
        """Check the stop rules now rather than at the next tick (the mode saw something change)."""
        if self._ending is None:
            self.send_later(0.0, _Tick())

    def event(self, kind: str, **details: Any) -> None:
        self.report.record_event(self.wall(), kind, **details)

    # -- hosts ------------------------------------------------------------------
    @handler
    async def join(self, msg: JoinJob) -> Assignment | NoJob:
        if self.state in ("finished", "failed"):
            return NoJob(f"the job has {self.state}", retry=False)
        if msg.role == "ps":
            return self.shards.place(msg)
        if not self.shards.placed:
            return NoJob("waiting for the PS shards", retry=True)
        try:
            return self.job.assign(msg)
        except JobFailed as exc:
            self._fail(exc)
            return NoJob(str(exc), retry=False)

    @handler
    async def ready(self, msg: Ready) -> bool:
        if self.shards.ready(msg.member, msg.refs):
            return True
        try:
            await self.job.ready(msg)
        except JobFailed as exc:
            self._fail(exc)
        return True

    @handler
    def progress(self, msg: Progress) -> None:
        for shard, version in enumerate(msg.ps_versions):
            self.shards.note_version(shard, version)
        self.job.progress(msg)
        if self.samples() >= self.config.sample_budget:
            self.poke()  # the epoch budget is spent: stop now, not at the next tick

    # -- the tick: liveness, evaluation, stop rules ---------------------------------
    @handler
    async def tick(self, msg: _Tick) -> None:
        if self._ending is not None or self._check_fence():
            return
        try:
            self.shards.check(time.monotonic())
            self.job.check(time.monotonic())
            if self.state == "training":
                self._maybe_snapshot()
                self._maybe_evaluate()
                reason = self._stop_reason()
                if reason is not None:
                    self._end(reason)
                    return
        except JobFailed as exc:
            self._fail(exc)
            return
        self.send_later(min(TICK_S, self.config.eval.interval_s or TICK_S), _Tick())

    def _maybe_snapshot(self) -> None:
        every = self.config.checkpoint.every_seconds
        due = every is not None and time.monotonic() - self._last_snapshot >= every
        if due and (self._snapshot_task is None or self._snapshot_task.done()):
            self._last_snapshot = time.monotonic()
            self._snapshot_task = asyncio.create_task(self._checkpoint(), name=f"{self.config.job.name}-checkpoint")

    async def _checkpoint(self) -> None:
        """Snapshot the PS shards, then write a checkpoint of them and of the job (off the event loop)."""
        if self.shards.refs:
            # a shard that does not answer within an interval is skipped: it must not hold up the next round
            await self.shards.snapshot(timeout_s=max(2.0, min(10.0, self.config.checkpoint.every_seconds or 10.0)))
        mode_meta, parts = self.job.checkpoint()
        meta = durable.job_state(self.report, self.wall(), self.samples(), mode_meta)
        parts = {**durable.shard_parts(self.shards.snapshots), **parts}
        if self._check_fence():
            return
        if not parts:  # nothing answered in time (a p2p job's peers all busy): the next round tries again
            self.event(EVENT_CHECKPOINT_FAILED, reason="no part to save")
            log.warning("checkpoint not written: no part to save")
            return
        try:
            path = await self.run_blocking(durable.write, self.store, parts, meta)
        except OSError as exc:
            self.event(EVENT_CHECKPOINT_FAILED, reason=repr(exc))
            log.warning("checkpoint not written: %r", exc)
            return
        log.info("checkpoint %s: %d samples at %.1f s", path.name, meta["samples"], meta["wall_s"])

    def samples(self) -> int:
        return self.job.samples()

    def _stop_reason(self) -> str | None:
        stop = self.config.stop
        if stop.target_accuracy is not None and self.accuracy is not None and self.accuracy >= stop.target_accuracy:
            return f"reached target accuracy {stop.target_accuracy:g}"
        done = self.job.done()
        if done is not None:
            return done
        if self.samples() >= self.config.sample_budget:
            return f"trained {stop.max_epochs} epochs"
        if stop.max_seconds is not None and self.wall() >= stop.max_seconds:
            return f"ran {stop.max_seconds:g} s"
        return None

    def _eval_due(self) -> bool:
        every = self.config.eval
        if every.every_steps is not None:
            steps = self.job.steps()
            if steps < self._next_eval_steps:
                return False
            self._next_eval_steps = steps + every.every_steps
            return True
        return self.wall() - self._last_eval_wall >= (every.interval_s or 2.0)

    def _maybe_evaluate(self) -> None:
        if self.takeover is not None and isinstance(self.job, Adoptable) and not self.job.reported():
            return  # just taken over: the members' counts (each evaluation's samples) are not current yet
        if (self._eval_task is None or self._eval_task.done()) and self._eval_due():
            self._last_eval_wall = self.wall()
            self._eval_task = asyncio.create_task(self._evaluate(), name=f"{self.config.job.name}-eval")

    # -- evaluation ---------------------------------------------------------------
    async def _evaluate(self) -> None:
        """Take the weights now and score them (with ``eval.deferred``: keep them to score after training)."""
        asked = self.samples()
        try:
            async with asyncio.timeout(self.config.eval.timeout_s):
                snapshot = await self.job.snapshot()
        except (ActorError, TimeoutError) as exc:
            self.event(EVENT_EVAL_FAILED, reason=repr(exc))
            log.warning("evaluation skipped: could not take the weights (%r)", exc)
            return
        snapshot.wall, snapshot.samples = self.wall(), self.samples()  # dated when the weights arrived
        self._last_asked = asked
        if not self.config.eval.deferred:
            await self._score(snapshot)
            return
        self._deferred.append(snapshot)
        if len(self._deferred) > MAX_DEFERRED_SNAPSHOTS:
            await self._score(self._deferred.popleft())

    async def _score(self, snapshot: Snapshot) -> None:
        accuracy, loss = await self.job.score(snapshot)
        wall, samples = snapshot.wall, snapshot.samples
        last_wall, last_samples = self._rate
        if wall > last_wall:
            self.samples_per_s = (samples - last_samples) / (wall - last_wall)
        self._rate = (wall, samples)
        self.accuracy, self.loss = accuracy, loss
        self.report.record_eval(wall, samples, accuracy, loss)
        log.info("eval: %.1f s, %d samples, accuracy %.4f, loss %.4f", wall, samples, accuracy, loss)

    # -- ending -------------------------------------------------------------------
    def _fail(self, exc: JobFailed) -> None:
        if self._ending is not None:
            return
        log.error("job failed: %s", exc)
        self.event(exc.event, reason=str(exc), **exc.details)
        self._end(f"failed: {exc}", state="failed")

    def _end(self, reason: str, state: str = "finished") -> None:
        if self._ending is None:
            self._ending = asyncio.create_task(self._finish(reason, state), name=f"{self.config.job.name}-finish")

    async def _finish(self, reason: str, state: str, *, quick: bool = False) -> None:
        """Stop training, take a last evaluation if it says something new, write the summary.

        ``quick`` (the node is stopping, its peers too): no last evaluation, no asking for statistics.
        """
        if self._check_fence():
            return
        train_wall, train_samples = self.wall(), self.samples()
        self._wall_at_end = train_wall
        self.report.set_metric("train_samples_per_s", train_samples / train_wall if train_wall > 0 else 0.0)
        try:
            await self.job.stop(reason)
            if not quick:
                await self._last_words(reason, state, train_samples)
        except Exception as exc:  # whatever failed, the summary of what ran is written
            log.exception("while ending the job")
            self.event(EVENT_JOB_FAILED, reason=repr(exc))
            if state == "finished":
                state, reason = "failed", f"failed while ending: {exc!r}"
        wall = max(train_wall, self.report.history[-1].wall_s) if self.report.history else train_wall
        self._wall_at_end = wall
        self.report.finish(wall, max(train_samples, self.report.samples), reason)
        if self._check_fence():  # taken over while it ended: the new coordinator writes the summary
            return
        self.summary_path = str(await self.run_blocking(self.report.write_outputs, self.config.output_dir))
        self.state = state
        log.info("job %s: %s; summary in %s", state, reason, self.summary_path)
        self.finished.set()

    async def _last_words(self, reason: str, state: str, train_samples: int) -> None:
        """The last evaluation (unless the last one saw the final weights), deferred scores, the mode's figures."""
        if self._eval_task is not None:
            await asyncio.gather(self._eval_task, return_exceptions=True)
        last = self._deferred[-1].samples if self._deferred else (
            self.report.history[-1].samples if self.report.history else None)
        # An evaluation is dated when its weights arrive, and the counts that finish training may arrive before them
        # (a stage's Done overtakes its big state reply; replicas report after the stop): one dated at the final
        # count saw the final weights only if they were asked for at that count. If not, evaluate again: the weights
        # are final now, and a row of the same date (both after the stop) is replaced by it (RunReport.record_eval).
        final = max(train_samples, self.samples())
        unsure = last is not None and self._last_asked is not None and self._last_asked < final
        if state == "finished" and not reason.startswith("reached") and (last is None or last < final or unsure):
            if unsure and last == final:
                log.info("the last evaluation's weights were asked for at %d samples, before the final %d: "
                         "evaluating the final weights", self._last_asked, final)
            await self._evaluate()
        if self._deferred:
            log.info("training done: scoring %d deferred evaluations", len(self._deferred))
            while self._deferred:
                snapshot = self._deferred.popleft()
                snapshot.threads = os.cpu_count() or 1  # nothing trains beside them now
                await self._score(snapshot)
        async with asyncio.timeout(self.config.eval.timeout_s):  # the mode's figures travel as the weights do
            await self.job.record(self.report)

    # -- status -------------------------------------------------------------------
    @handler
    def status(self, msg: JobStatus) -> JobStatusReply:
        return self.snapshot()

    @property
    def evaluations(self) -> int:
        """Held-out evaluations run so far."""
        return len(self.report.history)

    def snapshot(self) -> JobStatusReply:
        """The job's state now (what :class:`JobStatus` answers); read by the node's metrics and live page."""
        samples = self.samples()
        return JobStatusReply(
            job=self.config.job.name, mode=self.config.mode, state=self.state, wall_s=self.wall(),
            samples=samples, epochs=samples / self.config.data.n_train, max_epochs=self.config.stop.max_epochs,
            accuracy=self.accuracy, loss=self.loss, samples_per_s=self.samples_per_s,
            replicas=self.job.members(), summary=self.summary_path,
            extra={"bytes_pushed": self.report.bytes_pushed, "bytes_pulled": self.report.bytes_pulled,
                   **self.job.extra()},
        )
