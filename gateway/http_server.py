"""The HTTP servers' sockets (the admin API on ``http`` and ``http_tls``, a standby's
health port), bounded like the protocol listeners' (docs/operations.md, "Connection
limits"): at most ``max_http_connections`` open at once, a request head due within
``login_timeout`` and a request body within ``http_body_timeout``.

How it works. aiohttp's ``AppRunner`` makes the request handlers; ``CappedSite`` listens
with a protocol factory of its own, which wraps each handler in ``_Counted``. When the
transport is ready (after the TLS handshake), ``_Counted`` asks the shared
``HttpConnections`` for a place: over the cap the peer gets a ``503`` with the API's JSON
error (``connection-limit``) and the socket is closed before aiohttp sees it; otherwise
the handler runs, and its place is given back when the connection is lost. Refusals are
counted (``keygate_listener_refused_connections_total``) and logged at most once per
``REFUSAL_LOG_INTERVAL``: a flood of them must not become a flood of log lines.

The request head deadline is aiohttp's keep-alive timer, set to ``login_timeout``: it
starts at the accept, closes the connection if it fires while the handler is still waiting
for a complete request head (bytes trickling in do not restart it), and starts again after
each response. So one timeout bounds a silent socket, a slowloris head and an idle
keep-alive connection; a TLS handshake gets the same deadline.

The body deadline is ``read_body``'s, a middleware that reads the whole body (up to the
app's ``client_max_size``) before the handler runs: a peer that announced a body and
then stalled or trickled it held its connection, and a place under the cap, for as long
as it liked. Too late, it gets a ``408`` with the API's JSON error (``request-timeout``)
and the connection is closed at once, not after aiohttp's lingering read of the rest.
The open connections are exported as ``keygate_open_http_connections``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from dataclasses import dataclass
from typing import Final, cast

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from aiohttp.web_protocol import RequestHandler

from core.errors import ConnectionLimitReached
from gateway.logs import quiet_bad_requests
from protocols._accept import listen_on

log = logging.getLogger("keygate.http")

REFUSAL_LOG_INTERVAL: Final = 10.0
"""Seconds between two log lines about refused HTTP connections."""


def error_json(code: str, message: str) -> bytes:
    """The API's JSON error body."""
    return json.dumps({"error": code, "message": message}).encode()


class HttpConnections:
    """The open connections of one gateway's HTTP servers, against one cap (0 = none):
    it bounds file descriptors, so ``http`` and ``http_tls`` share it."""

    def __init__(self, limit: int, header_timeout: float) -> None:
        self.limit = limit
        self.header_timeout = header_timeout
        self.open = 0
        self._unlogged = 0  # refusals not yet in a log line
        self._logged_at: float | None = None
        self._summary: asyncio.TimerHandle | None = None

    def admit(self) -> bool:
        """Take a place for a new connection; False (and the refusal logged) when full."""
        if self.limit and self.open >= self.limit:
            self._refused()
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1

    def refusal(self) -> bytes:
        """What a refused peer is sent: a 503 with the API's JSON error, then the close."""
        error = ConnectionLimitReached(
            f"connection limit reached ({self.limit} HTTP connections, max_http_connections)"
        )
        body = error_json(error.code, error.message)
        head = (
            f"HTTP/1.1 {error.status} Service Unavailable\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        return head.encode() + body

    def _refused(self) -> None:
        self._unlogged += 1
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._logged_at is None or now - self._logged_at >= REFUSAL_LOG_INTERVAL:
            self._log(now)
        elif self._summary is None:
            # The rest of this interval's refusals, in one line at its end.
            self._summary = loop.call_at(self._logged_at + REFUSAL_LOG_INTERVAL, self._flush)

    def _flush(self) -> None:
        self._summary = None
        if self._unlogged:
            self._log(asyncio.get_running_loop().time())

    def _log(self, now: float) -> None:
        log.warning(
            "http: refused %d connection(s): %d open, the max_http_connections limit",
            self._unlogged,
            self.open,
        )
        self._unlogged = 0
        self._logged_at = now


@dataclass(slots=True)
class HttpStats:
    """An HTTP server's counters, exported as ``keygate_listener_*_total{listener}``."""

    refused_connections: int = 0


class _Counted(asyncio.Protocol):
    """An aiohttp request handler that holds a place in its site's connections, or a
    refused socket that never reaches aiohttp."""

    __slots__ = ("_admitted", "_handler", "_site")

    def __init__(self, site: CappedSite, handler: RequestHandler) -> None:
        self._site = site
        self._handler = handler
        self._admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        connections = self._site.connections
        if not connections.admit():
            self._site.stats.refused_connections += 1
            # A stream transport (uvloop's is not a subclass of asyncio's).
            stream = cast(asyncio.Transport, transport)
            stream.write(connections.refusal())
            stream.close()
            return
        self._admitted = True
        self._handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._admitted:
            self._admitted = False
            self._site.connections.release()
            self._handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._admitted:
            self._handler.data_received(data)

    def eof_received(self) -> None:  # None: the transport closes, as aiohttp's does
        if self._admitted:
            self._handler.eof_received()

    def pause_writing(self) -> None:
        if self._admitted:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self._handler.resume_writing()


class CappedSite(web.BaseSite):
    """aiohttp's ``TCPSite``, with every connection counted in ``connections``."""

    __slots__ = ("_host", "_port", "connections", "stats")

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None,
        connections: HttpConnections,
        stats: HttpStats,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._host = host
        self._port = port
        self.connections = connections
        self.stats = stats

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None  # the runner was set up
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Counted(self, server()),
            **listen_on(self._host, self._port),
            ssl=self._ssl_context,
            backlog=self._backlog,
            ssl_handshake_timeout=self.connections.header_timeout if self._ssl_context else None,
        )


def read_body(timeout: float) -> Middleware:
    """A middleware that reads a request's body within ``timeout`` seconds before its
    handler runs, or answers ``408`` and closes the connection (see the module doc)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.can_read_body:
            try:
                async with asyncio.timeout(timeout):
                    # Kept: the handler's read returns it. can_read_body is False from
                    # here on: a handler asks body_exists whether there is one.
                    await request.read()
            except TimeoutError:
                return await _too_late(request, timeout)
        return await handler(request)

    return middleware


async def _too_late(request: web.Request, timeout: float) -> web.StreamResponse:
    message = f"the request body did not arrive within {timeout:g}s (http_body_timeout)"
    response = web.Response(
        status=408, body=error_json("request-timeout", message), content_type="application/json"
    )
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    # Closed now (its answer written first): the rest of the body is not waited for.
    request.protocol.force_close()
    return response


def app_runner(app: web.Application, connections: HttpConnections) -> web.AppRunner:
    """A runner whose handlers close a connection that sends no complete request head
    within the header timeout (see the module doc)."""
    return web.AppRunner(app, access_log=None, keepalive_timeout=connections.header_timeout)


async def serve(
    runner: web.AppRunner,
    host: str,
    port: int,
    ssl_context: ssl.SSLContext | None,
    connections: HttpConnections,
    stats: HttpStats,
) -> int:
    """Set up ``runner`` and listen on ``host:port`` (0: any free port); the port bound."""
    quiet_bad_requests()
    await runner.setup()
    site = CappedSite(
        runner, host, port, ssl_context=ssl_context, connections=connections, stats=stats
    )
    await site.start()
    return int(runner.addresses[0][1])


__all__ = [
    "CappedSite",
    "HttpConnections",
    "HttpStats",
    "app_runner",
    "error_json",
    "read_body",
    "serve",
]
