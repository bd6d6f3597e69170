"""The native protocol's server: one ``protocols.native.ServerConnection`` per socket.

Requests are handled as they arrive. PUBLISH is pipelined: each one runs in its own task,
and because ``Broker.publish`` hands its messages to the store's group commit before its
first suspension, tasks started in arrival order are stored in arrival order; PUBLISH_OK
goes out when the commit is done. Deliveries come from the group runtimes through
``_FlowOutput`` and are written straight to the transport: the flow's window bounds how
much can be outstanding. A socket that drops unbinds its flows (their partitions enter the
rebalance delay), exactly like UNBIND without shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import uuid
from collections.abc import Sequence
from dataclasses import fields
from typing import Any, Final

from core import actions
from core.errors import InvalidArgument, KeygateError, Unavailable
from core.model import Publication, QueueConfig
from gateway.broker import Broker
from protocols.native.connection import ServerConnection
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
    Deliver,
    Error,
    Event,
    FlowClosed,
    Hello,
    Nack,
    NackOutcome,
    NativeProtocolError,
    Ok,
    PartitionsChanged,
    Ping,
    Pong,
    Publish,
    PublishOk,
    QueueOk,
    SettingValue,
    Unbind,
)
from protocols.sink import Principal, peer_identity

log = logging.getLogger("keygate.native")

_READ_SIZE: Final = 256 * 1024
# How long a closing listener waits for publishes it already received to be confirmed.
DRAIN_TIMEOUT: Final = 10.0
_SETTINGS: Final = {f.name for f in fields(QueueConfig)} - {"name", "subscriptions"}


def queue_settings(config: QueueConfig) -> dict[str, SettingValue]:
    """A queue's settings as the QUEUE_OK map (None values left out)."""
    out: dict[str, SettingValue] = {}
    for name in sorted(_SETTINGS):
        value = getattr(config, name)
        if value is not None:
            out[name] = value
    out["dead_letter_queue"] = config.dlq_name or ""
    return out


def queue_from_settings(
    name: str, settings: dict[str, Any], subscriptions: Sequence[str] | None
) -> QueueConfig:
    unknown = set(settings) - _SETTINGS
    if unknown:
        raise InvalidArgument(f"unknown queue settings: {', '.join(sorted(unknown))}")
    try:
        return QueueConfig(name=name, subscriptions=tuple(subscriptions or ()), **settings)
    except TypeError as e:
        raise InvalidArgument(str(e)) from e


