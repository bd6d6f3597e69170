"""The asyncio AMQP adapter: sockets around ``AmqpConnection`` and ``Session``.

How it works, per connection (``_Connection``). Its tasks are owned by one
``protocols._tasks.Tasks`` and end with it: the reader feeds bytes to the sans-IO
connection and queues the events it yields for the ``Session`` (protocols/amqp/session.py),
whose worker performs them in order; after each read it stores the exchanges the read
declared, hands the replies to the outbox and stops reading while the session's queue is
full. A heartbeat task (``protocols._io.send_heartbeats``) beats when the connection has
been quiet; two missed heartbeats of the peer, or a handshake not finished within the
login timeout, end the reader. The writer is the connection's ``protocols._io.Outbox``,
in a second ``Tasks`` so that it outlives the others and writes the last replies.

A connection ends when the peer closes the socket or the connection (Close / Close-Ok),
breaks a rule, stays silent, one of its tasks fails with a bug (``Tasks.failed``), or its
listener drains it. Publishes already received are then still stored (at most
``DRAIN_TIMEOUT``), as a broker that had routed them would, and confirmed; its consumers'
flows are unbound, and what is queued is written (at most ``CLOSE_TIMEOUT``), then the
connection lingers (``protocols._io.linger``) and closes. ``AmqpListener.close`` drains
every connection (``protocols._accept.Acceptor.close``): it stops reading, confirms what
it received, then sends 320 CONNECTION_FORCED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import Final

from protocols._accept import Accepted, Acceptor
from protocols._intake import Intake
from protocols._io import DEFAULT_HIGH, LINGER, Outbox, linger, send_heartbeats
from protocols._limits import DEFAULT_LIMITS, ConnectionLimits
from protocols._log import ConnectionLog
from protocols._tasks import Tasks
from protocols.amqp import events as ev
from protocols.amqp.codec import HEARTBEAT_FRAME
from protocols.amqp.connection import AmqpConnection, State
from protocols.amqp.constants import ReplyCode
from protocols.amqp.exchanges import Exchanges
from protocols.amqp.session import Session
from protocols.sink import Sink, peer_identity

logger = logging.getLogger("keygate.amqp")

READ_SIZE: Final = 256 * 1024
CLOSE_TIMEOUT: Final = 3.0
DRAIN_TIMEOUT: Final = 30.0
BLOCKED_POLL: Final = 0.25


class _Connection:
    def __init__(self, listener: AmqpListener, accepted: Accepted) -> None:
        limits = listener.limits
        reader, writer = accepted.reader, accepted.writer
        self.reader = reader
        self.intake = Intake(reader)
        self.writer = writer
        self.peer = writer.get_extra_info("peername")
        self.log = ConnectionLog(logger, "amqp", self.peer)
        self.connection = AmqpConnection(
            listener.exchanges,
            frame_max=listener.frame_max,
            channel_max=listener.channel_max,
            heartbeat=listener.heartbeat,
            max_message_size=listener.sink.max_message_size,
            max_login_frame=limits.max_login_frame,
            max_unconfirmed_bytes=limits.max_unconfirmed_bytes,
        )
        self.admission = accepted.admission
        # The whole handshake (TLS, header to connection.open) must finish by then.
        self._login_deadline = accepted.login_deadline
        self.tasks = Tasks(f"amqp {self.peer}")
        self.writing = Tasks(f"amqp {self.peer} writer", failed=self.tasks.failed)
        self.outbox = Outbox(
            writer, settle_written=self._settle_written, high=listener.write_buffer
        )
        self.session = Session(
            listener.sink,
            self.connection,
            self.outbox,
            identity=peer_identity(writer),
            admission=self.admission,
            log=self.log,
            peer=self.peer,
        )

    def _settle_written(self, flow_id: str, message_ids: tuple[str, ...]) -> None:
        self.session.settle_written(flow_id, message_ids)

    async def run(self) -> None:
        tasks, session = self.tasks, self.session
        writing = self.writing.spawn(self.outbox.run(), name="amqp writer")
        try:
            tasks.spawn(session.run(), name="amqp worker")
            heartbeats = send_heartbeats(self.outbox, HEARTBEAT_FRAME, self._heartbeat)
            tasks.spawn(heartbeats, name="amqp heartbeat")
            reading = tasks.spawn(self._read(), name="amqp reader")
            crashed = tasks.spawn(tasks.failed.wait(), name="amqp crash watch")
            await asyncio.wait((reading, crashed), return_when=asyncio.FIRST_COMPLETED)
            try:
                async with asyncio.timeout(DRAIN_TIMEOUT):
                    await session.queue.idle.wait()
            except TimeoutError:
                self.log.warning(
                    "amqp connection %s: gave up storing its last publishes", self.peer
                )
            if self.intake.stopped:
                # Drained: the goodbye follows the confirms of everything received.
                await self.outbox.sent(CLOSE_TIMEOUT)
                self.connection.close(ReplyCode.CONNECTION_FORCED, "keygate is shutting down")
        finally:
            self.admission.release()
            session.unbind_all()
            await tasks.close()
            session.flush()
            self.outbox.close()
            await asyncio.wait((writing,), timeout=CLOSE_TIMEOUT)
            await self.writing.close()
            if not self.outbox.broken:
                await linger(self.reader, self.writer, LINGER)
            self.writer.close()
            with contextlib.suppress(ConnectionError, ssl.SSLError, TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await self.writer.wait_closed()

    def _heartbeat(self) -> float | None:
        """Seconds of silence the peer accepts (None: no heartbeats)."""
        connection = self.connection
        return connection.heartbeat if connection.state is State.OPEN else None

    def drain(self) -> None:
        """Stop reading; ``run`` confirms what was received, then closes with 320."""
        self.intake.stop()

    def _read_timeout(self) -> float | None:
        connection = self.connection
        if connection.state is State.CLOSING:
            return CLOSE_TIMEOUT
        if connection.state is not State.OPEN:
            return max(0.0, self._login_deadline - asyncio.get_running_loop().time())
        # Two missed heartbeats mean the peer is gone (spec 4.2.7).
        return 2 * connection.heartbeat if connection.heartbeat else None

    async def _read(self) -> None:
        connection, session = self.connection, self.session
        try:
            while connection.state is not State.CLOSED:
                async with asyncio.timeout(self._read_timeout()):
                    data = await self.intake.read(READ_SIZE)
                if not data:
                    return
                connection.receive_data(data)
                while (event := connection.next_event()) is not None:
                    if isinstance(event, ev.ConnectionClosed):
                        self.log.debug("amqp connection %s closed: %s", self.peer, event.reply_text)
                    else:
                        session.queue.put_nowait(event)
                await session.save_exchanges()
                session.flush()
                await self.writer.drain()
                await session.queue.room()
        except (TimeoutError, ConnectionError, ssl.SSLError) as e:
            self.log.info("amqp connection %s ended: %r", self.peer, e)


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
        write_buffer: int = DEFAULT_HIGH,
    ) -> None:
        self.name = name
        self.limits = limits
        self.write_buffer = write_buffer  # consumer_write_buffer: see protocols/_io.py
        self.sink = sink
        self.exchanges = Exchanges()
        self.frame_max = frame_max
        self.channel_max = channel_max
        self.heartbeat = heartbeat
        self._acceptor = Acceptor(
            "amqp", lambda accepted: _Connection(self, accepted), limits=limits
        )
        self._watching = Tasks("amqp blocked watch")

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        self.exchanges.load(await self.sink.amqp_exchanges())
        bound = await self._acceptor.start(host, port, ssl_context)
        self._watching.spawn(self._watch_blocked(), name=f"{self.name}-blocked")
        return bound

    async def close(self) -> None:
        self._acceptor.stop_accepting()
        await self._watching.close()
        await self._acceptor.close(DRAIN_TIMEOUT + 2 * CLOSE_TIMEOUT + LINGER)

    async def _watch_blocked(self) -> None:
        # The Sink exposes backpressure as a property, so it is polled; a few reads of a
        # bool per second cost nothing and need no callback contract.
        while True:
            await asyncio.sleep(BLOCKED_POLL)
            blocked = self.sink.blocked
            for connection in list(self._acceptor.connections):
                connection.connection.set_blocked(blocked)
                connection.session.flush()


__all__ = ["AmqpListener"]
