"""The weight-sync interface: how one trainer's weights are shared, and the registry of the ways to do it.

A :class:`WeightSync` sits between a trainer (a data-parallel
:class:`~dniasync.train.replica.Replica` or a pipeline
:class:`~dniasync.train.pipeline.stage.Stage`) and its optimizer: the trainer
runs forward and backward, and the sync decides what the gradients become (a
local optimizer step, an accumulator pushed to PS shards, an in-place update
of a shared store, ...) and when weights come back from elsewhere.

The call order a trainer follows::

    await sync.ready()                  # on the loop, before a batch (a first pull)
    n = sync.steps_per_call(steps)      # how many steps to run in one thread hop
    # on a worker thread, n times: zero_grad(), forward, backward, step()
    await sync.sync(samples)            # on the loop, after the run (push / pull as the cadence says)

Each way of sharing is a :class:`SyncKind` in :data:`SYNCS`, keyed by its
config name: its spec class (a registered ``@message``, so it travels in an
assignment), how a worker builds it, whether it needs PS shards and whether it
owns the optimizer. :func:`build_sync` picks the kind by the spec's class.
Adding a sync is one module that calls :func:`register` once, and one import
line in ``train/sync/__init__.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ...actors import Actor
    from ..flat import FlatModel
    from ..specs import OptimizerSpec

__all__ = [
    "SYNCS",
    "Clock",
    "SyncContext",
    "SyncKind",
    "StepScales",
    "SyncStats",
    "WeightSync",
    "build_sync",
    "register",
    "sync_kind",
]

Clock = Callable[[], float]
S = TypeVar("S")


@dataclass
class SyncStats:
    """What a sync has sent and received so far (payload bytes, and what the pushes would take as float32)."""

    bytes_pushed: int = 0
    bytes_pulled: int = 0
    dense_bytes_pushed: int = 0
    pushes: int = 0
    pulls: int = 0
    versions: list[int] = field(default_factory=list)
    """The version of each remote copy (PS shard, peer) the local weights were last brought to."""
    extra: dict[str, float] = field(default_factory=dict)
    """Figures only this kind of sync has (e.g. ``dense_pulls``, ``delta_pulls``)."""
    pusher: str = ""
    """With PS shards: the key under which their copies count this trainer's pushes
    (:func:`~dniasync.train.chain.pusher`); empty for other syncs."""


@dataclass
class SyncContext:
    """What a sync is built with besides its spec and the model: who trains, and with what."""

    name: str
    """The trainer's name (as the PS shards and peers know it)."""
    incarnation: int
    """This trainer's incarnation (pushes are idempotent per (name, incarnation, seq))."""
    optimizer: OptimizerSpec
    """The optimizer and lr the trainer steps with where the sync applies the update itself."""
    actor: Actor | None = None
    """The owning actor: a sync that receives messages spawns a child of it."""
    clock: Clock = time.monotonic
    ask_timeout_s: float = 10.0
    """How long a pull waits for an answer."""


class StepScales:
    """The ``lr_scale`` of each step (:meth:`WeightSync.step`) since the last update was applied or sent: an
    update that carries several steps' gradients applies their mean."""

    def __init__(self) -> None:
        self._sum = 0.0
        self._count = 0

    def add(self, scale: float) -> None:
        self._sum += scale
        self._count += 1

    def take(self) -> float:
        """The mean scale of the steps added since the last call (1 if none), and start again."""
        mean = self._sum / self._count if self._count else 1.0
        self._sum, self._count = 0.0, 0
        return mean


