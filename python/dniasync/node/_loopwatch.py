"""A thread that notices when a node's event loop stops turning, and logs where every thread is while it is held.

A node whose loop is held up (a handler or a call that blocks it, or another
thread keeping the GIL) answers nothing: its heartbeats stop, so its peers
declare it dead after ``detect_s``, and its ``/metrics`` and live page hang.
After the fact nothing says why. :class:`LoopWatch` beats on the loop every
``tick_s``; a thread of its own checks the beat and, the first time in a stall
that it is ``warn_s`` old, logs a warning with every thread's stack (the loop's
thread shows what holds it), and another when the loop turns again. When the
watch's own thread could not run for ``warn_s`` either, that is logged first:
the whole process was stopped (SIGSTOP, a debugger) or starved of CPU, or one
call kept the GIL (a stack showing only the loop's native frames then points
to the first two).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

__all__ = ["LoopWatch"]

log = logging.getLogger(__name__)

WARN_S = 3.0
"""The remote layer's default ``detect_s``: a loop held up this long gets its node declared dead by its peers."""


def thread_stacks() -> str:
    """Every thread's current stack, the innermost call last, each headed by the thread's name."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"thread {names.get(ident, ident)!s}:\n{stack}")
    return "\n".join(parts)


class LoopWatch:
    """Watch ``loop`` from a daemon thread: :meth:`start` on the loop, :meth:`stop` before it closes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, warn_s: float = WARN_S, tick_s: float = 0.5) -> None:
        if not 0 < tick_s < warn_s:
            raise ValueError(f"need 0 < tick_s < warn_s, got {tick_s} and {warn_s}")
        self.loop = loop
        self.warn_s = warn_s
        self.tick_s = tick_s
        self.stalls = 0
        """Stalls of at least ``warn_s`` seen so far."""
        self.pauses = 0
        """Times the watch's own thread could not run for ``warn_s`` or more."""
        self._beat_at = time.monotonic()
        self._handle: asyncio.TimerHandle | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dniasync-loop-watch", daemon=True)

    def start(self) -> None:
        self._beat()
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._handle is not None:
            self._handle.cancel()
        if self._thread.is_alive():
            self._thread.join()

    def _beat(self) -> None:
        self._beat_at = time.monotonic()
        if not self._stopped.is_set():
            self._handle = self.loop.call_later(self.tick_s, self._beat)

    def _watch(self) -> None:
        held_since: float | None = None
        woke = time.monotonic()
        while not self._stopped.wait(self.tick_s / 2):
            last, woke = woke, time.monotonic()
            if woke - last >= self.warn_s:
                self.pauses += 1
                log.warning("the loop watch's own thread could not run for %.1f s: the process was stopped or "
                            "starved of CPU, or one call kept the GIL that long", woke - last)
            beat_at = self._beat_at
            held = woke - beat_at
            if held_since is None and held >= self.warn_s:
                held_since = beat_at
                self.stalls += 1
                log.warning("event loop held up for %.1f s so far (peers declare a node dead after detect_s, 3 s "
                            "by default); every thread's stack:\n%s", held, thread_stacks())
            elif held_since is not None and beat_at > held_since:
                log.warning("event loop turning again, after %.1f s held up", beat_at - held_since)
                held_since = None
