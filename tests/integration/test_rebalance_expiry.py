"""The rebalance delay ends with no consumer left (DESIGN.md §2, §4 Rebalance): the
partitions become ``unassigned`` with no owner in ``kg_partition_status`` and in the admin
API's inspection — also when housekeeping ran meanwhile (it gives up the groups it finds
idle; one whose partitions are reserved for a client is not). And a client that comes
back within the delay gets its partitions back, however often housekeeping ran. SDK and
pika consumers, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from gateway.client import Client
from gateway.inspect import inspect_queue
from gateway.server import Gateway
from tests.integration.conftest import native_url, start_gateway
from tests.support.amqp import pika_channel
from tests.support.proxy import TcpProxy
from tests.support.wait import eventually

PARTITIONS = 4
DELAY = 2.0
MARGIN = 3.0
# Housekeeping gives up idle groups every retention_interval: many times per delay.
HOUSEKEEPING = 0.1

Shown = set[tuple[str, str | None]]


@pytest.fixture
async def busy_gateway(db_url: str) -> AsyncIterator[Gateway]:
    gw = await start_gateway(db_url, retention_interval=HOUSEKEEPING)
    try:
        yield gw
    finally:
        await gw.stop()


async def _stored(gateway: Gateway, queue: str) -> Shown:
    """(state, owner flow) of every partition of the queue's group, in kg_partition_status."""
    rows = await gateway.store.partition_status(queue)
    assert len(rows) == PARTITIONS
    return {(row["state"], row["owner_flow"]) for row in rows}


async def _inspected(gateway: Gateway, queue: str) -> Shown:
    """The same as the admin API (``keygate inspect``, the console) shows it."""
    assert gateway.broker is not None
    (entry,) = (await inspect_queue(gateway.broker, gateway.store, queue))["groups"]
    return {(p["state"], p["owner_flow"]) for p in entry["partitions"]}


async def _all(gateway: Gateway, queue: str, state: str, owner: str | None) -> bool:
    want = {(state, owner)}
    return await _stored(gateway, queue) == want and await _inspected(gateway, queue) == want


async def _declare(gateway: Gateway, queue: str, delay: float = DELAY) -> None:
    async with Client(native_url(gateway)) as admin:
        await admin.declare_queue(queue, partitions=PARTITIONS, rebalance_delay=delay)


async def _expires(gateway: Gateway, queue: str, flow_id: str, left: float) -> None:
    """Unbound, reserved for the flow, until the delay ends; then unassigned, no owner."""
    await eventually(lambda: _all(gateway, queue, "unbound", flow_id), timeout=DELAY / 2)
    await eventually(lambda: _all(gateway, queue, "unassigned", None), timeout=DELAY + MARGIN)
    assert time.monotonic() - left >= DELAY


async def test_the_last_sdk_consumer_leaving_leaves_its_partitions_unassigned(
    busy_gateway: Gateway,
) -> None:
    await _declare(busy_gateway, "orders")
    async with Client(native_url(busy_gateway)) as client:
        consumer = await client.subscribe("orders", group="g")
        await eventually(lambda: len(consumer.partitions) == PARTITIONS)
        flow_id = consumer.flow_id
        assert flow_id is not None
        left = time.monotonic()
        await consumer.close()
        await _expires(busy_gateway, "orders", flow_id, left)


async def test_a_standby_leaving_during_the_delay_changes_nothing(busy_gateway: Gateway) -> None:
    await _declare(busy_gateway, "orders")
    async with Client(native_url(busy_gateway)) as client:
        first = await client.subscribe("orders", group="g")
        await eventually(lambda: len(first.partitions) == PARTITIONS)
        flow_id = first.flow_id
        assert flow_id is not None
        left = time.monotonic()
        await first.close()
        standby = await client.subscribe("orders", group="g")
        assert standby.partitions == frozenset()  # every partition is reserved for first
        await standby.close()
        await _expires(busy_gateway, "orders", flow_id, left)


