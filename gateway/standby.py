"""What a standby gateway serves while it waits for the gateway lease: ``GET /healthz`` on
the admin HTTP port, answering 503 with its role, so that load balancers and probes tell
the standby from the active gateway (whose ``/healthz`` answers 200 ``"role": "active"``).

The protocol ports of a standby stay closed: a client that lists every gateway's address
is refused at once by the standby and moves on to the next (docs/operations.md).
"""

from __future__ import annotations

import ssl

from aiohttp import web


class StandbyHealth:
    """The standby's admin port: only ``/healthz``."""

    def __init__(self, name: str) -> None:
        self.name = name
        app = web.Application()
        app.add_routes([web.get("/healthz", self._health)])
        self._runner = web.AppRunner(app, access_log=None)

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
        await site.start()
        return int(self._runner.addresses[0][1])

    async def close(self) -> None:
        await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        body = {"status": "standby", "role": "standby", "gateway": self.name}
        return web.json_response(body, status=503)


__all__ = ["StandbyHealth"]
