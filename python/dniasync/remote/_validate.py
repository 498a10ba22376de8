"""Validating decoded messages: a field check per annotation, compiled once per message class.

Every field of a registered message is checked against its annotation as it
is decoded (ints, floats, strings, unions, literals, tuples, mappings,
arrays, tensors, refs, nested messages), so a peer cannot hand an actor a
value of the wrong type.
"""

from __future__ import annotations

import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..actors import ActorRef, message_class, message_spec
from ._errors import DecodeError

__all__ = ["Check", "Schema", "message_schema"]


Check = Callable[[Any], Any]


class Schema:
    """How to check and build one message class from its decoded fields."""

    __slots__ = ("cls", "names", "_count", "_checked")

    def __init__(self, cls: type, names: tuple[str, ...], checks: tuple[Check, ...]) -> None:
        self.cls = cls
        self.names = names
        self._count = len(names)
        self._checked = tuple((i, check) for i, check in enumerate(checks) if check is not _identity)
        """(position, check) of the fields with something to check: ``Any`` costs nothing."""

    def build(self, tag: str, fields: Any) -> Any:
        """The message from its decoded field list (checked and converted in place)."""
        if type(fields) is not list or len(fields) != self._count:
            raise DecodeError(f"{tag}: expected {self._count} fields")
        i = 0
        try:
            for i, check in self._checked:
                fields[i] = check(fields[i])
        except _Mismatch as exc:
            raise DecodeError(f"{tag}.{self.names[i]}: {exc}", fatal=False) from None
        try:
            return self.cls(*fields)
        except Exception as exc:  # __post_init__ validation of the class itself
            raise DecodeError(f"{tag}: {type(exc).__name__}: {exc}") from None


_schemas: dict[str, Schema] = {}


def _torch() -> Any:
    return sys.modules.get("torch")


def message_schema(tag: str) -> Schema:
    try:
        cls = message_class(tag)
    except KeyError:
        raise DecodeError(f"unknown message tag {tag[:128]!r}") from None
    cached = _schemas.get(tag)
    if cached is not None and cached.cls is cls:
        return cached
    spec = message_spec(cls)
    try:
        hints = spec.field_types()
    except Exception:  # unresolvable annotations: accept any value rather than refuse the class
        hints = {name: Any for name in spec.field_names}
    schema = Schema(cls, spec.field_names, tuple(_checker(hints[name]) for name in spec.field_names))
    _schemas[tag] = schema
    return schema


class _Mismatch(Exception):
    pass


def _identity(value: Any) -> Any:
    return value


def _checker(tp: Any) -> Check:  # noqa: C901 - one branch per kind of annotation
    if tp is Any or tp is object:
        return _identity
    if tp is None or tp is type(None):
        return _exact(type(None), "None")
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or isinstance(tp, types.UnionType):
        members = [_checker(a) for a in args]

        def union(value: Any) -> Any:
            for member in members:
                try:
                    return member(value)
                except _Mismatch:
                    continue
            raise _Mismatch(f"{_short(value)} matches none of {tp}")

        return union
    if origin is typing.Literal:
        allowed = args

        def literal(value: Any) -> Any:
            if value not in allowed:
                raise _Mismatch(f"{_short(value)} is not one of {allowed}")
            return value

        return literal
    if tp is float:

        def as_float(value: Any) -> float:
            if isinstance(value, float):
                return value
            if isinstance(value, int) and not isinstance(value, bool):
                return float(value)
            raise _Mismatch(f"expected float, got {_short(value)}")

        return as_float
    if tp is int:

        def as_int(value: Any) -> int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            raise _Mismatch(f"expected int, got {_short(value)}")

        return as_int
    if tp in (str, bytes, bool):
        return _exact(tp, tp.__name__)
    if origin in (list, Sequence, typing.Sequence) or tp in (list, Sequence):
        item = _checker(args[0]) if args else _identity
        to_tuple = False
        return _sequence(item, to_tuple)
    if origin is tuple or tp is tuple:
        if not args or (len(args) == 2 and args[1] is Ellipsis):
            return _sequence(_checker(args[0]) if args else _identity, True)
        fixed = [_checker(a) for a in args]

        def fixed_tuple(value: Any) -> tuple[Any, ...]:
            if not isinstance(value, (list, tuple)) or len(value) != len(fixed):
                raise _Mismatch(f"expected a {len(fixed)}-tuple, got {_short(value)}")
            return tuple(check(v) for check, v in zip(fixed, value))

        return fixed_tuple
    if origin in (dict, Mapping, typing.Mapping) or tp in (dict, Mapping):
        key = _checker(args[0]) if args else _identity
        val = _checker(args[1]) if args else _identity

        def mapping(value: Any) -> dict[Any, Any]:
            if not isinstance(value, dict):
                raise _Mismatch(f"expected a dict, got {_short(value)}")
            return {key(k): val(v) for k, v in value.items()}

        return mapping
    if tp is ActorRef:
        return _exact(ActorRef, "ActorRef")
    if tp is np.ndarray or origin is np.ndarray:
        return _as_ndarray
    if getattr(tp, "__module__", "") == "torch" and getattr(tp, "__name__", "") == "Tensor":
        return _as_tensor
    if isinstance(tp, type):
        return _exact(tp, tp.__qualname__)
    return _identity  # TypeVar, NewType, ...: nothing checkable


def _exact(cls: type, name: str) -> Check:
    def exact(value: Any) -> Any:
        if not isinstance(value, cls):
            raise _Mismatch(f"expected {name}, got {_short(value)}")
        return value

    return exact


def _sequence(item: Check, to_tuple: bool) -> Check:
    def sequence(value: Any) -> Any:
        if not isinstance(value, list):
            raise _Mismatch(f"expected a sequence, got {_short(value)}")
        if item is not _identity:
            value = [item(v) for v in value]
        return tuple(value) if to_tuple else value

    return sequence


def _as_ndarray(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return value.numpy()  # shares memory with the received buffer
    raise _Mismatch(f"expected an array, got {_short(value)}")


def _as_tensor(value: Any) -> Any:
    torch = _torch()
    if torch is not None and isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        import torch as torch_module

        return torch_module.from_numpy(value)
    raise _Mismatch(f"expected a tensor, got {_short(value)}")


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
