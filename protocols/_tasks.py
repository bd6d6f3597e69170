"""The tasks of one connection (or listener), owned by one object and ended with it.

How it works (aiormq's ``FutureStore`` pattern). Every task a connection starts — reader,
writer, heartbeat, a publish in flight — is started through its ``Tasks``: ``spawn``
keeps it until it finishes, ``close`` cancels every task still running and waits for them
all, so nothing a connection started outlives it. A task that fails with an exception is
a bug on our side (peer behaviour is handled inside the tasks): it is logged with its
traceback once, instead of as "Task exception was never retrieved" at garbage collection,
and ``failed`` is set so the owner can end the connection (several ``Tasks`` of one
connection may share one ``failed``). ``wait`` lets work in flight finish (a closing
listener lets received publishes commit). After ``close`` nothing more can be spawned: a
coroutine handed in then is closed unrun.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger("keygate.io")

T = TypeVar("T")


class Tasks:
    """A set of tasks with one owner: spawn, close (cancel all and wait)."""

    def __init__(self, owner: str, *, failed: asyncio.Event | None = None) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.failed = failed if failed is not None else asyncio.Event()

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def closed(self) -> bool:
        return self._closed

    def spawn(self, coro: Coroutine[Any, Any, T], *, name: str | None = None) -> asyncio.Task[T]:
        """Start ``coro`` as a task owned here; raises RuntimeError once closed."""
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self._owner}: tasks already closed")
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.error("%s: task %s failed", self._owner, task.get_name(), exc_info=error)
            self.failed.set()

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait until every task has ended (True), at most ``timeout`` seconds (False)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self._tasks:
                    await asyncio.wait(list(self._tasks))
        return not self._tasks

    async def close(self) -> None:
        """Cancel every task still running and wait until all have ended."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
