"""The asyncio STOMP listener: sockets around ``ServerConnection`` and ``Session``.

How it works, per connection (``_Connection``). Its tasks all belong to one
``protocols._tasks.Tasks`` and end with it:

- the reader feeds bytes to the sans-IO ``ServerConnection`` and hands each event to the
  ``Session`` (protocols/stomp/session.py) in arrival order; CONNECT is handled inline
  (nothing may follow it until it is accepted). A client silent for longer than its
  negotiated heart-beat interval times ``HEARTBEAT_TOLERANCE`` is dropped, as is one that
  sends no CONNECT within the login timeout;
- the worker (``Session.run``) does the work in order: publishes, commits, receipts,
  subscriptions; the connection ends when it returns (DISCONNECT, an ERROR, the reader's
  end);
- the writer (``protocols._io.Outbox``) writes frames in order, everything queued since
  its last write in one write;
- once CONNECTED, the heartbeat task (``protocols._io.send_heartbeats``) sends EOLs when
  we have been silent.

A task that fails with a bug (``Tasks.failed``) ends the connection like a lost client,
and a draining listener (``protocols._accept.Acceptor.close``) like a client that closed
its socket: the reader stops, what was received is still done and receipted. Ending
unbinds its flows, writes what is queued (at most ``CLOSE_TIMEOUT``), half-closes and
lingers (``protocols._io.linger``) so that the client reads its last ERROR or RECEIPT,
then closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import Final

from core.errors import KeygateError
from protocols._accept import Accepted, Acceptor
from protocols._intake import Intake
from protocols._io import DEFAULT_HIGH, LINGER, Outbox, linger, send_heartbeats
from protocols._limits import DEFAULT_LIMITS, ConnectionLimits
from protocols._log import ConnectionLog
from protocols._tasks import Tasks
from protocols.sink import Sink, peer_identity
from protocols.stomp.codec import DEFAULT_MAX_HEADERS
from protocols.stomp.connection import HEARTBEAT, ServerConnection, State
from protocols.stomp.events import Connect
from protocols.stomp.session import Fatal, Session

log = logging.getLogger(__name__)

READ_SIZE: Final = 256 * 1024
HEADER_ALLOWANCE: Final = 64 * 1024  # frame size beyond the largest message body
CLOSE_TIMEOUT: Final = 5.0
DEFAULT_HEARTBEAT: Final = (10_000, 10_000)


class _Connection:
    def __init__(self, listener: StompListener, accepted: Accepted) -> None:
        reader, writer = accepted.reader, accepted.writer
        self.listener = listener
        self.reader = reader
        self.intake = Intake(reader)
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.log = ConnectionLog(log, "stomp", self.peer)
        self.conn = ServerConnection(
            server=listener.server_name,
            max_frame_size=listener.max_frame_size,
            max_headers=listener.max_headers,
            heartbeat=listener.heartbeat,
            max_login_frame=listener.limits.max_login_frame,
        )
        self.admission = accepted.admission
        # The CONNECT frame is due by then (TLS included), however it trickles in.
        self.login_deadline = accepted.login_deadline
        self.tasks = Tasks(f"stomp {self.peer}")
        self.outbox = Outbox(
            writer, settle_written=self._settle_written, high=listener.write_buffer
        )
        self.session = Session(
            listener.sink,
            self.conn,
            self.outbox,
            identity=peer_identity(writer),
            admission=self.admission,
            max_unconfirmed_bytes=listener.limits.max_unconfirmed_bytes,
            log=self.log,
            peer=self.peer,
        )
        self._reading: asyncio.Task[None] | None = None

    def _settle_written(self, flow_id: str, message_ids: tuple[str, ...]) -> None:
        self.session.settle_written(flow_id, message_ids)

    async def run(self) -> None:
        """Serve the connection until it ends; every task it started is ended with it."""
        tasks = self.tasks
        writing = tasks.spawn(self._write(), name="stomp writer")
        try:
            self._reading = tasks.spawn(self._read(), name="stomp reader")
            working = tasks.spawn(self.session.run(), name="stomp worker")
            tasks.spawn(self._end_on_failure(), name="stomp crash watch")
            await asyncio.wait((working,))
            self.session.unbind_all()
            self.outbox.close()
            await asyncio.wait((writing,), timeout=CLOSE_TIMEOUT)
            await self._linger()
        finally:
            self.admission.release()
            self.session.unbind_all()
            await tasks.close()
            self.writer.close()
            with contextlib.suppress(OSError, TimeoutError):
                async with asyncio.timeout(CLOSE_TIMEOUT):
                    await self.writer.wait_closed()

    async def _end_on_failure(self) -> None:
        """A task failed with a bug (logged by ``Tasks``): end as if the client left."""
        await self.tasks.failed.wait()
        self.stop()

    def stop(self) -> None:
        """Stop reading; what is already queued is still stored and confirmed."""
        if self._reading is not None:
            self._reading.cancel()
        self.session.stop()

    def drain(self) -> None:
        """Stop reading between reads, as if the client had closed its socket."""
        self.intake.stop()

    async def _linger(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
            await asyncio.wait((self._reading,))
        if not self.outbox.broken:
            await linger(self.reader, self.writer, LINGER)

    async def _write(self) -> None:
        await self.outbox.run()
        if self.outbox.broken:
            self.stop()

    async def _read(self) -> None:
        conn, session = self.conn, self.session
        loop = asyncio.get_running_loop()
        try:
            while conn.state is not State.CLOSED:
                if conn.state is State.AWAITING_CONNECT:
                    deadline: float | None = self.login_deadline
                elif conn.receive_timeout is None:  # the client sends no heart-beats
                    deadline = None
                else:
                    deadline = loop.time() + conn.receive_timeout
                async with asyncio.timeout_at(deadline):
                    data = await self.intake.read(READ_SIZE)
                if not data:
                    break
                conn.receive_data(data)
                while (event := conn.next_event()) is not None:
                    if not isinstance(event, Connect):
                        await session.put(event)
                    elif not await session.connect(event):
                        return
                    elif conn.send_interval:
                        self.tasks.spawn(
                            send_heartbeats(self.outbox, HEARTBEAT, lambda: conn.send_interval),
                            name="stomp heartbeat",
                        )
        except KeygateError as e:
            self.log.info("stomp %s: protocol error: %s", self.peer, e.message)
            await session.put(Fatal(e))
            return
        except TimeoutError:
            if conn.state is State.AWAITING_CONNECT:
                self.log.info(
                    "stomp %s: no CONNECT within %.0fs",
                    self.peer,
                    self.listener.limits.login_timeout,
                )
            else:
                self.log.info(
                    "stomp %s: no heart-beat for %.1fs, closing", self.peer, conn.receive_timeout
                )
        except OSError as e:
            self.log.info("stomp %s: read failed: %s", self.peer, e)
        if conn.state is not State.CLOSED:
            session.stop()


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
        write_buffer: int = DEFAULT_HIGH,
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
        self.limits = limits
        self.write_buffer = write_buffer  # consumer_write_buffer: see protocols/_io.py
        self.server_name = server_name
        self._acceptor = Acceptor(
            "stomp",
            lambda accepted: _Connection(self, accepted),
            limits=limits,
            read_limit=READ_SIZE,
        )

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        return await self._acceptor.start(host, port, ssl_context)

    async def close(self) -> None:
        await self._acceptor.close(CLOSE_TIMEOUT * 2)


__all__ = ["StompListener"]
