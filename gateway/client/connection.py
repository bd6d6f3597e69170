"""One native-protocol TCP connection: handshake, pipelined requests, dispatch, heartbeat.

How it works: a reader task feeds socket bytes to the sans-IO ``ClientConnection`` and
handles each event. Responses resolve the future registered under their request id (after
running an optional synchronous ``on_response`` hook, so a BIND_OK registers its flow
before the DELIVERs that follow it are dispatched). DELIVER and PARTITIONS_CHANGED go to
the ``FlowHandler`` registered for their flow id. A heartbeat task pings the gateway and
aborts the socket when it has heard nothing for HEARTBEAT_MISSES pings (see
``_heartbeat``); a gateway that accepts the socket but does not answer HELLO is given up
as soon (a frozen process's kernel still accepts connections). Frames are not written one
by one: what the application sends during one pass of the event loop leaves in one
``write`` (one system call for a thousand pipelined PUBLISHes rather than a thousand).
Whatever ends the connection — EOF, a socket error, a protocol error, CLOSE, ``close()`` —
fails every pending future with ``ConnectionLost`` and calls ``on_lost`` once. ``close()``
is a handshake (docs/native-protocol.md, CLOSE): it sends CLOSE and reads on until the
gateway has answered what was sent before it (the PUBLISH_OKs of publishes in flight) and
sent its own CLOSE, for at most ``timeout``; requests are refused from the CLOSE on. This
object never reconnects; ``robust.py`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from typing import Final, Protocol

from core.errors import KeygateError
from gateway.client.errors import ClientClosed, ConnectionLost, error_from_code
from protocols.native import (
    ClientConnection,
    Close,
    Deliver,
    Error,
    Event,
    FlowClosed,
    Hello,
    HelloOk,
    NativeProtocolError,
    PartitionsChanged,
    Ping,
    Pong,
)

_READ_SIZE: Final = 256 * 1024
# A gateway is taken for gone once this many heartbeat intervals pass with nothing at all
# received from it: with the SDK's default 2 s, 6-8 s after it froze or fell silent.
HEARTBEAT_MISSES: Final = 3


class FlowHandler(Protocol):
    def on_deliver(self, event: Deliver) -> None: ...

    def on_partitions_changed(self, event: PartitionsChanged) -> None: ...

    def on_flow_closed(self, event: FlowClosed) -> None: ...


class Connection:
    """A connected, handshaken native connection. Create with ``Connection.open``."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        proto: ClientConnection,
        on_lost: Callable[[Connection, BaseException], None],
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._proto = proto
        self._on_lost = on_lost
        self._pending: dict[int, tuple[asyncio.Future[Event], Callable[[Event], None] | None]] = {}
        self.flows: dict[str, FlowHandler] = {}
        self.lost: BaseException | None = None
        # CLOSE was sent: nothing more may be (the answers to what went before still come).
        self.closing = False
        # Reads from the socket so far: the heartbeat's sign of life.
        self._reads = 0
        self._closed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # Encoded frames not yet handed to the transport, written by _flush (call_soon).
        self._out: list[bytes] = []

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        hello: Hello,
        *,
        ssl_context: ssl.SSLContext | None,
        connect_timeout: float,
        heartbeat: float,
        on_lost: Callable[[Connection, BaseException], None],
    ) -> Connection:
        """Connect and handshake within ``connect_timeout`` — with a ``heartbeat``, within
        the silence that takes a connected gateway for gone if that is shorter. Raises
        OSError/TimeoutError for the network, the gateway's error (e.g.
        AuthenticationFailed) when it refuses."""
        if heartbeat > 0:
            connect_timeout = min(connect_timeout, HEARTBEAT_MISSES * heartbeat)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, ssl=ssl_context, limit=_READ_SIZE),
            connect_timeout,
        )
        proto = ClientConnection(max_frame=hello.max_frame)
        try:
            writer.write(proto.send(hello))
            async with asyncio.timeout(connect_timeout):
                reply = await cls._handshake(reader, proto)
        except BaseException:
            writer.close()
            raise
        if isinstance(reply, Error):
            writer.close()
            raise error_from_code(reply.code, reply.text)
        conn = cls(reader, writer, proto, on_lost)
        conn._tasks.append(asyncio.create_task(conn._read_loop(), name="keygate-reader"))
        if heartbeat > 0:
            conn._tasks.append(
                asyncio.create_task(conn._heartbeat(heartbeat), name="keygate-heartbeat")
            )
        return conn

    @staticmethod
    async def _handshake(reader: asyncio.StreamReader, proto: ClientConnection) -> Event:
        while True:
            event = proto.next_event()
            if isinstance(event, HelloOk | Error):
                return event
            if isinstance(event, Close):
                raise ConnectionLost(f"gateway closed the connection: {event.reason}")
            data = await reader.read(_READ_SIZE)
            if not data:
                raise ConnectionLost("gateway closed the connection during the handshake")
            proto.receive_data(data)

    @property
    def session_id(self) -> str | None:
        return self._proto.session_id

    @property
    def is_open(self) -> bool:
        return self.lost is None

    def send(self, event: Event) -> None:
        """Queue a frame that expects no response (ACK, NACK, CREDIT with id 0)."""
        self._check_usable()
        self._write(self._proto.send(event))

    def _check_usable(self) -> None:
        if self.lost is not None:
            raise ConnectionLost(f"connection lost: {self.lost}") from self.lost
        if self.closing:
            raise ClientClosed("the connection is closing: nothing more is sent")

    def _write(self, data: bytes) -> None:
        """Queue encoded bytes; the first of a loop pass schedules the flush."""
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(data)

    def _flush(self) -> None:
        if self._out and self.lost is None:
            self._writer.write(b"".join(self._out))
        self._out.clear()

    async def request(
        self,
        make: Callable[[int], Event],
        on_response: Callable[[Event], None] | None = None,
    ) -> Event:
        """Send ``make(request_id)`` and wait for its response. Blocks until the response
        arrives; raises the gateway's error for ERROR, ConnectionLost if the connection
        ends first, ClientClosed once ``close()`` has begun. ``on_response`` runs in the
        reader, before later frames are handled."""
        self._check_usable()
        rid = self._proto.next_request_id()
        future: asyncio.Future[Event] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (future, on_response)
        try:
            self._write(self._proto.send(make(rid)))
        except BaseException:
            del self._pending[rid]
            raise
        # The transport's back-pressure (the frame itself leaves at the end of this loop
        # pass). A failed drain means the socket died: the reader fails the future for us.
        with contextlib.suppress(OSError):
            await self._writer.drain()
        return await future

    async def drain(self) -> None:
        await self._writer.drain()

    async def _read_loop(self) -> None:
        reason: BaseException = ConnectionLost("gateway closed the connection")
        try:
            while True:
                while (event := self._proto.next_event()) is not None:
                    self._handle(event)
                data = await self._reader.read(_READ_SIZE)
                if not data:
                    break
                self._reads += 1
                self._proto.receive_data(data)
        except (OSError, NativeProtocolError, KeygateError) as e:
            reason = e
        except asyncio.CancelledError:
            reason = ConnectionLost("connection closed by the client")
        self._lose(reason)

    def _handle(self, event: Event) -> None:
        if isinstance(event, Deliver):
            flow = self.flows.get(event.flow_id)
            if flow is not None:
                flow.on_deliver(event)
        elif isinstance(event, FlowClosed):
            flow = self.flows.pop(event.flow_id, None)
            if flow is not None:
                flow.on_flow_closed(event)
        elif isinstance(event, PartitionsChanged):
            flow = self.flows.get(event.flow_id)
            if flow is not None:
                flow.on_partitions_changed(event)
        elif isinstance(event, Ping):
            self._write(self._proto.send(Pong(request_id=event.request_id)))
        elif isinstance(event, Close):
            raise ConnectionLost(f"gateway closed the connection: {event.reason}")
        elif isinstance(event, Error) and event.request_id == 0:
            raise error_from_code(event.code, event.text)
        else:
            future, on_response = self._pending.pop(event.request_id, (None, None))
            if future is None or future.done():
                return
            if isinstance(event, Error):
                future.set_exception(error_from_code(event.code, event.text))
                return
            if on_response is not None:
                on_response(event)
            future.set_result(event)

    async def _heartbeat(self, interval: float) -> None:
        """PING every ``interval``; abort the socket when HEARTBEAT_MISSES intervals in a
        row brought nothing from the gateway. Anything read counts (a PONG, a reply, a
        DELIVER), so a busy link whose PONGs wait behind deliveries stays up; intervals are
        counted, not seconds, so a client whose own event loop was held up does not take
        the gateway for gone. The PONGs answer nothing anyone waits for."""
        seen, missed = self._reads, 0
        while self.lost is None:
            await asyncio.sleep(interval)
            missed = missed + 1 if self._reads == seen else 0
            seen = self._reads
            if missed >= HEARTBEAT_MISSES:
                self._writer.transport.abort()
                return
            self.send(Ping(request_id=self._proto.next_request_id()))

    def _lose(self, reason: BaseException) -> None:
        if self.lost is not None:
            return
        self.lost = reason
        error = ConnectionLost(f"connection lost: {reason}")
        error.__cause__ = reason
        for future, _ in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._writer.close()
        self._closed.set()
        self._on_lost(self, reason)

    def abort(self) -> None:
        """Drop the socket at once, no CLOSE: to the gateway this is a network cut."""
        self._writer.transport.abort()

    async def close(self, timeout: float, reason: str = "client closing") -> None:
        """Send CLOSE, wait up to ``timeout`` seconds for the gateway's answers to the
        requests sent before it and for its CLOSE, then close the socket. Blocks until the
        reader has stopped. Requests still unanswered then fail with ConnectionLost."""
        if self.lost is None and not self.closing:
            self.closing = True
            with contextlib.suppress(OSError, RuntimeError):
                self._write(self._proto.send(Close(reason=reason)))
                self._flush()
                await self._writer.drain()
            # The reader ends the connection at the gateway's CLOSE (or at EOF).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._closed.wait()
            for task in self._tasks:
                task.cancel()
            self._lose(ConnectionLost("connection closed by the client"))
        await self._closed.wait()
        with contextlib.suppress(OSError, ConnectionError):
            await self._writer.wait_closed()


__all__ = ["Connection", "FlowHandler"]
