"""Key-granular handoff with real SDK consumers, on SQLite and PostgreSQL: when a partition
moves to a consumer that joins, only the key the old owner still holds waits; the other
keys of the partition reach the new owner at once, and the busy key follows in order
once the old owner acks. A partition that moves on again while it waits keeps the first
owner's keys waiting, and kg_key_status says they have waited since the first move."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from core.keys import partition_for
from gateway.client import Client
from gateway.server import Gateway
from tests.integration.conftest import native_url
from tests.support.wait import eventually


async def key_status(engine: AsyncEngine) -> list[tuple[object, ...]] | None:
    """kg_key_status of orders/g as (partition, reason) rows; None when empty."""
    query = sa.text(
        "SELECT partition, reason FROM kg_key_status WHERE queue = 'orders' AND group_name = 'g'"
    )
    async with engine.connect() as conn:
        rows = [tuple(r) for r in await conn.execute(query)]
    return rows or None


async def handoff_since(engine: AsyncEngine, owner: str | None) -> float | None:
    """blocked_since of the handoff row of orders/g once ``owner`` is its new owner."""
    query = sa.text(
        "SELECT blocked_since FROM kg_key_status WHERE queue = 'orders' AND group_name = 'g'"
        " AND reason = 'handoff' AND detail = :owner"
    )
    async with engine.connect() as conn:
        since = (await conn.execute(query, {"owner": owner})).scalar_one_or_none()
    return None if since is None else float(since)


async def test_a_busy_key_does_not_hold_back_the_other_keys_of_a_moving_partition(
    gateway: Gateway,
) -> None:
    assert gateway.store is not None
    engine = gateway.store.engine
    async with (
        Client(native_url(gateway), client_name="a") as a_client,
        Client(native_url(gateway), client_name="b") as b_client,
        Client(native_url(gateway)) as producer,
    ):
        # A handoff that waited for the busy key would take the whole minute.
        await producer.declare_queue("orders", partitions=2, max_handoff_time=60.0)
        a = await a_client.subscribe("orders", group="g", window=100)
        await eventually(lambda: a.partitions == frozenset({0, 1}))
        for n in range(20):
            await producer.publish("orders", f"k{n}:1".encode(), key=f"k{n}")
        held = [await a.receive(timeout=5) for _ in range(20)]
        b = await b_client.subscribe("orders", group="g", window=100)
        await eventually(lambda: len(b.partitions) == 1)
        (moving,) = b.partitions
        keys = sorted({m.key for m in held if m.partition == moving and m.key})
        busy = next(m for m in held if m.key == keys[0])
        for message in held:
            if message is not busy:
                await a.acknowledge(message)
        for key in keys:
            await producer.publish("orders", f"{key}:2".encode(), key=key)
        others = [await b.receive(timeout=5) for _ in keys[1:]]
        assert sorted(m.payload for m in others) == sorted(f"{k}:2".encode() for k in keys[1:])
        assert await eventually(lambda: key_status(engine)) == [(moving, "handoff")]
        await a.acknowledge(busy)
        follows = await b.receive(timeout=5)
        assert (follows.payload, follows.redelivered) == (f"{keys[0]}:2".encode(), False)


@pytest.mark.parametrize("leaving", ["shutdown", "connection drop"])
async def test_a_second_handoff_keeps_the_keys_the_first_owner_still_holds_waiting(
    gateway: Gateway, leaving: str
) -> None:
    assert gateway.store is not None
    engine = gateway.store.engine
    async with (
        Client(native_url(gateway), client_name="a") as a_client,
        Client(native_url(gateway), client_name="b") as b_client,
        Client(native_url(gateway), client_name="c") as c_client,
        Client(native_url(gateway)) as producer,
    ):
        # A handoff that timed out would take the whole minute.
        await producer.declare_queue(
            "orders", partitions=2, max_handoff_time=60.0, rebalance_delay=0.2
        )
        a = await a_client.subscribe("orders", group="g", window=100)
        await eventually(lambda: a.partitions == frozenset({0, 1}))
        for n in range(20):
            await producer.publish("orders", f"k{n}:1".encode(), key=f"k{n}")
        held = [await a.receive(timeout=5) for _ in range(20)]
        before_first_move = time.time()
        b = await b_client.subscribe("orders", group="g", window=100)
        await eventually(lambda: len(b.partitions) == 1)
        after_first_move = time.time()
        (moving,) = b.partitions
        c = await c_client.subscribe("orders", group="g", window=100)  # standby
        if leaving == "shutdown":
            await b.close(shutdown=True)
        else:
            b_client.abort()  # the partition waits through the rebalance delay
        await eventually(lambda: c.partitions == frozenset({moving}))
        keys = sorted({m.key for m in held if m.partition == moving and m.key})
        for key in keys:
            await producer.publish("orders", f"{key}:2".encode(), key=key)
        # A message of a key A holds nothing of, published after all of them, flows at
        # once; nothing of A's keys may reach C before it.
        free = next(f"x{n}" for n in range(100) if partition_for(f"x{n}", 2) == moving)
        await producer.publish("orders", b"free", key=free)
        early = []
        while (got := await c.receive(timeout=5)).payload != b"free":
            early.append((got.payload, got.redelivered))
        assert early == []
        assert await eventually(lambda: key_status(engine)) == [(moving, "handoff")]
        # A's keys have waited since the move to B, not since the move on to C.
        since = await eventually(lambda: handoff_since(engine, c.flow_id))
        assert since is not None and before_first_move <= since <= after_first_move
        for message in held:
            await a.acknowledge(message)
        follows = [await c.receive(timeout=5) for _ in keys]
        assert sorted((m.payload, m.redelivered) for m in follows) == sorted(
            (f"{key}:2".encode(), False) for key in keys
        )

        async def flowing() -> bool:
            return await key_status(engine) is None

        await eventually(flowing)
