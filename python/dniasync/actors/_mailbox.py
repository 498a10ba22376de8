"""A bounded FIFO mailbox for one consumer, with backpressure on producers.

Faster than ``asyncio.Queue`` on the hot path (no per-put futures when there is
room) and exact about capacity: a producer that has to wait hands its item to
the queue of waiters, and the consumer moves it in when a slot frees, so order
of arrival is kept and the bound is never exceeded by ordinary messages.
Control items (stop, restart) bypass the bound.

Urgent items (``urgent=True``) overtake ordinary ones: they join the end of
the urgent run at the head of the queue, so they are FIFO among themselves
and come before every ordinary item already queued. The bound covers both.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

__all__ = ["Mailbox"]


class Mailbox:
    __slots__ = ("_items", "_urgent", "_capacity", "_getter", "_putters", "_loop", "_closed_error")

    def __init__(self, capacity: int, loop: asyncio.AbstractEventLoop) -> None:
        if capacity < 0:
            raise ValueError(f"mailbox capacity must be >= 0 (0 = unbounded), got {capacity}")
        self._items: deque[Any] = deque()
        self._urgent = 0
        """How many items at the head of ``_items`` are urgent (or front-of-line control)."""
        self._capacity = capacity
        self._getter: asyncio.Future[None] | None = None
        self._putters: deque[tuple[asyncio.Future[None], Any, bool]] = deque()
        self._loop = loop
        self._closed_error: BaseException | None = None

    def __len__(self) -> int:
        return len(self._items) + len(self._putters)

    @property
    def capacity(self) -> int:
        return self._capacity

    def _insert(self, item: Any, urgent: bool) -> None:
        if urgent:
            if self._urgent == len(self._items):
                self._items.append(item)
            else:
                self._items.insert(self._urgent, item)
            self._urgent += 1
        else:
            self._items.append(item)

    def try_put(self, item: Any) -> bool:
        """Queue ``item`` last if there is room and nobody is waiting before it."""
        if self._putters or (self._capacity and len(self._items) >= self._capacity):
            return False
        self._items.append(item)
        getter = self._getter
        if getter is not None and not getter.done():
            getter.set_result(None)
        return True

    def try_put_urgent(self, item: Any) -> bool:
        """Queue ``item`` after the urgent items already queued, on the same terms as :meth:`try_put`."""
        if self._putters or (self._capacity and len(self._items) >= self._capacity):
            return False
        self._insert(item, True)
        getter = self._getter
        if getter is not None and not getter.done():
            getter.set_result(None)
        return True

    async def put(self, item: Any, urgent: bool = False) -> None:
        """Queue ``item`` (after the queued urgent items if ``urgent``), waiting while the mailbox is full."""
        if self.try_put_urgent(item) if urgent else self.try_put(item):
            return
        if self._closed_error is not None:
            raise self._closed_error
        fut: asyncio.Future[None] = self._loop.create_future()
        waiter = (fut, item, urgent)
        self._putters.append(waiter)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.cancelled():  # still queued: withdraw it; otherwise it was delivered
                try:
                    self._putters.remove(waiter)
                except ValueError:
                    pass
            raise

    def put_control(self, item: Any, *, front: bool) -> None:
        """Add a control item regardless of capacity, first in line or last."""
        if front:
            self._items.appendleft(item)
            self._urgent += 1
        else:
            self._items.append(item)
        getter = self._getter
        if getter is not None and not getter.done():
            getter.set_result(None)

    def get_nowait(self) -> Any:
        item = self._items.popleft()
        if self._urgent:
            self._urgent -= 1
        if self._putters:
            fut, waiting, urgent = self._putters.popleft()
            self._insert(waiting, urgent)
            if not fut.done():
                fut.set_result(None)
        return item

    def consumer_waiting(self) -> bool:
        """True if the consumer waits in :meth:`get` on an empty mailbox (nobody woke it yet)."""
        getter = self._getter
        return getter is not None and not getter.done() and not self._items and not self._putters

    async def get(self) -> Any:
        while not self._items:
            getter: asyncio.Future[None] = self._loop.create_future()
            self._getter = getter
            try:
                await getter
            finally:
                self._getter = None
        return self.get_nowait()

    def close(self, error: BaseException) -> list[Any]:
        """Refuse further waiting producers with ``error``; return everything left."""
        self._closed_error = error
        left = list(self._items)
        self._items.clear()
        self._urgent = 0
        while self._putters:
            fut, item, _ = self._putters.popleft()
            left.append(item)
            if not fut.done():
                fut.set_exception(error)
        return left
