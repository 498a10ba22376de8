"""One way to run the event loop: ``asyncio.Runner`` over uvloop.

uvloop is used whenever it is importable; asyncio's own loop is the fallback
(Windows, or an environment without uvloop). No loop policies, no
``uvloop.install()``: the loop factory is passed explicitly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["loop_factory", "run", "uses_uvloop"]

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """The event-loop factory dniasync runs on: uvloop's when available."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def uses_uvloop() -> bool:
    """True when :func:`run` will run on uvloop."""
    return loop_factory() is not asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Run ``main`` to completion on a fresh loop (uvloop when available)."""
    with asyncio.Runner(loop_factory=loop_factory(), debug=debug) as runner:
        return runner.run(main)
