"""Training modes as plug-ins: one module per mode, one registry that everything reads.

Each mode module defines a :class:`~dniasync.cluster.mode_api.Mode` (the
contract lives in :mod:`dniasync.cluster.mode_api`, which imports no mode);
this package holds only the registry. Adding a method = a module here plus
one line in :data:`MODES`; nothing else branches on the mode's name.

Mode modules import torch and the training actors only inside the functions
that need them, so parsing a config or starting a plain node stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._schema import ConfigError
from ..mode_api import Mode
from .downpour import DOWNPOUR
from .hogwild import HOGWILD
from .p2p import P2P
from .pipeline import PIPELINE
from .sandblaster import SANDBLASTER

if TYPE_CHECKING:
    from ...actors import ActorRef
    from ..hosts import Host

__all__ = ["MODES", "RENAMED", "get_mode", "host_spec"]

MODES: dict[str, Mode] = {mode.name: mode for mode in (DOWNPOUR, HOGWILD, PIPELINE, SANDBLASTER, P2P)}
"""Every mode by its ``job.mode`` name."""

RENAMED: dict[str, str] = {
    "dni": "was renamed: use job.mode = 'pipeline' and a [pipeline] section (its 'variant' key is now 'method')",
}
"""Former mode names and section names, with what to write instead."""


def get_mode(name: str) -> Mode:
    """The mode called ``name``; a :class:`ConfigError` on ``job.mode`` listing the known ones."""
    mode = MODES.get(name)
    if mode is not None:
        return mode
    if name in RENAMED:
        raise ConfigError(f"'job.mode' {name!r} {RENAMED[name]}", "job.mode")
    raise ConfigError(f"'job.mode' is {name!r}; choose one of {', '.join(map(repr, MODES))}", "job.mode")


async def host_spec(host: Host, spec: Any) -> list[ActorRef]:
    """Spawn what an assignment's ``spec`` describes, whichever mode it belongs to."""
    for mode in MODES.values():
        hoster = mode.hosters().get(type(spec))
        if hoster is not None:
            return await hoster(host, spec)
    raise TypeError(f"no mode hosts a {type(spec).__name__}")
