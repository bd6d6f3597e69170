"""Acceptor: every accepted socket becomes one owned connection task, counted from the
accept, its TLS handshake due by its login deadline; finish waits for them (up to a
timeout), cancels the rest and closes the server."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest

from protocols._accept import Accepted, Acceptor
from protocols._limits import ConnectionLimits
from tests.support.pki import Pki, make_pki
from tests.support.wait import eventually


class _Echo:
    """Echoes one line, then waits until told to stop (or is cancelled)."""

    def __init__(self, accepted: Accepted) -> None:
        self.reader, self.writer = accepted.reader, accepted.writer
        self.peer = str(self.writer.get_extra_info("peername"))
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
    acceptor: Acceptor[_Echo] = Acceptor("echo", _Echo, limits=ConnectionLimits())
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


async def _tls_handshakes_are_counted_from_accept_and_due_at_the_login_timeout(
    pki: Pki,
) -> None:
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(*pki.server)
    limits = ConnectionLimits(login_timeout=0.5)
    acceptor: Acceptor[_Echo] = Acceptor("echo", _Echo, limits=limits)
    port = await acceptor.start("127.0.0.1", 0, server)
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # no ClientHello
        await eventually(lambda: limits.connections.total == 1, timeout=5)
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed by the server
        assert 0.4 <= loop.time() - started < 1.5
        writer.close()
        await eventually(lambda: limits.connections.total == 0, timeout=5)
        tls_reader, tls_writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=pki.client_context()
        )
        tls_writer.write(b"over tls\n")
        assert await tls_reader.readline() == b"over tls\n"
        assert limits.connections.total == 1
        tls_writer.close()
    finally:
        await acceptor.finish(timeout=0.1)


async def test_tls_handshakes_are_counted_from_accept_and_due_at_the_login_timeout(
    tmp_path: Path,
) -> None:
    """asyncio's own handshake was not counted until done and had 60 s to finish."""
    await _tls_handshakes_are_counted_from_accept_and_due_at_the_login_timeout(make_pki(tmp_path))


def test_tls_handshakes_on_uvloop(tmp_path: Path) -> None:
    """``keygate serve`` runs on uvloop where it is installed."""
    uvloop = pytest.importorskip("uvloop")
    pki = make_pki(tmp_path)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_tls_handshakes_are_counted_from_accept_and_due_at_the_login_timeout(pki))
