"""Group commit: many concurrent callers, one writer task, one transaction per batch.

Callers ``submit`` an item and await its result. A single writer task takes what is
pending (bounded by ``max_weight``, e.g. messages), waits ``linger`` seconds once for
more when the batch is not full and the writer was idle, and hands the batch to
``process``, which runs one transaction and returns one result or exception per item.
Futures resolve only after ``process`` returns, that is after COMMIT. While a batch
commits, new calls pile up and form the next batch, which goes at once: its first
callers have waited a commit already, so under load batches grow without any linger.

Fairness. Each item comes from a ``source`` (a connection), and the sources with items
pending take turns: a batch is formed one item per source per round, in the order the
sources last had a turn, until the next item would not fit (then the sources whose item
does not fit are passed over, keeping their place for the next batch, and smaller items
of the others still fill the room). A source's own items stay in submit order. So a
connection with one publish queued waits for at most one item of each other source, not
for their whole backlog: one connection may have megabytes queued (its unconfirmed
limit), and in plain arrival order every other publish waited behind all of it. One
source alone fills every batch exactly as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

from core.errors import StorageError, Unavailable

_log = logging.getLogger("keygate.storage")

T = TypeVar("T")
R = TypeVar("R")

Processor = Callable[[list[T]], Awaitable[Sequence[R | BaseException]]]
# An item, its weight and its caller's future.
_Entry = tuple[T, int, "asyncio.Future[R]"]


class GroupCommitter(Generic[T, R]):
    def __init__(
        self, process: Processor[T, R], *, max_weight: int, linger: float, name: str
    ) -> None:
        self._process = process
        self._max_weight = max_weight
        self._linger = linger
        # Each source's pending items in submit order; the sources in turn order (a
        # source whose items are all taken leaves, and joins at the end with its next).
        self._pending: dict[Hashable, deque[_Entry[T, R]]] = {}
        self._pending_weight = 0
        self._processing_weight = 0
        self._wakeup = asyncio.Event()
        self._closing = False
        self._task = asyncio.create_task(self._run(), name=name)
        self.commits = 0
        """Batches written so far (observable, e.g. by tests and metrics)."""

    @property
    def task(self) -> asyncio.Task[None]:
        """The writer task: it runs until ``close``."""
        return self._task

    @property
    def backlog(self) -> int:
        """The weight submitted and not yet committed (queued, or in the batch being
        written)."""
        return self._pending_weight + self._processing_weight

    async def submit(self, item: T, weight: int = 1, *, source: Hashable = None) -> R:
        """Queue ``item`` for a batch; return its result once that batch committed."""
        return await self.enqueue(item, weight, source=source)

    def enqueue(self, item: T, weight: int = 1, *, source: Hashable = None) -> asyncio.Future[R]:
        """``submit`` in two steps: ``item`` is queued now, before anything ``source``
        queues later (batches are processed in order, and a source's items are taken in
        submit order), and the future resolves after its batch's COMMIT. Raises
        Unavailable once closing."""
        if self._closing:
            raise Unavailable("the store is closed")
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        queued = self._pending.get(source)
        if queued is None:
            queued = self._pending[source] = deque()
        queued.append((item, weight, future))
        self._pending_weight += weight
        self._wakeup.set()
        return future

    async def close(self) -> None:
        """Process everything already submitted, then stop the writer task."""
        self._closing = True
        self._wakeup.set()
        # A task that already ended (a bug, or cancelled: the gateway stops for it) has
        # nothing left to write; its outcome must not stop the store closing after it.
        await asyncio.gather(self._task, return_exceptions=True)

    def _take(self) -> list[_Entry[T, R]]:
        """The next batch: one item per source per round, in turn order (module doc)."""
        pending = self._pending
        if len(pending) == 1:  # one source: its items in order, as many as fit
            ((source, queued),) = pending.items()
            batch = [queued.popleft()]
            weight = batch[0][1]
            while queued and weight + queued[0][1] <= self._max_weight:
                entry = queued.popleft()
                weight += entry[1]
                batch.append(entry)
            if not queued:
                del pending[source]
            self._pending_weight -= weight
            return batch
        batch, weight = [], 0
        added = True
        while pending and added:
            added = False
            for source in list(pending):
                queued = pending[source]
                if batch and weight + queued[0][1] > self._max_weight:
                    continue  # keeps its place: ahead of the sources that had a turn
                entry = queued.popleft()
                weight += entry[1]
                batch.append(entry)
                added = True
                del pending[source]
                if queued:
                    pending[source] = queued  # to the end of the turn order
        self._pending_weight -= weight
        return batch

    async def _run(self) -> None:
        busy = False  # the previous batch left callers waiting
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if not self._pending:
                if self._closing:
                    return
                busy = False
                continue
            full = self._pending_weight >= self._max_weight
            if self._linger > 0 and not (busy or full or self._closing):
                await asyncio.sleep(self._linger)
            batch = self._take()
            self._processing_weight = sum(weight for _, weight, _ in batch)
            try:
                outcomes = await self._process([item for item, _, _ in batch])
                self.commits += 1
            except StorageError as e:
                outcomes = [e] * len(batch)
            except Exception as e:
                # A bug, not a database failure: fail the callers (with a fixed text: the
                # exception may hold other callers' data), log it, keep the writer.
                _log.exception("%s: a batch of %d failed", self._task.get_name(), len(batch))
                error = StorageError("storage error")
                error.__cause__ = e
                outcomes = [error] * len(batch)
            self._processing_weight = 0
            for (_, _, future), outcome in zip(batch, outcomes, strict=True):
                if future.done():  # the caller was cancelled; the write still happened
                    continue
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)
            busy = bool(self._pending)
            if self._pending or self._closing:
                self._wakeup.set()
