"""A pipeline job's checkpoints, and the restart in place of a stage that died.

With ``[checkpoint] every_seconds`` set, each pipeline is *captured* that
often between two mini-batches: drained (no batch in flight), each stage
copies its whole state in place (weights, optimizer state, SG and
synthetic-input models: :mod:`~dniasync.train.pipeline.stage_state`), and
the pipeline trains on while the copies come over to the coordinator, kept
there with the pipeline's data cursor, its sample count and the split at the
drain. The pipelines' captures are spread over the interval. The job runner's
checkpoints write the latest captures (parts ``stage-<r>-<k>``); ``--resume``
loads them into the stages before training starts.

When a stage of pipeline ``r`` dies (its process killed, its actor failed,
the pipeline stalled), the pipeline is rolled back to its last capture
instead of failing the job: its stages are cut off from each other (so that
nothing still queued travels on), the slots of stages that are gone are
handed to the worker that joins next (``--role local`` restarts the dead
process; an operator may start one by hand), then every stage of the
pipeline, restarted or not, loads its captured state and the data cursor
goes back to the capture's. The semantics are those of a rollback: the
model continues from the capture as if the batches after it had never been
trained, and those batches are driven again, in the same order; each batch
of the data order is in the final model exactly once (with PS shards,
``sync.kind = "ps"``, the pushes a rolled-back pipeline made after its capture
stay in the shards: at least once there). The samples trained after the
capture are lost work, at most one capture interval's worth per fault,
reported in the ``pipeline_restored`` event. A pipeline whose stages are not
back within :data:`REJOIN_TIMEOUT_S` fails the job naming the stage. Without
``every_seconds`` a stage that dies fails the job at once, as before.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from ...actors import ActorError, ActorRef, AskTimeout
from ...train.data import DataCursor
from ..mode_api import JobFailed

if TYPE_CHECKING:
    from ...train.checkpoint import LoadedCheckpoint, Part
    from ...train.pipeline import PipelineBroken, PipelineDriver
    from ...train.pipeline.stage_state import StageCheckpoint
    from ._pipeline_job import PipelineJob

__all__ = ["EVENT_PIPELINE_RESTORED", "EVENT_STAGE_LOST", "PipelineDurability", "REJOIN_TIMEOUT_S"]

log = logging.getLogger("dniasync.cluster.modes")

REJOIN_TIMEOUT_S: Final = 180.0
"""How long a pipeline waits for its dead stages to come back before the job fails."""
PROBE_TIMEOUT_S: Final = 10.0
EVENT_STAGE_LOST: Final = "stage_lost"
EVENT_PIPELINE_RESTORED: Final = "pipeline_restored"


@dataclass
class Capture:
    """Pipeline ``r`` drained: its cursor, its samples so far, the split and every stage's state."""

    cursor: DataCursor
    samples: int
    groups: list[list[int]]
    states: list[StageCheckpoint]


