"""PostgreSQL drops the gateway's connections (restart, failover, an idle-connection
killer): the gateway replaces them and keeps serving without failing a publish."""

from __future__ import annotations

import asyncio

import psycopg
from sqlalchemy.engine import make_url

from gateway.client import Client
from storage.engine import GATEWAY_APPLICATION
from tests.integration.conftest import native_url, start_gateway


def _terminate_gateway_sessions(url: str) -> int:
    """End every gateway session (not the test's own, nor other tools' sessions)."""
    libpq = make_url(url).set(drivername="postgresql").difference_update_query(["search_path"])
    with psycopg.connect(libpq.render_as_string(hide_password=False), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            (GATEWAY_APPLICATION,),
        ).fetchone()
    return int(row[0]) if row else 0


async def test_dropped_database_connections_are_replaced_without_failing_publishes(
    postgres_url: str,
) -> None:
    gateway = await start_gateway(postgres_url)
    try:
        async with Client(native_url(gateway)) as client:
            await client.declare_queue("orders", partitions=2)
            consumer = await client.subscribe("orders", group="g")
            for i in range(5):
                await client.publish("orders", b"%d" % i, key="k")
            assert await asyncio.to_thread(_terminate_gateway_sessions, postgres_url) > 0
            for i in range(5, 15):
                await client.publish("orders", b"%d" % i, key="k")
            got = [int((await consumer.receive(timeout=10)).payload) for _ in range(15)]
            assert got == list(range(15))
    finally:
        await gateway.stop()
