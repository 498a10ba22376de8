"""Typed errors of the remote layer."""

from __future__ import annotations

from ..actors import ActorError

__all__ = ["AuthError", "DecodeError", "ProtocolError", "RemoteError"]


class DecodeError(ActorError, ValueError):
    """A frame or message could not be decoded (unknown tag, wrong types, bad sizes).

    ``fatal`` is true when the byte stream itself can no longer be trusted
    (truncated, oversized, malformed header): the connection is then closed.
    """

    def __init__(self, detail: str, *, fatal: bool = True) -> None:
        super().__init__(detail)
        self.fatal = fatal


class ProtocolError(ActorError):
    """The peer broke the protocol (wrong version, unexpected frame)."""


class AuthError(ActorError, PermissionError):
    """The peer could not prove it holds the cluster token (or we could not)."""


class RemoteError(ActorError):
    """A handler on another node raised; carries the remote type name and message.

    Exceptions never travel as serialized objects: only their type name and text.
    """

    def __init__(self, remote_type: str, detail: str, address: str = "") -> None:
        where = f" (from {address})" if address else ""
        super().__init__(f"{remote_type}: {detail}{where}")
        self.remote_type = remote_type
        self.detail = detail
        self.address = address
