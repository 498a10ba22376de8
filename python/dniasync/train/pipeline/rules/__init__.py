"""Update rules: what a pipeline stage does with each batch, chosen by name.

``RULES`` maps a config name to a rule class; :func:`get_rule` looks one up
and :func:`make_rule` builds one for a stage. Adding a rule is a class (see
:class:`UpdateRule`) and one line here.
"""

from __future__ import annotations

from typing import Final

from ..settings import StageSettings, StageShape
from .base import NOTHING, Kept, Outcome, StageContext, UpdateRule
from .dni import CDNIRule, DNIRule
from .gpipe import GPipeRule
from .real import AsyncRule, SpecTrainRule, SpecTrainStashRule, StashRule

__all__ = [
    "NOTHING",
    "RULES",
    "AsyncRule",
    "CDNIRule",
    "DNIRule",
    "GPipeRule",
    "Kept",
    "Outcome",
    "SpecTrainRule",
    "SpecTrainStashRule",
    "StageContext",
    "StashRule",
    "UpdateRule",
    "get_rule",
    "make_rule",
]

RULES: Final[dict[str, type[UpdateRule]]] = {
    "dni": DNIRule,
    "cdni": CDNIRule,
    "sync": GPipeRule,
    "async": AsyncRule,
    "stash": StashRule,
    "spectrain": SpecTrainRule,
    "spectrain_stash": SpecTrainStashRule,
}


def get_rule(name: str) -> type[UpdateRule]:
    """The rule class registered as ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return RULES[name]
    except KeyError:
        known = ", ".join(repr(n) for n in RULES)
        raise ValueError(f"unknown update rule {name!r}; known rules: {known}") from None


def make_rule(settings: StageSettings, shape: StageShape) -> UpdateRule:
    """A fresh rule object of ``settings.rule`` for a stage of ``shape``."""
    return get_rule(settings.rule)(settings, shape)
