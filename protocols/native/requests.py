"""What the gateway does for each request of one native connection.

How it works. The listener's reader hands ``Requests.handle`` the connection's events in
arrival order; answers go out through the connection's ``Outbox`` (protocols/_io.py).
PUBLISH is pipelined: the reader queues each one and goes on reading; when it has handled
what one socket read brought (or before any other request, or before it waits), ``flush``
hands the queued PUBLISHes to the sink as one lot (``store_each``: one group-commit
submission, each publication stored or refused alone) and a task answers each with
PUBLISH_OK or ERROR once committed. Lots are queued for the store at once, in the order
read, so the next lot goes in while this one commits and none overtakes another. The
payload, key and properties of PUBLISHes not yet confirmed (``publication_bytes``) are
held in a ``ByteBudget``: when it is spent the reader waits for confirms. BIND gives the sink one
``FlowOutput`` per flow; a run of DELIVERs is pushed in pieces of DELIVER_CHUNK bytes,
each with the way to encode it again, so a consumer that reads slowly holds its window of
messages, not an encoded copy, and auto-ack deliveries are acked once the kernel took
them; the flow's window bounds how much can be outstanding. Client-ack deliveries that
arrive while the outbox holds (the consumer is behind) are pushed unencoded and encoded
once, when they leave; one the wire cannot carry is found then and settled as
``Undeliverable`` instead of being returned by ``FlowOutput.deliver``. ACK, NACK, CREDIT
and UNBIND become the sink's settle events; the sink refuses them for a flow bound by
another connection (ERROR, the connection stays). A flow id this connection never bound
is ``NotFound``; one it bound that has ended since (UNBIND, NACK shutdown, FLOW_CLOSED) is
remembered (the last ENDED_FLOWS_KEPT of them), so a late settle of it is the sink's no-op,
answered OK. The client's CLOSE ends its flows, waits for the confirms of the PUBLISHes
sent before it to go out, and is answered with CLOSE. ``unbind_all`` is what a dropped socket
does: its flows' partitions enter the rebalance delay, exactly as after UNBIND without
shutdown.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import replace
from typing import Final, Protocol

from core import actions
from core.errors import InvalidArgument, KeygateError, NotFound
from core.ingress import MAX_WINDOW, validate_client_name, validate_delay
from core.model import AckMode, Publication
from protocols import sink
from protocols._io import FlowGate, Outbox, store_each, tell_backpressure
from protocols._limits import Admission, ByteBudget, ConnectionLimits, publication_bytes
from protocols._log import ConnectionLog
from protocols._tasks import Tasks
from protocols.native.connection import ServerConnection
from protocols.native.encoding import append_deliver
from protocols.native.errors import error_frame
from protocols.native.events import (
    Ack,
    AckCumulative,
    Bind,
    BindOk,
    Close,
    Credit,
    DeclareQueue,
    DeleteQueue,
    Error,
    Event,
    FlowClosed,
    Hello,
    Nack,
    NackOutcome,
    Ok,
    PartitionsChanged,
    Ping,
    Pong,
    Publish,
    QueueOk,
    Unbind,
)
from protocols.native.mapping import (
    publication,
    queue_from_settings,
    queue_settings,
)
from protocols.sink import BindRequest, Principal, Sink, peer_identity

# A run of deliveries is written in pieces of about this many bytes: each a push of its
# own that a slow consumer's outbox can hold as the frames, not their bytes.
DELIVER_CHUNK: Final = 64 * 1024
# Flows of one connection that ended and are still known by id: a settle racing the end of
# its flow is a no-op, not an error (bounded, as all a client can make the gateway hold).
ENDED_FLOWS_KEPT: Final = 1024
# How long a client's CLOSE waits for the commits of the PUBLISHes it sent before it.
CLOSE_CONFIRM_WAIT: Final = 10.0


def _window(window: int, zero: str) -> int:
    """BIND's or CREDIT's window: 0 (which means ``zero``) to MAX_WINDOW."""
    if window and not 1 <= window <= MAX_WINDOW:
        raise InvalidArgument(f"window must be between 0 and {MAX_WINDOW} ({zero})")
    return window


class Server(Protocol):
    """What the requests of a connection need of their listener."""

    sink: Sink
    server_name: str
    max_frame: int
    limits: ConnectionLimits
    write_buffer: int
    unconfirmed_peak: int


class FlowOutput:
    """protocols.sink.FlowOutput for one flow on one native connection."""

    def __init__(self, requests: Requests, *, auto_ack: bool) -> None:
        self.requests = requests
        self.flow_id = ""
        self.auto_ack = auto_ack
        self.gate = FlowGate(requests.outbox, self._backpressure)

    def deliver(self, deliveries: Sequence[actions.Deliver]) -> Sequence[actions.Deliver]:
        # Those not encodable (a field longer than the wire carries, a frame over the
        # peer's max_frame) come back: the group dead-letters them as undeliverable.
        self.gate.check()
        return self.requests.deliver(deliveries, auto_ack=self.auto_ack)

    def _backpressure(self, on: bool) -> None:
        requests = self.requests
        tell_backpressure(requests.sink, requests.principal, self.flow_id, on)

    def partitions_changed(self, partitions: frozenset[int]) -> None:
        self.requests.send(PartitionsChanged(flow_id=self.flow_id, partitions=partitions))

    def terminate(self, error: KeygateError) -> None:
        self.requests.ended(self.flow_id)
        self.requests.send(FlowClosed(flow_id=self.flow_id, code=error.code, text=error.message))


class Requests:
    """One connection's protocol state (login, flows, publishes in flight) and answers."""

    def __init__(
        self,
        server: Server,
        writer: asyncio.StreamWriter,
        publishes: Tasks,
        admission: Admission,
        log: ConnectionLog,
    ) -> None:
        self.server = server
        self.sink = server.sink
        self.conn = ServerConnection(
            server.max_frame, max_login_frame=server.limits.max_login_frame
        )
        self.outbox = Outbox(writer, settle_written=self.settle_written, high=server.write_buffer)
        self.identity = peer_identity(writer)
        self.peer = str(writer.get_extra_info("peername"))
        self.publishes = publishes
        self.admission = admission
        self.log = log
        self.principal: Principal | None = None
        self.flows: set[str] = set()
        self._ended: dict[str, None] = {}  # insertion-ordered: the oldest goes first
        self.session_id = uuid.uuid4().hex
        self.producer = ""  # every message's producer, once HELLO named the client
        self.unconfirmed = ByteBudget(server.limits.max_unconfirmed_bytes)
        self._queued: list[tuple[Publish, Publication]] = []
        self._queued_bytes = 0  # their publication_bytes, held in ``unconfirmed``

    def send(self, event: Event) -> None:
        try:
            data = self.conn.send(event)
        except RuntimeError:
            return  # the state machine closed (ERROR/CLOSE sent): nothing more goes out
        self.outbox.push(data)

    def deliver(
        self, deliveries: Sequence[actions.Deliver], *, auto_ack: bool
    ) -> list[actions.Deliver]:
        """Queue the DELIVERs of one flow's run, in writes of up to DELIVER_CHUNK bytes
        each pushed with the way to encode it again; returns the deliveries the wire
        cannot carry. Client-ack deliveries that would only be held (the socket is behind)
        are not encoded now but once, when they are written: see ``_write_late``."""
        failed: list[actions.Deliver] = []
        append = self.conn.append_deliver
        out = bytearray()
        sent: list[actions.Deliver] = []
        for i, d in enumerate(deliveries):
            if not sent and not auto_ack and self.outbox.holding:
                self._hold_deliveries(deliveries[i:])
                break
            try:
                append(out, d.flow_id, d.message, d.delivery_count, d.redelivered)
            except RuntimeError:
                return failed  # closed: not auto-acked, so the unbind returns them
            except KeygateError:
                failed.append(d)
                continue
            sent.append(d)
            if len(out) >= DELIVER_CHUNK:
                self._push_deliveries(out, sent, auto_ack)
                out, sent = bytearray(), []
        if sent:
            self._push_deliveries(out, sent, auto_ack)
        return failed

    def _push_deliveries(self, out: bytearray, sent: list[actions.Deliver], auto_ack: bool) -> None:
        acked = (sent[0].flow_id, [d.message.message_id for d in sent]) if auto_ack else None
        self.outbox.push(bytes(out), acked, remake=functools.partial(self._write_late, sent))

    def _hold_deliveries(self, deliveries: Sequence[actions.Deliver]) -> None:
        # Pieces of about DELIVER_CHUNK bytes, as the outbox releases them.
        piece: list[actions.Deliver] = []
        size = 0
        for d in deliveries:
            piece.append(d)
            size += d.message.size
            if size >= DELIVER_CHUNK:
                self.outbox.push(None, remake=functools.partial(self._write_late, piece))
                piece, size = [], 0
        if piece:
            self.outbox.push(None, remake=functools.partial(self._write_late, piece))

    def _write_late(self, deliveries: list[actions.Deliver]) -> bytes:
        """The DELIVERs of one piece of a flow's run, made when the outbox writes them.
        A piece first encoded when it was pushed encodes the same again; one held without
        being encoded may hold a delivery the wire cannot carry: it is left out and settled
        as undeliverable, which dead-letters it as ``deliver`` returning it would have."""
        out = bytearray()
        undeliverable: list[str] = []
        max_frame = self.conn.max_frame
        for d in deliveries:
            try:
                append_deliver(
                    out, d.flow_id, d.message, d.delivery_count, d.redelivered, max_frame
                )
            except KeygateError:
                undeliverable.append(d.message.message_id)
        if undeliverable and self.principal is not None:
            event = sink.Undeliverable(tuple(undeliverable))
            try:
                self.sink.settle(self.principal, deliveries[0].flow_id, event)
            except KeygateError as e:  # runs in the writer task, which must go on
                self.log.info("native %s: undeliverable messages not settled: %s", self.peer, e)
        return bytes(out)

    def settle_written(self, flow_id: str, message_ids: tuple[str, ...]) -> None:
        if self.principal is not None:
            self.sink.settle(self.principal, flow_id, sink.Ack(message_ids))

    def unbind_all(self) -> None:
        if self.principal is not None:
            for flow_id in list(self.flows):
                self.sink.settle(self.principal, flow_id, sink.Unbind())
        self.flows.clear()

    def publish(self, event: Publish) -> bool:
        """Queue a PUBLISH for the next ``flush``, or answer it with ERROR when it is
        refused at once; without a coroutine, as most requests are PUBLISHes. False, with
        nothing done, when it does not fit the unconfirmed budget: ``handle`` then waits
        for room."""
        try:
            message = self._publication(event)
        except KeygateError as e:
            self.send(error_frame(e, event.request_id))
            return True
        size = publication_bytes(message)
        if self.unconfirmed.full_for(size):
            return False
        self.unconfirmed.hold(size)
        self._queue(event, message, size)
        return True

    def _queue(self, event: Publish, message: Publication, size: int) -> None:
        self._queued.append((event, message))
        self._queued_bytes += size

    def _publication(self, event: Publish) -> Publication:
        return publication(event, self.producer)

    async def handle(self, event: Event) -> bool:
        """Handle one request; False ends the connection. A PUBLISH is queued until
        ``flush``; any other request flushes first, so it comes after them."""
        if not isinstance(event, Publish):
            self.flush()
        try:
            match event:
                case Hello():
                    await self.hello(event)
                case Publish():
                    # What ``publish`` leaves: a PUBLISH its unconfirmed budget has no
                    # room for. Refused at once when malformed (InvalidArgument answers
                    # this request), else it waits: the read loop stops, back-pressure
                    # rather than buffering, with the confirms waited for on their way.
                    message = self._publication(event)
                    size = publication_bytes(message)
                    self.flush()
                    await self.unconfirmed.acquire(size)
                    self._queue(event, message, size)
                case Ack():
                    self.settle(event.flow_id, sink.Ack(event.message_ids))
                    self.ok(event.request_id)
                case AckCumulative():
                    self.settle(event.flow_id, sink.AckCumulative(event.partition, event.seq))
                    self.ok(event.request_id)
                case Nack():
                    self.nack(event)
                    self.ok(event.request_id)
                case Credit():
                    window = _window(event.window, "0 pauses the flow")
                    self.settle(event.flow_id, sink.Credit(window))
                    self.ok(event.request_id)
                case Bind():
                    await self.bind(event)
                case Unbind():
                    self.settle(event.flow_id, sink.Unbind(shutdown=event.shutdown))
                    self.ok(event.request_id)
                case DeclareQueue():
                    await self.declare(event)
                case DeleteQueue():
                    assert self.principal is not None
                    await self.sink.delete_queue(self.principal, event.name)
                    self.ok(event.request_id)
                case Ping():
                    self.send(Pong(request_id=event.request_id))
                case Close():
                    await self.close()
                    return False
                case Error():
                    self.log.info(
                        "native %s: client error %s: %s", self.peer, event.code, event.text
                    )
                    return event.request_id != 0
        except KeygateError as e:
            if isinstance(event, Hello):
                # A refused login answers the HELLO (its id), then ends the connection.
                self.send(error_frame(e, event.request_id))
                self.send(Close(reason=e.code))
                return False
            if event.request_id:
                self.send(error_frame(e, event.request_id))
            else:
                # Fire-and-forget frames have nobody to answer; an ERROR with id 0 would
                # end the connection, which a late ack must not do.
                self.log.info("native %s: %s ignored: %s", self.peer, type(event).__name__, e)
        return True

    async def close(self) -> None:
        """The client's CLOSE: end its flows (no DELIVER follows), answer the PUBLISHes it
        sent before (their commit awaited, at most CLOSE_CONFIRM_WAIT), then CLOSE."""
        self.unbind_all()
        if not await self.publishes.wait(CLOSE_CONFIRM_WAIT):
            self.log.info("native %s: publishes unconfirmed at CLOSE, closing", self.peer)
        self.send(Close())

    def ok(self, request_id: int) -> None:
        if request_id:
            self.send(Ok(request_id=request_id))

    async def hello(self, event: Hello) -> None:
        validate_client_name(event.client_name)
        peer, certificate_user = self.identity
        principal = await self.sink.authenticate(
            event.username,
            event.password,
            protocol="native",
            client_id=event.client_name,
            peer=peer,
            certificate_user=certificate_user,
        )
        self.principal = replace(principal, connection=f"native:{self.session_id}")
        self.producer = f"native:{event.client_name or self.session_id}"
        self.log.authenticated(self.principal)
        self.admission.login(self.principal.username)
        self.send(self.conn.accept(self.server.server_name, self.session_id))

    def flush(self) -> None:
        """Hand the PUBLISHes queued since the last flush to the sink as one lot, queued
        for storage now, behind the earlier lots; a task answers them once committed."""
        if not self._queued:
            return
        assert self.principal is not None
        lot, self._queued = self._queued, []
        size, self._queued_bytes = self._queued_bytes, 0
        pending = store_each(
            self.sink, self.principal, [message for _, message in lot], log=self.log
        )
        self.publishes.spawn(self._confirm(lot, size, pending), name="publish")

    async def _confirm(
        self,
        lot: list[tuple[Publish, Publication]],
        size: int,
        pending: Awaitable[list[sink.Receipt | KeygateError]],
    ) -> None:
        """Answer each PUBLISH of ``lot`` (``size`` bytes held) in arrival order with
        PUBLISH_OK or ERROR."""
        try:
            outcomes = await pending
        finally:
            self.unconfirmed.release(size)
            self.server.unconfirmed_peak = max(self.server.unconfirmed_peak, self.unconfirmed.peak)
        out = bytearray()
        conn = self.conn
        try:
            for (event, _), outcome in zip(lot, outcomes, strict=True):
                if isinstance(outcome, KeygateError):
                    out += conn.send(error_frame(outcome, event.request_id))
                else:
                    conn.append_publish_ok(
                        out, event.request_id, outcome.message_ids, outcome.duplicate
                    )
        except RuntimeError:
            pass  # the state machine closed (ERROR/CLOSE sent): nothing more goes out
        if out:
            self.outbox.push(bytes(out))

    def settle(self, flow_id: str, event: sink.Settle) -> None:
        assert self.principal is not None
        # The sink first: a flow of another connection is its PermissionDenied.
        self.sink.settle(self.principal, flow_id, event)
        if flow_id in self.flows:
            if isinstance(event, sink.Unbind):
                self.ended(flow_id)
        elif flow_id not in self._ended:
            raise NotFound(f"unknown flow id {flow_id[:100]!r}: not bound on this connection")

    def ended(self, flow_id: str) -> None:
        """``flow_id`` ended (unbound, shut down, closed by the gateway): settles naming it
        are no-ops from now on."""
        self.flows.discard(flow_id)
        self._ended[flow_id] = None
        if len(self._ended) > ENDED_FLOWS_KEPT:
            del self._ended[next(iter(self._ended))]

    def nack(self, event: Nack) -> None:
        if event.outcome is NackOutcome.RETRY:
            self.settle(event.flow_id, sink.Nack(event.message_ids, validate_delay(event.delay)))
        elif event.outcome is NackOutcome.REJECT:
            self.settle(event.flow_id, sink.Reject(event.message_ids))
        else:
            self.settle(event.flow_id, sink.Unbind(shutdown=True))

    async def bind(self, event: Bind) -> None:
        assert self.principal is not None
        _window(event.window, "0 = the queue's default window")
        output = FlowOutput(self, auto_ack=event.ack_mode is AckMode.AUTO)
        result = await self.sink.bind(
            self.principal,
            BindRequest(
                queue=event.queue,
                group=event.group,
                client=self.conn.client_name or self.session_id,
                window=event.window or None,
                ack_mode=event.ack_mode,
                tags=dict(event.tags) if event.tags else None,
                mode=event.mode,
                key_order=event.key_order,
                start=event.start,
                ack_timeout=event.ack_timeout,
                previous=event.previous_partitions,
            ),
            output,
        )
        output.flow_id = result.flow_id
        self.flows.add(result.flow_id)
        self.send(
            BindOk(
                request_id=event.request_id,
                flow_id=result.flow_id,
                partitions=result.partitions,
                mode=result.group.mode,
                window=result.window,
            )
        )

    async def declare(self, event: DeclareQueue) -> None:
        assert self.principal is not None
        config = queue_from_settings(event.name, dict(event.settings), event.subscriptions)
        stored = await self.sink.declare_queue(
            self.principal,
            config,
            passive=event.passive,
            exist_ok=event.exist_ok,
            given=tuple(event.settings),
        )
        self.send(
            QueueOk(
                request_id=event.request_id,
                name=stored.name,
                settings=queue_settings(stored),
                subscriptions=stored.subscriptions,
            )
        )


__all__ = ["FlowOutput", "Requests", "Server"]
