"""Reading what the gateway stored with plain SQL, for the protocol integration tests
(and declaring their queues with the SDK).

The tests assert on kg_messages and kg_queues rows, not on the store's API, so that they
prove what docs/sql.md promises a user who opens the database. The engine is the async
one (aiosqlite / asyncpg) so that a read never blocks the event loop the gateway runs on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from core.model import PropertyValue
from gateway.client import Client
from gateway.server import Gateway
from storage.codec import decode_properties
from storage.engine import async_engine
from storage.schema import kg_messages, kg_queues
from tests.integration.conftest import native_url
from tests.support.wait import eventually

KEY: str = "Order-3459134"  # DESIGN.md §3.3's test vector: masked murmur3 964695987


@dataclass(frozen=True, slots=True)
class Row:
    """One kg_messages row, properties decoded as storage/codec.py encodes them."""

    queue: str
    partition: int
    seq: int
    message_id: str
    key: str | None
    payload: bytes
    properties: dict[str, PropertyValue]
    topic: str | None
    publish_time: float
    deliver_at: float | None
    expire_at: float | None
    producer: str | None
    dedup_id: str | None
    content_type: str | None
    correlation_id: str | None
    reply_to: str | None


class Sql:
    """Queries against the gateway's database."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def messages(self, queue: str) -> list[Row]:
        """Every message of ``queue``, in (partition, seq) order."""
        query = (
            sa.select(kg_messages)
            .where(kg_messages.c.queue == queue)
            .order_by(kg_messages.c.partition, kg_messages.c.seq)
        )
        async with self.engine.connect() as conn:
            result = await conn.execute(query)
            return [_row(dict(r._mapping)) for r in result]

    async def wait_messages(self, queue: str, count: int, *, timeout: float = 10.0) -> list[Row]:
        """The messages of ``queue`` once at least ``count`` are stored (polls; fails after
        ``timeout``). Exactly ``count`` is then asserted, so extra rows fail the test."""

        async def probe() -> list[Row]:
            rows = await self.messages(queue)
            return rows if len(rows) >= count else []

        rows: list[Row] = await eventually(probe, timeout=timeout)
        assert len(rows) == count, [r.payload for r in rows]
        return rows

    async def queue_partitions(self, queue: str) -> int | None:
        """kg_queues.partitions of ``queue``, None when there is no such row."""
        query = sa.select(kg_queues.c.partitions).where(kg_queues.c.name == queue)
        async with self.engine.connect() as conn:
            value = (await conn.execute(query)).scalar_one_or_none()
        return None if value is None else int(value)

    async def queue(self, queue: str) -> dict[str, Any] | None:
        """The kg_queues row of ``queue`` as a dict, None when there is no such row."""
        query = sa.select(kg_queues).where(kg_queues.c.name == queue)
        async with self.engine.connect() as conn:
            row = (await conn.execute(query)).one_or_none()
        return None if row is None else dict(row._mapping)


def _row(mapping: dict[str, Any]) -> Row:
    mapping.pop("size", None)
    mapping["properties"] = decode_properties(mapping["properties"])
    mapping["payload"] = bytes(mapping["payload"])
    return Row(**mapping)


@asynccontextmanager
async def open_sql(db_url: str) -> AsyncIterator[Sql]:
    engine = async_engine(db_url)
    try:
        yield Sql(engine)
    finally:
        await engine.dispose()


async def declare(gateway: Gateway, name: str, **settings: Any) -> None:
    """Create queue ``name`` with the SDK, as an application would."""
    async with Client(native_url(gateway)) as admin:
        await admin.declare_queue(name, **settings)
