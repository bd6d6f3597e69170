"""The asyncio MQTT listener: sockets around the sans-IO ``ServerConnection``.

Each connection is one ``_Client`` owning three tasks: a reader (bytes → state machine →
sink calls), an acker (the publish pipeline) and a writer (a bounded queue of bytes). All
three end with the connection, which then publishes the Will when due and releases the
MQTT session.

Ordered pipeline: the reader starts ``sink.publish`` for every PUBLISH as a task, in the
order the packets arrived, and appends it to a bounded FIFO; asyncio runs new tasks in
creation order and the sink keeps the order of calls started in order (its group commit
is FIFO), so one connection's messages are stored in the order sent while many are in
flight. The acker awaits the FIFO head by head and sends each PUBACK / PUBREC only after
that publish returned, i.e. after commit, and in arrival order (MQTT 3.1.1 §4.6 asks for
that). When the FIFO is full the reader stops reading: TCP pushes back on the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Final

from core.errors import (
    AuthError,
    ConnectionLimitReached,
    KeygateError,
    PermissionDenied,
    StorageError,
    Unavailable,
)
from core.model import Publication
from protocols._io import Outbox, keep_alive
from protocols._limits import DEFAULT_LIMITS, ByteBudget, ConnectionLimits, publication_bytes
from protocols._log import ConnectionLog
from protocols.mqtt.connection import (
    ConnectRequest,
    Limits,
    PublishRequest,
    ReleaseRequest,
    ServerConnection,
    State,
)
from protocols.mqtt.errors import MqttProtocolError, publish_reason
from protocols.mqtt.events import ReasonCode
from protocols.mqtt.session import SessionStore
from protocols.mqtt.stored_session import StoredSession
from protocols.mqtt.wire import MAX_VBI
from protocols.sink import Principal, Sink, peer_identity

log = logging.getLogger(__name__)

READ_CHUNK: Final = 64 * 1024
# Room for the topic and properties around a payload of the sink's largest size.
PACKET_OVERHEAD: Final = 64 * 1024
# How long a closing connection waits for its in-flight publishes to finish.
DRAIN_TIMEOUT: Final = 30.0


@dataclass
class MqttStats:
    """Counters a metrics exporter can read."""

    connections: int = 0
    publishes: int = 0
    rejected: int = 0
    qos0_dropped: int = 0
    protocol_errors: int = 0
    wills: int = 0
    # MQTT 3.1.1 connections closed instead of acknowledging a QoS 1/2 publish that was
    # not stored (3.1.1 has no negative ack; the client resends after reconnecting).
    unconfirmed_closes: int = 0


@dataclass(frozen=True, slots=True)
class _Outcome:
    reason: ReasonCode
    detail: str | None = None


class _Client:
    def __init__(
        self,
        listener: MqttListener,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self.listener = listener
        self.reader = reader
        self.writer = writer
        self.conn = ServerConnection(listener.limits)
        self.admission = listener.connections.open("mqtt")
        self.principal: Principal | None = None
        self.log = ConnectionLog(log, "mqtt", writer.get_extra_info("peername"))
        self.loop = asyncio.get_running_loop()
        self.done = asyncio.Event()
        self._out = Outbox(writer)
        # Free places in the pipeline; taken before a publish starts, so a cancelled
        # reader never leaves a started publish outside the pipeline.
        self._slots = asyncio.Semaphore(listener.limits.receive_maximum)
        # Receive Maximum bounds the count of publishes in flight, this their bytes.
        self._unconfirmed = ByteBudget(listener.max_unconfirmed_bytes)
        # Publishes in arrival order; None marks the end of the connection.
        self._pipeline: deque[tuple[PublishRequest, asyncio.Task[_Outcome]] | None] = deque()
        self._pipeline_grew = asyncio.Event()
        self._reader_task: asyncio.Task[None] | None = None
        self._graceful_shutdown = False
        # The session as kept by the sink (SQL), so it survives a restart or failover.
        self._stored = StoredSession(listener.sink, self.log, self._released, self._abort)

    async def serve(self) -> None:
        """Run the connection to its end; never raises for peer behaviour."""
        stats = self.listener.stats
        stats.connections += 1
        writer_task = asyncio.create_task(self._write_loop())
        acker_task = asyncio.create_task(self._ack_loop())
        releaser_task = asyncio.create_task(self._stored.run_releases())
        self._reader_task = asyncio.create_task(self._read_loop())
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader_task
            self._append(None)
            try:
                async with asyncio.timeout(DRAIN_TIMEOUT):
                    await acker_task
            except TimeoutError:
                self.log.warning("mqtt %s: in-flight publishes did not finish", self.conn.client_id)
            self._flush_nowait()
            await self._finish_session()
        finally:
            for task in (self._reader_task, acker_task, releaser_task):
                task.cancel()
            for item in self._pipeline:
                if item is not None:
                    item[1].cancel()
            self._out.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await writer_task
            writer_task.cancel()
            self.writer.close()
            self.done.set()

    async def shutdown(self, reason: ReasonCode, *, graceful: bool = False) -> None:
        """Close from the server side and wait until the connection has fully ended."""
        self._graceful_shutdown = graceful
        self.conn.disconnect(reason)
        self._flush_nowait()
        if self._reader_task is not None:
            self._reader_task.cancel()
        await self.done.wait()

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
        if self._out.broken and self._reader_task is not None:
            self._reader_task.cancel()

    async def _read_loop(self) -> None:
        conn = self.conn
        deadline: float | None = self.loop.time() + self.listener.connect_timeout
        try:
            while conn.state is not State.CLOSED:
                try:
                    async with asyncio.timeout_at(deadline):
                        data = await self.reader.read(READ_CHUNK)
                except TimeoutError:
                    conn.keep_alive_expired(self.loop.time())
                    self.log.info("mqtt %s: keep-alive or connect timeout", conn.client_id)
                    break
                if not data:
                    break
                conn.receive_data(data, self.loop.time())
                while (event := conn.next_event()) is not None:
                    if isinstance(event, ConnectRequest):
                        await self._on_connect(event)
                    elif isinstance(event, ReleaseRequest):
                        self._stored.release(event.packet_id)

                    else:
                        await self._slots.acquire()
                        await self._unconfirmed.acquire(publication_bytes(event.publication))
                        self._append((event, self._start_publish(event)))
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
        connect = request.connect
        listener = self.listener
        password = None
        if connect.password is not None:
            try:
                password = connect.password.decode("utf-8")
            except UnicodeDecodeError:
                self.conn.refuse(ReasonCode.BAD_USER_NAME_OR_PASSWORD)
                return
        try:
            peer, certificate_user = peer_identity(self.writer)
            self.principal = await listener.sink.authenticate(
                connect.username,
                password,
                protocol="mqtt",
                client_id=request.client_id,
                peer=peer,
                certificate_user=certificate_user,
            )
        except PermissionDenied:
            self.conn.refuse(ReasonCode.NOT_AUTHORIZED)
            return
        except AuthError as e:
            self.log.info("mqtt %s: authentication refused: %s", request.client_id, e.message)
            self.conn.refuse(ReasonCode.BAD_USER_NAME_OR_PASSWORD)
            return
        except KeygateError as e:
            self.log.warning("mqtt %s: cannot authenticate: %s", request.client_id, e.message)
            self.conn.refuse(ReasonCode.SERVER_UNAVAILABLE)
            return
        self.log.authenticated(self.principal)
        try:
            self.admission.login(self.principal.username)
        except ConnectionLimitReached as e:
            self.log.info("mqtt %s: refused: %s", request.client_id, e.message)
            self.conn.refuse(ReasonCode.QUOTA_EXCEEDED)
            return
        owner = self.principal.username
        if not listener.may_use(request.client_id, owner, self.loop.time()):
            self.log.info("mqtt %s: client id belongs to another user; refused", request.client_id)
            self.conn.refuse(ReasonCode.CLIENT_IDENTIFIER_NOT_VALID)
            return
        await listener.take_over(request.client_id, self)
        try:
            stored = await self._stored.load(request.client_id, clean_start=connect.clean_start)
        except KeygateError as e:
            self.log.warning("mqtt %s: cannot load the session: %s", request.client_id, e.message)
            self.conn.refuse(ReasonCode.SERVER_UNAVAILABLE)
            return
        session, present = listener.sessions.open(
            request.client_id, connect.clean_start, self.loop.time(), owner=owner
        )
        if stored is not None and not present:
            # Kept in SQL by an earlier run or another gateway (restart, failover).
            session.qos2_received |= stored
            present = True
        self.conn.accept(session, present, request.client_id)

    def _start_publish(self, request: PublishRequest) -> asyncio.Task[_Outcome]:
        assert self.principal is not None
        if request.qos == 2 and request.packet_id is not None:
            return asyncio.create_task(self._publish_qos2(self.principal, request))
        return asyncio.create_task(self._publish(self.principal, request.publication))

    async def _publish_qos2(self, principal: Principal, request: PublishRequest) -> _Outcome:
        """Store, recording the packet id in the stored session in the same transaction,
        before the PUBREC goes out: a PUBLISH re-sent to another gateway after a failover
        is answered, not stored again."""
        outcome = await self._publish(principal, request.publication, request.packet_id)
        if outcome.reason < 0x80:
            self._stored.saved = True  # the row exists now
        return outcome

    async def _released(self, packet_ids: frozenset[int]) -> None:
        """The stored session forgot these ids: their PUBCOMPs go out."""
        for packet_id in sorted(packet_ids):
            self.conn.released(packet_id)
        await self._flush()

    def _abort(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()

    async def _publish(
        self, principal: Principal, publication: Publication, qos2_packet_id: int | None = None
    ) -> _Outcome:
        try:
            await self.listener.sink.publish(principal, publication, qos2_packet_id=qos2_packet_id)
        except KeygateError as e:
            if isinstance(e, StorageError | Unavailable):
                self.log.warning("mqtt %s: publish failed: %s", self.conn.client_id, e.message)
            return _Outcome(publish_reason(e), e.message)
        except Exception:
            self.log.exception("mqtt %s: publish failed unexpectedly", self.conn.client_id)
            return _Outcome(ReasonCode.UNSPECIFIED_ERROR, "internal error")
        return _Outcome(ReasonCode.SUCCESS)

    def _append(self, item: tuple[PublishRequest, asyncio.Task[_Outcome]] | None) -> None:
        self._pipeline.append(item)
        self._pipeline_grew.set()

    async def _ack_loop(self) -> None:
        stats = self.listener.stats
        pipeline = self._pipeline
        while True:
            if not pipeline:
                await self._flush()
                # Cleared and re-checked with no await between: no append is missed.
                self._pipeline_grew.clear()
                if not pipeline:
                    await self._pipeline_grew.wait()
                continue
            item = pipeline[0]
            if item is None:
                return
            request, task = item
            if not task.done():
                await self._flush()  # acks of the commits already done leave together
            outcome = await task
            pipeline.popleft()
            self._slots.release()
            self._unconfirmed.release(publication_bytes(request.publication))
            if outcome.reason >= 0x80 or outcome.reason == ReasonCode.NO_MATCHING_SUBSCRIBERS:
                self.log.info(
                    "mqtt %s: publish to %r not stored: %s",
                    self.conn.client_id,
                    request.publication.topic,
                    outcome.reason.name,
                )
                stats.rejected += 1
                if request.qos == 0:
                    stats.qos0_dropped += 1
            else:
                stats.publishes += 1
            was_open = self.conn.state is not State.CLOSED
            self.conn.complete(request.qos, request.packet_id, outcome.reason, outcome.detail)
            if was_open and self.conn.state is State.CLOSED:
                # MQTT 3.1.1 refusal: no PUBACK, the connection ends (see conn.complete).
                stats.unconfirmed_closes += 1
                self.log.warning(
                    "mqtt %s: closing without acknowledging packet %s (%s: %s); "
                    "the client resends it after reconnecting",
                    self.conn.client_id,
                    request.packet_id,
                    outcome.reason.name,
                    outcome.detail,
                )
                if self._reader_task is not None:
                    self._reader_task.cancel()

    async def _finish_session(self) -> None:
        conn, listener = self.conn, self.listener
        now = self.loop.time()
        if conn.session is not None:
            await self._stored.ended(conn.session)
            listener.release(conn.client_id, self)
            listener.sessions.release(conn.session, now)
        will = conn.will
        if will is None or self.principal is None or self._graceful_shutdown:
            return
        delay = min(conn.will_delay, conn.session.expiry_interval if conn.session else 0.0)
        listener.schedule_will(conn.client_id or "", self.principal, will, delay)


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
        self.connect_timeout = limits.login_timeout
        self.connections = limits.connections
        self.max_unconfirmed_bytes = limits.max_unconfirmed_bytes
        self.sessions = SessionStore()
        self.stats = MqttStats()
        self._server: asyncio.Server | None = None
        self._clients: set[_Client] = set()
        self._active: dict[str, _Client] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wills: dict[str, asyncio.Task[None]] = {}

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        self._server = await asyncio.start_server(self._accept, host, port, ssl=ssl_context)
        bound: int = self._server.sockets[0].getsockname()[1]
        log.info("mqtt listener %s on %s:%d", self.name, host, bound)
        return bound

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        clients = list(self._clients)
        await asyncio.gather(
            *(c.shutdown(ReasonCode.SERVER_SHUTTING_DOWN, graceful=True) for c in clients)
        )
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        keep_alive(writer)
        client = _Client(self, reader, writer)
        self._clients.add(client)
        try:
            await client.serve()
        finally:
            client.admission.release()
            self._clients.discard(client)

    def may_use(self, client_id: str, username: str | None, now: float) -> bool:
        """A client id (its connection, its session) is taken over only by its own user."""
        active = self._active.get(client_id)
        if (
            active is not None
            and active.principal is not None
            and active.principal.username != username
        ):
            return False
        return self.sessions.owner(client_id, now) in (None, username)

    async def take_over(self, client_id: str, client: _Client) -> None:
        """End any other connection of ``client_id`` (0x8E), then make ``client`` its owner."""
        while (old := self._active.get(client_id)) is not None and old is not client:
            await old.shutdown(ReasonCode.SESSION_TAKEN_OVER)
            if self._active.get(client_id) is old:
                del self._active[client_id]
        self._active[client_id] = client
        pending = self._wills.pop(client_id, None)
        if pending is not None:
            pending.cancel()  # reconnected within the Will Delay Interval (§3.1.3.2.2)

    def release(self, client_id: str | None, client: _Client) -> None:
        if client_id is not None and self._active.get(client_id) is client:
            del self._active[client_id]

    def schedule_will(
        self, client_id: str, principal: Principal, will: Publication, delay: float
    ) -> None:
        task = self._spawn(self._publish_will(client_id, principal, will, delay))
        if delay > 0:
            self._wills[client_id] = task

    async def _publish_will(
        self, client_id: str, principal: Principal, will: Publication, delay: float
    ) -> None:
        if delay > 0:
            await asyncio.sleep(delay)  # the Will Delay Interval; cancelled on reconnect
            if self._wills.get(client_id) is asyncio.current_task():
                del self._wills[client_id]
        try:
            await self.sink.publish(principal, will)
            self.stats.wills += 1
        except KeygateError as e:
            log.warning(
                "mqtt %s: will message to %r not stored: %s",
                client_id,
                will.topic,
                e.message,
                extra={"protocol": "mqtt", "client": client_id, "user": principal.username},
            )


__all__ = ["MqttListener", "MqttStats"]
