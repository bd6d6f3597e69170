"""The ordered, bounded queue between a connection's reader and its worker.

How it works. The reader puts every request it decodes, in arrival order; one worker
``take``s them from the head: one request at a time, except that a run of consecutive
publishes (``batchable``) is taken together, up to ``max_batch`` requests and
``max_batch_bytes``, so everything that arrived while the previous commit ran is stored
with one ``publish_in_order`` call (one group-commit submission) while the reader goes
on reading. There is one worker, so a connection has one batch in flight and its
messages are stored in the order sent.

Back-pressure: ``put`` waits while the queue holds ``max_items`` requests or
``max_bytes`` (``size`` of each); a reader that must not wait in the middle of a read
queues with ``put_nowait`` and then waits for ``room``. Either way the socket is not read
and TCP pushes back on the client. A request's bytes count from the moment it is queued
until the worker comes back for more (``take``): a batch being stored is held as much as
one waiting, so the connection holds at most ``max_bytes`` and what one read decoded
beyond it (the batch, up to ``max_batch_bytes``, used to leave the count when taken, and
that much more was read meanwhile). ``idle`` is set while the queue is empty and the
worker has come back for more: what the connection received has been done.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class WorkQueue(Generic[T]):
    """Requests in arrival order, taken one by one or as a run of publishes."""

    def __init__(
        self,
        *,
        max_items: int,
        max_bytes: int,
        max_batch: int,
        max_batch_bytes: int,
        batchable: Callable[[T], bool],
        size: Callable[[T], int],
    ) -> None:
        self._items: deque[T] = deque()
        self._bytes = 0  # of the requests queued and of the batch taken last
        self._taken = 0  # of the batch taken last, until the worker comes back
        self._max_items = max_items
        self._max_bytes = max_bytes
        self._max_batch = max_batch
        self._max_batch_bytes = max_batch_bytes
        self._batchable = batchable
        self._size = size
        self._ready = asyncio.Event()
        self._space = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def full(self) -> bool:
        if self._bytes and self._bytes >= self._max_bytes:
            return True  # the requests queued and the batch being done
        return bool(self._items) and len(self._items) >= self._max_items

    async def room(self) -> None:
        """Wait while the queue is full."""
        while self.full:
            self._space.clear()
            await self._space.wait()

    async def put(self, item: T) -> None:
        """Queue ``item``, first waiting for ``room``."""
        await self.room()
        self.put_nowait(item)

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        self._bytes += self._size(item)
        self.idle.clear()
        self._ready.set()

    def clear(self) -> None:
        """Drop everything queued (the connection failed; its worker is done)."""
        self._items.clear()
        self._bytes = self._taken = 0
        self._space.set()

    async def take(self) -> list[T]:
        """The next request, or the longest run of publishes within the batch bounds; the
        batch taken before is done, and its bytes are given back."""
        if self._taken:
            self._bytes -= self._taken
            self._taken = 0
            self._space.set()
        items = self._items
        while not items:
            self.idle.set()
            self._ready.clear()
            await self._ready.wait()
        batch = [items.popleft()]
        size = self._size(batch[0])
        if self._batchable(batch[0]):
            while (
                items
                and len(batch) < self._max_batch
                and size < self._max_batch_bytes
                and self._batchable(items[0])
            ):
                batch.append(items.popleft())
                size += self._size(batch[-1])
        self._taken = size
        self._space.set()
        return batch


__all__ = ["WorkQueue"]
