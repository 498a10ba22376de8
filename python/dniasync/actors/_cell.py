"""An actor's cell: its mailbox, its task, its supervision. Internal."""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import TYPE_CHECKING, Any, Final

from ._actor import Actor
from ._errors import ActorStopped, AskTimeout, MailboxFull
from ._mailbox import Mailbox
from ._ref import ActorRef
from ._supervision import Directive, RestartIntensity, SupervisorStrategy

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._system import ActorSystem

log = logging.getLogger("dniasync.actors")

constructing: contextvars.ContextVar[ActorCell | None] = contextvars.ContextVar(
    "dniasync_constructing", default=None
)


class _Control:
    __slots__ = ("kind", "error")

    def __init__(self, kind: str, error: BaseException | None = None) -> None:
        self.kind = kind
        self.error = error


_STOP: Final = _Control("stop")
_RESTART: Final = _Control("restart")

STARTING, RUNNING, STOPPING, STOPPED = "starting", "running", "stopping", "stopped"


def _expire(reply: asyncio.Future[Any], address: str, timeout: float) -> None:
    if not reply.done():
        reply.set_exception(AskTimeout(address, timeout))


class Supervisor:
    """What a parent cell and the system root have in common: children to supervise."""

    strategy: SupervisorStrategy
    intensity: RestartIntensity
    children: dict[str, ActorCell]

    def escalate(self, exc: BaseException, child: ActorCell) -> None:
        raise NotImplementedError