class PipelineDurability:
    """Captures, checkpoint parts, resume and rollback-restart for a :class:`PipelineJob`."""

    def __init__(self, job: PipelineJob) -> None:
        self.job = job
        self.every_s = job.config.checkpoint.every_seconds
        n = job.p.replicas
        self.captures: list[Capture | None] = [None] * n
        self.base = [0] * n
        self._high = [0] * n
        """Samples of each pipeline before its current driver (the capture it was rolled back to)."""
        self._next = [0.0] * n
        self._moves_seen = [0] * n
        self._ids = 0
        self._fetching: list[asyncio.Task[None] | None] = [None] * n
        self.recovering: set[int] = set()
        self.restore_on_start = False
        self.restarts = 0
        self.samples_lost = 0

    @property
    def enabled(self) -> bool:
        return self.every_s is not None

    def lineage(self, r: int) -> int:
        """Samples in pipeline ``r``'s model now (a rollback takes away those trained after its capture)."""
        drivers = self.job.drivers
        return self.base[r] + (drivers[r].samples_done if r < len(drivers) else 0)

    def pipeline_samples(self, r: int) -> int:
        """How far pipeline ``r`` has got in its data order: after a rollback it stays where it was until the
        batches driven again pass it (the history's sample counts never go back; none is counted twice)."""
        self._high[r] = max(self._high[r], self.lineage(r))
        return self._high[r]

    # -- captures ------------------------------------------------------------------------
    def background(self) -> list[asyncio.Task[None]]:
        """The captures still on their way over (the job cancels them when it stops)."""
        return [task for task in self._fetching if task is not None]

    async def maybe_capture(self, r: int) -> None:
        """Between two mini-batches of pipeline ``r``: capture it when due (or when its split just changed), unless
        its previous capture is still on its way over."""
        if not self.enabled:
            return
        fetching = self._fetching[r]
        if fetching is not None and not fetching.done():
            return
        now = asyncio.get_running_loop().time()
        if now >= self._next[r] or self._moves_seen[r] != self.job._moves:
            await self.capture(r)

    async def capture(self, r: int, *, first: bool = False) -> None:
        """Drain pipeline ``r`` and have each stage copy its state in place; the copies come over in a task of their
        own while the pipeline trains on, and become the pipeline's capture once all have arrived (until then the
        previous capture stands). ``first``: the capture before training, awaited whole. The pipelines' captures
        are spread over the interval, so that while one drains the others have the cores."""
        from ...train.pipeline.stage_state import Held, HoldStage

        assert self.every_s is not None
        job = self.job
        driver = job.drivers[r]
        moves = job._moves
        await driver.drain()
        self._ids += 1
        capture_id = self._ids
        cursor, samples, groups = job.cursors[r], self.lineage(r), [list(g) for g in job.groups]
        await driver._ask_each(HoldStage(capture_id), Held)
        self._moves_seen[r] = moves
        offset = self.every_s * (r + 1) / len(self.captures) if first else self.every_s
        self._next[r] = asyncio.get_running_loop().time() + offset
        task = asyncio.create_task(self._fetch(r, driver, capture_id, cursor, samples, groups),
                                   name=f"pipeline-{r}-capture-{capture_id}")
        self._fetching[r] = task
        if first:
            await task

    async def _fetch(self, r: int, driver: PipelineDriver, capture_id: int, cursor: DataCursor, samples: int,
                     groups: list[list[int]]) -> None:
        from ...train.pipeline import PipelineBroken
        from ...train.pipeline.stage_state import FetchHeld, StageCheckpoint

        try:
            states = await driver._ask_each(FetchHeld(capture_id), StageCheckpoint)
        except (PipelineBroken, ActorError, ValueError) as exc:  # a stage died or restarted: the previous one stands
            log.info("pipeline %d: capture %d not taken (%r)", r, capture_id, exc)
            return
        if driver is self.job.drivers[r] and r not in self.recovering:
            self.captures[r] = Capture(cursor, samples, groups, states)

    def checkpoint(self) -> tuple[dict[str, Any], dict[str, Part]]:
        """The mode's checkpoint meta and parts: the latest captures (the current cursors while there are none)."""
        from ...train.checkpoint import Part

        job = self.job
        captures = self.captures
        if not all(c is not None for c in captures):
            meta = {"cursors": [[c.shard, c.epoch, c.position] for c in job.cursors], "samples": job.samples()}
            return meta, {}
        parts: dict[str, Part] = {}
        for r, c in enumerate(captures):
            assert c is not None
            for k, state in enumerate(c.states):
                tensors = {name: np.ascontiguousarray(t.detach().cpu().numpy()) for name, t in zip(state.names, state.tensors)}
                parts[f"stage-{r}-{k}"] = Part(tensors, {"first_layer": state.first_layer, "n_layers": state.n_layers,
                                                         "names": list(state.names)})
        done = [c for c in captures if c is not None]
        meta = {"cursors": [[c.cursor.shard, c.cursor.epoch, c.cursor.position] for c in done],
                "samples": sum(c.samples for c in done), "pipeline_samples": [c.samples for c in done],
                "groups": done[0].groups, "stages": len(done[0].states)}
        return meta, parts

    def restore(self, loaded: LoadedCheckpoint) -> None:
        """``--resume``: the split, cursors and stage states of ``loaded``, loaded into the stages at start."""
        import torch

        from ...train.pipeline.stage_state import StageCheckpoint

        from ._pipeline_job import EVENT_RESUME_REFUSED, split_text

        job = self.job
        meta = loaded.meta["mode"]
        if "stages" not in meta:
            raise JobFailed("this checkpoint holds no pipeline stages (written before the first capture, or without "
                            "[checkpoint] every_seconds): the job cannot be resumed from it", EVENT_RESUME_REFUSED)
        groups = [list(g) for g in meta["groups"]]
        if job.config.sync_needs_ps and groups != [list(g) for g in job.p.groups]:
            raise JobFailed(f"the checkpoint's split {split_text(groups)} differs from pipeline.groups; replicated "
                            "stages resume only on their configured split", EVENT_RESUME_REFUSED)
        job.groups = groups
        if job.regrouper is not None:
            job.regrouper.groups = tuple(tuple(g) for g in groups)
        for r, ((shard, epoch, position), samples) in enumerate(zip(meta["cursors"], meta["pipeline_samples"])):
            states = []
            for k in range(int(meta["stages"])):
                part = f"stage-{r}-{k}"
                pmeta, arrays = loaded.part_meta(part), loaded.tensors(part)
                names = list(pmeta["names"])
                states.append(StageCheckpoint(int(pmeta["first_layer"]), int(pmeta["n_layers"]), names,
                                              [torch.from_numpy(np.array(arrays[n])) for n in names]))
            cursor = DataCursor(int(shard), int(epoch), int(position))
            self.captures[r] = Capture(cursor, int(samples), groups, states)
            job.cursors[r] = cursor
            self.base[r] = self._high[r] = int(samples)
        self.restore_on_start = True

    async def load_into(self, r: int, driver: PipelineDriver) -> None:
        """Every stage of pipeline ``r`` (wired by ``driver``) loads its captured state."""
        from ...train.pipeline.stage_state import RestoreStage

        capture = self.captures[r]
        assert capture is not None
        for ref, state in zip(driver.stages, capture.states, strict=True):
            await driver._guard(ref, ref.ask(RestoreStage(state.first_layer, state.names, state.tensors),
                                             timeout=driver.ask_timeout_s))

    # -- restart in place ----------------------------------------------------------------
    def can_recover(self, r: int) -> bool:
        return self.enabled and self.captures[r] is not None and not self.job.runner.ending

    async def recover(self, r: int, broken: PipelineBroken) -> None:
        """Roll pipeline ``r`` back to its last capture once every stage of it is up; ``broken`` if they do not
        come back within :data:`REJOIN_TIMEOUT_S`."""
        from ...train.pipeline import PipelineBroken, PipelineDriver

        job = self.job
        capture = self.captures[r]
        assert capture is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        lost = self.lineage(r) - capture.samples
        log.warning("pipeline %d broken at %s (%s): rolling it back to its capture at %d samples", r, broken.address,
                    broken.reason, capture.samples)
        job.runner.event(EVENT_STAGE_LOST, pipeline=r, stage=broken.address, reason=broken.reason)
        self.recovering.add(r)
        old = job.drivers[r]
        monitor = old._monitor
        await old.close()  # until restored, r stays in ``recovering`` (for good if it never is)
        while True:
            if loop.time() - started > REJOIN_TIMEOUT_S:
                raise broken
            if monitor is not None and not await self._isolate(r, monitor):
                await asyncio.sleep(0.5)
                continue
            refs = job.refs[r]
            if not all(ref is not None for ref in refs):
                await asyncio.sleep(0.5)
                continue
            driver = PipelineDriver(job.runner.system, [ref for ref in refs if ref is not None], job.schedule,
                                    synthetic_inputs=job.p.synthetic_inputs, name=f"pipeline-monitor-{r}")
            try:
                await driver.start()
                await self.load_into(r, driver)
            except (PipelineBroken, ActorError) as exc:
                log.info("pipeline %d not restored yet (%r); retrying", r, exc)
                await driver.close()
                await asyncio.sleep(1.0)
                continue
            break
        self.recovering.discard(r)
        job.drivers[r] = driver
        job.cursors[r] = capture.cursor
        self.base[r] = capture.samples
        self.restarts += 1
        self.samples_lost += max(0, lost)
        job.runner.event(EVENT_PIPELINE_RESTORED, pipeline=r, stage=broken.address, samples=capture.samples,
                         samples_lost=max(0, lost), seconds=round(loop.time() - started, 2),
                         stages=",".join(ref.address for ref in driver.stages))
        log.info("pipeline %d restored to %d samples (%d lost) in %.1f s", r, capture.samples, lost,
                 loop.time() - started)

    async def _isolate(self, r: int, monitor: ActorRef) -> bool:
        """Wire every stage of pipeline ``r`` to no neighbour (whatever it still has queued goes nowhere), then
        see each has handled all it had queued; the slots of stages that are gone are freed for a new worker.
        True once every stage still placed is quiet."""
        from ...train.pipeline.protocol import Connect, StatsRequest

        job = self.job
        quiet = True
        # the second round is a barrier: a stage answers it once it has handled what was queued before it
        for round_msg in (Connect([], [], monitor), StatsRequest()):
            for k, ref in enumerate(job.refs[r]):
                if ref is None:
                    continue
                try:
                    await ref.ask(round_msg, timeout=PROBE_TIMEOUT_S)
                except AskTimeout:
                    quiet = False  # frozen or busy: ask again
                except ActorError as exc:
                    job.vacate(r, k, repr(exc))
        return quiet
