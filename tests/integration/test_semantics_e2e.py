"""DESIGN.md §3-§4 features end to end through the SDK and a real gateway, on SQLite and
PostgreSQL: the state machine has unit tests for each; these prove the wiring."""

from __future__ import annotations

import asyncio
import time

import pytest

from core.errors import QueueFull
from gateway.client import Client, Consumer, Message
from gateway.server import Gateway
from tests.integration.conftest import native_url
from tests.support.consume import take
from tests.support.wait import eventually


async def _client(gateway: Gateway) -> Client:
    return await Client(native_url(gateway)).connect()


async def _take(consumer: Consumer, count: int) -> list[Message]:
    """Receive exactly ``count`` messages (acking each), then check that no more come."""
    got = await take(consumer, count)
    with pytest.raises(TimeoutError):
        await consumer.receive(timeout=0.3)
    return got


async def test_strict_key_order_holds_one_unacked_message_per_key(gateway: Gateway) -> None:
    client = await _client(gateway)
    await client.declare_queue("orders", partitions=1)
    for n in range(3):
        for key in ("a", "b"):
            await client.publish("orders", f"{key}{n}".encode(), key=key)
    consumer = await client.subscribe("orders", group="g", key_order="strict", window=100)
    first = [await consumer.receive(timeout=5) for _ in range(2)]
    assert sorted(m.payload for m in first) == [b"a0", b"b0"]
    with pytest.raises(TimeoutError):  # a1 and b1 wait for a0 and b0 to be settled
        await consumer.receive(timeout=0.3)
    a0 = next(m for m in first if m.key == "a")
    await consumer.negative_acknowledge(a0, delay=0.0)
    again = await consumer.receive(timeout=5)
    assert again.payload == b"a0" and again.redelivered
    await consumer.acknowledge(again)
    assert (await consumer.receive(timeout=5)).payload == b"a1"
    await client.close()


async def test_a_group_tag_filter_skips_messages_that_do_not_match(gateway: Gateway) -> None:
    client = await _client(gateway)
    await client.declare_queue("events", partitions=2)
    for region in ("eu", "us", "eu"):
        await client.publish("events", region.encode(), key=region, properties={"region": region})
    eu = await client.subscribe("events", group="eu-only", tags={"region": "eu"})
    everyone = await client.subscribe("events", group="all")
    assert [m.payload for m in await _take(eu, 2)] == [b"eu", b"eu"]
    assert sorted(m.payload for m in await _take(everyone, 3)) == [b"eu", b"eu", b"us"]
    await client.close()


async def test_an_unacked_message_comes_back_after_the_ack_timeout(gateway: Gateway) -> None:
    client = await _client(gateway)
    await client.declare_queue("jobs", partitions=1, backoff_initial=0.0)
    await client.publish("jobs", b"job", key="k")
    consumer = await client.subscribe("jobs", group="g", ack_timeout=0.5)
    first = await consumer.receive(timeout=5)
    taken = time.monotonic()
    again = await consumer.receive(timeout=5)
    assert again.message_id == first.message_id and again.delivery_count == 2
    assert time.monotonic() - taken >= 0.4
    await client.close()


async def test_expired_messages_are_not_delivered(gateway: Gateway) -> None:
    client = await _client(gateway)
    await client.declare_queue("news", partitions=1)
    await client.publish("news", b"stale", key="k", ttl=0.2)
    await client.publish("news", b"fresh", key="k")
    await asyncio.sleep(0.4)  # let the first one's TTL pass before anyone consumes
    consumer = await client.subscribe("news", group="g")
    assert [m.payload for m in await _take(consumer, 1)] == [b"fresh"]
    await client.close()


async def test_a_scheduled_message_is_delivered_at_its_time(gateway: Gateway) -> None:
    client = await _client(gateway)
    await client.declare_queue("later", partitions=1)
    consumer = await client.subscribe("later", group="g")
    due = time.time() + 0.6
    await client.publish("later", b"later", key="k", deliver_at=due)
    await client.publish("later", b"now", key="other")
    assert (await consumer.receive(timeout=5)).payload == b"now"
    msg = await consumer.receive(timeout=5)
    assert msg.payload == b"later" and time.time() >= due - 0.05
    await client.close()


async def test_a_repeated_dedup_id_is_confirmed_but_stored_once(gateway: Gateway) -> None:
    client = await _client(gateway)
    await client.declare_queue("payments", partitions=2, dedup_window=300)
    first = await client.publish("payments", b"pay 10", key="k", dedup_id="tx-1")
    second = await client.publish("payments", b"pay 10", key="k", dedup_id="tx-1")
    assert first == second
    consumer = await client.subscribe("payments", group="g")
    assert [m.payload for m in await _take(consumer, 1)] == [b"pay 10"]
    await client.close()


