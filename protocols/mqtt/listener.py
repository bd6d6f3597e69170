"""The asyncio MQTT listener: sockets around the sans-IO ``ServerConnection``.

How it works. Each connection is one ``_Client`` whose tasks all belong to one ``Tasks``:
a reader (bytes → state machine → requests), a writer (the ``Outbox``), the releaser of
QoS 2 packet ids (``StoredSession``) and, once CONNECT is accepted, the publish worker
(``pipeline.Pipeline``). The reader decodes every complete packet of a socket read in
one pass: CONNECT is answered inline (the state machine reads nothing more until then),
PUBREL goes to the releaser, every PUBLISH to the pipeline (those answered without
storing too, for their acks' order), which stores the publishes of a read with one group commit,
acknowledges them in arrival order after it, and stops the reader while it is full. The
connection ends when the reader does (socket closed, protocol error, keep-alive,
takeover, a refusal on 3.1.1, the listener draining it) or when one of its tasks fails
with a bug (``Tasks.failed``). It then lets the pipeline finish what it holds (up to
``DRAIN_TIMEOUT``), publishes the Will when due and releases the MQTT session. Which
connection holds a client id, and the Wills still due, are kept by ``clients.Clients``.
A drained connection (``MqttListener.close``, via ``protocols._accept.Acceptor.close``)
stops reading, acknowledges every publish it received once stored, then sends DISCONNECT
0x8B (MQTT 5), lingers (``protocols._io.linger``) and closes; its Will is not published.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Final

from core.errors import ConnectionLimitReached
from protocols._accept import Accepted, Acceptor
from protocols._intake import Intake
from protocols._io import LINGER, Outbox, linger
from protocols._limits import DEFAULT_LIMITS, ConnectionLimits
from protocols._log import ConnectionLog
from protocols._tasks import Tasks
from protocols.mqtt.clients import Clients, authenticate
from protocols.mqtt.connection import (
    ConnectRequest,
    Limits,
    PublishRequest,
    ReleaseRequest,
    ServerConnection,
    State,
)
from protocols.mqtt.errors import MqttProtocolError
from protocols.mqtt.events import ReasonCode
from protocols.mqtt.pipeline import MqttStats, Pipeline
from protocols.mqtt.session import SessionStore
from protocols.mqtt.stored_session import StoredSession
from protocols.mqtt.wire import MAX_VBI
from protocols.sink import Principal, Sink

log = logging.getLogger(__name__)

READ_CHUNK: Final = 64 * 1024
# Room for the topic and properties around a payload of the sink's largest size.
PACKET_OVERHEAD: Final = 64 * 1024
# How long a closing connection waits for its in-flight publishes to finish.
DRAIN_TIMEOUT: Final = 30.0
# How long a closing connection waits for its last bytes to be written.
WRITE_TIMEOUT: Final = 5.0


class _Client:
    def __init__(self, listener: MqttListener, accepted: Accepted) -> None:
        reader, writer = accepted.reader, accepted.writer
        self.listener = listener
        self.reader = reader
        self.intake = Intake(reader)
        self.writer = writer
        self.conn = ServerConnection(listener.limits)
        self.admission = accepted.admission
        self.connect_deadline = accepted.login_deadline
        self.principal: Principal | None = None
        peer = writer.get_extra_info("peername")
        self.peer = str(peer)
        self.log = ConnectionLog(log, "mqtt", peer)
        self.loop = asyncio.get_running_loop()
        self.done = asyncio.Event()
        self.pipeline: Pipeline | None = None  # once CONNECT is accepted
        self._out = Outbox(writer)
        self._tasks = Tasks(f"mqtt connection {peer}")
        self._reader_task: asyncio.Task[None] | None = None
        self._graceful_shutdown = False
        # The session as kept by the sink (SQL), so it survives a restart or failover.
        self._stored = StoredSession(listener.sink, self.log, self._released, self._abort)

    async def run(self) -> None:
        """Run the connection to its end; never raises for peer behaviour."""
        try:
            await self._serve()
        finally:
            self.admission.release()

    async def _serve(self) -> None:
        self.listener.stats.connections += 1
        tasks = self._tasks
        writer_task = tasks.spawn(self._write_loop(), name="mqtt writer")
        tasks.spawn(self._stored.run_releases(), name="mqtt releases")
        tasks.spawn(self._end_on_failure(), name="mqtt failure watch")
        self._reader_task = tasks.spawn(self._read_loop(), name="mqtt reader")
        try:
            await asyncio.wait([self._reader_task])
            await self._drain()
            if self.intake.stopped:
                # Drained: the goodbye follows the acks of everything received.
                if self.conn.v5:
                    await self._out.sent(WRITE_TIMEOUT)
                self.conn.disconnect(ReasonCode.SERVER_SHUTTING_DOWN)
            self._flush_nowait()
            will_due = not self._graceful_shutdown
            await self.listener.clients.ended(self, self.conn, self._stored, will_due=will_due)
        finally:
            self._out.close()
            await asyncio.wait([writer_task], timeout=WRITE_TIMEOUT)
            await tasks.close()
            if self.intake.stopped and not self._out.broken:
                await linger(self.reader, self.writer, LINGER)
            self.writer.close()
            self.done.set()

    async def shutdown(self, reason: ReasonCode) -> None:
        """Close from the server side at once (a takeover) and wait until the connection
        has fully ended."""
        self._close(reason)
        await self.done.wait()

    def drain(self) -> None:
        """Stop reading; ``run`` acknowledges what was received, then sends DISCONNECT
        0x8B. A graceful shutdown: the Will is not published."""
        self._graceful_shutdown = True
        self.intake.stop()

    def _close(self, reason: ReasonCode) -> None:
        self.conn.disconnect(reason)
        self._flush_nowait()
        self._abort()

    async def _end_on_failure(self) -> None:
        """A task failed with a bug (logged by ``Tasks``): end the connection as if it
        were lost, so its session is released and its Will published."""
        await self._tasks.failed.wait()
        self._close(ReasonCode.UNSPECIFIED_ERROR)

    async def _drain(self) -> None:
        """Let the pipeline store and acknowledge what it holds."""
        if self.pipeline is None:
            return
        if not await self.pipeline.finish(DRAIN_TIMEOUT):
            self.log.warning("mqtt %s: in-flight publishes did not finish", self.conn.client_id)

    async def _flush(self) -> None:
        """Hand the connection's bytes to the outbox, waiting while it is full (a peer that
        does not read slows this connection down, not the gateway)."""
        data = self.conn.data_to_send()
        if data:
            await self._out.put(data)

    def _flush_nowait(self) -> None:
        """Flush without waiting: a peer that does not read must not stall a shutdown."""
        self._out.push(self.conn.data_to_send())

    async def _write_loop(self) -> None:
        await self._out.run()
        if self._out.broken:
            self._abort()

    def _abort(self) -> None:
        """Stop reading: the connection ends."""
        if self._reader_task is not None:
            self._reader_task.cancel()

    async def _read_loop(self) -> None:
        conn = self.conn
        deadline: float | None = self.connect_deadline
        try:
            while conn.state is not State.CLOSED:
                try:
                    async with asyncio.timeout_at(deadline):
                        data = await self.intake.read(READ_CHUNK)
                except TimeoutError:
                    conn.keep_alive_expired(self.loop.time())
                    self.log.info("mqtt %s: keep-alive or connect timeout", conn.client_id)
                    break
                if not data:
                    break
                conn.receive_data(data, self.loop.time())
                # Every complete packet of this read, in one pass: the pipeline gets the
                # read's publishes together and stores them with one commit.
                while (event := conn.next_event()) is not None:
                    if isinstance(event, PublishRequest):
                        assert self.pipeline is not None  # publishes follow CONNACK
                        await self.pipeline.put(event)
                    elif isinstance(event, ConnectRequest):
                        await self._on_connect(event)
                    elif isinstance(event, ReleaseRequest):
                        self._stored.release(event.packet_id)
                    else:
                        assert self.pipeline is not None
                        await self.pipeline.answer(event)
                await self._flush()
                if conn.state is State.CONNECTED:
                    # None when the client asked for no keep-alive (0).
                    deadline = conn.keep_alive_deadline
        except MqttProtocolError as e:
            self.listener.stats.protocol_errors += 1
            self.log.info("mqtt %s: %s (reason 0x%02x)", conn.client_id, e.message, e.reason_code)
            self._flush_nowait()
        except (ConnectionError, OSError) as e:
            self.log.info("mqtt %s: connection lost: %s", conn.client_id, e)

    async def _on_connect(self, request: ConnectRequest) -> None:
        listener = self.listener
        principal = await authenticate(listener.sink, request, self.writer, self.log)
        if isinstance(principal, ReasonCode):
            self.conn.refuse(principal)
            return
        self.principal = principal
        self.log.authenticated(principal)
        try:
            self.admission.login(principal.username)
        except ConnectionLimitReached as e:
            self.log.info("mqtt %s: refused: %s", request.client_id, e.message)
            self.conn.refuse(ReasonCode.QUOTA_EXCEEDED)
            return
        opened = await listener.clients.open(
            request, principal.username, self, self._stored, self.log
        )
        if isinstance(opened, ReasonCode):
            self.conn.refuse(opened)
            return
        session, present = opened
        self.conn.accept(session, present, request.client_id)
        self.pipeline = Pipeline(
            listener.sink,
            self.principal,
            self.conn,
            self._stored,
            listener.stats,
            self.log,
            max_count=listener.limits.receive_maximum,
            max_bytes=listener.max_unconfirmed_bytes,
            tasks=self._tasks,
            flush=self._flush,
            close=self._abort,
        )

    async def _released(self, packet_ids: frozenset[int]) -> None:
        """The stored session forgot these ids: their PUBCOMPs go out."""
        for packet_id in sorted(packet_ids):
            self.conn.released(packet_id)
        await self._flush()


class MqttListener:
    """An MQTT 3.1.1 + 5.0 server on one port, publishing into ``sink``."""

    def __init__(
        self,
        sink: Sink,
        *,
        max_packet_size: int | None = None,
        name: str = "mqtt",
        receive_maximum: int = 1024,
        topic_alias_maximum: int = 64,
        max_session_expiry: float = 7200.0,
        limits: ConnectionLimits = DEFAULT_LIMITS,
    ) -> None:
        self.name = name
        self.sink = sink
        packet_size = max_packet_size or min(sink.max_message_size + PACKET_OVERHEAD, MAX_VBI)
        self.limits = Limits(
            packet_size,
            receive_maximum,
            topic_alias_maximum,
            max_session_expiry,
            limits.max_login_frame,
        )
        self.max_unconfirmed_bytes = limits.max_unconfirmed_bytes
        self.sessions = SessionStore()
        self.stats = MqttStats()
        self.clients = Clients(sink, self.sessions, self.stats)
        self._acceptor = Acceptor("mqtt", lambda accepted: _Client(self, accepted), limits=limits)

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        return await self._acceptor.start(host, port, ssl_context)

    async def close(self) -> None:
        await self._acceptor.close()
        await self.clients.close()


__all__ = ["MqttListener", "MqttStats"]
