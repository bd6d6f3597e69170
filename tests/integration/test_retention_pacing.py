"""Retention in a running gateway: settled messages are deleted in the background, paced
over half the retention interval, while the gateway's other periodic work (writing acks)
goes on at its own cadence."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from gateway.client import Client
from gateway.server import Gateway
from tests.integration.conftest import native_url, start_gateway
from tests.support.consume import take
from tests.support.wait import eventually

INTERVAL = 6.0  # retention_interval: a run is paced over 3 s


@pytest.fixture
async def gateway(db_url: str) -> AsyncIterator[Gateway]:
    gw = await start_gateway(db_url, retention_interval=INTERVAL)
    try:
        yield gw
    finally:
        await gw.stop()


async def test_acks_are_written_while_a_paced_retention_run_deletes(gateway: Gateway) -> None:
    store = gateway.store
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=16)
        for n in range(400):
            await client.publish("orders", b"%d" % n, key=f"k{n}")
        consumer = await client.subscribe("orders", group="billing")
        await take(consumer, 400)

        async def deleting() -> bool:
            return 0 < (await store.depth("orders"))[0] < 400

        await eventually(deleting, timeout=2 * INTERVAL)
        # A run is under way (some settled messages deleted, some not yet): a new
        # message's ack still reaches the database at the ack-flush cadence.
        await client.publish("orders", b"late", key="late")
        (message,) = await take(consumer, 1)
        assert message.payload == b"late"
        partition, seq = message.partition, message.seq

        async def acked() -> bool:
            snapshot = await store.load_group("orders", "billing")
            return snapshot.partitions[partition].committed_seq >= seq

        await eventually(acked, timeout=INTERVAL)
        assert (await store.depth("orders"))[0] > 1, "the run ended before the ack was seen"

        async def emptied() -> bool:
            return (await store.depth("orders"))[0] == 0

        await eventually(emptied, timeout=2 * INTERVAL)
