"""The gauges an SRE alerts on, scraped from /metrics while a consumer works, on SQLite and
PostgreSQL: depth, bytes, in-flight, dead letters and oldest message age per queue; lag,
owners and the age of the oldest unsettled message per group; publish-to-delivery latency;
the lease role."""

from __future__ import annotations

import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.client import Client
from gateway.server import Gateway
from protocols.mqtt import Connect, PubAck, Publish
from tests.integration.conftest import native_url, start_gateway
from tests.support.mqtt_raw import RawMqtt
from tests.support.wait import eventually

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def _scrape(gateway: Gateway) -> Samples:
    url = f"http://127.0.0.1:{gateway.ports['http']}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        text = await response.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


async def test_queue_and_group_gauges_follow_a_consumer(gateway: Gateway) -> None:
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=2, max_deliveries=1)
        for n in range(5):
            await client.publish("orders", b"x" * 100, key=f"k{n}")
        consumer = await client.subscribe("orders", group="billing", window=2)
        held = [await consumer.receive(timeout=10) for _ in range(2)]
        samples = await _scrape(gateway)
        group = {"queue": "orders", "group": "billing"}
        assert _value(samples, "keygate_queue_messages", queue="orders") == 5
        assert (_value(samples, "keygate_queue_bytes", queue="orders") or 0) >= 500
        assert _value(samples, "keygate_queue_in_flight_messages", queue="orders") == 2
        assert _value(samples, "keygate_group_lag_messages", **group) == 5
        assert _value(samples, "keygate_group_owners", **group) == 1
        assert (_value(samples, "keygate_group_oldest_unacked_age_seconds", **group) or -1) >= 0
        assert (_value(samples, "keygate_publish_to_deliver_seconds_count") or 0) >= 2
        assert _value(samples, "keygate_gateway_active") == 1
        assert (_value(samples, "keygate_open_connections", protocol="native") or 0) >= 1

        await consumer.reject(held[0])
        await consumer.acknowledge(held[1])

        async def settled() -> bool:
            now = await _scrape(gateway)
            return (
                _value(now, "keygate_queue_dead_letter_messages", queue="orders") == 1
                and _value(now, "keygate_group_lag_messages", **group) == 3
            )

        await eventually(settled)


async def test_every_consumer_of_a_shared_group_is_an_owner(gateway: Gateway) -> None:
    async with (
        Client(native_url(gateway)) as first,
        Client(native_url(gateway)) as second,
    ):
        await first.declare_queue("jobs", partitions=3)
        for client in (first, second):
            await client.subscribe("jobs", group="workers", mode="shared")
        samples = await _scrape(gateway)
        # Both are served from every partition: an alert on owners == 0 must not fire.
        assert _value(samples, "keygate_group_owners", queue="jobs", group="workers") == 2


async def test_oldest_message_age_per_queue_follows_its_slowest_group(gateway: Gateway) -> None:
    def age(samples: Samples) -> float | None:
        return _value(samples, "keygate_queue_oldest_message_age_seconds", queue="orders")

    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=2)
        await client.publish("orders", b"1", key="a")
        await client.publish("orders", b"2", key="b")
        assert age(await _scrape(gateway)) is not None  # no group yet: stored messages wait
        billing = await client.subscribe("orders", group="billing", window=2)
        received = [await billing.receive(timeout=10) for _ in range(2)]
        oldest = min(m.publish_time for m in received)
        before = time.time()
        assert (age(await _scrape(gateway)) or -1) >= before - oldest

        await billing.acknowledge(received[0])
        await billing.acknowledge(received[1])

        async def nothing_waits() -> bool:
            return age(await _scrape(gateway)) == 0

        await eventually(nothing_waits)
        # A second group that has settled nothing makes the same messages wait again.
        audit = await client.subscribe("orders", group="audit", start="earliest")
        await audit.close()
        before = time.time()
        assert (age(await _scrape(gateway)) or -1) >= before - oldest


async def test_a_publish_refused_inside_a_batch_is_counted_once(gateway: Gateway) -> None:
    """Six MQTT publishes in one read, one lot: the one too large (refused by the broker)
    and the one its queue has no room for (refused by the store) each count once as
    refused, the other four as published."""
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=1, subscriptions=["orders/#"])
        await client.declare_queue("small", max_message_size=4, subscriptions=["small/#"])
        await client.declare_queue("one", max_depth_messages=1, subscriptions=["one/#"])
    mqtt = await RawMqtt.connected(gateway.ports["mqtt"], Connect("batcher"))
    try:
        await mqtt.send_together(
            Publish("orders/a", b"1", 1, packet_id=1),
            Publish("small/b", b"too large", 1, packet_id=2),
            Publish("orders/c", b"3", 1, packet_id=3),
            Publish("one/x", b"x", 1, packet_id=4),
            Publish("one/y", b"y", 1, packet_id=5),
            Publish("orders/d", b"4", 1, packet_id=6),
        )
        acks = [await mqtt.receive() for _ in range(6)]
        assert [a.packet_id for a in acks if isinstance(a, PubAck)] == [1, 2, 3, 4, 5, 6]
    finally:
        await RawMqtt.close_all()
    samples = await _scrape(gateway)
    assert _value(samples, "keygate_publish_rejected_total", reason="message-too-large") == 1
    assert _value(samples, "keygate_publish_rejected_total", reason="queue-full") == 1
    assert _value(samples, "keygate_published_total", queue="orders", protocol="mqtt") == 3
    assert _value(samples, "keygate_published_total", queue="one", protocol="mqtt") == 1


async def test_expired_messages_of_a_queue_without_groups_are_counted(db_url: str) -> None:
    """DESIGN §4: expired messages are dead-lettered if the queue asks, else dropped and
    counted — a queue no group consumes yet dropped them without a count."""
    gateway = await start_gateway(db_url, retention_interval=0.2)
    try:
        async with Client(native_url(gateway)) as client:
            await client.declare_queue("events")
            await client.declare_queue("kept", dead_letter_expired=True)
            for queue in ("events", "events", "kept"):
                await client.publish(queue, b"short-lived", ttl=0.05)

        async def counted() -> bool:
            samples = await _scrape(gateway)
            dropped = _value(
                samples, "keygate_dropped_total", queue="events", group="", reason="expired"
            )
            lettered = _value(samples, "keygate_dead_lettered_total", queue="kept", group="")
            return dropped == 2 and lettered == 1

        await eventually(counted, timeout=10)
    finally:
        await gateway.stop()
