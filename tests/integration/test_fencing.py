"""The gateway lease and fencing, at the store: a takeover increments the epoch, and a
store fenced with an older epoch can write nothing more (SQLite and PostgreSQL)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from core.actions import OffsetUpdate
from core.errors import Fenced
from core.model import QueueConfig
from storage import SqlStore, open_store
from storage.base import GatewayLease
from tests.conftest import MessageFactory
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
    store.fence(GatewayLease("main", "gw-a", epoch), fenced.append)
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
    store.fence(GatewayLease("main", "gw-a", epoch), pytest.fail)
    await store.create_queue(QueueConfig("orders"))
    for n in range(3):
        assert await store.acquire_gateway_lease("main", "gw-a", ttl=10, epoch=epoch) == epoch
        await store.append([make_message("orders", payload=b"%d" % n)], now=NOW)
    assert [m.payload for m in await store.read("orders", 0, 0, 10)] == [b"0", b"1", b"2"]
