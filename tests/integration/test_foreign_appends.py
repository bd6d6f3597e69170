"""Rows another writer appends (a Spark job, a second gateway, here a second store) reach a
running group's consumer within a second, on SQLite and PostgreSQL."""

from __future__ import annotations

import time

from core.model import Message
from gateway.client import Client
from storage import open_store
from tests.conftest import MessageFactory
from tests.integration.conftest import native_url, start_gateway

NOW = 1_700_000_000.0


async def test_rows_another_writer_appends_reach_a_running_group_within_a_second(
    db_url: str, make_message: MessageFactory
) -> None:
    gateway = await start_gateway(db_url)
    other = await open_store(db_url)
    try:
        async with Client(native_url(gateway)) as client:
            await client.declare_queue("orders", partitions=2)
            consumer = await client.subscribe("orders", group="g")
            assert await client.publish("orders", b"via-gateway", key="k")
            assert (await consumer.receive(timeout=5)).payload == b"via-gateway"
            await other.load_caches()
            rows: list[Message] = [
                make_message("orders", partition, b"foreign-%d" % partition) for partition in (0, 1)
            ]
            started = time.monotonic()
            await other.append(rows, now=NOW)
            got = {(await consumer.receive(timeout=5)).payload for _ in rows}
            elapsed = time.monotonic() - started
            assert got == {b"foreign-0", b"foreign-1"}
            assert elapsed < 1.0, f"foreign rows took {elapsed:.2f}s to arrive"
    finally:
        await other.close()
        await gateway.stop()
