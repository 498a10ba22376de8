"""dniasync: asynchronous, distributed neural-network training on asyncio actors.

The actor runtime is importable on its own (``from dniasync import ActorSystem``);
training lives in ``dniasync.train``, the transport in ``dniasync.remote``.
"""

from importlib.metadata import PackageNotFoundError, version

from .actors import (
    DEFAULT_ASK_TIMEOUT,
    Actor,
    ActorError,
    ActorNameTaken,
    ActorNotFound,
    ActorRef,
    ActorStopped,
    ActorSystem,
    ActorUnreachable,
    AskTimeout,
    Directive,
    MailboxFull,
    SupervisionEscalated,
    SupervisorStrategy,
    SystemListener,
    UnhandledMessage,
    handler,
    message,
    one_for_all,
    one_for_one,
)
from .runtime import run

try:
    __version__ = version("dniasync")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

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
    "Directive",
    "MailboxFull",
    "SupervisionEscalated",
    "SupervisorStrategy",
    "SystemListener",
    "UnhandledMessage",
    "__version__",
    "handler",
    "message",
    "one_for_all",
    "one_for_one",
    "run",
]