class _FlowOutput:
    """gateway.runtime.FlowOutput for one flow on one native connection."""

    def __init__(self, session: _Session) -> None:
        self.session = session
        self.flow_id = ""

    def deliver(self, deliveries: Sequence[actions.Deliver]) -> None:
        send = self.session.send
        for d in deliveries:
            m = d.message
            send(
                Deliver(
                    flow_id=d.flow_id,
                    message_id=m.message_id,
                    partition=m.partition,
                    seq=m.seq,
                    key=m.key,
                    payload=m.payload,
                    properties=m.properties,
                    topic=m.topic,
                    publish_time=m.publish_time,
                    delivery_count=d.delivery_count,
                    redelivered=d.redelivered,
                    content_type=m.content_type,
                    correlation_id=m.correlation_id,
                    reply_to=m.reply_to,
                )
            )

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
        self.broker = listener.broker
        self.reader = reader
        self.writer = writer
        self.conn = ServerConnection(listener.max_frame)
        self.principal: Principal | None = None
        self.flows: set[str] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.outgoing: list[bytes] = []
        self.session_id = uuid.uuid4().hex

    def send(self, event: Event) -> None:
        """Encode now, write once per event-loop turn: replies and deliveries produced in
        one turn leave in one transport write instead of one each."""
        if self.writer.is_closing():
            return
        try:
            self.outgoing.append(self.conn.send(event))
        except RuntimeError:
            # The connection state machine is closed (after ERROR/CLOSE): nothing to send.
            return
        if len(self.outgoing) == 1:
            asyncio.get_running_loop().call_soon(self.write_out)

    def write_out(self) -> None:
        if self.outgoing and not self.writer.is_closing():
            self.writer.write(b"".join(self.outgoing))
        self.outgoing.clear()

    def abort(self) -> None:
        self.write_out()
        self.writer.close()

    async def run(self) -> None:
        try:
            while True:
                data = await self.reader.read(_READ_SIZE)
                if not data:
                    return
                self.conn.receive_data(data)
                while (event := self.conn.next_event()) is not None:
                    if not await self.handle(event):
                        return
                await self.writer.drain()
        except NativeProtocolError as e:
            log.info("native %s: protocol error: %s", self.peer, e)
            self.send(Error(request_id=0, code=e.code, text=e.message))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            await self.finish()

    @property
    def peer(self) -> str:
        return str(self.writer.get_extra_info("peername"))

    async def finish(self) -> None:
        self.write_out()
        for flow_id in list(self.flows):
            self.broker.unbind(flow_id)
        self.flows.clear()
        for task in list(self.tasks):
            task.cancel()
        with contextlib.suppress(ConnectionError, OSError):
            self.writer.close()
            await self.writer.wait_closed()

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
                    self.spawn(self.publish(event))
                case Ack():
                    self.broker.ack(event.flow_id, event.message_ids)
                    self.ok(event.request_id)
                case AckCumulative():
                    self.broker.ack_cumulative(event.flow_id, event.partition, event.seq)
                    self.ok(event.request_id)
                case Nack():
                    self.nack(event)
                    self.ok(event.request_id)
                case Credit():
                    self.broker.credit(event.flow_id, event.window)
                    self.ok(event.request_id)
                case Bind():
                    await self.bind(event)
                case Unbind():
                    self.flows.discard(event.flow_id)
                    self.broker.unbind(event.flow_id, shutdown=event.shutdown)
                    self.ok(event.request_id)
                case DeclareQueue():
                    await self.declare(event)
                case DeleteQueue():
                    assert self.principal is not None
                    await self.broker.delete_queue(self.principal, event.name)
                    self.ok(event.request_id)
                case Ping():
                    self.send(Pong(request_id=event.request_id))
                case Close():
                    self.send(Close())
                    return False
                case Error():
                    log.info("native %s: client error %s: %s", self.peer, event.code, event.text)
                    return event.request_id != 0
        except KeygateError as e:
            if isinstance(event, Hello):
                self.send(Error(request_id=0, code=e.code, text=e.message))
                return False
            if event.request_id:
                self.send(Error(request_id=event.request_id, code=e.code, text=e.message))
            else:
                # Fire-and-forget frames have nobody to answer; an ERROR with id 0 would
                # end the connection, which a late ack must not do.
                log.info("native %s: %s ignored: %s", self.peer, type(event).__name__, e)
        return True

    def ok(self, request_id: int) -> None:
        if request_id:
            self.send(Ok(request_id=request_id))

    async def hello(self, event: Hello) -> None:
        peer, certificate_user = peer_identity(self.writer)
        self.principal = await self.broker.authenticate(
            event.username,
            event.password,
            protocol="native",
            client_id=event.client_name,
            peer=peer,
            certificate_user=certificate_user,
        )
        self.send(self.conn.accept(self.listener.server_name, self.session_id))

    async def publish(self, event: Publish) -> None:
        assert self.principal is not None
        try:
            receipt = await self.broker.publish(
                self.principal,
                Publication(
                    payload=event.payload,
                    queue=event.queue,
                    topic=event.topic,
                    key=event.key,
                    properties=event.properties,
                    ttl=event.ttl,
                    deliver_at=event.deliver_at,
                    producer=f"native:{self.conn.client_name or self.session_id}",
                    dedup_id=event.dedup_id,
                    content_type=event.content_type,
                    correlation_id=event.correlation_id,
                    reply_to=event.reply_to,
                ),
            )
        except KeygateError as e:
            self.send(Error(request_id=event.request_id, code=e.code, text=e.message))
            return
        self.send(
            PublishOk(
                request_id=event.request_id,
                message_ids=receipt.message_ids,
                duplicate=receipt.duplicate,
            )
        )

    def nack(self, event: Nack) -> None:
        if event.outcome is NackOutcome.RETRY:
            self.broker.nack(event.flow_id, event.message_ids, event.delay)
        elif event.outcome is NackOutcome.REJECT:
            self.broker.reject(event.flow_id, event.message_ids)
        else:
            self.flows.discard(event.flow_id)
            self.broker.unbind(event.flow_id, shutdown=True)

    async def bind(self, event: Bind) -> None:
        assert self.principal is not None
        output = _FlowOutput(self)
        result = await self.broker.bind(
            self.principal,
            event.queue,
            event.group,
            output=output,
            client=self.conn.client_name or self.session_id,
            window=event.window or None,
            ack_mode=event.ack_mode,
            tags=dict(event.tags) if event.tags else None,
            mode=event.mode,
            key_order=event.key_order,
            start=event.start,
            ack_timeout=event.ack_timeout,
            previous=event.previous_partitions,
        )
        output.flow_id = result.flow_id
        self.flows.add(result.flow_id)
        window = event.window or self.broker.queue(event.queue).window
        self.send(
            BindOk(
                request_id=event.request_id,
                flow_id=result.flow_id,
                partitions=result.partitions,
                mode=result.group.mode,
                window=window,
            )
        )

    async def declare(self, event: DeclareQueue) -> None:
        assert self.principal is not None
        config = queue_from_settings(event.name, dict(event.settings), event.subscriptions)
        if event.passive:
            stored = self.broker.queue(event.name)
        else:
            stored = await self.broker.declare(self.principal, config, exist_ok=event.exist_ok)
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
        self, broker: Broker, *, server_name: str = "keygate", max_frame: int = DEFAULT_MAX_FRAME
    ) -> None:
        self.broker = broker
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
                session.write_out()
        if self._sessions:
            self._idle.clear()
            for session in list(self._sessions):
                session.abort()
            await self._idle.wait()
        if self._server is not None:
            await self._server.wait_closed()
