"""A node's event loop held up is named in its log, with the stack of what holds it, and so is its return."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from dniasync.node._loopwatch import LoopWatch
from dniasync.runtime import run


class _Caught(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []
        self.held = threading.Event()
        self.turning = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        if "event loop held up" in message:
            self.held.set()
        if "event loop turning again" in message:
            self.turning.set()


def _hold_the_loop_until(event: threading.Event) -> None:
    """A callback that blocks its loop (what a blocking call in a handler does) until ``event``, at most 60 s."""
    event.wait(60.0)


def test_a_held_loop_is_logged_with_the_blocking_call_and_its_return() -> None:
    caught = _Caught()
    logger = logging.getLogger("dniasync.node._loopwatch")
    logger.addHandler(caught)

    async def main() -> LoopWatch:
        watch = LoopWatch(asyncio.get_running_loop(), warn_s=0.2, tick_s=0.05)
        watch.start()
        try:
            await asyncio.sleep(0.1)
            _hold_the_loop_until(caught.held)  # held until the watch has said so: no race with its thread
            await asyncio.to_thread(caught.turning.wait, 60.0)
        finally:
            watch.stop()
        return watch

    try:
        watch = run(main())
    finally:
        logger.removeHandler(caught)
    assert caught.held.is_set() and caught.turning.is_set(), caught.messages
    assert watch.stalls == 1
    held = next(m for m in caught.messages if "event loop held up" in m)
    assert "_hold_the_loop_until" in held and "thread MainThread" in held  # where the loop's thread was
    assert "thread dniasync-loop-watch" in held


def test_a_watch_needs_its_tick_below_its_warning() -> None:
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="need 0 < tick_s < warn_s"):
            LoopWatch(loop, warn_s=0.5, tick_s=0.5)
    finally:
        loop.close()
