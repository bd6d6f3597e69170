"""HTTP/1.1 over a plain socket, for tests that hold connections open, send half a
request head or read exactly what the server wrote before it closed (aiohttp's client
pools and retries, which hides all three)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final

WAIT: Final = 10.0


def request(path: str, *, keep_alive: bool = False) -> bytes:
    """A GET under the address connected to (an anonymous gateway refuses other names)."""
    connection = "keep-alive" if keep_alive else "close"
    head = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: {connection}\r\n\r\n"
    return head.encode()


async def get(port: int, path: str) -> tuple[int, bytes]:
    """One request on a new connection (``Connection: close``): the status and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request(path))
        async with asyncio.timeout(WAIT):
            answer = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def answered_then_closed(reader: asyncio.StreamReader, wait: float = WAIT) -> bytes:
    """Everything the server writes until it closes the connection (a reset counts as a
    close): fails when it is still open after ``wait`` seconds."""
    received = b""
    async with asyncio.timeout(wait):
        try:
            while chunk := await reader.read(65536):
                received += chunk
        except ConnectionError:
            pass
    return received


class Held:
    """A keep-alive connection that made one request and stays open."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Held:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        held = cls(reader, writer)
        writer.write(request("/healthz", keep_alive=True))
        async with asyncio.timeout(WAIT):
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
        return held

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()
