"""The gateway lease and fencing: a takeover increments the epoch, a store fenced with an
older epoch can write nothing more, and a gateway fenced off stops at once (SQLite and
PostgreSQL)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import sqlalchemy as sa

from core.actions import OffsetUpdate
from core.errors import Fenced
from core.model import QueueConfig
from gateway.client import Client
from storage import SqlStore, open_store
from storage.fence import GatewayLease
from storage.schema import kg_gateway_lease, kg_group_offsets
from tests.conftest import MessageFactory
from tests.integration.conftest import native_url, start_gateway
from tests.support.wait import eventually

NOW = 1_700_000_000.0


@pytest.fixture
async def other(db_url: str, store: SqlStore) -> AsyncIterator[SqlStore]:
    """A second store on the same database: the other gateway."""
    opened = await open_store(db_url)
    try:
        yield opened
    finally:
        await opened.close()


async def test_one_gateway_holds_the_lease_and_each_takeover_increments_the_epoch(
    store: SqlStore,
) -> None:
    assert await store.acquire_gateway_lease("main", "gw-a", ttl=0.3) == 1
    assert await store.acquire_gateway_lease("main", "gw-b", ttl=10) is None
    assert await store.acquire_gateway_lease("main", "gw-a", ttl=0.3, epoch=1) == 1
    # gw-a stops renewing: once the database's clock passes its expiry, gw-b takes over.
    assert await eventually(lambda: store.acquire_gateway_lease("main", "gw-b", ttl=10)) == 2
    assert await store.acquire_gateway_lease("main", "gw-a", ttl=10, epoch=1) is None
    assert await store.acquire_gateway_lease("main", "gw-a", ttl=10) is None
    await store.release_gateway_lease("main", "gw-b")
    assert await store.acquire_gateway_lease("main", "gw-a", ttl=10) == 3


async def test_a_store_whose_lease_was_taken_over_stores_nothing_more(
    store: SqlStore, other: SqlStore, make_message: MessageFactory
) -> None:
    fenced: list[Fenced] = []
    epoch = await store.acquire_gateway_lease("main", "gw-a", ttl=0.3)
    assert epoch is not None
    store.fence(GatewayLease("main", "gw-a", epoch, 0.3), fenced.append)
    await store.create_queue(QueueConfig("orders"))
    [kept] = await store.append([make_message("orders", payload=b"kept")], now=NOW)
    # gw-a freezes (stops renewing); gw-b takes the lease over.
    await eventually(lambda: other.acquire_gateway_lease("main", "gw-b", ttl=10))

    with pytest.raises(Fenced):
        await store.append([make_message("orders", payload=b"lost")], now=NOW)
    with pytest.raises(Fenced):
        await store.create_queue(QueueConfig("other"))
    with pytest.raises(Fenced):
        await store.write_offsets("orders", "g", [OffsetUpdate(0, 1)])
    assert len(fenced) == 1, "the gateway is told once"
    assert store.fenced

    await other.load_caches()
    stored = await other.read("orders", 0, 0, 10)
    assert [m.payload for m in stored] == [b"kept"]
    assert [q.name for q in await other.list_queues()] == ["orders", "orders.dlq"]
    assert kept.seq == 1


async def test_the_holder_writes_while_it_renews(
    store: SqlStore, make_message: MessageFactory
) -> None:
    epoch = await store.acquire_gateway_lease("main", "gw-a", ttl=10)
    assert epoch is not None
    store.fence(GatewayLease("main", "gw-a", epoch, 10), pytest.fail)
    await store.create_queue(QueueConfig("orders"))
    for n in range(3):
        assert await store.acquire_gateway_lease("main", "gw-a", ttl=10, epoch=epoch) == epoch
        await store.append([make_message("orders", payload=b"%d" % n)], now=NOW)
    assert [m.payload for m in await store.read("orders", 0, 0, 10)] == [b"0", b"1", b"2"]


async def test_a_busy_holder_keeps_its_lease_with_its_writes_alone(
    store: SqlStore, other: SqlStore, make_message: MessageFactory
) -> None:
    """The gateway's own renewals can wait behind its appends for the single SQLite
    writer; the appends themselves must keep the lease, or a flood makes it stop.
    The TTL leaves a slow machine's stalls (CI once paused over 0.4 s) a second."""
    ttl = 1.5
    fenced: list[Fenced] = []
    epoch = await store.acquire_gateway_lease("main", "gw-a", ttl=ttl)
    assert epoch is not None
    store.fence(GatewayLease("main", "gw-a", epoch, ttl), fenced.append)
    await store.create_queue(QueueConfig("orders"))
    until = time.monotonic() + 3 * ttl  # three TTLs with no renewal but the writes'
    while time.monotonic() < until:
        await store.append([make_message("orders")], now=NOW)
        assert await other.acquire_gateway_lease("main", "gw-b", ttl=10) is None
    assert not fenced
    assert time.monotonic() - store.lease_renewed_at < ttl
    # Once the writes stop, nothing renews: the lease lapses and gw-b takes over.
    assert await eventually(lambda: other.acquire_gateway_lease("main", "gw-b", ttl=10)) == 2
    with pytest.raises(Fenced):
        await store.append([make_message("orders")], now=NOW)


