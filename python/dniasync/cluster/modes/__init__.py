"""Training modes as plug-ins: one module per mode, one registry that everything reads.

A mode is a :class:`Mode` (what config parsing, the node and the launcher ask
of it: its section's schema, its cross-section rules, how many processes it
needs) plus the :class:`ModeJob` it creates on the coordinator (what the job
runner asks of it while the job runs) and the spec types its workers host.
Adding a method = a module here plus one line in :data:`MODES`; nothing else
branches on the mode's name.

Mode modules import torch and the training actors only inside the functions
that need them, so parsing a config or starting a plain node stays fast.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .._schema import ConfigError, Section

if TYPE_CHECKING:
    from torch import nn

    from ...actors import ActorRef
    from ...train.checkpoint import LoadedCheckpoint, Part
    from ...train.messages import Progress
    from ..config import Config
    from ..hosts import Host
    from ..job import JobRunner
    from ..protocol import Assignment, JoinJob, NoJob, Ready
    from ..report import RunReport

__all__ = [
    "MODES",
    "RENAMED",
    "JobFailed",
    "Mode",
    "ModeJob",
    "Snapshot",
    "get_mode",
    "host_spec",
]


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


Hoster = Callable[["Host", Any], Awaitable[list["ActorRef"]]]
"""Spawns what a spec describes on a worker node (its host is the parent); returns the refs."""


class ModeJob(Protocol):
    """The coordinator-side part of a running job (see :class:`~dniasync.cluster.job.JobRunner`)."""

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
        """Each worker (replica, layer group) -> ``alive`` / ``dead``."""

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
        """What a worker process is called in messages (``replica``, ``layer-group worker``)."""

    @property
    def member_kind(self) -> str:
        """What the job's status lists as its members (``replica``, ``layer group``)."""

    def data_shards(self, settings: Any) -> int: ...

    def check(self, config: Config, raw: Mapping[str, Any]) -> None:
        """Rules across sections; raise :class:`~dniasync.cluster.config.ConfigError` naming the key."""

    def resolve(self, config: Config, model: nn.Module) -> None:
        """Rules against the model the config builds."""

    def processes(self, config: Config) -> tuple[int, int]:
        """(PS processes, worker processes) the job needs."""

    def summary_lines(self, config: Config, doc: Mapping[str, Any]) -> list[str]:
        """Mode-specific lines of the launcher's closing summary."""

    def job(self, config: Config, runner: JobRunner) -> ModeJob:
        """The coordinator-side part (runs on a worker thread: it may build models and load data)."""

    def hosters(self) -> dict[type, Hoster]:
        """Spec type -> what spawns it on a worker node."""


def _modes() -> dict[str, Mode]:
    from .downpour import DOWNPOUR
    from .hogwild import HOGWILD
    from .pipeline import PIPELINE
    from .sandblaster import SANDBLASTER

    return {mode.name: mode for mode in (DOWNPOUR, HOGWILD, PIPELINE, SANDBLASTER)}


MODES: dict[str, Mode] = _modes()
"""Every mode by its ``job.mode`` name."""

RENAMED: dict[str, str] = {
    "dni": "was renamed: use job.mode = 'pipeline' and a [pipeline] section (its 'variant' key is now 'method')",
}
"""Former mode names and section names, with what to write instead."""


def get_mode(name: str) -> Mode:
    """The mode called ``name``; a :class:`ConfigError` on ``job.mode`` listing the known ones."""
    mode = MODES.get(name)
    if mode is not None:
        return mode
    if name in RENAMED:
        raise ConfigError(f"'job.mode' {name!r} {RENAMED[name]}", "job.mode")
    raise ConfigError(f"'job.mode' is {name!r}; choose one of {', '.join(map(repr, MODES))}", "job.mode")


async def host_spec(host: Host, spec: Any) -> list[ActorRef]:
    """Spawn what an assignment's ``spec`` describes, whichever mode it belongs to."""
    for mode in MODES.values():
        hoster = mode.hosters().get(type(spec))
        if hoster is not None:
            return await hoster(host, spec)
    raise TypeError(f"no mode hosts a {type(spec).__name__}")
