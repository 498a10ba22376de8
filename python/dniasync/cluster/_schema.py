"""The job config's schema machinery: msgspec structs, errors that name the dotted key, docs.

Each TOML section is a :class:`Section` (a frozen msgspec ``Struct`` that
forbids unknown fields). A field's type carries its bounds and its one-line
reference (``Annotated[int, Meta(ge=1, description="...")]``), so one
definition gives parsing, validation, the error and the docs. What a type
cannot say is declared beside it:

- ``only_for``: a key that applies only for some values of a sibling key
  (``tau`` only with ``codec = "threshold"``), checked on the keys the user wrote;
- ``__post_init__`` raising :class:`KeyProblem` for the other cross-key rules.

msgspec's errors are turned into ours: the dotted key, the near miss for a
typo, and plain words ("must be at least 1, got 0").
"""

from __future__ import annotations

import difflib
import math
import re
import typing
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar

import msgspec
import msgspec.inspect as mi

__all__ = ["ConfigError", "KeyProblem", "Section", "convert_section", "reference", "section_keys", "to_table"]

S = TypeVar("S", bound="Section")


class ConfigError(ValueError):
    """A job config is malformed; ``key`` is the dotted key at fault (None for the file itself)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class KeyProblem(Exception):
    """Raised by a section's ``__post_init__``: ``message`` may hold ``{key}`` (the dotted key)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One TOML table of a job config."""

    only_for: ClassVar[dict[str, tuple[str, tuple[str, ...]]]] = {}
    """key -> (sibling key, the sibling's values it applies to)."""
    renamed: ClassVar[dict[str, str]] = {}
    """former key -> the key that replaced it (named in the error)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _note_literals(cls)

    def check_given(self, given: frozenset[str]) -> None:
        """Rules on which keys the user wrote (raise :class:`KeyProblem`); none by default."""


def section_keys(cls: type[Section]) -> tuple[str, ...]:
    return tuple(f.name for f in mi.type_info(cls).fields)  # type: ignore[attr-defined]


def _type_name(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array", dict: "a table"}
    return names.get(type(value), type(value).__name__)


def unknown_key(dotted: str, key: str, allowed: tuple[str, ...], what: str = "key") -> str:
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    hint = f" (did you mean '{close[0]}'?)" if close else f" (allowed: {', '.join(allowed)})"
    return f"unknown {what} '{dotted}'{hint}"


_NUMBERS = {2: "two", 3: "three"}
_DECLARED_CHOICES: list[tuple[Any, ...]] = []
"""Every Literal of every section in the order it was written (msgspec sorts them)."""


def _note_literals(cls: type) -> None:
    def walk(tp: Any) -> None:
        if typing.get_origin(tp) is typing.Literal:
            _DECLARED_CHOICES.append(typing.get_args(tp))
        for arg in typing.get_args(tp):
            walk(arg)

    for hint in typing.get_type_hints(cls, include_extras=True).values():
        walk(hint)


_VIOLATED: dict[str, tuple[str, Callable[[float, float], bool]]] = {
    "gt": (">", lambda v, b: v <= b), "ge": (">=", lambda v, b: v < b),
    "lt": ("<", lambda v, b: v >= b), "le": ("<=", lambda v, b: v > b),
}


def _bounds(t: Any, value: float) -> str | None:
    for attr, (op, bad) in _VIOLATED.items():
        bound = getattr(t, attr, None)
        if bound is not None and bad(value, bound):
            if isinstance(t, mi.IntType) and attr == "ge":
                return f"must be at least {bound}, got {value}"
            return f"must be {op} {bound}, got {value}"
    return None


def _problem(value: Any, t: Any) -> str | None:
    """What is wrong with ``value`` for type ``t`` in our words; None if it fits."""
    if isinstance(t, mi.Metadata):
        return _problem(value, t.type)
    if isinstance(t, mi.UnionType):
        members = [m for m in t.types if not isinstance(m, mi.NoneType)]
        problems = [_problem(value, m) for m in members]
        if any(p is None for p in problems):
            return None
        return problems[0] if len(members) == 1 else f"must be {' or '.join(_kind(m) for m in members)}, got {_type_name(value)}"
    if isinstance(t, mi.IntType):
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer, got {_type_name(value)}"
        return _bounds(t, value)
    if isinstance(t, mi.FloatType):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"must be a number, got {_type_name(value)}"
        if not math.isfinite(value):
            return f"must be finite, got {value}"
        return _bounds(t, float(value))
    if isinstance(t, mi.BoolType):
        return None if isinstance(value, bool) else f"must be true or false, got {_type_name(value)}"
    if isinstance(t, mi.StrType):
        return None if isinstance(value, str) else f"must be a string, got {_type_name(value)}"
    if isinstance(t, mi.LiteralType):
        if value in t.values:
            return None
        declared = next((c for c in _DECLARED_CHOICES if set(c) == set(t.values)), t.values)
        return f"is {value!r}; choose one of {', '.join(map(repr, declared))}"
    if isinstance(t, mi.DictType):
        return None if isinstance(value, dict) else f"must be a table, got {_type_name(value)}"
    if isinstance(t, mi.TupleType):
        n = len(t.item_types)
        if not isinstance(value, list | tuple) or len(value) != n:
            return f"must be an array of {_NUMBERS.get(n, n)} {_kind(t.item_types[0], plural=True)}, got {value!r}"
        return next((p for v, it in zip(value, t.item_types) if (p := _problem(v, it))), None)
    if isinstance(t, mi.VarTupleType | mi.ListType):
        if not isinstance(value, list | tuple):
            return f"must be an array of {_kind(t.item_type, plural=True)}, got {_type_name(value)}"
        if any(_problem(v, t.item_type) for v in value):
            return f"must be an array of {_kind(t.item_type, plural=True)}, got {value!r}"
        return None
    return None


def _kind(t: Any, plural: bool = False) -> str:
    if isinstance(t, mi.Metadata):
        return _kind(t.type, plural)
    s = "s" if plural else ""
    if isinstance(t, mi.IntType):
        return f"integer{s}" if plural else "an integer"
    if isinstance(t, mi.FloatType):
        return f"number{s}" if plural else "a number"
    if isinstance(t, mi.StrType):
        return f"string{s}" if plural else "a string"
    if isinstance(t, mi.TupleType):
        return f"arrays of {_kind(t.item_types[0], True)}"
    if isinstance(t, mi.VarTupleType | mi.ListType):
        return f"arrays of {_kind(t.item_type, True)}"
    return "a value"


_AT = re.compile(r" - at `\$\.?([A-Za-z_0-9]*)")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]+)`")
_MISSING = re.compile(r"Object missing required field `([^`]+)`")


def convert_section(name: str, raw: Any, cls: type[S]) -> S:
    """Validate the TOML table ``raw`` as section ``name`` of type ``cls``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"'{name}' must be a table, got {_type_name(raw)}", name)
    keys = section_keys(cls)
    for key in raw:
        if key in cls.renamed:
            raise ConfigError(f"'{name}.{key}' was renamed: use '{name}.{cls.renamed[key]}'", f"{name}.{key}")
        if key not in keys:
            raise ConfigError(unknown_key(f"{name}.{key}", key, keys), f"{name}.{key}")
    fields = {f.name: f for f in mi.type_info(cls).fields}  # type: ignore[attr-defined]
    for key, value in raw.items():  # our words for type and bound errors, before msgspec's
        problem = _problem(value, fields[key].type)
        if problem is not None:
            dotted = f"{name}.{key}"
            raise ConfigError(f"'{dotted}' {problem}", dotted)
    try:
        section = msgspec.convert(raw, cls, strict=True)
    except KeyProblem as p:
        dotted = f"{name}.{p.key}"
        raise ConfigError(p.message.format(key=dotted), dotted) from None
    except msgspec.ValidationError as e:
        text = str(e)
        missing = _MISSING.search(text)
        if missing:
            dotted = f"{name}.{missing.group(1)}"
            raise ConfigError(f"missing required key '{dotted}'", dotted) from None
        at = _AT.search(text)
        dotted = f"{name}.{at.group(1)}" if at and at.group(1) else name
        raise ConfigError(f"'{dotted}': {text.split(' - at ')[0]}", dotted) from None
    try:
        section.check_given(frozenset(raw))
    except KeyProblem as p:
        dotted = f"{name}.{p.key}"
        raise ConfigError(p.message.format(key=dotted), dotted) from None
    for key, (sibling, values) in cls.only_for.items():
        actual = getattr(section, sibling)
        if key in raw and actual not in values:
            dotted = f"{name}.{key}"
            raise ConfigError(
                f"'{dotted}' applies only when {name}.{sibling} is {' or '.join(map(repr, values))} (it is {actual!r})",
                dotted,
            )
    return section