class ActorCell(Supervisor):
    """Runs one actor: a mailbox, one task, the current instance, its children."""

    def __init__(
        self,
        system: ActorSystem,
        name: str,
        cls: type[Actor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        parent: Supervisor,
        mailbox_size: int,
        supervision: Directive | None,
    ) -> None:
        self.system = system
        self.name = name
        self.address = f"{name}@{system.node}"
        self.cls = cls
        self.args = args
        self.kwargs = kwargs
        self.parent = parent
        self.supervision = supervision
        self.strategy = cls.supervisor_strategy
        self.intensity = RestartIntensity(self.strategy.max_restarts, self.strategy.within_s)
        self.children = {}
        self.loop = asyncio.get_running_loop()
        self.mailbox = Mailbox(mailbox_size, self.loop)
        self.ref = ActorRef(self.address, self)
        self.state = STARTING
        self.instance: Actor | None = None
        self.task: asyncio.Task[None] | None = None
        self.started: asyncio.Future[None] = self.loop.create_future()
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.restarts = 0
        self.dropped = 0
        self._dispatch: dict[type, tuple[Callable[[Any], Any], bool]] = {}
        self._killed = False
        self.context = contextvars.copy_context()
        """The context the actor's task runs in; plain handlers run at delivery (:meth:`handle_now`) run in it too."""
        self.urgent: tuple[type, ...] = tuple(cls.urgent_messages)

    def is_urgent(self, msg: Any) -> bool:
        """Whether ``msg`` overtakes ordinary messages in this actor's mailbox."""
        return bool(self.urgent) and isinstance(msg, self.urgent)

    def _try_put(self, item: tuple[Any, Any]) -> bool:
        if self.urgent and isinstance(item[0], self.urgent):
            return self.mailbox.try_put_urgent(item)
        return self.mailbox.try_put(item)

    # -- Destination --------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.state is STARTING or self.state is RUNNING

    def unsent_bytes(self) -> int:
        return 0  # a local actor's messages go straight to its mailbox

    def silent_for(self) -> float:
        return 0.0  # on this node

    def tell_nowait(self, msg: Any) -> None:
        if self.state is STOPPING or self.state is STOPPED:
            raise ActorStopped(self.address)
        if not self._try_put((msg, None)):
            raise MailboxFull(f"{self.address}: mailbox full ({self.mailbox.capacity} messages)")

    async def tell(self, msg: Any) -> None:
        if self.state is STOPPING or self.state is STOPPED:
            raise ActorStopped(self.address)
        item = (msg, None)
        urgent = self.urgent
        if urgent and isinstance(msg, urgent):
            if not self.mailbox.try_put_urgent(item):
                await self.mailbox.put(item, True)
        elif not self.mailbox.try_put(item):
            await self.mailbox.put(item)

    async def ask(self, msg: Any, timeout: float | None) -> Any:
        if self.state is STOPPING or self.state is STOPPED:
            raise ActorStopped(self.address)
        reply: asyncio.Future[Any] = self.loop.create_future()
        item = (msg, reply)
        if not self._try_put(item):
            try:
                async with asyncio.timeout(timeout):
                    await self.mailbox.put(item, self.is_urgent(msg))
            except TimeoutError:
                raise AskTimeout(self.address, timeout or 0.0) from None
            except ActorStopped:
                reply.cancel()  # the cell may have failed it too: nobody will read that
                raise
        if timeout is None:
            return await reply
        handle = self.loop.call_later(timeout, _expire, reply, self.address, timeout)
        try:
            return await reply
        finally:
            handle.cancel()

    def handle_now(self, msg: Any, reply: Any) -> bool:
        """Handle ``msg`` at once if this actor is idle and its handler is plain (not ``async``).

        Idle means the actor's task waits on an empty mailbox between two
        messages, so handling ``msg`` here is what the task would do next:
        one message at a time and arrival order hold. The handler runs in the
        actor's context; its outcome goes where the task would send it (the
        reply, or for a failed ``tell`` the supervisor, through the task,
        before any later message). False (nothing done) otherwise.
        """
        mailbox = self.mailbox
        if self.state is not RUNNING or not mailbox.consumer_waiting():
            return False
        try:
            entry = self._dispatch.get(type(msg)) or self._resolve(type(msg))
            if entry[1]:
                return False
            result = self.context.run(entry[0], msg)
        except Exception as exc:
            if reply is not None:
                if not reply.done():
                    reply.set_exception(exc)
            else:
                mailbox.put_control(_Control("fail", exc), front=True)  # the task recovers before anything else
            return True
        if reply is not None and not reply.done():
            reply.set_result(result)
        return True

    # -- control from outside ------------------------------------------------
    def request_stop(self, *, drain: bool) -> None:
        """Stop after the current message (``drain``: after everything queued)."""
        if self.state is STOPPING or self.state is STOPPED:
            return
        self.state = STOPPING
        self.mailbox.put_control(_STOP, front=not drain)

    def kill(self) -> None:
        """Cancel the message being handled: the stop did not finish in time."""
        if self.task is not None and not self.task.done():
            self._killed = True
            self.task.cancel()

    async def stopped(self, timeout: float) -> None:
        """Wait until stopped, cancelling a handler that holds the stop up past ``timeout``."""
        while True:
            try:
                await asyncio.wait_for(asyncio.shield(self.done), timeout)
                return
            except TimeoutError:
                log.warning("actor %s did not stop within %g s: cancelling its current message", self.address, timeout)
                self.kill()

    def request_restart(self) -> None:
        if self.alive:
            self.mailbox.put_control(_RESTART, front=True)

    def escalate(self, exc: BaseException, child: ActorCell) -> None:
        if self.alive:
            self.mailbox.put_control(_Control("fail", exc), front=True)

    # -- the actor's task ----------------------------------------------------
    async def run(self) -> None:
        try:
            try:
                await self._create_instance()
                running = True
            except Exception as exc:
                running = await self._recover(exc)
            if running and self.state is STARTING:
                self.state = RUNNING
            if not self.started.done():
                self.started.set_result(None)
            mailbox = self.mailbox
            while running:
                item = mailbox.get_nowait() if mailbox._items else await mailbox.get()
                if type(item) is tuple:
                    msg, reply = item
                    try:
                        entry = self._dispatch.get(type(msg)) or self._resolve(type(msg))
                        result = entry[0](msg)
                        if entry[1]:
                            result = await result
                    except Exception as exc:
                        if reply is not None:
                            if not reply.done():
                                reply.set_exception(exc)
                        else:
                            running = await self._recover(exc)
                    except asyncio.CancelledError:
                        if not self._killed:
                            raise
                        asyncio.current_task().uncancel()  # type: ignore[union-attr]
                        if reply is not None and not reply.done():
                            reply.set_exception(ActorStopped(self.address, "stopped while handling this message"))
                        break
                    else:
                        if reply is not None and not reply.done():
                            reply.set_result(result)
                elif item is _STOP:
                    break
                elif item is _RESTART:
                    running = await self._restart_healthy()
                else:
                    assert item.error is not None
                    running = await self._recover(item.error)
        finally:
            await self._finish()

    def _resolve(self, msg_type: type) -> tuple[Callable[[Any], Any], bool]:
        instance = self.instance
        assert instance is not None
        table = type(instance).handler_table()
        for klass in msg_type.__mro__:
            found = table.get(klass)
            if found is not None:
                entry = (getattr(instance, found[0]), found[1])
                break
        else:
            entry = (instance.receive, False)
        self._dispatch[msg_type] = entry
        return entry

    async def _create_instance(self) -> None:
        token = constructing.set(self)
        try:
            instance = self.cls(*self.args, **self.kwargs)
        finally:
            constructing.reset(token)
        self._dispatch = {}
        self.instance = instance
        self.urgent = tuple(instance.urgent_messages)
        await instance.on_start()

    async def _recover(self, exc: BaseException) -> bool:
        """This instance failed: ask the supervisor; True if running again."""
        while True:
            if not await self._supervise(exc):
                return False
            await self._stop_children()
            self.restarts += 1
            self.system.note_restart(self, exc)
            try:
                await self._create_instance()
                return True
            except Exception as start_exc:
                exc = start_exc

    async def _supervise(self, exc: BaseException) -> bool:
        instance, self.instance = self.instance, None
        log.warning("actor %s failed: %r", self.address, exc, exc_info=exc)
        if instance is not None:
            await self._hook(instance.on_failure(exc), "on_failure")
        supervisor = self.parent
        strategy = supervisor.strategy
        directive = self.supervision or strategy.decide(exc)
        if directive is Directive.RESTART and not supervisor.intensity.allow(self.system.clock()):
            log.error(
                "restart intensity exceeded under %s (%d in %gs): escalating",
                getattr(supervisor, "address", "the root"),
                strategy.max_restarts,
                strategy.within_s,
            )
            directive = Directive.ESCALATE
        if directive is Directive.RESTART:
            if strategy.scheme == "one_for_all":
                for sibling in list(supervisor.children.values()):
                    if sibling is not self:
                        sibling.request_restart()
            return True
        if directive is Directive.ESCALATE:
            supervisor.escalate(exc, self)
        return False

    async def _restart_healthy(self) -> bool:
        """Restart requested by a one-for-all supervisor: this instance did not fail."""
        instance, self.instance = self.instance, None
        if instance is not None:
            await self._hook(instance.on_stop(), "on_stop")
        await self._stop_children()
        try:
            await self._create_instance()
            return True
        except Exception as exc:
            return await self._recover(exc)

    async def _stop_children(self) -> None:
        for child in reversed(list(self.children.values())):
            child.request_stop(drain=False)
            await child.stopped(self.system.stop_timeout)

    async def _hook(self, coro: Any, what: str) -> None:
        try:
            await coro
        except Exception:
            log.exception("actor %s: %s raised", self.address, what)

    async def _finish(self) -> None:
        self.state = STOPPING
        try:
            await self._stop_children()
            instance, self.instance = self.instance, None
            if instance is not None:
                await self._hook(instance.on_stop(), "on_stop")
        finally:
            error = ActorStopped(self.address)
            for item in self.mailbox.close(error):
                if type(item) is tuple:
                    reply = item[1]
                    if reply is None:
                        self.dropped += 1
                    elif not reply.done():
                        reply.set_exception(ActorStopped(self.address))
            self.state = STOPPED
            self.system.forget(self)
            if not self.started.done():
                self.started.set_exception(ActorStopped(self.address, "stopped before it started"))
                self.started.exception()  # retrieved here: spawn re-raises its own
            self.done.set_result(None)
