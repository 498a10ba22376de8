"""``ActorSystem``: owns the actors of one node, their tasks and their threads."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

from ._actor import Actor
from ._cell import ActorCell, Supervisor
from ._errors import ActorNameTaken, ActorNotFound, ActorStopped, SupervisionEscalated
from ._ref import ActorRef, Transport, split_address
from ._supervision import Directive, RestartIntensity, SupervisorStrategy, one_for_one

__all__ = ["ActorSystem", "SystemListener"]

log = logging.getLogger("dniasync.actors")
R = TypeVar("R")


class SystemListener:
    """Receives runtime events (restarts, stops); subclass and override what you need.

    The observability layer uses this to count restarts without ``actors``
    knowing about Prometheus.
    """

    def actor_restarted(self, address: str, actor_class: str, error: BaseException) -> None:
        """An actor was restarted by its supervisor after ``error``."""

    def actor_stopped(self, address: str, actor_class: str, dropped: int) -> None:
        """An actor stopped; ``dropped`` tells were discarded from its mailbox."""


class _Root(Supervisor):
    def __init__(self, system: ActorSystem, strategy: SupervisorStrategy) -> None:
        self.system = system
        self.strategy = strategy
        self.intensity = RestartIntensity(strategy.max_restarts, strategy.within_s)
        self.children = {}

    def escalate(self, exc: BaseException, child: ActorCell) -> None:
        self.system._escalated(exc, child)


class ActorSystem:
    """The actors of one node, as an async context manager.

    ::

        async with ActorSystem() as system:
            ref = await system.spawn(Greeter, name="greeter")
            print(await ref.ask(Greet("ada")))

    Leaving the block stops every actor (children before parents, last spawned
    first), fails every pending ask with ``ActorStopped`` and leaves no task
    behind. A failure that escalates past ``supervisor`` (the root strategy)
    shuts the system down and raises :class:`SupervisionEscalated`.

    ``clock`` is the monotonic clock that restart intensity is measured with
    (inject one in tests). ``blocking_threads`` sizes the pool behind
    :meth:`run_blocking`. An actor whose current message holds up its stop
    for more than ``stop_timeout`` seconds has that handler cancelled (an
    ask it was answering fails with ``ActorStopped``), so shutdown never hangs
    on, say, a handler waiting for room in another actor's full mailbox.
    """

    def __init__(
        self,
        node: str = "local",
        *,
        supervisor: SupervisorStrategy | None = None,
        clock: Callable[[], float] = time.monotonic,
        blocking_threads: int | None = None,
        stop_timeout: float = 10.0,
    ) -> None:
        if "@" in node or not node:
            raise ValueError(f"node name must be non-empty and contain no '@', got {node!r}")
        self._node = node
        self._root = _Root(self, supervisor or one_for_one())
        self.clock = clock
        self._blocking_threads = blocking_threads or max(2, os.cpu_count() or 2)
        self._executor: ThreadPoolExecutor | None = None
        self._cells: dict[str, ActorCell] = {}
        self._transport: Transport | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._closing = False
        self._failure: BaseException | None = None
        self._listeners: list[SystemListener] = []
        self._names = itertools.count(1)
        self.stop_timeout = stop_timeout
        self.restart_count = 0

    # -- context manager ----------------------------------------------------
    async def __aenter__(self) -> ActorSystem:
        if self._tg is not None:
            raise RuntimeError("an ActorSystem can be entered only once")
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._tg is not None
        try:
            await self.shutdown()
        finally:
            try:
                await self._tg.__aexit__(exc_type, exc, tb)
            except BaseExceptionGroup as group:
                # actor tasks never raise; the group holds the body's own error and/or the escalation
                if group.subgroup(lambda e: not isinstance(e, (BaseExceptionGroup, SupervisionEscalated)) and e is not exc):
                    raise
                if self._failure is not None:
                    raise SupervisionEscalated("a failure escalated past the root supervisor") from self._failure
                return  # only the body's exception: let it propagate unwrapped
            finally:
                if self._executor is not None:
                    self._executor.shutdown(wait=True)
                    self._executor = None
        if self._failure is not None and exc_type is None:
            raise SupervisionEscalated("a failure escalated past the root supervisor") from self._failure

    async def shutdown(self) -> None:
        """Stop every actor, last spawned first; idempotent."""
        self._closing = True
        for cell in reversed(list(self._root.children.values())):
            cell.request_stop(drain=False)
            await cell.stopped(self.stop_timeout)

    # -- identity -----------------------------------------------------------
    @property
    def node(self) -> str:
        """This node's name: ``"local"``, or ``host:port`` once a transport is attached."""
        return self._node

    def attach_transport(self, transport: Transport, node: str) -> None:
        """Make refs to other nodes resolvable; names this node. Before any spawn."""
        if self._cells:
            raise RuntimeError("attach the transport before spawning actors (their addresses name the node)")
        if "@" in node or not node:
            raise ValueError(f"node name must be non-empty and contain no '@', got {node!r}")
        self._transport = transport
        self._node = node

    def add_listener(self, listener: SystemListener) -> None:
        self._listeners.append(listener)

    # -- spawning, finding, stopping ----------------------------------------
    async def spawn(
        self,
        cls: type[Actor],
        *args: Any,
        name: str | None = None,
        mailbox_size: int | None = None,
        supervision: Directive | None = None,
        **kwargs: Any,
    ) -> ActorRef:
        """Start a top-level actor and return its ref once ``on_start`` has run.

        ``args``/``kwargs`` go to ``cls``'s constructor (again on every
        restart). ``name`` must be unique in this system (default
        ``ClassName-N``); ``mailbox_size`` overrides ``cls.mailbox_size``;
        ``supervision`` overrides the root strategy's decision for this actor.
        """
        return await self.spawn_child(
            None, cls, args, kwargs, name=name, mailbox_size=mailbox_size, supervision=supervision
        )

    async def spawn_child(
        self,
        parent: ActorCell | None,
        cls: type[Actor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        name: str | None,
        mailbox_size: int | None,
        supervision: Directive | None,
    ) -> ActorRef:
        if self._tg is None:
            raise RuntimeError("enter the ActorSystem (async with) before spawning")
        if self._closing:
            raise ActorStopped(f"system@{self._node}", "system is shutting down")
        if not (isinstance(cls, type) and issubclass(cls, Actor)):
            raise TypeError(f"spawn takes an Actor subclass, got {cls!r}")
        if name is None:
            name = f"{cls.__name__}-{next(self._names)}"
        elif not name or "@" in name or "/" in name:
            raise ValueError(f"actor name must be non-empty without '@' or '/', got {name!r}")
        if name in self._cells:
            raise ActorNameTaken(f"an actor named {name!r} is already running")
        size = cls.mailbox_size if mailbox_size is None else mailbox_size
        supervisor: Supervisor = self._root if parent is None else parent
        cell = ActorCell(self, name, cls, args, kwargs, supervisor, size, supervision)
        self._cells[name] = cell
        supervisor.children[name] = cell
        cell.task = self._tg.create_task(cell.run(), name=f"actor:{cell.address}", context=cell.context)
        if parent is not None and cell.task is asyncio.current_task():
            return cell.ref
        await asyncio.shield(cell.started)
        return cell.ref

    def lookup(self, name: str) -> ActorRef:
        """The ref of the running local actor called ``name``."""
        cell = self._cells.get(name)
        if cell is None:
            raise ActorNotFound(f"no actor named {name!r} on {self._node}")
        return cell.ref

    def ref(self, address: str) -> ActorRef:
        """A ref from an address ``name@node``; ``name`` alone means this node."""
        if "@" not in address:
            return self.lookup(address)
        name, node = split_address(address)
        if node == self._node:
            return self.lookup(name)
        if self._transport is None:
            raise ActorNotFound(f"{address}: no transport attached, only local actors ({self._node}) resolve")
        return ActorRef(address, self._transport.destination(address))

    async def stop(self, ref: ActorRef, *, drain: bool = False) -> None:
        """Stop a local actor and its children; returns once it has stopped.

        Without ``drain`` the actor stops after its current message and every
        message still queued fails (asks get ``ActorStopped``). With ``drain``
        it first handles what is already queued. Called by the actor on itself,
        it returns at once and the stop happens after the current message.
        """
        cell = self._cells.get(ref.name) if ref.node == self._node else None
        if cell is None:
            if ref.node != self._node:
                raise ValueError(f"{ref.address} is not local to {self._node}; stop it on its own node")
            return  # already stopped
        cell.request_stop(drain=drain)
        if cell.task is asyncio.current_task():
            return
        if drain:
            await asyncio.shield(cell.done)  # draining may take as long as the queue takes
        else:
            await cell.stopped(self.stop_timeout)

    def deliver(self, name: str, msg: Any, reply: Any) -> bool:
        """Enqueue ``msg`` for the local actor ``name`` without waiting; for transports.

        Keeps arrival order, which a task per message would not. ``reply``
        (for an ask) gets the handler's result or error: an ``asyncio.Future``
        or any object with ``done``, ``set_result``, ``set_exception`` and
        ``cancel`` (a transport writes the reply from there, without a loop
        round trip). An idle actor with a plain (not ``async``) handler for
        ``msg`` handles it at once, in its own context (one loop round trip
        less; order and supervision as through the mailbox). False if the
        mailbox is full (then :meth:`deliver_wait`); ``ActorNotFound``/``ActorStopped``.
        """
        cell = self._cells.get(name)
        if cell is None:
            raise ActorNotFound(f"no actor named {name!r} on {self._node}")
        if not cell.alive:
            raise ActorStopped(cell.address)
        return cell.handle_now(msg, reply) or cell._try_put((msg, reply))

    async def deliver_wait(self, name: str, msg: Any, reply: Any) -> None:
        """Like :meth:`deliver`, waiting while the mailbox is full."""
        cell = self._cells.get(name)
        if cell is None:
            raise ActorNotFound(f"no actor named {name!r} on {self._node}")
        if not cell.alive:
            raise ActorStopped(cell.address)
        await cell.mailbox.put((msg, reply), cell.is_urgent(msg))

    def actors(self) -> list[ActorRef]:
        """Refs of every running local actor."""
        return [cell.ref for cell in self._cells.values()]

    def mailbox_depth(self, ref: ActorRef) -> int:
        """Messages waiting for a local actor (0 if it is not running)."""
        cell = self._cells.get(ref.name)
        return len(cell.mailbox) if cell is not None else 0

    # -- blocking work ------------------------------------------------------
    async def run_blocking(self, func: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run ``func`` on a worker thread so the event loop keeps serving messages."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._blocking_threads, thread_name_prefix="dniasync-blocking")
        loop = asyncio.get_running_loop()
        call = functools.partial(func, *args, **kwargs) if kwargs else functools.partial(func, *args)
        return await loop.run_in_executor(self._executor, call)

    # -- called by cells ----------------------------------------------------
    def note_restart(self, cell: ActorCell, exc: BaseException) -> None:
        self.restart_count += 1
        log.warning("actor %s restarted (%d restarts) after %r", cell.address, cell.restarts, exc)
        for listener in self._listeners:
            listener.actor_restarted(cell.address, cell.cls.__name__, exc)

    def forget(self, cell: ActorCell) -> None:
        if self._cells.get(cell.name) is cell:
            del self._cells[cell.name]
        cell.parent.children.pop(cell.name, None)
        for listener in self._listeners:
            listener.actor_stopped(cell.address, cell.cls.__name__, cell.dropped)

    def _escalated(self, exc: BaseException, child: ActorCell) -> None:
        if self._failure is not None:
            return
        self._failure = exc
        log.error("failure of %s escalated past the root supervisor: shutting down", child.address)
        assert self._tg is not None

        async def abort() -> None:
            await self.shutdown()
            raise SupervisionEscalated(f"failure of {child.address} escalated past the root supervisor") from exc

        self._tg.create_task(abort(), name="dniasync-escalation")
