"""A raw AMQP 0-9-1 publisher over a plain socket (pamqp framing): it pipelines publishes in
confirm mode and reads every frame until the server closes the socket, so a test sees
exactly which publishes were confirmed before the connection ended (pika hides that)."""

from __future__ import annotations

import asyncio
from typing import Any, Final

from pamqp import base, body, commands, frame, header

WAIT: Final = 10.0


class RawAmqp:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._buffer = b""
        self.acked: set[int] = set()  # delivery tags confirmed with basic.ack
        self.nacked: set[int] = set()
        self.closed_by: commands.Connection.Close | None = None

    @classmethod
    async def confirming(cls, port: int, channel: int = 1) -> RawAmqp:
        """Open a connection and ``channel`` in confirm mode."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = await cls.opened(reader, writer, channel)
        client.send(channel, commands.Confirm.Select())
        await client.expect(commands.Confirm.SelectOk)
        return client

    @classmethod
    async def opened(
        cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, channel: int = 1
    ) -> RawAmqp:
        """Log in as guest on a connected socket and open ``channel``."""
        client = cls(reader, writer)
        writer.write(b"AMQP\x00\x00\x09\x01")
        await client.expect(commands.Connection.Start)
        response = "\x00guest\x00guest"
        client.send(0, commands.Connection.StartOk({}, "PLAIN", response, "en_US"))
        tune = await client.expect(commands.Connection.Tune)
        client.send(0, commands.Connection.TuneOk(tune.channel_max, tune.frame_max, 0))
        client.send(0, commands.Connection.Open("/"))
        await client.expect(commands.Connection.OpenOk)
        client.send(channel, commands.Channel.Open())
        await client.expect(commands.Channel.OpenOk)
        return client

    def send(self, channel: int, method: base.Frame) -> None:
        self.writer.write(frame.marshal(method, channel))

    @staticmethod
    def publish_frames(routing_key: str, payload: bytes, channel: int = 1) -> bytes:
        """The frames of one basic.publish to the default exchange."""
        content = header.ContentHeader(0, len(payload), commands.Basic.Properties())
        return (
            frame.marshal(commands.Basic.Publish(exchange="", routing_key=routing_key), channel)
            + frame.marshal(content, channel)
            + frame.marshal(body.ContentBody(payload), channel)
        )

    async def next_frame(self) -> Any | None:
        """The next frame's payload, or None once the server closed the socket."""
        while True:
            if len(self._buffer) >= 7:
                try:
                    used, _, payload = frame.unmarshal(self._buffer)
                except Exception:  # pamqp: the frame is not complete yet
                    pass
                else:
                    self._buffer = self._buffer[used:]
                    return payload
            async with asyncio.timeout(WAIT):
                data = await self.reader.read(65536)
            if not data:
                return None
            self._buffer += data

    async def expect(self, kind: type[Any]) -> Any:
        payload = await self.next_frame()
        assert isinstance(payload, kind), payload
        return payload

    async def read_confirms(self) -> None:
        """Record confirms until the server closes the socket (a Connection.Close is
        recorded, not answered: what follows it is still read)."""
        last = 0
        while (payload := await self.next_frame()) is not None:
            if isinstance(payload, commands.Basic.Ack | commands.Basic.Nack):
                tags = set(range(last + 1, payload.delivery_tag + 1))
                settled = tags if payload.multiple else {payload.delivery_tag}
                (self.acked if isinstance(payload, commands.Basic.Ack) else self.nacked).update(
                    settled
                )
                last = max(last, payload.delivery_tag)
            elif isinstance(payload, commands.Connection.Close):
                self.closed_by = payload