async def test_an_empty_dedup_id_is_no_dedup_id(gateway: Gateway) -> None:
    client = await _client(gateway)
    await client.declare_queue("payments", partitions=1, dedup_window=300)
    first = await client.publish("payments", b"pay 10", key="k", dedup_id="")
    second = await client.publish("payments", b"pay 20", key="k", dedup_id="")
    assert first != second
    consumer = await client.subscribe("payments", group="g")
    assert [m.payload for m in await _take(consumer, 2)] == [b"pay 10", b"pay 20"]
    await client.close()


async def test_cumulative_ack_settles_everything_up_to_the_message(gateway: Gateway) -> None:
    client = await _client(gateway)
    await client.declare_queue("log", partitions=1)
    for n in range(5):
        await client.publish("log", b"%d" % n, key="k")
    consumer = await client.subscribe("log", group="g", window=10)
    got = [await consumer.receive(timeout=5) for _ in range(5)]
    await consumer.acknowledge_cumulative(got[3])
    assert gateway.broker is not None
    (runtime,) = gateway.broker.runtimes("log")
    await eventually(lambda: runtime.status().partitions[0].committed_seq == got[3].seq)
    await consumer.close(shutdown=True)  # hand over at once: only the unsettled one returns
    again = await client.subscribe("log", group="g")
    redelivered = await _take(again, 1)
    assert [(m.payload, m.redelivered) for m in redelivered] == [(b"4", True)]
    await client.close()


async def test_a_shared_group_spreads_messages_over_its_consumers(gateway: Gateway) -> None:
    client_a, client_b = await _client(gateway), await _client(gateway)
    await client_a.declare_queue("work")  # partitions = 0: shared by default
    a = await client_a.subscribe("work", group="pool", window=5)
    b = await client_b.subscribe("work", group="pool", window=5)
    for n in range(20):
        await client_a.publish("work", b"%d" % n)
    got: dict[Consumer, list[Message]] = {a: [], b: []}

    async def pull(consumer: Consumer) -> None:
        while sum(map(len, got.values())) < 20:
            try:
                msg = await consumer.receive(timeout=0.2)
            except TimeoutError:
                continue
            got[consumer].append(msg)
            await consumer.acknowledge(msg)

    await asyncio.wait_for(asyncio.gather(pull(a), pull(b)), 30)
    assert len(got[a]) + len(got[b]) == 20 and got[a] and got[b]
    await client_a.close()
    await client_b.close()


async def test_an_exclusive_group_has_one_active_consumer_and_a_standby(gateway: Gateway) -> None:
    client_a, client_b = await _client(gateway), await _client(gateway)
    await client_a.declare_queue("ledger", partitions=4)
    a = await client_a.subscribe("ledger", group="g", mode="exclusive")
    b = await client_b.subscribe("ledger", group="g", mode="exclusive")
    await eventually(lambda: a.partitions == frozenset(range(4)))
    assert b.partitions == frozenset()
    await a.close(shutdown=True)
    await eventually(lambda: b.partitions == frozenset(range(4)))
    await client_a.close()
    await client_b.close()


async def test_a_group_started_at_latest_skips_the_existing_backlog(gateway: Gateway) -> None:
    client = await _client(gateway)
    await client.declare_queue("ticks", partitions=2)
    await client.publish("ticks", b"old", key="k")
    consumer = await client.subscribe("ticks", group="live", start="latest")
    await client.publish("ticks", b"new", key="k")
    assert [m.payload for m in await _take(consumer, 1)] == [b"new"]
    await client.close()


async def test_a_full_queue_accepts_again_soon_after_its_messages_are_acked(
    gateway: Gateway,
) -> None:
    client = await _client(gateway)
    await client.declare_queue("bounded", partitions=1, max_depth_messages=10)
    for n in range(10):
        await client.publish("bounded", b"%d" % n, key="k")
    with pytest.raises(QueueFull):
        await client.publish("bounded", b"one too many", key="k")
    consumer = await client.subscribe("bounded", group="g")
    assert len(await _take(consumer, 10)) == 10

    async def accepted() -> bool:
        try:
            await client.publish("bounded", b"room again", key="k")
        except QueueFull:
            return False
        return True

    # Well before the 5 s retention interval: a filling queue is cleaned promptly.
    await eventually(accepted, timeout=3.5, interval=0.1)
    await client.close()