def to_table(section: Section) -> dict[str, Any]:
    """TOML-shaped plain data of ``section``, defaults and None left out."""
    out: dict[str, Any] = {}
    for f in mi.type_info(type(section)).fields:  # type: ignore[attr-defined]
        value = getattr(section, f.name)
        default = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
        if value is None or (f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT) and value == default:
            continue
        out[f.name] = msgspec.to_builtins(value)
    return out


def _describe(t: Any) -> str:
    if isinstance(t, mi.Metadata):
        return _describe(t.type)
    if isinstance(t, mi.UnionType):
        return " or ".join(_describe(m) for m in t.types if not isinstance(m, mi.NoneType))
    if isinstance(t, mi.LiteralType):
        return " | ".join(map(repr, t.values))
    if isinstance(t, mi.IntType | mi.FloatType):
        kind = "int" if isinstance(t, mi.IntType) else "float"
        limits = [f"{op} {getattr(t, a)}" for a, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
                  if getattr(t, a) is not None]
        return f"{kind} {', '.join(limits)}".strip()
    names: dict[type, str] = {mi.StrType: "str", mi.BoolType: "bool", mi.DictType: "table"}
    return names.get(type(t), "array")


def _description(t: Any) -> str:
    if isinstance(t, mi.Metadata):
        return str((t.extra_json_schema or {}).get("description", "")) or _description(t.type)
    if isinstance(t, mi.UnionType):
        return next((d for m in t.types if (d := _description(m))), "")
    return ""


def reference(name: str, cls: type[Section]) -> Iterator[str]:
    """Markdown lines documenting section ``name``: each key, its type and default, what it does."""
    doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
    yield f"### `[{name}]`" + (f" — {doc}" if doc else "")
    yield ""
    for f in mi.type_info(cls).fields:  # type: ignore[attr-defined]
        if f.required:
            default = "required"
        else:
            value = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
            default = "unset" if value is None else f"default `{msgspec.json.encode(msgspec.to_builtins(value)).decode()}`"
        rule = cls.only_for.get(f.name)
        applies = f"; only when `{rule[0]}` is {' or '.join(f'`{v}`' for v in rule[1])}" if rule else ""
        yield f"- `{f.name}` ({_describe(f.type)}, {default}{applies}): {_description(f.type)}"
    yield ""
