"""The actor runtime: actors, refs, supervision. Usable alone, without training.

Nothing here knows about websockets or torch; ``dniasync.remote`` plugs in as
a :class:`Transport` to make refs location-transparent.
"""

from ._actor import Actor, handler
from ._backoff import Backoff
from ._errors import (
    ActorError,
    ActorNameTaken,
    ActorNotFound,
    ActorStopped,
    ActorUnreachable,
    AskTimeout,
    MailboxFull,
    SupervisionEscalated,
    UnhandledMessage,
)
from ._message import MessageSpec, message, message_class, message_spec, registered_messages
from ._ref import DEFAULT_ASK_TIMEOUT, ActorRef, Destination, Transport, split_address
from ._supervision import Directive, SupervisorStrategy, one_for_all, one_for_one
from ._system import ActorSystem, SystemListener

__all__ = [
    "DEFAULT_ASK_TIMEOUT",
    "Actor",
    "ActorError",
    "ActorNameTaken",
    "ActorNotFound",
    "ActorRef",
    "ActorStopped",
    "ActorSystem",
    "ActorUnreachable",
    "AskTimeout",
    "Backoff",
    "Destination",
    "Directive",
    "MailboxFull",
    "MessageSpec",
    "SupervisionEscalated",
    "SupervisorStrategy",
    "SystemListener",
    "Transport",
    "UnhandledMessage",
    "handler",
    "message",
    "message_class",
    "message_spec",
    "one_for_all",
    "one_for_one",
    "registered_messages",
    "split_address",
]
