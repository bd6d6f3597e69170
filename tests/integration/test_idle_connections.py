"""A native consumer that vanishes without a FIN or RST (power loss, a dropped NAT entry)
does not hold its partitions forever: the gateway closes a connection that sent nothing
for ``native_idle_timeout`` (the SDK pings every 2 s), and the partitions go to the other
consumer after the rebalance delay.
"""

from __future__ import annotations

import asyncio
import socket

from gateway.client import Client
from protocols.native.connection import ClientConnection
from protocols.native.events import Bind, BindOk, Error, Hello, HelloOk
from tests.integration.conftest import native_url, start_gateway
from tests.integration.sqlcheck import declare
from tests.support.native_raw import expect

IDLE = 0.5


def _silent_consumer(port: int) -> tuple[socket.socket, ClientConnection]:
    """HELLO and BIND, then nothing: no pings, as from a machine that lost power."""
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        conn = ClientConnection()
        sock.sendall(conn.send(Hello(client_name="silent")))
        expect(sock, conn, HelloOk)
        bind = Bind(request_id=conn.next_request_id(), queue="idle", group="g", window=10)
        sock.sendall(conn.send(bind))
        expect(sock, conn, BindOk)
    except BaseException:
        sock.close()
        raise
    return sock, conn


def _closed_by_gateway(sock: socket.socket) -> bytes:
    """Everything the gateway sends until it closes (the silent client reads, never writes)."""
    sock.settimeout(30)
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


async def test_a_silent_native_consumer_is_closed_and_its_partitions_move(db_url: str) -> None:
    gateway = await start_gateway(db_url, native_idle_timeout=IDLE)
    try:
        await declare(gateway, "idle", partitions=4, rebalance_delay=0.2)
        sock, conn = await asyncio.to_thread(_silent_consumer, gateway.ports["native"])
        try:
            # This client pings well within the idle timeout, as the SDK does by default.
            async with Client(native_url(gateway), heartbeat=IDLE / 5) as client:
                other = await client.subscribe("idle", "g")
                tail = await asyncio.to_thread(_closed_by_gateway, sock)
                conn.receive_data(tail)
                events = []
                while (event := conn.next_event()) is not None:
                    events.append(event)
                assert any(isinstance(e, Error) and e.code == "idle-timeout" for e in events)
                # Forty keys reach all four partitions: the silent one's two included.
                for i in range(40):
                    await client.publish("idle", b"%d" % i, key=f"key-{i}")
                got = set()
                for _ in range(40):
                    message = await other.receive(timeout=10)
                    got.add(message.partition)
                    await other.acknowledge(message)
                assert got == {0, 1, 2, 3}
        finally:
            sock.close()
    finally:
        await gateway.stop()


async def test_an_sdk_consumer_that_pings_is_not_closed(db_url: str) -> None:
    gateway = await start_gateway(db_url, native_idle_timeout=IDLE)
    try:
        await declare(gateway, "pinged", partitions=1)
        async with Client(native_url(gateway), heartbeat=IDLE / 5) as client:
            consumer = await client.subscribe("pinged", "g")
            flow = consumer.flow_id
            # Three idle timeouts of silence but for the pings (a duration, not a hope).
            await asyncio.sleep(3 * IDLE)
            await client.publish("pinged", b"still here", key="k")
            message = await consumer.receive(timeout=10)
            assert message.payload == b"still here"
            assert consumer.flow_id == flow  # the same flow: never reconnected
    finally:
        await gateway.stop()
