"""The native protocol's server: one ``protocols.native.ServerConnection`` per socket.

The listener talks to the gateway only through ``protocols.sink.Sink``. Requests are
handled as they arrive. PUBLISH is pipelined: each one runs in its own task, and because
the sink's ``publish`` hands its messages to the store's group commit before its first
suspension, tasks started in arrival order are stored in arrival order; PUBLISH_OK goes out
when the commit is done. The payload bytes of PUBLISHes not yet confirmed are held in a
``ByteBudget``: when it is spent the read loop waits for confirms instead of reading (and
spawning) more. BIND gives the sink one ``_FlowOutput`` per flow; deliveries come
through it and are written to the transport by the connection's ``FrameWriter``
(protocols/native/writer.py: coalesced writes, back-pressure, auto-ack once written): the
flow's window bounds how much can be outstanding. ACK, NACK, CREDIT and UNBIND become the
sink's settle events; the sink refuses them for a flow bound by another connection
(ERROR, the connection stays). A socket that drops unbinds its flows (their partitions
enter the rebalance delay), exactly like UNBIND without shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Final

from core import actions
from core.errors import KeygateError, Unavailable
from core.ingress import validate_client_name, validate_delay, validate_window
from core.model import AckMode
from protocols import sink
from protocols._io import keep_alive
from protocols._limits import DEFAULT_LIMITS, ByteBudget, ConnectionLimits
from protocols._log import ConnectionLog
from protocols.native.connection import ConnectionState, ServerConnection
from protocols.native.errors import IdleTimeout, LoginTimeout, NativeProtocolError, error_frame
from protocols.native.events import (
    DEFAULT_MAX_FRAME,
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
    PublishOk,
    QueueOk,
    Unbind,
)
from protocols.native.mapping import (
    deliver_frame,
    publication,
    queue_from_settings,
    queue_settings,
)
from protocols.native.writer import FrameWriter
from protocols.sink import BindRequest, Principal, Sink, peer_identity

log = logging.getLogger("keygate.native")

_READ_SIZE: Final = 256 * 1024
# How long a closing listener waits for publishes it already received to be confirmed.
DRAIN_TIMEOUT: Final = 10.0
# How long closing a connection waits for its unsent bytes to leave before dropping them.
_CLOSE_WAIT: Final = 2.0
# Bytes a connection may hold in its write buffer before deliveries wait (high-water mark).
DEFAULT_WRITE_BUFFER: Final = 1024 * 1024
# Four of the SDK's 15 s heartbeats.
DEFAULT_IDLE_TIMEOUT: Final = 60.0


class _FlowOutput:
    """protocols.sink.FlowOutput for one flow on one native connection."""

    def __init__(self, session: _Session, *, auto_ack: bool) -> None:
        self.session = session
        self.flow_id = ""
        self.auto_ack = auto_ack

    def deliver(self, deliveries: Sequence[actions.Deliver]) -> Sequence[actions.Deliver]:
        send = self.session.send
        failed = []
        for d in deliveries:
            try:
                frame = deliver_frame(d)
                send(frame, auto_ack=self.auto_ack)
            except KeygateError:
                # Not encodable (a field longer than the wire carries, a frame over the
                # peer's max_frame): the group dead-letters it as undeliverable.
                failed.append(d)
        return failed

    def partitions_changed(self, partitions: frozenset[int]) -> None:
        self.session.send(PartitionsChanged(flow_id=self.flow_id, partitions=partitions))

    def terminate(self, error: KeygateError) -> None:
        self.session.flows.discard(self.flow_id)
        self.session.send(FlowClosed(flow_id=self.flow_id, code=error.code, text=error.message))


class _Session:
    def __init__(
        self,
        listener: NativeListener,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.listener = listener
        self.sink = listener.sink
        self.reader = reader
        self.writer = writer
        self.conn = ServerConnection(
            listener.max_frame, max_login_frame=listener.limits.max_login_frame
        )
        self.principal: Principal | None = None
        self.log = ConnectionLog(log, "native", writer.get_extra_info("peername"))
        self.flows: set[str] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.session_id = uuid.uuid4().hex
        self.admission = listener.limits.connections.open("native")
        self.unconfirmed = ByteBudget(listener.limits.max_unconfirmed_bytes)
        self.out = FrameWriter(self.conn, writer, listener.write_buffer, self.settle_written)
        self.send = self.out.send

    async def run(self) -> None:
        login_deadline = asyncio.get_running_loop().time() + self.listener.limits.login_timeout
        try:
            while True:
                if self.conn.state is ConnectionState.AWAIT_HELLO:
                    async with asyncio.timeout_at(login_deadline):
                        data = await self.reader.read(_READ_SIZE)
                else:
                    async with asyncio.timeout(self.listener.idle_timeout):
                        data = await self.reader.read(_READ_SIZE)
                if not data:
                    return
                self.conn.receive_data(data)
                while (event := self.conn.next_event()) is not None:
                    if not await self.handle(event):
                        return
                await self.writer.drain()
        except NativeProtocolError as e:
            self.log.info("native %s: protocol error: %s", self.peer, e)
            self.send(error_frame(e))
        except TimeoutError:
            if self.conn.state is ConnectionState.AWAIT_HELLO:
                self.log.info(
                    "native %s: no HELLO within %.0fs",
                    self.peer,
                    self.listener.limits.login_timeout,
                )
                self.send(error_frame(LoginTimeout("no HELLO in time")))
            else:
                # A peer that vanished without a FIN or RST (power loss, a dropped NAT
                # entry) must not hold its partitions forever: the SDK pings every 15 s.
                self.log.info(
                    "native %s: nothing received for %.0fs, closing",
                    self.peer,
                    self.listener.idle_timeout,
                )
                self.send(error_frame(IdleTimeout("no frame in time")))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            await self.finish()

    @property
    def peer(self) -> str:
        return str(self.writer.get_extra_info("peername"))

    def settle_written(self, flow_id: str, message_ids: tuple[str, ...]) -> None:
        if self.principal is not None:
            self.sink.settle(self.principal, flow_id, sink.Ack(message_ids))

    async def finish(self) -> None:
        self.admission.release()
        self.out.stop()
        if self.principal is not None:
            for flow_id in list(self.flows):
                self.sink.settle(self.principal, flow_id, sink.Unbind())
        self.flows.clear()
        for task in list(self.tasks):
            task.cancel()
        with contextlib.suppress(ConnectionError, OSError):
            self.writer.close()
            try:
                await asyncio.wait_for(self.writer.wait_closed(), _CLOSE_WAIT)
            except TimeoutError:
                # A peer that stopped reading keeps unsent bytes in the transport, and a
                # close would wait for them forever: drop them (and the connection).
                self.writer.transport.abort()

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def handle(self, event: Event) -> bool:
        """Handle one request; False ends the connection."""
        try:
            match event:
                case Hello():
                    await self.hello(event)
                case Publish():
                    if self.listener.closing:
                        raise Unavailable("the gateway is shutting down")
                    # Waiting here stops the read loop: back-pressure, not buffering.
                    await self.unconfirmed.acquire(len(event.payload))
                    self.spawn(self.publish(event))
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
                    self.settle(event.flow_id, sink.Credit(validate_window(event.window)))
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
                    self.send(Close())
                    return False
                case Error():
                    self.log.info(
                        "native %s: client error %s: %s", self.peer, event.code, event.text
                    )
                    return event.request_id != 0
        except KeygateError as e:
            if isinstance(event, Hello):
                self.send(error_frame(e))
                return False
            if event.request_id:
                self.send(error_frame(e, event.request_id))
            else:
                # Fire-and-forget frames have nobody to answer; an ERROR with id 0 would
                # end the connection, which a late ack must not do.
                self.log.info("native %s: %s ignored: %s", self.peer, type(event).__name__, e)
        return True

    def ok(self, request_id: int) -> None:
        if request_id:
            self.send(Ok(request_id=request_id))

    async def hello(self, event: Hello) -> None:
        validate_client_name(event.client_name)
        peer, certificate_user = peer_identity(self.writer)
        principal = await self.sink.authenticate(
            event.username,
            event.password,
            protocol="native",
            client_id=event.client_name,
            peer=peer,
            certificate_user=certificate_user,
        )
        self.principal = replace(principal, connection=f"native:{self.session_id}")
        self.log.authenticated(self.principal)
        self.admission.login(self.principal.username)
        self.send(self.conn.accept(self.listener.server_name, self.session_id))

    async def publish(self, event: Publish) -> None:
        try:
            await self._publish(event)
        finally:
            self.unconfirmed.release(len(event.payload))
            self.listener.unconfirmed_peak = max(
                self.listener.unconfirmed_peak, self.unconfirmed.peak
            )

    async def _publish(self, event: Publish) -> None:
        assert self.principal is not None
        try:
            receipt = await self.sink.publish(
                self.principal,
                publication(event, f"native:{self.conn.client_name or self.session_id}"),
            )
        except KeygateError as e:
            self.send(error_frame(e, event.request_id))
            return
        self.send(
            PublishOk(
                request_id=event.request_id,
                message_ids=receipt.message_ids,
                duplicate=receipt.duplicate,
            )
        )

    def settle(self, flow_id: str, event: sink.Settle) -> None:
        assert self.principal is not None
        self.sink.settle(self.principal, flow_id, event)
        if isinstance(event, sink.Unbind):
            self.flows.discard(flow_id)

    def nack(self, event: Nack) -> None:
        if event.outcome is NackOutcome.RETRY:
            self.settle(event.flow_id, sink.Nack(event.message_ids, validate_delay(event.delay)))
        elif event.outcome is NackOutcome.REJECT:
            self.settle(event.flow_id, sink.Reject(event.message_ids))
        else:
            self.settle(event.flow_id, sink.Unbind(shutdown=True))

    async def bind(self, event: Bind) -> None:
        assert self.principal is not None
        if event.window:  # 0 = the queue's default window
            validate_window(event.window)
        output = _FlowOutput(self, auto_ack=event.ack_mode is AckMode.AUTO)
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
            self.principal, config, passive=event.passive, exist_ok=event.exist_ok
        )
        self.send(
            QueueOk(
                request_id=event.request_id,
                name=stored.name,
                settings=queue_settings(stored),
                subscriptions=stored.subscriptions,
            )
        )


class NativeListener:
    """protocols.sink.Listener for the native protocol."""

    name = "native"

    def __init__(
        self,
        sink: Sink,
        *,
        server_name: str = "keygate",
        max_frame: int = DEFAULT_MAX_FRAME,
        write_buffer: int = DEFAULT_WRITE_BUFFER,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        limits: ConnectionLimits = DEFAULT_LIMITS,
    ) -> None:
        self.sink = sink
        # Seconds a logged-in connection may send nothing before it is closed; None = never.
        self.idle_timeout = idle_timeout
        self.limits = limits
        # The most bytes of unconfirmed publishes any connection has held (never above
        # limits.max_unconfirmed_bytes, or one message when a message is larger).
        self.unconfirmed_peak = 0
        self.write_buffer = write_buffer
        self.server_name = server_name
        self.max_frame = max_frame
        self._server: asyncio.Server | None = None
        self._sessions: set[_Session] = set()
        self._idle = asyncio.Event()
        self.closing = False

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        self._server = await asyncio.start_server(self._accept, host, port, ssl=ssl_context)
        return int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        keep_alive(writer)
        session = _Session(self, reader, writer)
        self._sessions.add(session)
        try:
            await session.run()
        finally:
            self._sessions.discard(session)
            if not self._sessions:
                self._idle.set()

    async def close(self) -> None:
        """Stop accepting; refuse new PUBLISHes and let those already received commit and
        be confirmed (at most DRAIN_TIMEOUT); then end every connection by closing its
        socket (the session's reader sees EOF and unbinds its flows) and wait for them."""
        if self._server is not None:
            self._server.close()
        self.closing = True
        in_flight = [task for session in self._sessions for task in session.tasks]
        if in_flight:
            await asyncio.wait(in_flight, timeout=DRAIN_TIMEOUT)
            for session in self._sessions:
                session.out.write_out()
        if self._sessions:
            self._idle.clear()
            for session in list(self._sessions):
                session.out.abort()
            await self._idle.wait()
        if self._server is not None:
            await self._server.wait_closed()
