"""The native protocol's server: sockets around ``protocols.native.requests.Requests``.

How it works, per connection (``_Session``). Its tasks — the reader, the writer (the
connection's ``protocols._io.Outbox``) and the PUBLISHes in flight — are owned by its
``Tasks`` and end with it. The reader feeds bytes to the ``ServerConnection`` and hands
each event to ``Requests`` (protocols/native/requests.py) in arrival order; after each read
it waits while the outbox is full, so a client that does not read its answers is not read
either. A connection ends when the peer closes or breaks the socket, sends CLOSE or a
connection-level ERROR, sends a bad frame (ERROR ``protocol-error``), stays silent (no
HELLO within the login timeout, no frame within the idle timeout: ERROR), or when one of
its tasks crashes (a bug: logged with its traceback, ERROR ``error``). Ending unbinds the
flows exactly like UNBIND without shutdown (their partitions enter the rebalance delay),
writes what is queued (at most ``CLOSE_WAIT``) and closes the socket (after lingering,
``protocols._io.linger``, when drained).

``NativeListener.close`` drains every connection (``protocols._accept.Acceptor.close``): it
stops reading as if its peer had closed the socket, lets the PUBLISHes already received
commit and be confirmed (at most ``DRAIN_TIMEOUT``), then ends.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Final

from core.errors import KeygateError
from protocols._accept import Accepted, Acceptor
from protocols._intake import Intake
from protocols._io import LINGER, linger
from protocols._limits import DEFAULT_LIMITS, ConnectionLimits
from protocols._log import ConnectionLog
from protocols._tasks import Tasks
from protocols.native.connection import ConnectionState
from protocols.native.errors import IdleTimeout, LoginTimeout, NativeProtocolError, error_frame
from protocols.native.events import DEFAULT_MAX_FRAME, Publish
from protocols.native.requests import Requests
from protocols.sink import Sink

log = logging.getLogger("keygate.native")

READ_SIZE: Final = 256 * 1024
# How long a closing listener waits for publishes it already received to be confirmed,
# and then for its connections to end.
DRAIN_TIMEOUT: Final = 10.0
# How long an ending connection waits for its unsent bytes to leave before dropping them.
CLOSE_WAIT: Final = 2.0
# Bytes a connection may hold for the socket before deliveries wait as messages.
DEFAULT_WRITE_BUFFER: Final = 1024 * 1024
# Four of the SDK's 15 s heartbeats.
DEFAULT_IDLE_TIMEOUT: Final = 60.0


class _Session:
    def __init__(self, listener: NativeListener, accepted: Accepted) -> None:
        reader, writer = accepted.reader, accepted.writer
        self.listener = listener
        self.reader = reader
        self.intake = Intake(reader)
        self.writer = writer
        self.peer = str(writer.get_extra_info("peername"))
        self.log = ConnectionLog(log, "native", self.peer)
        self.tasks = Tasks(f"native {self.peer}")
        self.publishes = Tasks(f"native {self.peer} publishes", failed=self.tasks.failed)
        self.admission = accepted.admission
        self.login_deadline = accepted.login_deadline
        self.requests = Requests(listener, writer, self.publishes, self.admission, self.log)
        self.outbox = self.requests.outbox

    async def run(self) -> None:
        tasks = self.tasks
        writing = tasks.spawn(self.outbox.run(), name="writer")
        try:
            reading = tasks.spawn(self.read(), name="reader")
            crashed = tasks.spawn(tasks.failed.wait(), name="crash watch")
            await asyncio.wait((reading, writing, crashed), return_when=asyncio.FIRST_COMPLETED)
            if tasks.failed.is_set():
                self.requests.send(error_frame(KeygateError("internal server error")))
        finally:
            await self.finish(writing)

    def drain(self) -> None:
        """Stop reading, as if the peer had closed the socket; ``finish`` then waits for
        the PUBLISHes received to be confirmed."""
        self.intake.stop()

    async def read(self) -> None:
        requests = self.requests
        conn = requests.conn
        listener = self.listener
        try:
            while True:
                if conn.state is ConnectionState.AWAIT_HELLO:
                    async with asyncio.timeout_at(self.login_deadline):
                        data = await self.intake.read(READ_SIZE)
                else:
                    async with asyncio.timeout(listener.idle_timeout):
                        data = await self.intake.read(READ_SIZE)
                if not data:
                    return
                conn.receive_data(data)
                try:
                    while (event := conn.next_event()) is not None:
                        if type(event) is Publish and requests.publish(event):
                            continue
                        if not await requests.handle(event):
                            return
                finally:
                    self.requests.flush()  # what this read brought, one lot
                await self.outbox.room()
        except NativeProtocolError as e:
            self.log.info("native %s: protocol error: %s", self.peer, e)
            self.requests.send(error_frame(e))
        except TimeoutError:
            if conn.state is ConnectionState.AWAIT_HELLO:
                self.log.info(
                    "native %s: no HELLO within %.0fs", self.peer, listener.limits.login_timeout
                )
                self.requests.send(error_frame(LoginTimeout("no HELLO in time")))
            else:
                # A peer that vanished without a FIN or RST (power loss, a dropped NAT
                # entry) must not hold its partitions forever: the SDK pings every 15 s.
                self.log.info(
                    "native %s: nothing received for %.0fs, closing",
                    self.peer,
                    listener.idle_timeout,
                )
                self.requests.send(error_frame(IdleTimeout("no frame in time")))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass

    async def finish(self, writing: asyncio.Task[None]) -> None:
        self.admission.release()
        if self.intake.stopped and not await self.publishes.wait(DRAIN_TIMEOUT):
            self.log.warning("native %s: gave up confirming its last publishes", self.peer)
        self.outbox.close()
        self.requests.unbind_all()
        try:
            await asyncio.wait((writing,), timeout=CLOSE_WAIT)
            if writing.done():
                if self.intake.stopped and not self.outbox.broken:
                    await linger(self.reader, self.writer, LINGER)
                self.writer.close()
                await asyncio.wait_for(self.writer.wait_closed(), CLOSE_WAIT)
        except (TimeoutError, ConnectionError, OSError):
            pass
        finally:
            # What a peer that stopped reading has not taken yet would keep the socket
            # open forever: it is dropped with the connection.
            self.writer.transport.abort()
            await self.tasks.close()
            await self.publishes.close()


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
        self._acceptor = Acceptor(
            "native", lambda accepted: _Session(self, accepted), limits=limits
        )

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        return await self._acceptor.start(host, port, ssl_context)

    async def close(self) -> None:
        await self._acceptor.close(DRAIN_TIMEOUT + CLOSE_WAIT * 2)
