"""Issue 3's SDK example, as written, against a real gateway."""

from __future__ import annotations

import asyncio

from gateway.client import BlockingClient, Client
from gateway.server import Gateway
from tests.integration.conftest import native_url


async def test_the_documented_sdk_example_works_as_written(gateway: Gateway) -> None:
    async with Client(native_url(gateway)) as client:
        await client.declare_queue(
            "orders",
            partitions=8,
            subscriptions=["orders/#"],
            max_deliveries=16,
            rebalance_delay=5.0,
            max_handoff_time=3.0,
            ttl=None,
            window=10000,
        )
        await client.publish("orders", b"...", key="customer-1", properties={"a": "b"})
        await client.publish_topic("orders/eu", b"...", key="customer-1")
        consumer = await client.subscribe(
            "orders", group="billing", window=100, ack_mode="client", tags=None, mode=None
        )  # group mode when it is created
        msg = await consumer.receive(timeout=5.0)  # also: async for msg in consumer
        assert (msg.payload, msg.key, dict(msg.properties)) == (b"...", "customer-1", {"a": "b"})
        assert msg.partition in consumer.partitions and msg.seq == 1
        assert msg.delivery_count == 1 and not msg.redelivered and msg.publish_time > 0
        await consumer.acknowledge(msg)
        async for second in consumer:
            assert second.topic == "orders/eu"
            await consumer.negative_acknowledge(second, delay=None)  # retry with backoff
            break
        again = await consumer.receive(timeout=5.0)
        await consumer.reject(again)  # dead-letter now
        assert consumer.partitions == frozenset(range(8))
        await consumer.close(shutdown=True)  # leave at once


async def test_the_blocking_twin_has_the_same_shape(gateway: Gateway) -> None:
    def use_it() -> bytes:
        with BlockingClient(native_url(gateway)) as client:
            client.declare_queue("jobs", partitions=2)
            client.publish("jobs", b"work", key="k")
            consumer = client.subscribe("jobs", group="workers")
            msg = consumer.receive(timeout=5.0)
            consumer.acknowledge(msg)
            consumer.close()
            return msg.payload

    # The gateway runs on this test's event loop; the blocking client has its own thread.
    assert await asyncio.to_thread(use_it) == b"work"
