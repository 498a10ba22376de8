"""Typed errors of the actor runtime. Every failure a caller can see is one of these."""

from __future__ import annotations

__all__ = [
    "ActorError",
    "ActorNameTaken",
    "ActorNotFound",
    "ActorStopped",
    "ActorUnreachable",
    "AskTimeout",
    "MailboxFull",
    "SupervisionEscalated",
    "UnhandledMessage",
]


class ActorError(Exception):
    """Base class of every error raised by the actor runtime."""


class ActorStopped(ActorError):
    """The target actor is stopped (or stopping): the message was not handled.

    Raised at once by ``ask``/``tell`` to a stopped actor, and given to every
    ask still pending when an actor stops, so no caller ever waits forever.
    """

    def __init__(self, address: str, detail: str = "actor is stopped") -> None:
        super().__init__(f"{address}: {detail}")
        self.address = address


class ActorUnreachable(ActorStopped):
    """The actor lives on a node that is down, partitioned or not connected."""


class AskTimeout(ActorError, TimeoutError):
    """No reply arrived within the ask's timeout."""

    def __init__(self, address: str, timeout: float) -> None:
        super().__init__(f"{address}: no reply within {timeout:g} s")
        self.address = address
        self.timeout = timeout


class ActorNotFound(ActorError, LookupError):
    """No actor is registered under that name or address."""


class ActorNameTaken(ActorError, ValueError):
    """An actor with that name is already running in this system."""


class MailboxFull(ActorError):
    """``tell_nowait`` found the bounded mailbox full (``tell`` would have waited)."""


class UnhandledMessage(ActorError, TypeError):
    """The actor has no handler for this message class."""


class SupervisionEscalated(ActorError):
    """A failure escalated past the root supervisor; the system shut down.

    The failure that started it is the ``__cause__``.
    """
