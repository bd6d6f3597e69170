"""Raw native-protocol clients for tests that must misbehave (stall, stay silent, send
what the SDK never sends) or look at the frames themselves: ``expect`` over a blocking
socket, ``RawClient`` over asyncio streams."""

from __future__ import annotations

import asyncio
import socket

from core.model import AckMode
from protocols.native.connection import ClientConnection
from protocols.native.events import Bind, BindOk, Event, Hello, HelloOk


def expect(sock: socket.socket, conn: ClientConnection, kind: type[Event]) -> Event:
    """Read until the next event arrives; it must be a ``kind``."""
    while (event := conn.next_event()) is None:
        data = sock.recv(65536)
        assert data, "gateway closed the connection"
        conn.receive_data(data)
    assert isinstance(event, kind), event
    return event


class RawClient:
    """A native connection driven frame by frame by the test."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.conn = ClientConnection()

    def send(self, event: Event) -> None:
        self.writer.write(self.conn.send(event))

    async def receive(self, timeout: float = 10) -> Event | None:
        """The next event; None once the gateway closed the connection."""
        async with asyncio.timeout(timeout):
            while (event := self.conn.next_event()) is None:
                data = await self.reader.read(65536)
                if not data:
                    return None
                self.conn.receive_data(data)
        return event

    async def request(self, event: Event) -> Event | None:
        """Send ``event`` and return the next event received."""
        self.send(event)
        return await self.receive()

    async def bind(self, queue: str, ack_mode: AckMode = AckMode.CLIENT, group: str = "g") -> str:
        reply = await self.request(
            Bind(
                request_id=self.conn.next_request_id(),
                queue=queue,
                group=group,
                window=0,
                ack_mode=ack_mode,
            )
        )
        assert isinstance(reply, BindOk), reply
        return reply.flow_id

    def close(self) -> None:
        self.writer.close()


async def connect(
    port: int, *, receive_buffer: int | None = None, source: str | None = None
) -> RawClient:
    """A RawClient connected to ``port`` on loopback, before its HELLO; from the address
    ``source`` if given (any of 127.0.0.0/8 reaches a listener on 127.0.0.1)."""
    sock = socket.socket()
    if source is not None:
        sock.bind((source, 0))
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return RawClient(*await asyncio.open_connection(sock=sock))


async def raw_client(
    port: int, *, receive_buffer: int | None = None, hello: Hello | None = None
) -> RawClient:
    """A RawClient connected to ``port``, logged in with ``hello`` (anonymous by
    default)."""
    client = await connect(port, receive_buffer=receive_buffer)
    client.send(hello or Hello(request_id=1, client_name="test"))
    reply = await client.receive()
    assert isinstance(reply, HelloOk), reply
    return client


__all__ = ["RawClient", "connect", "expect", "raw_client"]
