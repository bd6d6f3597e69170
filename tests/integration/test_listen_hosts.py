"""``--host ::`` listens on IPv6 and IPv4 alike (docs/operations.md, "Listeners"): asyncio
alone would bind ``::`` for IPv6 clients only."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import aiohttp
import pytest

from gateway.client import Client
from tests.support.serve import serve


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1) to connect from"
)


async def test_host_double_colon_takes_ipv4_and_ipv6_clients_on_every_listener(
    sqlite_url: str, tmp_path: Path
) -> None:
    with serve(sqlite_url, tmp_path, "--host", "::") as (_, ports, _log):
        for host, address in (("127.0.0.1", "127.0.0.1"), ("::1", "[::1]")):
            # Anonymous from loopback: an IPv4 client arrives as ::ffff:127.0.0.1.
            async with Client(f"keygate://{address}:{ports['native']}") as client:
                await client.declare_queue("q")
                await client.publish("q", host.encode())
            async with (
                aiohttp.ClientSession() as http,
                http.get(f"http://{address}:{ports['http']}/api/status") as answer,
            ):
                assert answer.status == 200, host
            for listener in ("mqtt", "amqp", "stomp"):
                _, writer = await asyncio.open_connection(host, ports[listener])
                writer.close()
                await writer.wait_closed()
