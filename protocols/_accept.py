"""The accept side every listener shares: a server socket, one owned task per connection.

How it works. ``Acceptor.start`` binds asyncio's server; each accepted socket gets TCP
keepalive (``keep_alive``), a place in the shared connection count (``Admission``,
protocols/_limits.py) and its login deadline, ``login_timeout`` from now, at once: the
stream protocol (``_Counted``) is made at the accept, before a TLS handshake, and the
handshake must finish by that same deadline (``ssl_handshake_timeout``). Before,
asyncio's defaults gave every handshake 60 s and the socket was counted only after it,
so a flood of peers that never send a ClientHello was neither counted against
``max_connections`` nor closed at the login timeout. A handshake that fails keeps its
place until that deadline: asyncio tells the protocol nothing of it. (Running the
handshake ourselves with ``StreamWriter.start_tls`` would tell, but does not work on
uvloop, which reads the ClientHello into the plain stream first.) Then a connection
object made by the listener's factory from the ``Accepted`` socket runs (``run()``,
spawned on the acceptor's ``Tasks``); it stays in ``connections`` while it runs, and the
admission is released when it ends, whoever else released it first.

A listener closes (``close``) the same way on every protocol: it stops accepting, then
drains each connection (``Served.drain``): the connection stops reading (its
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
from dataclasses import dataclass
from typing import Any, Final, Generic, Protocol, TypeVar, cast

from protocols._io import keep_alive
from protocols._limits import Admission, ConnectionLimits
from protocols._tasks import Tasks


@dataclass(frozen=True, slots=True)
class Accepted:
    """A socket a listener serves: its streams (TLS already set up on a TLS listener), its
    place in the connection count, taken at the accept, and when its login is due (event
    loop time: the accept plus ``login_timeout``)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    admission: Admission
    login_deadline: float


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

Factory = Callable[[Accepted], C]


class _Counted(asyncio.StreamReaderProtocol):
    """asyncio's stream protocol, made at the accept with its ``Accepted`` parts. On a TLS
    listener the handshake runs between the two, and one that fails never reaches
    ``connection_made``: nothing else would give its place back, so it is given back at
    the login deadline (when the handshake is aborted too), and a connection made after
    that, its login already overdue, is dropped."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        made: Callable[[Accepted], None],
        admission: Admission,
        deadline: float,
    ) -> None:
        super().__init__(reader, lambda r, w: made(Accepted(r, w, admission, deadline)))
        self._admission: Admission | None = admission
        self._overdue = asyncio.get_running_loop().call_at(deadline, self._give_back)

    def _give_back(self) -> None:
        if self._admission is not None:
            self._admission.release()
            self._admission = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._admission is None:  # overdue
            cast(asyncio.WriteTransport, transport).abort()
            return
        self._overdue.cancel()
        super().connection_made(transport)


class Acceptor(Generic[C]):
    """A listener's server socket and the connections it is serving."""

    def __init__(
        self,
        protocol: str,
        factory: Factory[C],
        *,
        limits: ConnectionLimits,
        read_limit: int = 2**16,
    ) -> None:
        self._protocol = protocol
        self._factory = factory
        self._limits = limits
        self._read_limit = read_limit
        self._server: asyncio.Server | None = None
        self._tasks = Tasks(f"{protocol} listener")
        self.connections: set[C] = set()

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Listen on ``host:port`` (0: any free port; ``::`` takes IPv4 clients too,
        see the module doc), with TLS when ``ssl_context`` is given; returns the port bound."""
        self._server = await asyncio.get_running_loop().create_server(
            self._counted,
            **listen_on(host, port),
            ssl=ssl_context,
            # From the accept, as the login deadline: the protocol is made just before.
            ssl_handshake_timeout=self._limits.login_timeout if ssl_context else None,
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

    def _counted(self) -> _Counted:
        """A new socket's protocol (before its TLS handshake), counted from now."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._limits.login_timeout
        admission = self._limits.connections.open(self._protocol)
        reader = asyncio.StreamReader(limit=self._read_limit, loop=loop)
        return _Counted(reader, self._accept, admission, deadline)

    def _accept(self, accepted: Accepted) -> None:
        writer = accepted.writer
        if self._tasks.closed or (self._server is not None and not self._server.is_serving()):
            accepted.admission.release()
            writer.close()
            return
        keep_alive(writer)
        peer = writer.get_extra_info("peername")
        self._tasks.spawn(self._serve(accepted), name=f"{self._protocol} {peer}")

    async def _serve(self, accepted: Accepted) -> None:
        try:
            connection = self._factory(accepted)
            self.connections.add(connection)
            try:
                await connection.run()
            finally:
                self.connections.discard(connection)
        finally:
            accepted.admission.release()


__all__ = ["DUAL_STACK_HOST", "Accepted", "Acceptor", "Served", "listen_on"]
