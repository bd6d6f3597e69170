"""Group commit: many concurrent callers, one writer task, one transaction per batch.

Callers ``submit`` an item and await its result. A single writer task takes everything
pending (bounded by ``max_weight``, e.g. messages), waits ``linger`` seconds once for
more when the batch is not full and the writer was idle, and hands the batch to
``process``, which runs one transaction and returns one result or exception per item.
Futures resolve only after ``process`` returns, that is after COMMIT. While a batch
commits, new calls pile up and form the next batch, which goes at once: its first
callers have waited a commit already, so under load batches grow without any linger.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from core.errors import StorageError, Unavailable

_log = logging.getLogger("keygate.storage")

T = TypeVar("T")
R = TypeVar("R")

Processor = Callable[[list[T]], Awaitable[Sequence[R | BaseException]]]


class GroupCommitter(Generic[T, R]):
    def __init__(
        self, process: Processor[T, R], *, max_weight: int, linger: float, name: str
    ) -> None:
        self._process = process
        self._max_weight = max_weight
        self._linger = linger
        self._pending: deque[tuple[T, int, asyncio.Future[R]]] = deque()
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

    async def submit(self, item: T, weight: int = 1) -> R:
        """Queue ``item`` for the next batch; return its result once that batch committed."""
        return await self.enqueue(item, weight)

    def enqueue(self, item: T, weight: int = 1) -> asyncio.Future[R]:
        """``submit`` in two steps: ``item`` is queued now, before anything queued later
        (batches are processed in order), and the future resolves after its batch's
        COMMIT. Raises Unavailable once closing."""
        if self._closing:
            raise Unavailable("the store is closed")
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, weight, future))
        self._pending_weight += weight
        self._wakeup.set()
        return future

    async def close(self) -> None:
        """Process everything already submitted, then stop the writer task."""
        self._closing = True
        self._wakeup.set()
        await self._task

    def _take(self) -> list[tuple[T, int, asyncio.Future[R]]]:
        batch = [self._pending.popleft()]
        weight = batch[0][1]
        while self._pending and weight + self._pending[0][1] <= self._max_weight:
            entry = self._pending.popleft()
            weight += entry[1]
            batch.append(entry)
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