async def test_a_gateway_whose_renewals_hang_stays_active_while_it_writes(
    db_url: str,
) -> None:
    gateway = await start_gateway(db_url, lease_ttl=1.0)
    hung = asyncio.Event()

    async def renewal_behind_a_flood(epoch: int | None = None) -> int | None:
        hung.set()
        await asyncio.Event().wait()  # never answers, like a renewal queued behind appends
        return epoch

    gateway._acquire = renewal_behind_a_flood  # type: ignore[method-assign]
    try:
        async with Client(native_url(gateway)) as client:
            await client.declare_queue("orders")
            until = time.monotonic() + 3.0  # three TTLs
            while time.monotonic() < until:
                await client.publish("orders", b"x", key="k")
            assert not gateway.lost_lease
        # Idle, with renewals that never answer: the gateway gives the lease up.
        await asyncio.wait_for(gateway.wait_closed(), 10)
        assert hung.is_set() and gateway.lost_lease
    finally:
        await gateway.stop()


async def test_a_gateway_fenced_off_with_consumers_stops_at_once_without_writing(
    db_url: str,
) -> None:
    gateway = await start_gateway(db_url, lease_ttl=30.0)
    try:
        async with Client(native_url(gateway)) as client:
            await client.declare_queue("orders", partitions=2)
            consumer = await client.subscribe("orders", group="g")
            for n in range(5):
                await client.publish("orders", b"%d" % n, key=f"k{n}")
            received = [await consumer.receive(timeout=5) for _ in range(5)]
            other = await open_store(db_url)
            try:
                # Another gateway takes over (its epoch is newer than ours).
                async with other.transaction() as conn:
                    await conn.execute(
                        sa.update(kg_gateway_lease).values(
                            holder="gw-b", epoch=kg_gateway_lease.c.epoch + 1
                        )
                    )
                for message in received:
                    await consumer.acknowledge(message)  # its offsets cannot be written
                started = time.monotonic()
                await asyncio.wait_for(gateway.wait_closed(), 30)
                assert time.monotonic() - started < 3.0, "a fenced gateway must not drain"
                assert gateway.lost_lease
                [lag] = await _group_lag(other)
                assert lag["committed"] == 0, "a fenced-off gateway wrote offsets"
            finally:
                await other.close()
    finally:
        await gateway.stop()


async def _group_lag(store: SqlStore) -> list[dict[str, int]]:
    async with store.transaction() as conn:
        rows = await conn.execute(
            sa.select(sa.func.coalesce(sa.func.sum(kg_group_offsets.c.committed_seq), 0))
        )
        return [{"committed": int(rows.scalar_one())}]
