"""Acceptor: every accepted socket becomes one owned connection task; finish waits for
them (up to a timeout), cancels the rest and closes the server."""

from __future__ import annotations

import asyncio

import pytest

from protocols._accept import Acceptor
from tests.support.wait import eventually


class _Echo:
    """Echoes one line, then waits until told to stop (or is cancelled)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.peer = str(writer.get_extra_info("peername"))
        self.stop = asyncio.Event()
        self.cancelled = False

    def drain(self) -> None:
        self.stop.set()

    async def run(self) -> None:
        try:
            self.writer.write(await self.reader.readline())
            await self.stop.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.writer.close()


async def _echo(port: int, line: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(line)
    answer = await reader.readline()
    writer.close()
    return answer


async def test_connections_are_served_tracked_and_ended_by_finish() -> None:
    acceptor: Acceptor[_Echo] = Acceptor("echo", _Echo)
    port = await acceptor.start("127.0.0.1", 0, None)
    assert await _echo(port, b"one\n") == b"one\n"
    assert await _echo(port, b"two\n") == b"two\n"
    await eventually(lambda: len(acceptor.connections) == 2)
    first, second = sorted(acceptor.connections, key=id)
    first.stop.set()  # ends by itself
    await eventually(lambda: acceptor.connections == {second})
    await acceptor.finish(timeout=0.1)  # the other is cancelled
    assert second.cancelled and not first.cancelled
    assert acceptor.connections == set()
    with pytest.raises(OSError):  # refused: the server socket is closed
        await asyncio.open_connection("127.0.0.1", port)
