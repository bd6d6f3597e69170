"""What a standby gateway serves while it waits for the gateway lease: ``GET /healthz`` on
the admin HTTP port, answering 503 with its role, so that load balancers and probes tell
the standby from the active gateway (whose ``/healthz`` answers 200 ``"role": "active"``),
and ``GET /api/status`` (200: its name, role, version and database), so that ``keygate
status`` says what it is. Requests pass the active gateway's checks
(``gateway.http_guard``): ``/api/status`` needs the same credentials, a gateway without
users answers only under the names it is served under, and every error, an unknown path
included, is the API's JSON.

The protocol ports of a standby stay closed: a client that lists every gateway's address
is refused at once by the standby and moves on to the next (docs/operations.md).

Its port is bounded like the active gateway's (``gateway.http_server``): the same
``max_http_connections`` and request head deadline.
"""

from __future__ import annotations

import platform
import ssl

from aiohttp import web

from gateway.access import Access
from gateway.config import GatewayConfig
from gateway.http_guard import Guard, json_errors
from gateway.http_server import HttpConnections, HttpStats, app_runner, serve
from gateway.openapi import package_version


class StandbyHealth:
    """The standby's admin port: ``/healthz`` and ``/api/status``."""

    def __init__(self, config: GatewayConfig, database: str, connections: HttpConnections) -> None:
        self.name = config.name
        self._database = database
        self.connections = connections
        guard = Guard(Access(config), config)
        app = web.Application(middlewares=[json_errors, guard.authenticate])
        app.add_routes([web.get("/healthz", self._health), web.get("/api/status", self._status)])
        self._runner = app_runner(app, connections)

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        return await serve(self._runner, host, port, ssl_context, self.connections, HttpStats())

    async def close(self) -> None:
        await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        body = {"status": "standby", "role": "standby", "gateway": self.name}
        return web.json_response(body, status=503)

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "name": self.name,
                "role": "standby",
                "version": package_version(),
                "python": platform.python_version(),
                "database": self._database,
            }
        )


__all__ = ["StandbyHealth"]
