"""Binary websocket messages handled where aiohttp parses them, not one task switch later.

aiohttp's protocol feeds a websocket's bytes to its parser, which queues the
messages for ``ws.receive()``; a reader task wakes for each. :func:`hook_parser`
puts a thin parser in front that calls back after every feed, so the
connection can take the binary messages off the head of that queue right
away (:func:`take`, in order, keeping aiohttp's flow control) while its
read loop is parked, and leave the rest (close, ping, errors, end of
stream) to ``ws.receive()``. It relies on aiohttp internals, checked when
hooking: if they are not the expected ones, nothing is hooked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["hook_parser", "queue_has_news", "take"]


class _PumpingParser:
    """aiohttp's websocket parser, followed by ``pump()`` after every feed."""

    __slots__ = ("parser", "pump")

    def __init__(self, parser: Any, pump: Callable[[], None]) -> None:
        self.parser = parser
        self.pump = pump

    def feed_data(self, data: Any) -> Any:
        result = self.parser.feed_data(data)
        self.pump()
        return result

    def feed_eof(self) -> None:
        self.parser.feed_eof()
        self.pump()


def hook_parser(ws: Any, pump: Callable[[], None]) -> Any:
    """Call ``pump()`` after aiohttp parses bytes of ``ws``; its message queue, or None if not hooked."""
    protocol: Any = getattr(getattr(ws, "_writer", None), "protocol", None)
    parser = getattr(ws, "_parser", None)
    queue = getattr(ws, "_reader", None)
    if (
        parser is None
        or getattr(protocol, "_payload_parser", None) is not parser
        or not all(hasattr(queue, name) for name in ("_buffer", "read", "is_eof", "exception"))
    ):
        return None
    protocol._payload_parser = _PumpingParser(parser, pump)
    return queue


def queue_has_news(queue: Any) -> bool:
    """Something for ``ws.receive()``: a message queued, the end of the stream, or an error."""
    return bool(queue._buffer) or queue.is_eof() or queue.exception() is not None


def take(queue: Any) -> Any:
    """The message at the head of a non-empty queue, through its own ``read`` (keeps its flow control)."""
    step = queue.read()
    try:
        step.send(None)
    except StopIteration as taken:
        return taken.value
    step.close()
    raise RuntimeError("websocket queue had no message to read")