async def test_the_last_consumer_shutting_down_leaves_its_partitions_unassigned_at_once(
    busy_gateway: Gateway,
) -> None:
    await _declare(busy_gateway, "orders", delay=60.0)
    async with Client(native_url(busy_gateway)) as client:
        consumer = await client.subscribe("orders", group="g")
        await eventually(lambda: len(consumer.partitions) == PARTITIONS)
        await consumer.close(shutdown=True)
        await eventually(lambda: _all(busy_gateway, "orders", "unassigned", None), timeout=2)


def _pika_consume_once(gateway: Gateway, queue: str) -> None:
    with pika_channel(gateway, confirm=False) as (connection, channel):
        channel.basic_consume(queue, lambda *_: None, arguments={"x-group": "g"})
        connection.process_data_events(time_limit=0.2)


async def test_the_last_pika_consumer_leaving_leaves_its_partitions_unassigned(
    busy_gateway: Gateway,
) -> None:
    await _declare(busy_gateway, "orders")
    left = time.monotonic()  # before the unbind, whenever the gateway reads the close
    await asyncio.to_thread(_pika_consume_once, busy_gateway, "orders")
    flow_id = await eventually(lambda: _owner(busy_gateway, "orders"))
    await _expires(busy_gateway, "orders", flow_id, left)


async def _owner(gateway: Gateway, queue: str) -> str | None:
    """The flow shown for partition 0 (owner, or the flow it is reserved for)."""
    rows = await gateway.store.partition_status(queue)
    owner: str | None = rows[0]["owner_flow"]
    return owner


async def test_clients_cut_off_get_their_own_partitions_back_after_housekeeping_ran(
    busy_gateway: Gateway,
) -> None:
    """Both consumers gone, the group has no flow while housekeeping runs; each client
    re-binding within the delay takes back exactly its own set (a group given up meanwhile
    would hand the first one back everything, then split by partition number)."""
    delay = 10.0
    await _declare(busy_gateway, "orders", delay=delay)
    native = busy_gateway.ports["native"]
    async with TcpProxy(native) as proxy_a, TcpProxy(native) as proxy_b:
        b_client = await Client(proxy_b.url).connect()
        b = await b_client.subscribe("orders", group="g")
        await eventually(lambda: len(b.partitions) == PARTITIONS)
        a_client = await Client(proxy_a.url).connect()
        a = await a_client.subscribe("orders", group="g")
        await eventually(lambda: len(a.partitions) == len(b.partitions) == PARTITIONS // 2)
        held_a, held_b = a.partitions, b.partitions
        assert min(held_a) > max(held_b)  # not what a fresh split would give a alone first
        proxy_a.cut()
        proxy_b.cut()
        await eventually(lambda: _only_unbound(busy_gateway, "orders"), timeout=5)
        # What housekeeping does every retention_interval, once more for certain.
        assert busy_gateway.broker is not None
        await busy_gateway.broker.groups.renew_leases()
        proxy_a.restore()
        await eventually(lambda: _owned_by(busy_gateway, a_client.client_name), timeout=5)
        assert await _owned_by(busy_gateway, a_client.client_name) == held_a
        await eventually(lambda: a.partitions == held_a)
        proxy_b.restore()
        await eventually(lambda: _owned_by(busy_gateway, b_client.client_name), timeout=5)
        assert await _owned_by(busy_gateway, b_client.client_name) == held_b
        assert await _owned_by(busy_gateway, a_client.client_name) == held_a
        await a_client.close()
        await b_client.close()


async def _owned_by(gateway: Gateway, client: str) -> frozenset[int]:
    """The partitions stored as ready for a flow of ``client``."""
    rows = await gateway.store.partition_status("orders")
    return frozenset(
        row["partition"]
        for row in rows
        if row["state"] == "ready" and row["owner_client"] == client
    )


async def _only_unbound(gateway: Gateway, queue: str) -> bool:
    return {state for state, _ in await _stored(gateway, queue)} == {"unbound"}
