"""The socket side shared by the listeners: one ordered, coalescing writer per connection.

How it works. A connection's frames — replies, receipts, heartbeats and deliveries — are
pushed into its ``Outbox`` and written by one task, in push order, every frame queued
since the last write leaving in one ``write`` call. Pushing never blocks (the group
runtime delivers from its own task and must not wait for a slow socket); ``put`` is the
waiting form for a connection's own replies, which pauses above ``high`` queued bytes so a
client that does not read cannot make the gateway buffer without bound. Deliveries are
bounded by their flows' windows.

A frame pushed with ``remake`` (how to encode it again) is not kept as bytes while more
than ``high`` bytes wait for the kernel (``holding``): the outbox holds ``remake``
instead, in order with everything pushed after it, and calls it when the socket has taken
enough, so the messages the group holds for it are not kept a second time, encoded. A caller that
sees ``holding`` may push the remake alone, without making the bytes it would only drop
(native client-ack deliveries: each is then encoded once, when it leaves).

A connection that is behind holds its flows back (DESIGN.md §8): each flow's output asks
its ``FlowGate`` before pushing deliveries, which tells the group once (``Backpressure``)
when the outbox is still ``holding`` what was pushed before (the socket did not take it;
one burst into an outbox that keeps up is not "behind"); the group then sends the flow
nothing, as if its window were full, and what is not sent stays in storage. When nothing
is held and at most half of ``high`` waits for the kernel, the writer task tells it to go
on (``on_caught_up``). So a reader that stops costs ``high`` plus what the group handed
over before it heard (at most two steps' deliveries), whatever its window.

Auto-ack deliveries (AMQP ``no_ack``, STOMP ``ack:auto``, native AUTO) ride with the bytes
that carry them and are settled once the kernel has taken their last byte (the transport's
buffer has drained past it): the socket took them. Until then they count against the
flow's window, which is the back-pressure towards a consumer that reads slowly.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from core.errors import KeygateError, StorageError, Unavailable
from core.model import Publication
from protocols.sink import Backpressure, Principal, Receipt, Sink

log = logging.getLogger("keygate.io")

DEFAULT_HIGH: Final = 1024 * 1024
# How often a connection whose transport still holds bytes checks what the kernel took:
# the transport raises no event when its buffer empties.
WRITE_POLL: Final = 0.01
# TCP keepalive on every accepted connection: a peer that vanished without a FIN or RST
# (power loss, a dropped NAT entry) is found after about KEEPALIVE_IDLE + 3 probes, even
# on a protocol whose heartbeats the client turned off, so it cannot hold its partitions.
KEEPALIVE_IDLE: Final = 60
KEEPALIVE_INTERVAL: Final = 10
KEEPALIVE_PROBES: Final = 3
# How long a closing connection waits for its peer to close after our last frames.
LINGER: Final = 1.0
# The pause between a draining connection's last confirms and its goodbye (Outbox.sent).
GOODBYE_GRACE: Final = 0.05


def keep_alive(writer: asyncio.StreamWriter) -> None:
    """Turn on TCP keepalive for an accepted connection (where the platform has it)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)


SettleWritten = Callable[[str, tuple[str, ...]], None]
# (flow id, message ids): the auto-ack deliveries some bytes carry.
AutoAcked = tuple[str, Sequence[str]]
Remake = Callable[[], bytes]
Tell = Callable[[bool], None]


