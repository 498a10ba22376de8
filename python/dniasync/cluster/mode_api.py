"""The mode contract: what the rest of the cluster asks of a training mode, and what a mode may ask of the runner.

A mode is a :class:`Mode` (what config parsing, the node and the launcher ask
of it: its section's schema, its cross-section rules, the weight syncs it runs
with, how many processes it needs) plus the :class:`ModeJob` it creates on the
coordinator (what the job runner asks of it while the job runs). A mode sees
the job runner only through :class:`Runner`, the few things a mode may use.

This module is a leaf of ``cluster/``: it imports no mode and nothing of
:mod:`dniasync.cluster.modes` (the registry), so the registry, the modes and
the config loader above them all import it without a circle. What it names
only in signatures is imported for the type checker alone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    from ..actors import ActorRef, ActorSystem
    from ..train.checkpoint import LoadedCheckpoint, Part
    from ..train.messages import Progress
    from ._schema import Section
    from .config import Config
    from .hosts import Host
    from .panels import Panel
    from .protocol import Assignment, JoinJob, NoJob, Ready
    from .report import RunReport

__all__ = ["Adoptable", "Hoster", "JobFailed", "Mode", "ModeJob", "Runner", "Snapshot"]

R = TypeVar("R")


class JobFailed(Exception):
    """The job cannot go on: ``event`` (with ``details``) goes into the run's events."""

    def __init__(self, reason: str, event: str, **details: Any) -> None:
        super().__init__(reason)
        self.event = event
        self.details = details


@dataclass
class Snapshot:
    """Weights taken for an evaluation, dated (by the runner) when they arrived."""

    weights: Any
    wall: float = 0.0
    samples: int = 0
    threads: int = 1
    """The torch threads that may score it: one while training runs beside it; every core for the ones
    ``eval.deferred`` kept, scored after training."""


Hoster = Callable[["Host", Any], Awaitable[list["ActorRef"]]]
"""Spawns what a spec describes on a worker node (its host is the parent); returns the refs."""