class WeightSync(Protocol):
    """How one trainer's weights are stepped and shared.

    ``zero_grad`` and ``step`` run on worker threads, the rest on the event loop.
    """

    @property
    def flat(self) -> FlatModel | None:
        """The model's parameters as views of one flat buffer (``flat.grad`` accumulates), where the sync has one."""

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The torch optimizer whose state moves with layers on a regroup (None: the update is applied elsewhere)."""

    @property
    def pulls_params(self) -> bool:
        """The weights come from elsewhere before the next batch: a checkpoint of the trainer need not keep them."""

    def zero_grad(self) -> None:
        """Clear the parameters' ``.grad`` before a backward."""

    def step(self, lr_scale: float = 1.0) -> None:
        """After a backward: apply the gradients in the parameters' ``.grad``, or set them aside to share.

        ``lr_scale`` multiplies the lr of this step only, wherever the optimizer runs (a gate on one step, as the
        DNI rules' on a synthetic gradient; :meth:`scale_lr` sets the lr for all steps). Scaling the gradient
        instead is not the same: Adam and Adagrad divide it by its own running size."""

    def steps_per_call(self, steps: int) -> int:
        """How many steps to run in one hand-off to a worker thread, ``steps`` taken so far (at least 1)."""

    async def ready(self) -> None:
        """Before a batch trains: the weights are the shared ones (the first pull)."""

    async def sync(self, samples: int) -> None:
        """After a run of steps (on ``samples`` samples): push and pull as the cadence says."""

    def scale_lr(self, scale: float) -> None:
        """Step with the configured lr times ``scale`` from now on."""

    def lr_now(self) -> float:
        """The lr the next step applies (NaN when the update is applied elsewhere, e.g. by PS shards)."""

    async def flush(self) -> None:
        """Share what has been set aside now (before the layers or the shards change)."""

    def relinked(self, layers: nn.Module) -> WeightSync:
        """The sync for ``layers`` after a regroup (the caller has moved the optimizer state, if any)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the sync (a local optimizer's state; nothing when it lives elsewhere)."""

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a :meth:`state_dict` back (into a sync of the same parameters)."""

    def stats(self) -> SyncStats: ...

    async def close(self) -> None:
        """Let go of whatever the sync holds (child actors, shared memory)."""


@dataclass(frozen=True)
class SyncKind(Generic[S]):
    """One way of sharing weights: its config name, its spec class and how a worker builds it from the spec."""

    name: str
    spec: type[S]
    build: Callable[[S, nn.Module, SyncContext], WeightSync]
    needs_ps: bool
    """The job runs PS shards for it."""
    owns_optimizer: bool
    """The trainer's own optimizer applies the update (else the shards or the shared store do)."""
    doc: str


SYNCS: dict[str, SyncKind[Any]] = {}
"""Every registered sync, by config name."""


def register(kind: SyncKind[Any]) -> SyncKind[Any]:
    """Add ``kind`` to :data:`SYNCS` (a name or a spec class registered twice is an error)."""
    known = SYNCS.get(kind.name)
    if known is not None and _where(known.spec) != _where(kind.spec):  # the same module reloaded replaces it
        raise ValueError(f"a weight sync named {kind.name!r} is already registered")
    clash = [k.name for k in SYNCS.values() if _where(k.spec) == _where(kind.spec) and k.name != kind.name]
    if clash:
        raise ValueError(f"spec {kind.spec.__qualname__} already belongs to the weight sync {clash[0]!r}")
    SYNCS[kind.name] = kind
    return kind


def _where(cls: type) -> tuple[str, str]:
    return cls.__module__, cls.__qualname__


def sync_kind(name: str) -> SyncKind[Any]:
    """The sync registered as ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return SYNCS[name]
    except KeyError:
        known = ", ".join(repr(n) for n in SYNCS)
        raise ValueError(f"unknown weight sync {name!r}; known syncs: {known}") from None


def build_sync(spec: object, model: nn.Module, ctx: SyncContext) -> WeightSync:
    """The sync ``spec`` describes, built over ``model``'s parameters (the kind is the one of ``type(spec)``)."""
    for kind in SYNCS.values():
        if type(spec) is kind.spec:
            return kind.build(spec, model, ctx)
    known = ", ".join(f"{k.name} ({k.spec.__qualname__})" for k in SYNCS.values())
    raise ValueError(f"no weight sync is registered for a {type(spec).__qualname__}; known: {known}")
