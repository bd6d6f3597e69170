"""Every listener turns TCP keepalive on for the connections it accepts, so a client that
vanished without a FIN or RST (power loss, a dropped NAT entry) is found by the kernel
even when its protocol's heartbeats are off, and its partitions move on.

Checked from outside the gateway, as an operator would with ``ss -o``: the kernel's
socket table (/proc/net/tcp) shows the keepalive timer (``tr`` 2) armed on the
gateway's side of each connection.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from gateway.server import Gateway
from tests.support.wait import eventually

KEEPALIVE_TIMER = 2
HAS_PROC_NET = Path("/proc/net/tcp").exists()


def _timer(local_port: int, remote_port: int) -> int | None:
    """The timer kind of the loopback socket local_port -> remote_port, if listed."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, remote, timer = fields[1], fields[2], fields[5]
            if int(local.rsplit(":", 1)[1], 16) == local_port and (
                int(remote.rsplit(":", 1)[1], 16) == remote_port
            ):
                return int(timer.split(":")[0], 16)
    return None


@pytest.mark.skipif(not HAS_PROC_NET, reason="no /proc/net/tcp on this platform")
@pytest.mark.parametrize("listener", ["native", "mqtt", "amqp", "stomp"])
async def test_accepted_connections_have_tcp_keepalive(
    sqlite_gateway: Gateway, listener: str
) -> None:
    port = sqlite_gateway.ports[listener]
    sock = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port))
    try:
        client_port = sock.getsockname()[1]

        async def armed() -> bool | None:
            return True if _timer(port, client_port) == KEEPALIVE_TIMER else None

        assert await eventually(armed)
    finally:
        sock.close()
