"""Errors and replies crossing the wire: a remote failure as a local exception, a reply written at once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..actors import ActorNotFound, ActorStopped, ActorUnreachable, UnhandledMessage
from ._errors import DecodeError, RemoteError

if TYPE_CHECKING:
    from ._peer import Peer

__all__ = ["ReplySink", "remote_error"]


def remote_error(address: str, remote_type: str, detail: str) -> Exception:
    """The local exception for an error that a remote handler (or node) raised."""
    if remote_type == "ActorNotFound":
        return ActorNotFound(detail)
    if remote_type == "ActorUnreachable":
        return ActorUnreachable(address, detail)
    if remote_type == "ActorStopped":
        return ActorStopped(address, "stopped on its node")
    if remote_type == "UnhandledMessage":
        return UnhandledMessage(detail)
    if remote_type == "DecodeError":
        return DecodeError(f"{address}: the receiving node could not decode the message: {detail}", fatal=False)
    return RemoteError(remote_type, detail, address)


class ReplySink:
    """Where a local handler's answer to a remote ask goes: straight onto the wire.

    Quacks like the ``asyncio.Future`` an ``ActorCell`` expects as a reply,
    but writes the reply when it is set instead of a loop iteration later.
    """

    __slots__ = ("peer", "corr", "_done")

    def __init__(self, peer: Peer, corr: int) -> None:
        self.peer = peer
        self.corr = corr
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        if not self._done:
            self._done = True
            self.peer.reply(self.corr, value, None)

    def set_exception(self, exc: BaseException) -> None:
        if not self._done:
            self._done = True
            self.peer.reply(self.corr, None, exc)

    def cancel(self) -> bool:
        self._done = True
        return True
