"""The asyncio adapter: sockets in, ``AmqpConnection`` in the middle, the ``Sink`` out.

How it works: each connection is a ``_Session`` with three tasks it owns and cancels when
it ends: the reader (the server's connection task) feeds bytes to the sans-IO connection
and queues the events it yields; one worker performs them in exactly that order; a
heartbeat task writes heartbeats when the connection has been quiet.

Publish order: the worker takes every contiguous Publish at the head of the queue (up to
``_BATCH``) and stores them with one ``sink.publish_many`` — one transaction, stored in
the order the frames arrived — while the reader keeps reading, so publishes are pipelined
without ever reordering: a connection has at most one batch committing at a time, and the
next batch, already accumulated, starts the moment it commits. If the batch is refused
because one message is (no route, too large, queue full) the worker falls back to storing
that batch one message at a time, in order, so only the refused messages are nacked. A
failed write (StorageError) nacks the whole batch: nothing of it was stored.

Consumers (basic.consume, get, ack, ...) are flows kept by ``protocols.amqp.flows``; their
settles travel the same ordered queue, so a cancel or an ack never overtakes the consume
it belongs to. Every frame leaves through the connection's ``Outbox`` (protocols._io).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import deque
from collections.abc import Sequence
from typing import Final

from core.errors import (
    ConnectionLimitReached,
    InvalidArgument,
    KeygateError,
    PermissionDenied,
    QueueNotFound,
    StorageError,
    Unavailable,
)
from core.model import QueueConfig
from protocols._io import Outbox, keep_alive, publish_in_order
from protocols._limits import DEFAULT_LIMITS, Admission, ConnectionLimits
from protocols._log import ConnectionLog
from protocols.amqp import events as ev
from protocols.amqp.arguments import check_equivalent
from protocols.amqp.codec import HEARTBEAT_FRAME
from protocols.amqp.connection import AmqpConnection, State
from protocols.amqp.constants import ReplyCode
from protocols.amqp.errors import AmqpChannelError
from protocols.amqp.exchanges import Exchanges
from protocols.amqp.flows import ConsumerFlows
from protocols.sink import Principal, Sink, peer_identity

logger = logging.getLogger("keygate.amqp")

_BATCH: Final = 1000
# Stop reading from a connection while this much is queued for the worker.
_MAX_PENDING_OPS: Final = 5000
_READ_SIZE: Final = 256 * 1024
_CLOSE_TIMEOUT: Final = 3.0
_DRAIN_TIMEOUT: Final = 30.0
_BLOCKED_POLL: Final = 0.25


class _InternalError(KeygateError):
    code = "internal-error"


class _Session:
    def __init__(
        self,
        sink: Sink,
        connection: AmqpConnection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        login_timeout: float,
        admission: Admission,
    ) -> None:
        self.sink = sink
        self._admission = admission
        self.connection = connection
        # The whole handshake (header to connection.open) must finish by then.
        self._login_deadline = asyncio.get_running_loop().time() + login_timeout
        self._reader = reader
        self._writer = writer
        self._ops: deque[ev.Authenticate | ev.Operation | ev.ChannelGone] = deque()
        self._pending_bytes = 0
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._principal: Principal | None = None
        self._saving = False
        self.peer = writer.get_extra_info("peername")
        self.log = ConnectionLog(logger, "amqp", self.peer)
        self._outbox = Outbox(writer, settle_written=self._settle_written)
        # no_ack deliveries whose frames wait in the connection while exchanges are saved.
        self._held_acks: list[tuple[str, Sequence[str]]] = []
        self._flows = ConsumerFlows(sink, connection, self.flush)

    def _settle_written(self, flow_id: str, message_ids: tuple[str, ...]) -> None:
        if self._principal is not None:
            self._flows.settle_written(self._principal, flow_id, message_ids)

    def flush(self, auto_acked: tuple[str, Sequence[str]] | None = None) -> None:
        """Hand the connection's pending frames to the outbox; ``auto_acked``: the no_ack
        deliveries among them, acked once written."""
        if auto_acked is not None:
            self._held_acks.append(auto_acked)
        if self._saving:
            return  # answers wait until the exchanges they confirm are stored
        self._outbox.push(self.connection.data_to_send())
        for acked in self._held_acks:
            self._outbox.push(b"", acked)
        self._held_acks.clear()

    async def run(self) -> None:
        worker = asyncio.create_task(self._work(), name=f"amqp-worker {self.peer}")
        beat = asyncio.create_task(self._heartbeat(), name=f"amqp-heartbeat {self.peer}")
        writing = asyncio.create_task(self._outbox.run(), name=f"amqp-writer {self.peer}")
        try:
            try:
                await self._read()
            except (TimeoutError, ConnectionError, ssl.SSLError) as e:
                self.log.info("amqp connection %s ended: %r", self.peer, e)
            except Exception:
                self.log.exception("amqp connection %s failed", self.peer)
            # Publishes already received are stored even if the client left without
            # waiting for their confirms (or vanished), as a broker that had routed them
            # would; whatever cannot be written by then is given up.
            try:
                async with asyncio.timeout(_DRAIN_TIMEOUT):
                    await self._idle.wait()
            except TimeoutError:
                self.log.warning(
                    "amqp connection %s: gave up storing its last publishes", self.peer
                )
        finally:
            if self._principal is not None:
                self._flows.unbind_all(self._principal)
            for task in (worker, beat):
                task.cancel()
            await asyncio.gather(worker, beat, return_exceptions=True)
            self.flush()
            self._outbox.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CLOSE_TIMEOUT):
                    await writing
            writing.cancel()
            self._writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError, TimeoutError):
                async with asyncio.timeout(_CLOSE_TIMEOUT):
                    await self._writer.wait_closed()

    async def _save_exchanges(self) -> None:
        """Store the exchanges this input declared or deleted before answering it."""
        unsaved = self.connection.exchanges.take_unsaved()
        if not unsaved:
            return
        self._saving = True
        try:
            for name, type_name in unsaved.items():
                await self.sink.save_amqp_exchange(name, type_name)
        except KeygateError as e:
            self.log.warning("amqp connection %s: cannot store exchanges: %s", self.peer, e)
            self.connection.close(ReplyCode.INTERNAL_ERROR, f"cannot store the exchange: {e}")
        finally:
            self._saving = False

    def shutdown(self) -> None:
        """Close with 320 CONNECTION_FORCED; stop reading if Close-Ok does not come."""
        self.connection.close(ReplyCode.CONNECTION_FORCED, "keygate is shutting down")
        self.flush()
        asyncio.get_running_loop().call_later(_CLOSE_TIMEOUT, self._reader.feed_eof)

    def _read_timeout(self) -> float | None:
        state = self.connection.state
        if state is State.CLOSING:
            return _CLOSE_TIMEOUT
        if state is not State.OPEN:
            return max(0.0, self._login_deadline - asyncio.get_running_loop().time())
        # Two missed heartbeats mean the peer is gone (spec 4.2.7).
        return 2 * self.connection.heartbeat if self.connection.heartbeat else None

    async def _read(self) -> None:
        connection = self.connection
        while connection.state is not State.CLOSED:
            async with asyncio.timeout(self._read_timeout()):
                data = await self._reader.read(_READ_SIZE)
            if not data:
                return
            connection.receive_data(data)
            while (event := connection.next_event()) is not None:
                if isinstance(event, ev.ConnectionClosed):
                    self.log.debug("amqp connection %s closed: %s", self.peer, event.reply_text)
                    continue
                self._ops.append(event)
                if isinstance(event, ev.Publish):
                    self._pending_bytes += len(event.payload)
                self._idle.clear()
                self._wake.set()
            await self._save_exchanges()
            self.flush()
            await self._writer.drain()
            while (
                len(self._ops) > _MAX_PENDING_OPS
                or self._pending_bytes > self.connection.max_unconfirmed_bytes
            ):
                self._room.clear()
                await self._room.wait()

    async def _heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            interval = self.connection.heartbeat / 2 if self.connection.heartbeat else 1.0
            await asyncio.sleep(interval)
            if not self.connection.heartbeat or self.connection.state is not State.OPEN:
                continue
            if loop.time() - self._outbox.last_sent >= interval:
                self._outbox.push(HEARTBEAT_FRAME)

    async def _work(self) -> None:
        while True:
            while not self._ops:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
            try:
                await self._perform_next()
            except Exception:
                # A bug of ours must not wedge the connection: fail it, keep the server.
                self.log.exception("amqp connection %s: internal error", self.peer)
                self._ops.clear()
                self._pending_bytes = 0
                self.connection.close(ReplyCode.INTERNAL_ERROR, "internal error")
            self.flush()
            self._room.set()

    async def _perform_next(self) -> None:
        head = self._ops[0]
        if isinstance(head, ev.Publish):
            batch: list[ev.Publish] = []
            while self._ops and len(batch) < _BATCH and isinstance(self._ops[0], ev.Publish):
                batch.append(self._ops.popleft())  # type: ignore[arg-type]
            self._pending_bytes -= sum(len(p.payload) for p in batch)
            self.connection.published(await self._publish(batch))
        else:
            self._ops.popleft()
            await self._perform(head)

    async def _perform(self, op: ev.Authenticate | ev.Operation | ev.ChannelGone) -> None:
        if isinstance(op, ev.Authenticate):
            try:
                peer, certificate_user = peer_identity(self._writer)
                self._principal = await self.sink.authenticate(
                    op.username,
                    op.password,
                    protocol="amqp",
                    client_id=op.client_id,
                    peer=peer,
                    certificate_user=certificate_user,
                )
            except KeygateError as e:
                self.log.info("amqp login refused for %r from %s: %s", op.username, self.peer, e)
                self.connection.authenticated(e)
            else:
                try:
                    self._admission.login(self._principal.username)
                except ConnectionLimitReached as e:
                    self.log.info(
                        "amqp login refused for %r from %s: %s", op.username, self.peer, e
                    )
                    self.connection.authenticated(e)
                else:
                    self.log.authenticated(self._principal)
                    admin = self.sink.may_administer(self._principal)
                    username = self._principal.username
                    self.connection.authenticated(None, admin=admin, username=username)
            return
        assert self._principal is not None and not isinstance(op, ev.Publish)
        if isinstance(op, ev.ChannelGone | ev.Consume | ev.Cancel | ev.SettleDeliveries | ev.Get):
            await self._flows.perform(self._principal, op)
            return
        if not self.connection.is_current(op):
            return
        try:
            result = await self._queue_operation(self._principal, op)
        except KeygateError as e:
            self.connection.operation_done(op, 0, e)
        except Exception:
            self.log.exception("amqp operation %r failed", op)
            self.connection.operation_done(op, 0, _InternalError("internal error"))
        else:
            self.connection.operation_done(op, result, None)

    async def _queue_operation(self, principal: Principal, op: ev.Operation) -> int:
        sink = self.sink
        if isinstance(op, ev.DeclareQueue):
            stored = await self._declare(principal, op)
            try:
                return await sink.queue_depth(principal, stored.name)
            except PermissionDenied:
                return 0  # a publisher may declare its queue, not learn its depth
        if isinstance(op, ev.DeleteQueue):
            # Deleting a queue that does not exist is delete-ok, as in RabbitMQ.
            # if-unused is not checked: keygate's consumers are the group's, and a
            # delete ends them all (basic.cancel to AMQP consumers that asked for it).
            try:
                if op.if_empty and await sink.queue_depth(principal, op.queue) > 0:
                    raise AmqpChannelError(
                        ReplyCode.PRECONDITION_FAILED, f"queue '{op.queue}' is not empty", 50, 40
                    )
                return await sink.delete_queue(principal, op.queue)
            except QueueNotFound:
                return 0
        if isinstance(op, ev.PurgeQueue):
            return await sink.purge_queue(principal, op.queue)
        if isinstance(op, ev.BindQueue):
            if not op.unbind:
                assert op.pattern is not None
                await sink.subscribe(principal, op.queue, op.pattern)
            elif op.pattern is not None:
                with contextlib.suppress(QueueNotFound):  # unbind is idempotent (RabbitMQ)
                    await sink.unsubscribe(principal, op.queue, op.pattern)
            return 0
        raise InvalidArgument(f"unexpected operation {op!r}")

    async def _declare(self, principal: Principal, op: ev.DeclareQueue) -> QueueConfig:
        """Passive: the queue or 404. Otherwise an existing queue must match every setting
        the declare names (406 otherwise); a missing one is created."""
        try:
            stored = await self.sink.declare_queue(principal, op.config, passive=True)
        except QueueNotFound:
            if op.passive:
                raise
            return await self.sink.declare_queue(principal, op.config)
        if not op.passive:
            check_equivalent(stored, op.config, op.given)
        return stored

    async def _publish(
        self, batch: list[ev.Publish]
    ) -> list[tuple[ev.Publish, KeygateError | None]]:
        assert self._principal is not None
        results: dict[int, KeygateError | None] = {
            index: publish.rejected for index, publish in enumerate(batch)
        }
        todo = [(i, p.publication) for i, p in enumerate(batch) if p.rejected is None]
        publications = [publication for _, publication in todo if publication is not None]
        outcomes = await publish_in_order(
            self.sink, self._principal, publications, stop_at_refusal=False, log=self.log
        )
        for (index, _), outcome in zip(todo, outcomes, strict=True):
            results[index] = outcome
        if any(isinstance(o, StorageError | Unavailable) for o in outcomes):
            self.log.warning("amqp publish of %d messages failed: %s", len(todo), outcomes[0])
        return [(publish, results[index]) for index, publish in enumerate(batch)]


class AmqpListener:
    """An AMQP 0-9-1 server publishing into a ``Sink`` (implements ``Listener``)."""

    def __init__(
        self,
        sink: Sink,
        *,
        frame_max: int = 131072,
        channel_max: int = 2047,
        heartbeat: int = 60,
        name: str = "amqp",
        limits: ConnectionLimits = DEFAULT_LIMITS,
    ) -> None:
        self.name = name
        self.limits = limits
        self.sink = sink
        self.exchanges = Exchanges()
        self._frame_max = frame_max
        self._channel_max = channel_max
        self._heartbeat = heartbeat
        self._server: asyncio.Server | None = None
        self._sessions: set[_Session] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._watcher: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        self.exchanges.load(await self.sink.amqp_exchanges())
        self._server = await asyncio.start_server(self._serve, host, port, ssl=ssl_context)
        self._watcher = asyncio.create_task(self._watch_blocked(), name=f"{self.name}-blocked")
        bound: int = self._server.sockets[0].getsockname()[1]
        logger.info("amqp listening on %s:%d", host, bound)
        return bound

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        for session in list(self._sessions):
            session.shutdown()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        keep_alive(writer)
        task = asyncio.current_task()
        assert task is not None
        connection = AmqpConnection(
            self.exchanges,
            frame_max=self._frame_max,
            channel_max=self._channel_max,
            heartbeat=self._heartbeat,
            max_message_size=self.sink.max_message_size,
            max_login_frame=self.limits.max_login_frame,
            max_unconfirmed_bytes=self.limits.max_unconfirmed_bytes,
        )
        admission = self.limits.connections.open("amqp")
        session = _Session(
            self.sink, connection, reader, writer, self.limits.login_timeout, admission
        )
        self._sessions.add(session)
        self._tasks.add(task)
        try:
            await session.run()
        finally:
            admission.release()
            self._sessions.discard(session)
            self._tasks.discard(task)

    async def _watch_blocked(self) -> None:
        # The Sink exposes backpressure as a property, so it is polled; a few reads of a
        # bool per second cost nothing and need no callback contract.
        while True:
            await asyncio.sleep(_BLOCKED_POLL)
            blocked = self.sink.blocked
            for session in list(self._sessions):
                session.connection.set_blocked(blocked)
                session.flush()


__all__ = ["AmqpListener"]
