"""Wire-ready message classes: a registry of stable type tags and field schemas.

``actors`` owns the registry so that training code can declare messages
without importing the transport; the codec in ``dniasync.remote`` reads it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["MessageSpec", "message", "message_class", "message_spec", "registered_messages"]

T = TypeVar("T")

_TAG_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


@dataclass(frozen=True)
class MessageSpec:
    """How a registered message class looks on the wire."""

    tag: str
    cls: type
    field_names: tuple[str, ...]

    def field_types(self) -> dict[str, Any]:
        """Resolved type hints of the fields (resolved lazily: forward refs are common)."""
        hints = typing.get_type_hints(self.cls)
        return {name: hints[name] for name in self.field_names}


_by_tag: dict[str, MessageSpec] = {}
_by_cls: dict[type, MessageSpec] = {}


def message(tag: str) -> typing.Callable[[type[T]], type[T]]:
    """Register a dataclass as a message with a stable wire tag.

    A class that is not yet a dataclass is made one (frozen). Tags are unique
    and must stay the same across versions: the tag, not the Python name, is
    what travels.

    >>> @message("example.Ping")
    ... class Ping:
    ...     n: int
    """
    if not tag or not set(tag) <= _TAG_CHARS or len(tag) > 128:
        raise ValueError(f"invalid message tag {tag!r}: use 1-128 of [A-Za-z0-9._-]")

    def register(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls):
            cls = dataclass(frozen=True)(cls)
        known = _by_tag.get(tag)
        if known is not None and (known.cls.__module__, known.cls.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"message tag {tag!r} already registered for {known.cls.__qualname__}")
        spec = MessageSpec(tag, cls, tuple(f.name for f in dataclasses.fields(cls)))  # type: ignore[arg-type]
        if known is not None:
            _by_cls.pop(known.cls, None)  # module reloaded: the new class replaces the old
        _by_tag[tag] = spec
        _by_cls[cls] = spec
        return cls

    return register


def message_spec(cls: type) -> MessageSpec:
    """The spec of a registered message class; ``KeyError`` if it is not registered."""
    try:
        return _by_cls[cls]
    except KeyError:
        raise KeyError(f"{cls.__qualname__} is not a registered message (use @message)") from None


def message_class(tag: str) -> type:
    """The class registered under ``tag``; ``KeyError`` for an unknown tag."""
    try:
        return _by_tag[tag].cls
    except KeyError:
        raise KeyError(f"unknown message tag {tag!r}") from None


def registered_messages() -> dict[str, MessageSpec]:
    """A snapshot of the registry, tag -> spec."""
    return dict(_by_tag)
