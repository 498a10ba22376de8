"""The ``Actor`` base class and the ``@handler`` decorator."""

from __future__ import annotations

import asyncio
import inspect
import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, overload

from ._errors import ActorError, UnhandledMessage
from ._supervision import Directive, SupervisorStrategy, one_for_one

if TYPE_CHECKING:
    from ._cell import ActorCell
    from ._ref import ActorRef
    from ._system import ActorSystem

__all__ = ["Actor", "handler"]

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")

_HANDLES = "__dniasync_handles__"


@overload
def handler(message_type: type, /, *more: type) -> Callable[[F], F]: ...
@overload
def handler(func: F, /) -> F: ...
def handler(*args: Any) -> Any:
    """Mark a method as the handler for a message class.

    ``@handler`` alone takes the class from the annotation of the message
    parameter (a union registers every member); ``@handler(Ping, Pong)`` names
    them explicitly. Handlers may be plain or ``async`` methods; the value they
    return is the reply to an ``ask``.
    """
    if len(args) == 1 and inspect.isfunction(args[0]):
        func = args[0]
        setattr(func, _HANDLES, None)  # resolved from annotations on first use
        return func
    if not args or not all(isinstance(a, type) for a in args):
        raise TypeError("use @handler or @handler(MessageClass, ...)")

    def mark(func: F) -> F:
        setattr(func, _HANDLES, tuple(args))
        return func

    return mark


def _annotated_types(func: Callable[..., Any]) -> tuple[type, ...]:
    params = list(inspect.signature(func).parameters.values())
    if len(params) != 2:
        raise TypeError(f"handler {func.__qualname__} must take (self, message)")
    hints = typing.get_type_hints(func)
    hint = hints.get(params[1].name)
    if hint is None:
        raise TypeError(f"handler {func.__qualname__}: annotate the message parameter or use @handler(Cls)")
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else (hint,)
    if not all(isinstance(m, type) for m in members):
        raise TypeError(f"handler {func.__qualname__}: {hint!r} is not a class")
    return tuple(members)


class Actor:
    """Base class of every actor.

    Subclasses declare handlers with :func:`handler`. The runtime guarantees
    one message at a time per actor, in order of arrival. Lifecycle hooks:

    - ``on_start``: before the first message of this instance (also after a restart);
    - ``on_failure(exc)``: this instance raised while handling a ``tell`` (or in
      ``on_start``); it will see no more messages; its supervisor decides next;
    - ``on_stop``: the actor is stopping for good, or being restarted because
      a sibling failed under a one-for-all supervisor.

    An exception raised while handling an ``ask`` goes back to the caller and
    does not fail the actor. ``supervisor_strategy`` governs this actor's
    children; ``mailbox_size`` bounds its mailbox (0 = unbounded).

    ``urgent_messages``: messages of these classes (or subclasses) overtake
    the ordinary messages already queued; among themselves they keep their
    order of arrival, and the mailbox bound covers them too. An instance may
    set its own in ``__init__`` (messages that arrive before it exists use
    the class's).
    """

    supervisor_strategy: ClassVar[SupervisorStrategy] = one_for_one()
    mailbox_size: ClassVar[int] = 1024
    urgent_messages: tuple[type, ...] = ()

    _cell: ActorCell
    _table: ClassVar[dict[type, tuple[str, bool]] | None] = None

    def __new__(cls, *args: Any, **kwargs: Any) -> Actor:
        from ._cell import constructing

        self = super().__new__(cls)
        cell = constructing.get()
        if cell is None:
            raise TypeError(f"{cls.__name__} is an actor: create it with ActorSystem.spawn or Actor.spawn")
        self._cell = cell
        return self

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._table = None

    @classmethod
    def handler_table(cls) -> dict[type, tuple[str, bool]]:
        """Message class -> (method name, is async), built once per class."""
        cached: dict[type, tuple[str, bool]] | None = cls.__dict__.get("_table")
        if cached is not None:
            return cached
        table: dict[type, tuple[str, bool]] = {}
        for klass in reversed(cls.__mro__):
            for attr, func in vars(klass).items():
                if not inspect.isfunction(func) or not hasattr(func, _HANDLES):
                    continue
                handled = getattr(func, _HANDLES) or _annotated_types(func)
                for msg_type in handled:
                    table[msg_type] = (attr, inspect.iscoroutinefunction(func))
        cls._table = table
        return table

    # -- identity -----------------------------------------------------------
    @property
    def ref(self) -> ActorRef:
        """This actor's own ref (valid across restarts)."""
        return self._cell.ref

    @property
    def name(self) -> str:
        return self._cell.name

    @property
    def system(self) -> ActorSystem:
        return self._cell.system

    @property
    def children(self) -> list[ActorRef]:
        """Refs of this actor's running children, in spawn order."""
        return [child.ref for child in self._cell.children.values()]

    # -- lifecycle hooks ----------------------------------------------------
    async def on_start(self) -> None:
        """Called before this instance handles its first message."""

    async def on_stop(self) -> None:
        """Called once when the actor stops (children are already stopped)."""

    async def on_failure(self, exc: BaseException) -> None:
        """Called when this instance failed with ``exc``; release what it holds."""

    def receive(self, msg: Any) -> Any:
        """Fallback for messages without a handler; raises ``UnhandledMessage``."""
        raise UnhandledMessage(f"{type(self).__name__} has no handler for {type(msg).__qualname__}")

    # -- acting -------------------------------------------------------------
    async def spawn(
        self,
        cls: type[Actor],
        *args: Any,
        name: str | None = None,
        mailbox_size: int | None = None,
        supervision: Directive | None = None,
        **kwargs: Any,
    ) -> ActorRef:
        """Start a child actor supervised by this one (see ``ActorSystem.spawn``)."""
        return await self._cell.system.spawn_child(
            self._cell, cls, args, kwargs, name=name, mailbox_size=mailbox_size, supervision=supervision
        )

    def send_later(self, delay: float, msg: Any) -> asyncio.TimerHandle:
        """Tell this actor ``msg`` after ``delay`` seconds: a timer, a retry, a poll.

        Dropped silently if the actor has stopped (or its mailbox is full) by
        then; cancel the returned handle to take it back.
        """
        ref = self.ref

        def deliver() -> None:
            try:
                ref.tell_nowait(msg)
            except ActorError:
                pass

        return asyncio.get_running_loop().call_later(delay, deliver)

    def stop(self) -> None:
        """Stop this actor after the current message; pending messages fail."""
        self._cell.request_stop(drain=False)

    async def run_blocking(self, func: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Run blocking work (a torch step, a long Rust call) on the system's threads.

        The event loop keeps serving other actors, heartbeats and timers meanwhile.
        """
        return await self._cell.system.run_blocking(func, *args, **kwargs)
