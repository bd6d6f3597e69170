"""The ordered, bounded queue between a STOMP session's reader and its worker.

The reader puts every event (and the ``Fatal``/``End`` markers) in arrival order; the
worker takes them one by one, except that a run of consecutive plain SENDs is taken
together (up to ``MAX_BATCH`` messages and ``MAX_BATCH_BYTES``) to be stored with one
``Sink.publish_many``. ``put`` waits while the queue is full (``MAX_PENDING_OPS`` or its
byte budget), which stops the reader and pushes back on the client through TCP.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Final, TypeAlias

from core.errors import KeygateError
from protocols._limits import publication_bytes
from protocols.stomp.connection import (
    Commit,
    Disconnect,
    Publish,
    ReceiptRequest,
    Settle,
    Subscribe,
    Unsubscribe,
)

MAX_PENDING_OPS: Final = 4096
MAX_BATCH: Final = 1024
MAX_BATCH_BYTES: Final = 4 * 1024 * 1024


class Fatal:
    """Pipeline marker: write this ERROR after everything queued before it, then close."""

    __slots__ = ("error", "receipt")

    def __init__(self, error: KeygateError, receipt: str | None = None) -> None:
        self.error = error
        self.receipt = receipt


class End:
    """Pipeline marker: the client went away; finish what is queued and close."""

    __slots__ = ()


Op: TypeAlias = (
    Publish | Commit | ReceiptRequest | Disconnect | Subscribe | Unsubscribe | Settle | Fatal | End
)


def op_size(op: Op) -> int:
    # Headers count: a SEND of small body and 64 KiB of headers is not free.
    if isinstance(op, Publish):
        return publication_bytes(op.publication)
    if isinstance(op, Commit):
        return sum(publication_bytes(p) for p in op.publications)
    return 0


class Pipeline:
    """The ordered, bounded queue between a session's reader and its worker."""

    def __init__(self, max_bytes: int) -> None:
        self._ops: deque[Op] = deque()
        self._bytes = 0
        self._max_bytes = max_bytes
        self._ready = asyncio.Event()
        self._space = asyncio.Event()

    async def put(self, op: Op) -> None:
        while self._ops and (len(self._ops) >= MAX_PENDING_OPS or self._bytes >= self._max_bytes):
            self._space.clear()
            await self._space.wait()
        self.put_nowait(op)

    def put_nowait(self, op: Op) -> None:
        self._ops.append(op)
        self._bytes += op_size(op)
        self._ready.set()

    async def take(self) -> list[Op]:
        """The next op, or the longest run of plain SENDs within the batch bounds."""
        while not self._ops:
            self._ready.clear()
            await self._ready.wait()
        batch: list[Op] = [self._ops.popleft()]
        size = op_size(batch[0])
        if isinstance(batch[0], Publish):
            while (
                self._ops
                and isinstance(self._ops[0], Publish)
                and len(batch) < MAX_BATCH
                and size < MAX_BATCH_BYTES
            ):
                op = self._ops.popleft()
                batch.append(op)
                size += op_size(op)
        self._bytes -= size
        self._space.set()
        return batch


__all__ = ["End", "Fatal", "Op", "Pipeline", "op_size"]
