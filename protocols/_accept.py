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

``::`` listens on IPv6 and IPv4 alike (dual stack): asyncio's ``create_server`` turns
``IPV6_V6ONLY`` on for every IPv6 socket it binds, so a listener on ``::`` took IPv6
clients only, where users expect what ``::`` means to most servers and to Linux by
default. For ``::`` the listeners (and the admin port, gateway.http_server) bind a socket
of their own with ``IPV6_V6ONLY`` off and hand it to asyncio (``listen_on``); an IPv4
client then arrives as an IPv4-mapped address (``::ffff:127.0.0.1``, which counts as
loopback). Any other host is asyncio's to bind, as before.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable, Coroutine
from typing import Any, Final, Generic, Protocol, TypeVar

from protocols._io import keep_alive
from protocols._tasks import Tasks


class Served(Protocol):
    """What a listener makes of an accepted socket."""

    @property
    def peer(self) -> str: ...

    def run(self) -> Coroutine[Any, Any, None]: ...

    def drain(self) -> None:
        """Stop reading; ``run`` then confirms what was received, says goodbye and ends."""


DUAL_STACK_HOST: Final = "::"


def listen_on(host: str, port: int) -> dict[str, Any]:
    """``create_server``'s keyword arguments for ``host:port``: ``host`` and ``port``, or for
    ``::`` a bound dual-stack ``sock``. OSError (errno EADDRINUSE when taken) as asyncio's."""
    if host != DUAL_STACK_HOST:
        return {"host": host, "port": port}
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return {"sock": sock}


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
        """Listen on ``host:port`` (0: any free port; ``::`` takes IPv4 clients too,
        see the module doc); returns the port bound."""
        self._server = await asyncio.start_server(
            self._accept, **listen_on(host, port), ssl=ssl_context, limit=self._read_limit
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


__all__ = ["DUAL_STACK_HOST", "Acceptor", "Served", "listen_on"]
