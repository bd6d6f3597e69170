"""The native listener's writer: coalesced socket writes with back-pressure per connection.

How it works. ``send`` encodes an event at once (a delivery the wire cannot carry raises
there and is dead-lettered) and queues its bytes; everything queued in one event-loop turn
leaves in one transport write. Above ``high`` bytes not yet taken by the kernel, events
wait here as events (no copy of the payload is kept), in order with everything after
them, until the transport drains below ``low`` (a quarter of ``high``); they are encoded
again when they leave. Their number is bounded by the flows' windows. Auto-ack deliveries
are acked once written: each remembers the end offset of its bytes in the stream, and is
settled when the kernel has taken that byte.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Final

from protocols.native.connection import ServerConnection
from protocols.native.events import Deliver, Event

# How often a connection with bytes still in its write buffer checks what the kernel took.
_WRITE_POLL: Final = 0.01


class FrameWriter:
    def __init__(
        self,
        conn: ServerConnection,
        writer: asyncio.StreamWriter,
        high: int,
        settle_written: Callable[[str, tuple[str, ...]], None],
    ) -> None:
        self._conn = conn
        self._writer = writer
        self._settle_written = settle_written
        self.outgoing: list[bytes] = []
        self.high = high
        self.low = high // 4
        self.held: collections.deque[tuple[Event, tuple[str, str] | None]] = collections.deque()
        self.outgoing_bytes = 0
        self.sent_bytes = 0
        self.written_bytes = 0
        self.unwritten: collections.deque[tuple[int, str, str]] = collections.deque()
        self.watcher: asyncio.Task[None] | None = None
        writer.transport.set_write_buffer_limits(high=self.high, low=self.low)

    def send(self, event: Event, *, auto_ack: bool = False) -> None:
        """Encode now, write once per event-loop turn: replies and deliveries produced in
        one turn leave in one transport write instead of one each. Above the high-water
        mark the event waits, in order with everything after it."""
        if self._writer.is_closing():
            return
        try:
            # Encoded at once even when it must wait, so that a delivery the wire cannot
            # carry raises here (and is dead-lettered); a waiting frame is kept as its event
            # (no copy of the payload) and encoded again when it leaves.
            data = self._conn.send(event)
        except RuntimeError:
            # The connection state machine is closed (after ERROR/CLOSE): nothing to send.
            return
        acked = None
        if auto_ack and isinstance(event, Deliver):
            acked = (event.flow_id, event.message_id)
        if self.held or self.buffered() > self.high:
            self.held.append((event, acked))
            self.watch()
            return
        self.queue_bytes(data, acked)

    def release(self, event: Event, acked: tuple[str, str] | None) -> None:
        try:
            self.queue_bytes(self._conn.send(event), acked)
        except RuntimeError:
            return  # closed meanwhile

    def queue_bytes(self, data: bytes, acked: tuple[str, str] | None) -> None:
        self.outgoing.append(data)
        self.outgoing_bytes += len(data)
        self.sent_bytes += len(data)
        if acked is not None:
            self.unwritten.append((self.sent_bytes, *acked))
        if len(self.outgoing) == 1:
            asyncio.get_running_loop().call_soon(self.write_out)

    def buffered(self) -> int:
        """Bytes accepted for this connection that the kernel has not taken yet."""
        return self.outgoing_bytes + self._writer.transport.get_write_buffer_size()

    def write_out(self) -> None:
        if self.outgoing and not self._writer.is_closing():
            self._writer.write(b"".join(self.outgoing))
            self.written_bytes += self.outgoing_bytes
        self.outgoing.clear()
        self.outgoing_bytes = 0
        self.ack_written()

    def ack_written(self) -> None:
        """Ack the auto-ack deliveries whose last byte the kernel has taken."""
        if not self.unwritten or self._writer.is_closing():
            return
        taken = self.written_bytes - self._writer.transport.get_write_buffer_size()
        by_flow: dict[str, list[str]] = {}
        while self.unwritten and self.unwritten[0][0] <= taken:
            _, flow_id, message_id = self.unwritten.popleft()
            by_flow.setdefault(flow_id, []).append(message_id)
        for flow_id, ids in by_flow.items():
            self._settle_written(flow_id, tuple(ids))
        if self.unwritten:
            self.watch()

    def watch(self) -> None:
        if self.watcher is None or self.watcher.done():
            self.watcher = asyncio.create_task(self.drain_held())

    async def drain_held(self) -> None:
        """Wait for the transport to drain, then release held frames and ack what the
        kernel took. The transport tells us when it falls below ``low`` (drain); a buffer
        between empty and ``low`` raises no event, so that case is polled."""
        while (self.held or self.unwritten) and not self._writer.is_closing():
            try:
                await self._writer.drain()
            except ConnectionError:
                return
            if self._writer.transport.get_write_buffer_size() > self.low:
                await asyncio.sleep(_WRITE_POLL)
                continue
            while self.held and self.buffered() <= self.high:
                self.release(*self.held.popleft())
            self.write_out()
            if self.unwritten and not self.held:
                await asyncio.sleep(_WRITE_POLL)

    def abort(self) -> None:
        self.write_out()
        self._writer.close()

    def stop(self) -> None:
        """The connection ends: write what is queued, stop watching the transport."""
        self.write_out()
        if self.watcher is not None:
            self.watcher.cancel()


__all__ = ["FrameWriter"]
