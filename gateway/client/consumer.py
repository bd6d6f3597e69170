"""A bound consumer: its receive buffer, ack batching and partition tracking.

How it works: the consumer records its bind *intent* (queue, group, window, settings) and
the partition set it currently holds. ``Session`` (robust.py) binds it on a connection;
each successful bind starts a new *generation*. DELIVERs are buffered with the generation
they arrived in. When the connection drops, the buffer and the not-yet-sent acks are
dropped (the gateway redelivers those messages, flagged redelivered), and settling a
message of an older generation is a silent no-op: the gateway no longer knows that
delivery. After the reconnect the session re-binds with ``previous_partitions`` = the set
held, so a cut shorter than the queue's rebalance delay keeps the same partitions.

Flow control is the gateway's: it sends at most ``window`` unsettled messages to the
flow, so in ``client`` ack mode the buffer never holds more than ``window`` messages.
Acks are batched: sent when ``ack_batch_size`` are pending or ``ack_flush_interval``
after the first one, and before any NACK, cumulative ack, window change or close, so
settlements reach the gateway in the order they were made.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from core.errors import InvalidArgument
from core.ingress import validate_window
from core.model import AckMode, GroupMode, KeyOrder, Properties, StartPosition
from gateway.client.errors import ConnectionLost, ConsumerClosed, error_from_code
from protocols.native import (
    Ack,
    AckCumulative,
    Bind,
    BindOk,
    Credit,
    Deliver,
    Event,
    FlowClosed,
    Nack,
    NackOutcome,
    PartitionsChanged,
    Unbind,
)

if TYPE_CHECKING:
    from gateway.client.connection import Connection


class Session(Protocol):
    """What a consumer needs of the client's session (``robust.Session``): to be
    forgotten when it closes, so the session stops re-binding it."""

    def forget(self, consumer: Consumer) -> None: ...


@dataclass(frozen=True, slots=True)
class Message:
    """A delivered message. Settle it with the consumer that received it."""

    message_id: str
    payload: bytes
    key: str | None
    properties: Properties
    partition: int
    seq: int
    delivery_count: int
    redelivered: bool
    publish_time: float
    topic: str | None = None
    content_type: str | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    # Which bind of the consumer delivered it; settling an older generation is a no-op.
    generation: int = field(default=0, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class BindIntent:
    """What the consumer asked for; replayed on every reconnect."""

    queue: str
    group: str
    window: int
    ack_mode: AckMode
    tags: Mapping[str, str] | None
    mode: GroupMode | None
    key_order: KeyOrder | None
    start: StartPosition | None
    ack_timeout: float | None
    # set_window(0): re-bound with a window of 1 and paused again at once.
    paused: bool = False


class Consumer:
    """Receives from one (queue, group). Created by ``Client.subscribe``."""

    def __init__(
        self,
        session: Session,
        intent: BindIntent,
        *,
        on_partitions_changed: Callable[[frozenset[int]], None] | None,
        ack_batch_size: int,
        ack_flush_interval: float,
    ) -> None:
        self._session = session
        self._intent = intent
        self._on_partitions_changed = on_partitions_changed
        self._ack_batch_size = ack_batch_size
        self._ack_flush_interval = ack_flush_interval
        self._conn: Connection | None = None
        self._flow_id: str | None = None
        self._generation = 0
        self._partitions: frozenset[int] = frozenset()
        self._buffer: deque[Message] = deque()
        self._wakeup = asyncio.Event()
        self._acks: list[str] = []
        self._ack_timer: asyncio.TimerHandle | None = None
        self._watchers: list[asyncio.Queue[frozenset[int] | None]] = []
        self._error: BaseException | None = None
        self.mode: GroupMode | None = None
        self.window = intent.window

    @property
    def queue(self) -> str:
        return self._intent.queue

    @property
    def group(self) -> str:
        return self._intent.group

    @property
    def partitions(self) -> frozenset[int]:
        """The partitions this consumer holds (kept through a reconnect)."""
        return self._partitions

    @property
    def flow_id(self) -> str | None:
        """The gateway's id for the current bind; None while disconnected."""
        return self._flow_id

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._conn.is_open

    # ------------------------------------------------------------- receiving

    async def receive(self, timeout: float | None = None) -> Message:
        """Wait for the next message (blocks up to ``timeout`` seconds; None = forever).

        Raises TimeoutError, or ConsumerClosed once the consumer is closed.
        """
        if self._buffer:  # no timer when a message is waiting
            return self._buffer.popleft()
        async with asyncio.timeout(timeout):
            while True:
                if self._buffer:
                    return self._buffer.popleft()
                self._check_open()
                self._wakeup.clear()
                await self._wakeup.wait()

    async def batch_receive(
        self,
        max_messages: int = 100,
        timeout: float | None = 0.1,
    ) -> list[Message]:
        """Up to ``max_messages`` messages: waits until that many are buffered or
        ``timeout`` passes, then returns what is there (possibly none). With ``timeout``
        None, waits for at least one message and returns what is buffered then."""
        if timeout is None:
            batch = [await self.receive()]
        else:
            batch = []
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while len(self._buffer) < max_messages and (left := deadline - loop.time()) > 0:
                self._check_open()
                self._wakeup.clear()
                try:
                    async with asyncio.timeout(left):
                        await self._wakeup.wait()
                except TimeoutError:
                    break
        while self._buffer and len(batch) < max_messages:
            batch.append(self._buffer.popleft())
        return batch

    def __aiter__(self) -> Consumer:
        return self

    async def __anext__(self) -> Message:
        try:
            return await self.receive()
        except ConsumerClosed:
            if self._error is not None and not isinstance(self._error, ConsumerClosed):
                raise
            raise StopAsyncIteration from None

    async def partition_changes(self) -> AsyncIterator[frozenset[int]]:
        """Yields the new partition set each time it changes, until the consumer closes."""
        watcher: asyncio.Queue[frozenset[int] | None] = asyncio.Queue()
        self._watchers.append(watcher)
        try:
            while (partitions := await watcher.get()) is not None:
                yield partitions
        finally:
            self._watchers.remove(watcher)

    # ------------------------------------------------------------- settling

    async def acknowledge(self, message: Message) -> None:
        """Settle ``message``. Does not block on the gateway: acks are batched (see module
        docstring); a no-op for auto-ack consumers and messages from before a reconnect."""
        if not self._current(message) or self._intent.ack_mode is AckMode.AUTO:
            return
        self._acks.append(message.message_id)
        if len(self._acks) >= self._ack_batch_size:
            await self._flush_acks()
        elif self._ack_timer is None:
            self._ack_timer = asyncio.get_running_loop().call_later(
                self._ack_flush_interval, self._send_acks
            )

    async def acknowledge_cumulative(self, message: Message) -> None:
        """Settle every message of ``message``'s partition up to its seq (partitioned and
        exclusive groups). Sent at once, after pending individual acks."""
        if self._current(message):
            await self._send(
                AckCumulative(
                    flow_id=self._flow_id or "", partition=message.partition, seq=message.seq
                )
            )

    async def negative_acknowledge(self, message: Message, delay: float | None = None) -> None:
        """Ask for redelivery after ``delay`` seconds (None = the queue's backoff)."""
        await self._nack(message, NackOutcome.RETRY, delay)

    async def reject(self, message: Message) -> None:
        """Dead-letter ``message`` now."""
        await self._nack(message, NackOutcome.REJECT, None)

    async def set_window(self, window: int) -> None:
        """Change the flow's window (max delivered-unsettled); kept across reconnects.
        0 pauses delivery: nothing more is sent until the window is raised (what was
        delivered stays the consumer's to settle). A consumer paused across a reconnect
        binds again with a window of 1 and pauses at once, so it may receive one message."""
        if window:
            validate_window(window)
        elif window < 0:
            raise InvalidArgument("window must be >= 0 (0 pauses delivery)")
        self.window = window
        intent = self._intent
        self._intent = replace(intent, window=window or intent.window, paused=not window)
        if self._conn is not None and self._flow_id is not None:
            await self._send(Credit(flow_id=self._flow_id, window=window))

    async def close(self, shutdown: bool = False) -> None:
        """Flush acks and unbind. Without ``shutdown`` the partitions stay reserved for
        this client through the queue's rebalance delay; with it they are handed over at
        once. Blocks until the gateway confirms (or the connection is gone)."""
        if self._error is not None:
            return
        self._session.forget(self)
        conn, flow_id = self._conn, self._flow_id
        try:
            if conn is not None and flow_id is not None and conn.is_open:
                self._send_acks()
                await conn.request(
                    lambda rid: Unbind(request_id=rid, flow_id=flow_id, shutdown=shutdown)
                )
        except ConnectionLost:
            pass  # the gateway treats the drop as an unbind
        finally:
            if conn is not None and flow_id is not None:
                conn.flows.pop(flow_id, None)
            self._fail(ConsumerClosed(f"consumer of {self.queue}/{self.group} is closed"))

    # ------------------------------------------------------------- session side

    async def bind(self, conn: Connection, previous: frozenset[int] | None) -> None:
        """(Re)bind on ``conn``; raises the gateway's error or ConnectionLost."""
        intent = self._intent
        generation = self._generation + 1

        def bound(event: Event) -> None:
            # Runs in the reader before any DELIVER of the new flow is dispatched.
            assert isinstance(event, BindOk)
            self._conn, self._flow_id, self._generation = conn, event.flow_id, generation
            self.mode, self.window = event.mode, event.window
            conn.flows[event.flow_id] = self
            self._set_partitions(event.partitions)
            if intent.paused:
                conn.send(Credit(flow_id=event.flow_id, window=0))
                self.window = 0

        await conn.request(
            lambda rid: Bind(
                request_id=rid,
                queue=intent.queue,
                group=intent.group,
                window=1 if intent.paused else intent.window,
                ack_mode=intent.ack_mode,
                tags=intent.tags,
                mode=intent.mode,
                key_order=intent.key_order,
                start=intent.start,
                ack_timeout=intent.ack_timeout,
                previous_partitions=previous,
            ),
            bound,
        )

    def on_deliver(self, event: Deliver) -> None:
        self._buffer.append(
            Message(
                message_id=event.message_id,
                payload=event.payload,
                key=event.key,
                properties=event.properties,
                partition=event.partition,
                seq=event.seq,
                delivery_count=event.delivery_count,
                redelivered=event.redelivered,
                publish_time=event.publish_time,
                topic=event.topic,
                content_type=event.content_type,
                correlation_id=event.correlation_id,
                reply_to=event.reply_to,
                generation=self._generation,
            )
        )
        self._wakeup.set()

    def on_partitions_changed(self, event: PartitionsChanged) -> None:
        self._set_partitions(event.partitions)

    def on_flow_closed(self, event: FlowClosed) -> None:
        """The gateway ended this flow (e.g. its queue was deleted): fail for good, with
        the gateway's error, and do not re-bind after a reconnect."""
        self._session.forget(self)
        self._fail(error_from_code(event.code, event.text))

    def connection_lost(self) -> None:
        """The connection dropped: unsettled deliveries are the gateway's to redeliver."""
        self._conn = self._flow_id = None
        self._buffer.clear()
        self._acks.clear()
        self._cancel_timer()

    def fail(self, error: BaseException) -> None:
        """Re-binding failed for good (or the client closed): wake and end receivers."""
        self._fail(error)

    # ------------------------------------------------------------- internals

    def _fail(self, error: BaseException) -> None:
        self.connection_lost()
        self._error = error
        self._wakeup.set()
        for watcher in self._watchers:
            watcher.put_nowait(None)

    def _check_open(self) -> None:
        if self._error is not None:
            if isinstance(self._error, ConsumerClosed):
                raise ConsumerClosed(str(self._error))
            raise ConsumerClosed(f"consumer failed: {self._error}") from self._error

    def _current(self, message: Message) -> bool:
        return message.generation == self._generation and self._conn is not None

    def _set_partitions(self, partitions: frozenset[int]) -> None:
        if partitions == self._partitions:
            return
        self._partitions = partitions
        for watcher in self._watchers:
            watcher.put_nowait(partitions)
        if self._on_partitions_changed is not None:
            self._on_partitions_changed(partitions)

    async def _nack(self, message: Message, outcome: NackOutcome, delay: float | None) -> None:
        if self._current(message):
            await self._send(
                Nack(
                    flow_id=self._flow_id or "",
                    message_ids=(message.message_id,),
                    outcome=outcome,
                    delay=delay,
                )
            )

    async def _send(self, event: Event) -> None:
        conn = self._conn
        if conn is None:
            return
        self._send_acks()
        try:
            conn.send(event)
            await conn.drain()
        except (ConnectionLost, OSError):
            return  # the message will be redelivered after the reconnect

    async def _flush_acks(self) -> None:
        conn = self._conn
        self._send_acks()
        if conn is not None:
            try:
                await conn.drain()
            except OSError:
                return

    def _send_acks(self) -> None:
        self._cancel_timer()
        if not self._acks or self._conn is None or self._flow_id is None:
            return
        ids, self._acks = tuple(self._acks), []
        try:
            self._conn.send(Ack(flow_id=self._flow_id, message_ids=ids))
        except ConnectionLost:
            return

    def _cancel_timer(self) -> None:
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None


__all__ = ["BindIntent", "Consumer", "Message", "Session"]
