"""The SDK's graceful close against a real gateway, on SQLite and PostgreSQL: the
publishes in flight when ``close()`` is called are confirmed, not failed, and each
confirmed message is stored (docs/native-protocol.md, CLOSE)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.client import Client, ClientClosed
from gateway.server import Gateway
from tests.integration.conftest import native_url
from tests.integration.sqlcheck import declare, open_sql

IN_FLIGHT = 500


async def test_close_resolves_every_publish_in_flight_with_its_confirm(
    gateway: Gateway, db_url: str
) -> None:
    await declare(gateway, "orders", partitions=4)
    client = await Client(native_url(gateway)).connect()
    publishes = [
        asyncio.create_task(client.publish("orders", b"m%d" % n, key=f"k{n % 10}"))
        for n in range(IN_FLIGHT)
    ]
    await asyncio.sleep(0)  # one loop pass: each publish task has sent its PUBLISH
    assert not any(p.done() for p in publishes)
    closing = asyncio.create_task(client.close())
    await asyncio.sleep(0)  # close() has begun
    with pytest.raises(ClientClosed, match="close\\(\\) was called"):
        await client.publish("orders", b"late")
    await asyncio.wait_for(closing, 30)
    ids = await asyncio.gather(*publishes)
    assert all(ids) and len(set(ids)) == IN_FLIGHT
    async with open_sql(db_url) as sql:
        stored = await sql.messages("orders")
    assert sorted(r.message_id for r in stored) == sorted(ids)
    assert b"late" not in {r.payload for r in stored}
