"""The reading side of a connection, which a closing listener stops between reads.

How it works. A connection's reader reads through its ``Intake``. ``stop`` (the listener
is draining, see ``protocols._accept.Acceptor.close``) makes the read under way, or the
next one, return ``b""``: the reader ends exactly as when the peer closes the socket, and
the connection then stores and confirms what it had already received, says goodbye and
closes. Nothing is read after ``stop``: a peer that keeps sending is not served any more,
and what it sent is never half taken.

The stream itself is left alone. Ending a reader with ``StreamReader.feed_eof`` while the
socket is still open makes the next bytes that arrive fail in the transport (``feed_data
after feed_eof``, logged as an error with a traceback); cancelling the reader task at any
point would cut it off in the middle of handling what it read.
"""

from __future__ import annotations

import asyncio


class Intake:
    """Reads of one connection, stoppable by its listener (see above)."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self._stream = stream
        self._reading: asyncio.Task[object] | None = None
        self.stopped = False

    async def read(self, size: int) -> bytes:
        """``StreamReader.read(size)``; ``b""`` once stopped, as at the end of the stream."""
        if self.stopped:
            return b""
        task = asyncio.current_task()
        assert task is not None
        self._reading = task
        try:
            return await self._stream.read(size)
        except asyncio.CancelledError:
            if not self.stopped or task.cancelling() > 1:
                raise  # not (only) ours: the task is being cancelled
            task.uncancel()
            return b""
        finally:
            self._reading = None

    def stop(self) -> None:
        """End the reads: the one under way returns ``b""`` now, later ones at once."""
        if self.stopped:
            return
        self.stopped = True
        if self._reading is not None:
            self._reading.cancel()


__all__ = ["Intake"]
