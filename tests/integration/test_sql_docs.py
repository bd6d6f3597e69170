"""Every example query in docs/sql.md runs against a live gateway's database, on SQLite and
PostgreSQL, and the headline one answers its question."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import sqlalchemy as sa

from gateway.client import Client
from gateway.server import Gateway
from tests.integration.conftest import native_url
from tests.support.wait import eventually

DOC = Path(__file__).parents[2] / "docs" / "sql.md"
# (the paragraph introducing a query, the query)
BLOCKS = re.findall(r"\n\n((?:[^\n]+\n)+)\n```sql\n(.*?)```", DOC.read_text(), re.S)


def _dialect_of(intro: str) -> str | None:
    return "postgresql" if "(PostgreSQL)" in intro else None


@pytest.fixture
async def busy_gateway(gateway: Gateway) -> Gateway:
    """orders (4 partitions) with group billing: one consumer holding messages unacked."""
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=4)
        for i in range(40):
            await client.publish("orders", b"%d" % i, key=f"customer-{i}")
    return gateway


async def test_the_documented_owner_and_lag_query_names_the_consumer(
    busy_gateway: Gateway,
) -> None:
    assert busy_gateway.store is not None
    intro, query = BLOCKS[0]
    assert "partition 3" in intro
    client = await Client(native_url(busy_gateway), client_name="billing-1").connect()
    consumer = await client.subscribe("orders", group="billing", window=1000)
    received = [await consumer.receive(timeout=5) for _ in range(40)]
    on_three = [m for m in received if m.partition == 3]
    for msg in on_three[:1]:
        await consumer.acknowledge(msg)

    async def answer() -> sa.Row[tuple[object, ...]] | None:
        async with busy_gateway.store.engine.connect() as conn:  # type: ignore[union-attr]
            row = (await conn.execute(sa.text(query))).first()
        return row if row is not None and row.lag == len(on_three) - 1 else None

    row = await eventually(answer)
    assert row.owner_client == "billing-1"
    assert row.state == "ready"
    await client.close()


@pytest.mark.parametrize("intro, query", BLOCKS, ids=[f"q{i}" for i in range(len(BLOCKS))])
async def test_every_documented_query_runs(busy_gateway: Gateway, intro: str, query: str) -> None:
    assert busy_gateway.store is not None
    engine = busy_gateway.store.engine
    wanted = _dialect_of(intro)
    if wanted is not None and engine.dialect.name != wanted:
        pytest.skip(f"documented for {wanted} only")
    async with engine.connect() as conn:
        await conn.execute(sa.text(query))