class Outbox:
    """The outgoing bytes of one connection and the task that writes them."""

    def __init__(
        self,
        writer: asyncio.StreamWriter,
        *,
        settle_written: SettleWritten | None = None,
        high: int = DEFAULT_HIGH,
    ) -> None:
        self._writer = writer
        self._transport = writer.transport
        self._settle_written = settle_written
        self._high = high
        self._chunks: list[bytes] = []
        self._size = 0
        # Frames pushed while the outbox was full, in push order, with what they deliver: as
        # their remake, or as bytes for a frame that has none (it only waits behind others).
        self._held: collections.deque[tuple[bytes | Remake, AutoAcked | None]] = collections.deque()
        # Bytes queued and written since the start; auto-ack deliveries not yet taken by
        # the kernel as (offset of their last byte, flow id, message ids).
        self._queued = 0
        self._written = 0
        self._unacked: collections.deque[tuple[int, str, Sequence[str]]] = collections.deque()
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._flushed = asyncio.Event()  # everything queued has been written
        self._flushed.set()
        self._closed = False
        # Called once from the writer task when it has caught up (on_caught_up).
        self._caught_up: list[Callable[[], None]] = []
        self.broken = False  # the socket failed: everything pushed from now on is dropped
        self.last_sent = asyncio.get_running_loop().time()

    @property
    def done(self) -> bool:
        """No more bytes will be written."""
        return self.broken or (self._closed and not self._chunks and not self._held)

    @property
    def pending(self) -> int:
        """Bytes queued here or in the transport that the kernel has not taken yet."""
        return self._size + self._transport.get_write_buffer_size()

    @property
    def holding(self) -> bool:
        """What is pushed with a ``remake`` now is held, not queued as bytes."""
        return bool(self._held) or self.pending > self._high

    def push(
        self,
        data: bytes | None,
        auto_acked: AutoAcked | None = None,
        *,
        remake: Remake | None = None,
    ) -> None:
        """Queue bytes for writing; never waits. ``auto_acked``: (flow id, message ids)
        the bytes deliver, settled as acked once the kernel took them. ``remake``: makes
        ``data`` again; given, the bytes are dropped and ``remake`` held while the outbox
        is above ``high``. ``data`` None: ``remake`` makes the bytes, once, when they are
        queued (what a caller that saw ``holding`` pushes without making them first)."""
        if self._closed or self.broken:
            return
        if remake is None:
            assert data is not None, "push(None) needs a remake"
            if self._held:
                self._held.append((data, auto_acked))
            else:
                self._queue(data, auto_acked)
        elif self.holding:
            self._held.append((remake, auto_acked))
        else:
            self._queue(remake() if data is None else data, auto_acked)
        self._wake.set()

    def on_caught_up(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, from the writer task, when nothing is held and at most
        half of ``high`` waits for the kernel; never once the outbox is closed or broken."""
        self._caught_up.append(callback)
        self._wake.set()

    async def room(self) -> None:
        """Wait while frames are held or more than ``high`` bytes are queued."""
        while (self._held or self._size > self._high) and not (self._closed or self.broken):
            self._room.clear()
            await self._room.wait()

    async def put(self, data: bytes) -> None:
        """Queue bytes, first waiting for ``room``."""
        await self.room()
        self.push(data)

    async def sent(self, timeout: float) -> None:
        """Wait until everything queued is written (at most ``timeout`` seconds),
        then ``GOODBYE_GRACE``: a draining connection's confirms leave in a read of their
        own before its goodbye. Some clients handle the frames of one read together and
        drop the confirms read with a connection close (pika's BlockingConnection)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._flushed.wait()
        if not self.broken:
            await asyncio.sleep(GOODBYE_GRACE)

    def close(self) -> None:
        """Write what is queued, then stop; later pushes are dropped."""
        self._closed = True
        self._wake.set()
        self._room.set()

    async def run(self) -> None:
        """The writer task: ends after ``close`` once everything queued is written, or when
        the socket fails (``broken``). Auto-ack deliveries the kernel has not taken by then
        stay unsettled."""
        try:
            while True:
                self._release()
                if self._chunks:
                    data = b"".join(self._chunks)
                    self._chunks.clear()
                    self._size = 0
                    self._room.set()
                    if self._writer.transport.is_closing():
                        # uvloop raises RuntimeError on a write to a closed transport (a
                        # peer that reset while confirms were queued): that is a lost
                        # connection, not a bug to log with its traceback.
                        raise ConnectionResetError("Connection lost")
                    self._writer.write(data)
                    self._written += len(data)
                    self.last_sent = asyncio.get_running_loop().time()
                    await self._writer.drain()
                    self._settle_taken()
                    continue
                self._settle_taken()
                if self._caught_up and not self._held and self.pending <= self._high // 2:
                    self._tell_caught_up()
                if not self._held:
                    self._flushed.set()
                if self._closed and not self._held:
                    return
                self._wake.clear()
                if self._held or self._unacked or self._caught_up:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(WRITE_POLL):
                            await self._wake.wait()
                else:
                    await self._wake.wait()
        except (ConnectionError, OSError) as e:
            log.info("write to %s failed: %s", self._writer.get_extra_info("peername"), e)
            self.broken = True
            self._chunks.clear()
            self._held.clear()
            self._caught_up.clear()
            self._room.set()
            self._flushed.set()

    def _queue(self, data: bytes, auto_acked: AutoAcked | None) -> None:
        if data:
            self._flushed.clear()
            self._chunks.append(data)
            self._size += len(data)
            self._queued += len(data)
        if auto_acked is not None and auto_acked[1]:
            self._unacked.append((self._queued, *auto_acked))

    def _release(self) -> None:
        """Queue held frames (made again) while the kernel has room for them."""
        while self._held and self.pending <= self._high:
            frame, auto_acked = self._held.popleft()
            self._queue(frame if isinstance(frame, bytes) else frame(), auto_acked)

    def _tell_caught_up(self) -> None:
        callbacks, self._caught_up = self._caught_up, []
        if self._closed:
            return
        for callback in callbacks:
            try:
                callback()
            except Exception:
                # The flow was unbound meanwhile, or a bug: the connection keeps writing.
                log.exception("a flow of a connection that caught up could not be told")

    def _settle_taken(self) -> None:
        """Settle the auto-ack deliveries whose last byte the kernel has taken."""
        if not self._unacked:
            return
        taken = self._written - self._transport.get_write_buffer_size()
        acks: dict[str, list[str]] = {}
        while self._unacked and self._unacked[0][0] <= taken:
            _, flow_id, message_ids = self._unacked.popleft()
            acks.setdefault(flow_id, []).extend(message_ids)
        if self._settle_written is None:
            return
        for flow_id, ids in acks.items():
            try:
                self._settle_written(flow_id, tuple(ids))
            except Exception:
                # The flow was unbound meanwhile (its messages went back for redelivery),
                # or a bug: the connection keeps writing either way.
                log.exception("auto-ack of flow %s failed", flow_id)


class FlowGate:
    """Holds one flow back while its connection's outbox is behind (see the module doc).
    ``tell(True)``: the group must send the flow nothing more for now; ``tell(False)``:
    it may go on. Call ``check`` before pushing the flow's deliveries."""

    __slots__ = ("_on", "_outbox", "_tell")

    def __init__(self, outbox: Outbox, tell: Tell) -> None:
        self._outbox = outbox
        self._tell = tell
        self._on = False

    def check(self) -> None:
        """Tell the group once that the outbox is behind, if it still holds more than
        ``high`` (the deliveries about to be pushed go out all the same: the group has
        counted them)."""
        if not self._on and self._outbox.holding:
            self._on = True
            self._tell(True)
            self._outbox.on_caught_up(self._lift)

    def _lift(self) -> None:
        self._on = False
        self._tell(False)


def tell_backpressure(sink: Sink, principal: Principal | None, flow_id: str, on: bool) -> None:
    """A ``FlowGate``'s ``tell`` for a listener: the flow's connection is behind (``on``)
    or caught up. Nothing before login or bind; a flow unbound meanwhile is ignored."""
    if principal is None or not flow_id:
        return
    with contextlib.suppress(KeygateError):
        sink.settle(principal, flow_id, Backpressure(on))


async def linger(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float
) -> None:
    """Half-close, then discard input until the peer closes, at most ``timeout`` seconds
    (STOMP calls it "Connection Lingering"): closing a socket with unread input sends a
    reset, which can make the peer drop the last frames it has not read yet — the confirms
    and the goodbye of a draining connection. Call it once the reader has stopped and the
    outbox is written."""
    if writer.is_closing() or not writer.can_write_eof():
        return
    with contextlib.suppress(OSError, TimeoutError):
        writer.write_eof()
        async with asyncio.timeout(timeout):
            while await reader.read(256 * 1024):
                pass


async def send_heartbeats(outbox: Outbox, frame: bytes, period: Callable[[], float | None]) -> None:
    """A connection's heartbeat task: push ``frame`` whenever nothing has been written for
    half of ``period()`` seconds, the longest silence the peer accepts (None: no
    heartbeats for now, asked again every second), so the peer hears from us well within
    it; checked four times a period."""
    loop = asyncio.get_running_loop()
    while True:
        every = period()
        await asyncio.sleep(every / 4 if every else 1.0)
        every = period()
        if every and loop.time() - outbox.last_sent >= every / 2:
            outbox.push(frame)


def store_each(
    sink: Sink,
    principal: Principal,
    publications: Sequence[Publication],
    *,
    log: logging.LoggerAdapter[logging.Logger] | logging.Logger = log,
) -> Awaitable[list[Receipt | KeygateError]]:
    """Hand a connection's publications to the sink now (``Sink.publish_each``): they
    are queued for storage behind the connection's earlier lots, so the caller may go on
    and hand over the next lot before this one commits. Await the result for one
    outcome per publication: its Receipt once committed, or the error that refused it
    alone. An unexpected error is logged and answered as unavailable."""
    try:
        pending = sink.publish_each(principal, publications)
    except Exception:
        log.exception("publish of %d message(s) failed unexpectedly", len(publications))
        return _unavailable(len(publications))
    return _outcomes(pending, len(publications), log)


async def _outcomes(
    pending: Awaitable[list[Receipt | KeygateError]],
    count: int,
    log: logging.LoggerAdapter[logging.Logger] | logging.Logger,
) -> list[Receipt | KeygateError]:
    try:
        return await pending
    except Exception:
        log.exception("publish of %d message(s) failed unexpectedly", count)
        return await _unavailable(count)


async def _unavailable(count: int) -> list[Receipt | KeygateError]:
    return [Unavailable("internal server error")] * count


async def publish_receipts(
    sink: Sink,
    principal: Principal,
    publications: Sequence[Publication],
    *,
    stop_at_refusal: bool,
    log: logging.LoggerAdapter[logging.Logger] | logging.Logger = log,
) -> list[Receipt | KeygateError]:
    """Store a connection's publications in arrival order; one outcome per publication
    tried: its Receipt once committed, or the error that refused it.

    Without ``stop_at_refusal`` this is ``store_each``, awaited. With it (a protocol
    whose refusal ends the connection) nothing after the first refusal may be stored:
    all go in one transaction (``Sink.publish_many``); if storage fails, none was stored
    and each gets that error; if one publication spoils the batch (no route, too large,
    queue full), they are stored one by one, in order, and the outcomes end at the first
    refusal. The caller must then not start another batch of the same connection before
    this one returns: a later batch committed while this one is retried one by one would
    overtake it.
    """
    if not stop_at_refusal:
        return await store_each(sink, principal, publications, log=log)
    try:
        if len(publications) == 1:
            return [await sink.publish(principal, publications[0])]
        return list(await sink.publish_many(principal, publications))
    except (StorageError, Unavailable) as e:
        return [e] * len(publications)
    except KeygateError as e:
        if len(publications) == 1:
            return [e]
    except Exception:
        log.exception("publish of %d message(s) failed unexpectedly", len(publications))
        return await _unavailable(len(publications))
    outcomes: list[Receipt | KeygateError] = []
    for publication in publications:
        (outcome,) = await publish_receipts(sink, principal, [publication], stop_at_refusal=True)
        outcomes.append(outcome)
        if isinstance(outcome, KeygateError):
            break
    return outcomes


async def publish_in_order(
    sink: Sink,
    principal: Principal,
    publications: Sequence[Publication],
    *,
    stop_at_refusal: bool,
    log: logging.LoggerAdapter[logging.Logger] | logging.Logger = log,
) -> list[KeygateError | None]:
    """``publish_receipts`` for protocols whose confirms carry no message ids: None for
    each publication stored."""
    outcomes = await publish_receipts(
        sink, principal, publications, stop_at_refusal=stop_at_refusal, log=log
    )
    return [outcome if isinstance(outcome, KeygateError) else None for outcome in outcomes]


__all__ = [
    "DEFAULT_HIGH",
    "LINGER",
    "AutoAcked",
    "FlowGate",
    "Outbox",
    "Remake",
    "SettleWritten",
    "Tell",
    "keep_alive",
    "linger",
    "publish_in_order",
    "publish_receipts",
    "send_heartbeats",
    "store_each",
    "tell_backpressure",
]
