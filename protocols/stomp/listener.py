"""The asyncio STOMP listener: sockets around ``ServerConnection``.

How it works, per connection (``_Session``), four tasks owned by the session and cancelled
together when it ends (consuming is described at ``_Subscriber``):

- the reader feeds bytes to the connection and pushes each event into an ordered
  pipeline. CONNECT is handled inline (nothing may follow it until it is accepted).
- the worker takes events from the pipeline in order. A run of consecutive plain SENDs
  that piled up while the previous write was committing is stored together with one
  ``Sink.publish_many``, so the reader never waits for a commit before reading the next
  frame (pipelining) while the store order is the send order: there is never more than
  one write of a connection in flight. RECEIPTs are written after the write returned,
  i.e. after commit. If a batch is rejected, its SENDs are retried one by one so that
  those before the culprit are stored and receipted and the culprit gets the ERROR.
  COMMIT is one ``publish_many`` of the transaction's SENDs.
- the writer (``protocols._io.Outbox``) writes frames to the socket in order, everything
  queued since its last write in one write.
- the heart-beat task sends EOLs when we have been silent and drops a client silent for
  longer than its negotiated interval times ``HEARTBEAT_TOLERANCE``.

The pipeline is bounded (messages and bytes): when it is full the reader stops reading,
which pushes back on the client through TCP. Every failure becomes an ERROR frame
written after the work queued before it, and then the connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
from collections.abc import Sequence
from typing import Final

from core.actions import Deliver
from core.errors import ConnectionLimitReached, KeygateError, Unavailable
from core.model import AckMode
from protocols import sink as settles
from protocols._io import Outbox, keep_alive, publish_in_order
from protocols._limits import DEFAULT_LIMITS, ConnectionLimits
from protocols._log import ConnectionLog
from protocols.sink import BindRequest, Principal, Sink, peer_identity
from protocols.stomp.codec import DEFAULT_MAX_HEADERS
from protocols.stomp.connection import (
    HEARTBEAT,
    Commit,
    Connect,
    Disconnect,
    Publish,
    ReceiptRequest,
    ServerConnection,
    Settle,
    State,
    Subscribe,
    Unsubscribe,
)
from protocols.stomp.pipeline import End, Fatal, Op, Pipeline

log = logging.getLogger(__name__)

READ_SIZE: Final = 256 * 1024
HEADER_ALLOWANCE: Final = 64 * 1024  # frame size beyond the largest message body
CLOSE_TIMEOUT: Final = 5.0
LINGER: Final = 1.0
DEFAULT_HEARTBEAT: Final = (10_000, 10_000)


class _Subscriber:
    """``protocols.sink.FlowOutput`` of one SUBSCRIBE (DESIGN.md §5b).

    A subscription is a flow of its ``x-group``: the group runtime pushes deliveries here,
    each becomes a MESSAGE frame in the connection's outbox. ``ack:auto`` deliveries are
    acked once the socket took them (``Outbox``), so the window bounds what a slow
    reader holds. A delivery the frame cannot carry is handed back (dead-lettered as
    undeliverable). When the queue is deleted the connection gets an ERROR and ends, as
    a STOMP server reports a failed subscription.
    """

    def __init__(self, session: _Session, subscription: str, auto: bool) -> None:
        self.session = session
        self.subscription = subscription
        self.auto = auto
        self.flow_id = ""

    def deliver(self, deliveries: Sequence[Deliver]) -> Sequence[Deliver]:
        frames: list[bytes] = []
        sent: list[str] = []
        failed: list[Deliver] = []
        conn = self.session.conn
        for delivery in deliveries:
            try:
                frames.append(conn.message(self.subscription, delivery))
            except (KeygateError, ValueError):
                failed.append(delivery)
                continue
            sent.append(delivery.message.message_id)
        auto_acked = (self.flow_id, sent) if self.auto else None
        self.session.outbox.push(b"".join(frames), auto_acked)
        return failed

    def partitions_changed(self, partitions: frozenset[int]) -> None:
        """STOMP has no frame for it: a consumer sees its partitions in ``x-partition``."""

    def terminate(self, error: KeygateError) -> None:
        self.session.flows.pop(self.subscription, None)
        self.session.conn.subscriptions.forget(self.subscription)
        self.session.pipeline.put_nowait(Fatal(error))


class _Session:
    def __init__(
        self,
        listener: StompListener,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        self._listener = listener
        self._sink = listener.sink
        self._reader = reader
        self._writer = writer
        self.conn = ServerConnection(
            server=listener.server_name,
            max_frame_size=listener.max_frame_size,
            max_headers=listener.max_headers,
            heartbeat=listener.heartbeat,
            max_login_frame=listener.max_login_frame,
        )
        self.pipeline = Pipeline(listener.max_unconfirmed_bytes)
        self.outbox = Outbox(writer, settle_written=self._settle_written)
        self._principal = Principal(None, "stomp")
        self._session_id = secrets.token_hex(8)
        # Subscription id -> the flow it bound.
        self.flows: dict[str, str] = {}
        self._loop = asyncio.get_running_loop()
        self._last_received = self._loop.time()
        self._tasks: list[asyncio.Task[None]] = []
        self._reader_task: asyncio.Task[None] | None = None
        self._broken = False  # the socket failed: frames for the client are dropped
        self._admission = listener.connections.open("stomp")
        peer = writer.get_extra_info("peername")
        self._peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._log = ConnectionLog(log, "stomp", self._peer)

    async def run(self) -> None:
        """Serve the connection until it ends; every task it started is ended with it."""
        writer_task = asyncio.create_task(self._write_loop())
        self._reader_task = asyncio.create_task(self._read_loop())
        self._tasks += [writer_task, self._reader_task]
        try:
            await self._work_loop()
            self._unbind_all()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    self.outbox.close()
                    await writer_task
            await self._linger()
        finally:
            self._unbind_all()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._writer.close()
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await self._writer.wait_closed()

    async def _linger(self) -> None:
        """Half-close, then discard input until the client closes (STOMP "Connection
        Lingering"): closing a socket with unread input sends a reset, which can make the
        client drop the ERROR or RECEIPT frame it has not read yet."""
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
        if self._broken or not self._writer.can_write_eof():
            return
        with contextlib.suppress(OSError, TimeoutError):
            self._writer.write_eof()
            async with asyncio.timeout(LINGER):
                while await self._reader.read(READ_SIZE):
                    pass

    def _unbind_all(self) -> None:
        """The connection ends: its flows' unacked messages go back for redelivery and
        their partitions are kept for them through the rebalance delay."""
        for flow_id in self.flows.values():
            self._sink.settle(self._principal, flow_id, settles.Unbind())
        self.flows.clear()

    def _settle_written(self, flow_id: str, message_ids: tuple[str, ...]) -> None:
        self._sink.settle(self._principal, flow_id, settles.Ack(message_ids))

    def release(self) -> None:
        self._admission.release()

    def stop(self) -> None:
        """Stop reading; what is already queued is still stored and confirmed."""
        if self._reader_task is not None:
            self._reader_task.cancel()
        self.pipeline.put_nowait(End())

    async def _read_loop(self) -> None:
        conn = self.conn
        try:
            while conn.state is not State.CLOSED:
                if conn.state is State.AWAITING_CONNECT:
                    async with asyncio.timeout(self._listener.connect_timeout):
                        data = await self._reader.read(READ_SIZE)
                else:
                    data = await self._reader.read(READ_SIZE)
                if not data:
                    break
                self._last_received = self._loop.time()
                conn.receive_data(data)
                while (event := conn.next_event()) is not None:
                    if isinstance(event, Connect):
                        if not await self._connect(event):
                            return
                    else:
                        await self.pipeline.put(event)
        except KeygateError as e:
            self._log.info("stomp %s: protocol error: %s", self._peer, e.message)
            await self.pipeline.put(Fatal(e))
            return
        except TimeoutError:
            log.info(
                "stomp %s: no CONNECT within %.0fs", self._peer, self._listener.connect_timeout
            )
        except OSError as e:
            self._log.info("stomp %s: read failed: %s", self._peer, e)
        except Exception:
            # A bug, not the peer's fault: the connection still ends instead of staying
            # open with nobody reading it.
            self._log.exception("stomp %s: reader failed", self._peer)
        if conn.state is not State.CLOSED:
            self.pipeline.put_nowait(End())

    async def _connect(self, event: Connect) -> bool:
        session = self._session_id
        try:
            peer, certificate_user = peer_identity(self._writer)
            self._principal = await self._sink.authenticate(
                event.login,
                event.passcode,
                protocol="stomp",
                client_id=event.client_id or session,
                peer=peer,
                certificate_user=certificate_user,
            )
        except KeygateError as e:
            self._log.info("stomp %s: CONNECT refused: %s", self._peer, e.message)
            await self.pipeline.put(Fatal(e))
            return False
        self._log.authenticated(self._principal)
        try:
            self._admission.login(self._principal.username)
        except ConnectionLimitReached as e:
            self._log.info("stomp %s: CONNECT refused: %s", self._peer, e.message)
            await self.pipeline.put(Fatal(e))
            return False
        await self._write(self.conn.connected(session))
        if self.conn.send_interval or self.conn.receive_timeout:
            self._tasks.append(asyncio.create_task(self._heartbeat_loop()))
        return True

    async def _work_loop(self) -> None:
        while True:
            batch = await self.pipeline.take()
            op = batch[0]
            if isinstance(op, Publish):
                if not await self._store(batch):
                    return
            elif isinstance(op, Commit):
                if not await self._commit(op):
                    return
            elif isinstance(op, Subscribe | Unsubscribe | Settle):
                if not await self._consume(op):
                    return
            elif isinstance(op, ReceiptRequest):
                await self._write(self.conn.receipt(op.receipt))
            elif isinstance(op, Disconnect):
                if op.receipt is not None:
                    await self._write(self.conn.receipt(op.receipt))
                return
            elif isinstance(op, Fatal):
                await self._write(self.conn.error(op.error, op.receipt))
                return
            else:
                return

    async def _store(self, batch: list[Op]) -> bool:
        sends = [op for op in batch if isinstance(op, Publish)]
        outcomes = await publish_in_order(
            self._sink,
            self._principal,
            [s.publication for s in sends],
            stop_at_refusal=True,
            log=self._log,
        )
        for index, (send, outcome) in enumerate(zip(sends, outcomes, strict=False)):
            if outcome is not None:
                # The ERROR names a receipt: this SEND's, or the next one that asked.
                later = (s.receipt for s in sends[index:] if s.receipt is not None)
                return await self._fail(outcome, next(later, None))
            if send.receipt is not None:
                await self._write(self.conn.receipt(send.receipt))
        return True

    async def _commit(self, commit: Commit) -> bool:
        try:
            if commit.publications:  # atomically: all of the transaction or none
                await self._sink.publish_many(self._principal, list(commit.publications))
        except KeygateError as e:
            return await self._fail(e, commit.receipt)
        except Exception:
            self._log.exception("stomp %s: COMMIT failed unexpectedly", self._peer)
            return await self._fail(Unavailable("internal server error"), commit.receipt)
        if commit.receipt is not None:
            await self._write(self.conn.receipt(commit.receipt))
        return True

    async def _consume(self, op: Subscribe | Unsubscribe | Settle) -> bool:
        """Bind, unbind or settle a subscription's flow; RECEIPT after it took effect."""
        try:
            if isinstance(op, Subscribe):
                await self._subscribe(op)
            elif isinstance(op, Unsubscribe):
                flow_id = self.flows.pop(op.subscription, None)
                if flow_id is not None:
                    self._sink.settle(self._principal, flow_id, settles.Unbind())
            else:
                self._settle(op)
        except KeygateError as e:
            return await self._fail(e, op.receipt)
        if op.receipt is not None:
            await self._write(self.conn.receipt(op.receipt))
        return True

    async def _subscribe(self, op: Subscribe) -> None:
        subscriber = _Subscriber(self, op.subscription, auto=op.ack == "auto")
        result = await self._sink.bind(
            self._principal,
            BindRequest(
                queue=op.queue,
                group=op.group,
                client=f"stomp:{self._principal.client_id or self._session_id}",
                window=op.prefetch,
                ack_mode=AckMode.AUTO if subscriber.auto else AckMode.CLIENT,
            ),
            subscriber,
        )
        subscriber.flow_id = result.flow_id
        self.flows[op.subscription] = result.flow_id
        self._log.info(
            "stomp %s: subscription %s is flow %s of %s/%s",
            self._peer,
            op.subscription,
            result.flow_id,
            op.queue,
            op.group,
            extra={"flow": result.flow_id, "queue": op.queue, "group": op.group},
        )

    def _settle(self, op: Settle) -> None:
        flow_id = self.flows.get(op.subscription)
        if flow_id is None:
            return  # unsubscribed meanwhile: its messages went back for redelivery
        event: settles.Settle
        if not op.ack:
            event = settles.Nack((op.message_id,))
        elif op.cumulative:
            event = settles.AckCumulative(op.partition, op.seq)
        else:
            event = settles.Ack((op.message_id,))
        self._sink.settle(self._principal, flow_id, event)

    async def _fail(self, error: KeygateError, receipt: str | None) -> bool:
        self._log.info("stomp %s: %s: %s", self._peer, error.code, error.message)
        await self._write(self.conn.error(error, receipt))
        return False

    async def _write(self, data: bytes) -> None:
        await self.outbox.put(data)

    async def _write_loop(self) -> None:
        await self.outbox.run()
        if self.outbox.broken:
            self._broken = True
            self.stop()

    async def _heartbeat_loop(self) -> None:
        send_every = self.conn.send_interval
        timeout = self.conn.receive_timeout
        tick = min(x for x in (send_every, timeout) if x) / 4
        while True:
            await asyncio.sleep(tick)
            now = self._loop.time()
            if timeout is not None and now - self._last_received > timeout:
                self._log.info("stomp %s: no heart-beat for %.1fs, closing", self._peer, timeout)
                self.stop()
                return
            if send_every is not None and now - self.outbox.last_sent + tick >= send_every:
                self.outbox.last_sent = now
                await self._write(HEARTBEAT)


class StompListener:
    """A STOMP 1.0/1.1/1.2 server for publishers and consumers (``protocols.sink.Listener``).

    ``max_frame_size`` None = the sink's largest message plus 64 KiB of headers.
    ``heartbeat`` is the server's (sx, sy) in milliseconds, as in the CONNECTED frame.
    """

    def __init__(
        self,
        sink: Sink,
        *,
        max_frame_size: int | None = None,
        max_headers: int = DEFAULT_MAX_HEADERS,
        name: str = "stomp",
        heartbeat: tuple[int, int] = DEFAULT_HEARTBEAT,
        limits: ConnectionLimits = DEFAULT_LIMITS,
        server_name: str = "keygate",
    ) -> None:
        self.sink = sink
        self.name = name
        self.max_frame_size = (
            max_frame_size
            if max_frame_size is not None
            else sink.max_message_size + HEADER_ALLOWANCE
        )
        self.max_headers = max_headers
        self.heartbeat = heartbeat
        self.connect_timeout = limits.login_timeout
        self.connections = limits.connections
        self.max_unconfirmed_bytes = limits.max_unconfirmed_bytes
        self.max_login_frame = limits.max_login_frame
        self.server_name = server_name
        self._server: asyncio.Server | None = None
        self._sessions: dict[_Session, asyncio.Task[None]] = {}

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        self._server = await asyncio.start_server(
            self._serve, host, port, ssl=ssl_context, limit=READ_SIZE
        )
        bound: int = self._server.sockets[0].getsockname()[1]
        log.info("stomp listener %s on %s:%d", self.name, host, bound)
        return bound

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        keep_alive(writer)
        session = _Session(self, reader, writer)
        task = asyncio.current_task()
        assert task is not None
        self._sessions[session] = task
        try:
            await session.run()
        except Exception:
            log.exception("stomp connection failed unexpectedly")
        finally:
            session.release()
            self._sessions.pop(session, None)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        sessions = dict(self._sessions)
        for session in sessions:
            session.stop()
        if sessions:
            _, pending = await asyncio.wait(sessions.values(), timeout=CLOSE_TIMEOUT * 2)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


__all__ = ["StompListener"]
