"""A raw STOMP 1.2 client socket for tests that pipeline frames or read exactly what the
server wrote (stomp.py hides both)."""

from __future__ import annotations

import asyncio
from typing import Final

from protocols.stomp import Codec, Frame, Version

WAIT: Final = 10.0


class RawClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.codec = Codec(version=Version.V1_2)
        self.heartbeats = 0

    async def send(self, command: str, *headers: tuple[str, str], body: bytes = b"") -> None:
        await self.send_raw(self.codec.send(Frame(command, headers, body)))

    async def send_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def frame(self, wait: float = WAIT) -> Frame | None:
        """The next frame, or None at EOF."""
        async with asyncio.timeout(wait):
            while (frame := self.codec.next_event()) is None:
                data = await self.reader.read(65536)
                if not data:
                    return None
                self.heartbeats += data.count(b"\n") if data.strip(b"\n") == b"" else 0
                self.codec.receive_data(data)
            return frame

    async def connect(self, *headers: tuple[str, str]) -> Frame:
        await self.send("CONNECT", ("accept-version", "1.2"), ("host", "h"), *headers)
        reply = await self.frame()
        assert reply is not None and reply.command == "CONNECTED", reply
        return reply


class raw:  # a context manager that reads like a function
    def __init__(self, port: int) -> None:
        self.port = port

    async def __aenter__(self) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.client = RawClient(reader, writer)
        return self.client

    async def __aexit__(self, *exc: object) -> None:
        self.client.writer.close()
        await self.client.writer.wait_closed()