class Runner(Protocol):
    """What a mode's job may use of the job runner (:class:`~dniasync.cluster.job.JobRunner`), and no more."""

    @property
    def config(self) -> Config: ...

    @property
    def ref(self) -> ActorRef:
        """The runner's own ref (workers report to it)."""

    @property
    def system(self) -> ActorSystem:
        """The coordinator's actor system (a mode spawns its coordinator-side actors there)."""

    @property
    def report(self) -> RunReport:
        """The run's report (a mode adds the bytes its workers moved)."""

    @property
    def epoch(self) -> int:
        """The coordinator epoch it runs the job as: every order it sends carries it (a later one fences it)."""

    @property
    def liveness_s(self) -> float:
        """A worker silent this long is taken for dead."""

    @property
    def ps(self) -> list[ActorRef | None]:
        """Each PS shard's ref (None until placed)."""

    @property
    def ending(self) -> bool:
        """The job has stopped training."""

    def event(self, kind: str, **details: Any) -> None:
        """Record an event of the run, dated by the runner's clock."""

    def mark_started(self) -> None:
        """Training has begun: the runner's clock starts."""

    def poke(self) -> None:
        """Check the stop rules now rather than at the next tick."""

    async def run_blocking(self, func: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run blocking work (building a model, scoring) on a worker thread."""


class ModeJob(Protocol):
    """The coordinator-side part of a running job."""

    def ps_shards(self) -> list[Any]:
        """The :class:`~dniasync.train.specs.ShardSpec` of every PS shard the job needs (maybe none)."""

    def assign(self, join: JoinJob) -> Assignment | NoJob:
        """What a worker host runs (asked once every PS shard is up)."""

    async def ready(self, ready: Ready) -> None:
        """A worker host runs its assignment; ``ready.refs`` are its actors."""

    def progress(self, msg: Progress) -> None:
        """A replica's counters arrived."""

    def check(self, now: float) -> None:
        """Liveness, on every tick; raise :class:`JobFailed` if the job cannot go on."""

    def samples(self) -> int: ...

    def steps(self) -> int: ...

    def done(self) -> str | None:
        """The stop reason if training ended by itself (a pipeline ran its epochs), else None."""

    def members(self) -> dict[str, str]:
        """Each worker (replica, stage) -> ``alive`` / ``dead``."""

    def extra(self) -> dict[str, Any]: ...

    async def snapshot(self) -> Snapshot:
        """A copy of the current weights (may raise ``ActorError``: the evaluation is skipped)."""

    async def score(self, snapshot: Snapshot) -> tuple[float, float]:
        """Held-out (accuracy, loss) of the weights in ``snapshot``."""

    async def stop(self, reason: str) -> None:
        """Stop training (workers stop stepping; nothing may fail here)."""

    async def record(self, report: RunReport) -> None:
        """Put the mode's own figures into the run summary."""

    def checkpoint(self) -> tuple[dict[str, Any], dict[str, Part]]:
        """The mode's state a resumed job needs: plain JSON (data cursors, samples so far) and tensor parts."""

    def restore(self, loaded: LoadedCheckpoint) -> None:
        """Continue from what :meth:`checkpoint` saved (called once, before any worker joins).

        Raises :class:`JobFailed` if the mode cannot resume.
        """

    async def close(self) -> None:
        """Release what the job holds (the runner is stopping)."""


@runtime_checkable
class Adoptable(Protocol):
    """A mode job a standby coordinator can take over (``[job] standby``): its members as JSON, and back."""

    def follow(self) -> dict[str, Any]:
        """Its members (with their refs' addresses), data cursors and counters, as JSON."""

    def adopt(self, doc: dict[str, Any]) -> None:
        """Go on with the members :meth:`follow` described (the same processes, now reporting here)."""

    def addresses(self) -> list[str]:
        """The actors to tell of a new coordinator (hosts and what they host)."""

    def reported(self) -> bool:
        """Every adopted member has reported to this coordinator (or was declared dead): its counts are current."""


class Mode(Protocol):
    """A training method, as config parsing, the node and the launcher see it."""

    @property
    def name(self) -> str: ...

    @property
    def settings(self) -> type[Section]:
        """The schema of the mode's own section (``[<name>]``)."""

    @property
    def shards_key(self) -> str:
        """The dotted key that sets how many data shards there are (named in errors)."""

    @property
    def worker_kind(self) -> str:
        """What a worker process is called in messages (``replica``, ``stage worker``)."""

    @property
    def member_kind(self) -> str:
        """What the job's status lists as its members (``replica``, ``stage``)."""

    @property
    def schedules(self) -> bool:
        """Whether the mode honours a ``[schedule]`` section (a growing batch size)."""

    @property
    def takes_local_steps(self) -> bool:
        """Whether its trainers honour ``[sync] local_steps`` (inner steps, then a pseudo-gradient and an outer step)."""

    @property
    def regroups(self) -> bool:
        """Whether the mode honours a ``[regroup]`` section (moving layers between stages at run time)."""

    def data_shards(self, settings: Any) -> int: ...

    def restarts_workers(self, config: Config) -> bool:
        """Whether the local launcher starts a dead worker process again (what it hosted comes back: a new
        replica, or stages rolled back to their last capture)."""

    def worker_state(self, members: Mapping[str, str], address: str) -> str | None:
        """``alive`` / ``dead`` for what the worker process at ``address`` hosts, from the job's member states
        (None: it hosts nothing yet)."""

    def preload(self, config: Config) -> tuple[str, ...]:
        """Modules the job's processes import beyond torch and dniasync's own (the local launcher's fork server
        imports them before it forks them): ``torch._dynamo`` where workers make torch optimizers, which import it
        as they are made (seconds of CPU in each process otherwise)."""

    def syncs(self, settings: Any) -> tuple[str, ...]:
        """The weight syncs (``sync.kind``) the mode runs with these settings; the first is the default."""

    def check(self, config: Config, raw: Mapping[str, Any]) -> None:
        """Rules across sections; raise :class:`~dniasync.cluster.config.ConfigError` naming the key."""

    def resolve(self, config: Config, model: Any) -> None:
        """Rules against the model the config builds (a ``torch.nn.Module``: not imported here)."""

    def processes(self, config: Config) -> tuple[int, int]:
        """(PS processes, worker processes) the job needs."""

    def summary_lines(self, config: Config, doc: Mapping[str, Any]) -> list[str]:
        """Mode-specific lines of the launcher's closing summary."""

    def panels(self, config: Config) -> tuple[Panel, ...]:
        """The live page's charts of this job beside accuracy, loss and samples/s (:mod:`~dniasync.cluster.panels`:
        lines over the job's figures, which include the numbers in its ``extra()``)."""

    def job(self, config: Config, runner: Runner) -> ModeJob:
        """The coordinator-side part (runs on a worker thread: it may build models and load data)."""

    def hosters(self) -> dict[type, Hoster]:
        """Spec type -> what spawns it on a worker node."""
