"""``ActorRef``: the handle through which every message is sent, local or remote."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

__all__ = ["DEFAULT_ASK_TIMEOUT", "ActorRef", "Destination", "Transport", "split_address"]

DEFAULT_ASK_TIMEOUT = 30.0
"""Seconds an ``ask`` waits for its reply unless told otherwise."""


class Destination(Protocol):
    """Where an ``ActorRef`` delivers: a local actor's cell or a remote proxy.

    ``dniasync.remote`` implements this for actors on other nodes, which is how
    a ref looks the same whether its actor is local or remote.
    """

    @property
    def alive(self) -> bool: ...

    def ask(self, msg: Any, timeout: float | None) -> Coroutine[Any, Any, Any]: ...

    def tell(self, msg: Any) -> Coroutine[Any, Any, None]: ...

    def tell_nowait(self, msg: Any) -> None: ...

    def unsent_bytes(self) -> int: ...

    def silent_for(self) -> float: ...


class Transport(Protocol):
    """Resolves addresses on other nodes; plugged into an ``ActorSystem``."""

    def destination(self, address: str) -> Destination: ...


def split_address(address: str) -> tuple[str, str]:
    """``"name@node"`` -> ``("name", "node")``; ``ValueError`` if malformed."""
    name, sep, node = address.rpartition("@")
    if not sep or not name or not node:
        raise ValueError(f"actor address must look like 'name@node', got {address!r}")
    return name, node


class ActorRef:
    """A handle to an actor: ``tell`` it, ``ask`` it, pass it inside messages.

    Refs compare and hash by address (``name@node``), so two refs to the same
    actor are equal wherever they came from. A ref stays valid across restarts
    of its actor; once the actor is stopped, every send fails at once with
    :class:`~dniasync.actors.ActorStopped`.
    """

    __slots__ = ("_address", "_dest")

    def __init__(self, address: str, destination: Destination) -> None:
        self._address = address
        self._dest = destination

    @property
    def address(self) -> str:
        """``name@node``; the node is ``host:port`` once the system listens."""
        return self._address

    @property
    def name(self) -> str:
        return self._address.rpartition("@")[0]

    @property
    def node(self) -> str:
        return self._address.rpartition("@")[2]

    @property
    def is_alive(self) -> bool:
        """False once the actor is stopped (or its node is known to be down)."""
        return self._dest.alive

    def tell(self, msg: Any) -> Coroutine[Any, Any, None]:
        """Send ``msg`` without waiting for it to be handled.

        Awaiting returns once the message is in the mailbox; while the mailbox
        is full it waits (backpressure). Raises ``ActorStopped`` if the actor
        is stopped.
        """
        return self._dest.tell(msg)

    def tell_nowait(self, msg: Any) -> None:
        """Send ``msg`` now or raise ``MailboxFull``; never waits."""
        self._dest.tell_nowait(msg)

    def unsent_bytes(self) -> int:
        """Bytes sent to this actor's node that have not reached it yet (0 for a local actor).

        Flow control for a sender that must not wait: the messages still queued for the connection, what the
        event loop's transport and the kernel hold of it (sent but not yet acknowledged by the peer). A figure
        that stays high means the link, or the node at its end, takes messages slower than they are sent.
        Cheap (one system call), and safe to read from any thread.
        """
        return self._dest.unsent_bytes()

    def silent_for(self) -> float:
        """Seconds since this node last received anything from the actor's node: a message to any actor, a reply,
        a heartbeat (0 for a local actor; ``inf`` while there is no connection to that node).

        Liveness for a sender that must not wait: unlike a reply, it does not depend on how fast the actor works
        through its mailbox, so a node busy with a long queue still counts as heard while its link carries anything.
        Safe to read from any thread.
        """
        return self._dest.silent_for()

    def ask(self, msg: Any, timeout: float | None = DEFAULT_ASK_TIMEOUT) -> Coroutine[Any, Any, Any]:
        """Send ``msg`` and wait for the handler's return value.

        An exception raised by the handler is raised here. ``AskTimeout`` after
        ``timeout`` seconds (``None``: no limit); ``ActorStopped`` at once if the
        actor is stopped, or as soon as it stops before replying.
        """
        return self._dest.ask(msg, timeout)

    def __hash__(self) -> int:
        return hash(self._address)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ActorRef):
            return NotImplemented
        return self._address == other._address

    def __repr__(self) -> str:
        return f"ActorRef({self._address!r})"

    def __str__(self) -> str:
        return self._address
