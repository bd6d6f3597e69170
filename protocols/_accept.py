"""The accept side every listener shares: a server socket, one owned task per connection.

How it works. ``Acceptor.start`` binds asyncio's server; each accepted socket gets TCP
keepalive (``keep_alive``) and a connection object made by the listener's factory, whose
``run()`` is spawned on the acceptor's ``Tasks`` and which stays in ``connections`` while it
runs. A listener closes (``close``) the same way on every protocol: it stops accepting,
then drains each connection (``Served.drain``): the connection stops reading (its
``protocols._intake.Intake``), waits for the outcome of every publish it had received,
writes their confirms, then its protocol's goodbye (AMQP connection.close 320, MQTT 5
DISCONNECT 0x8B), flushes and closes. ``finish`` waits for the connections to end (at
most ``timeout``), cancels what is left and closes the server. A socket accepted after
``stop_accepting`` raced the close: it is closed unserved.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Coroutine
from typing import Any, Generic, Protocol, TypeVar

from protocols._io import keep_alive
from protocols._tasks import Tasks


class Served(Protocol):
    """What a listener makes of an accepted socket."""

    @property
    def peer(self) -> str: ...

    def run(self) -> Coroutine[Any, Any, None]: ...

    def drain(self) -> None:
        """Stop reading; ``run`` then confirms what was received, says goodbye and ends."""


C = TypeVar("C", bound=Served)

Factory = Callable[[asyncio.StreamReader, asyncio.StreamWriter], C]


class Acceptor(Generic[C]):
    """A listener's server socket and the connections it is serving."""

    def __init__(self, protocol: str, factory: Factory[C], *, read_limit: int = 2**16) -> None:
        self._protocol = protocol
        self._factory = factory
        self._read_limit = read_limit
        self._server: asyncio.Server | None = None
        self._tasks = Tasks(f"{protocol} listener")
        self.connections: set[C] = set()

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Listen on ``host:port`` (0: any free port); returns the port bound."""
        self._server = await asyncio.start_server(
            self._accept, host, port, ssl=ssl_context, limit=self._read_limit
        )
        return int(self._server.sockets[0].getsockname()[1])  # server.py logs it

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def close(self, timeout: float | None = None) -> None:
        """Stop accepting, drain every connection, wait at most ``timeout`` seconds for
        them to end, cancel the rest and close the server."""
        self.stop_accepting()
        for connection in list(self.connections):
            connection.drain()
        await self.finish(timeout)

    async def finish(self, timeout: float | None = None) -> None:
        """Wait at most ``timeout`` seconds for the connections to end, cancel the rest,
        then close the server."""
        self.stop_accepting()
        await self._tasks.wait(timeout)
        await self._tasks.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._tasks.closed or (self._server is not None and not self._server.is_serving()):
            writer.close()
            return
        keep_alive(writer)
        connection = self._factory(reader, writer)
        self._tasks.spawn(self._serve(connection), name=f"{self._protocol} {connection.peer}")

    async def _serve(self, connection: C) -> None:
        self.connections.add(connection)
        try:
            await connection.run()
        finally:
            self.connections.discard(connection)


__all__ = ["Acceptor", "Served"]
