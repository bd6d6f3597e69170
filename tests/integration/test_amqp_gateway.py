"""AMQP 0-9-1 publishers through the real gateway into SQL (docs/protocols/amqp.md).

pika's BlockingConnection runs on a worker thread (the gateway runs on the test's event
loop); aio-pika runs on the loop itself. Every assertion about what was stored reads
kg_messages or kg_queues with SQL.
"""

from __future__ import annotations

import asyncio
import datetime
import decimal
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pika
import pika.exceptions
import pytest
from pamqp import commands

from core.keys import partition_for
from gateway.client import Client
from gateway.config import Permission
from gateway.server import Gateway
from tests.integration.conftest import native_url, start_gateway
from tests.integration.sqlcheck import KEY, Sql, declare, open_sql
from tests.support.amqp import HOST, pika_channel
from tests.support.security import ADMIN, hashed_users

NOT_FOUND = 404


@pytest.fixture
async def sql(db_url: str) -> AsyncIterator[Sql]:
    async with open_sql(db_url) as opened:
        yield opened


async def test_pika_confirmed_publish_is_partitioned_by_jmsxgroupid_with_every_field_stored(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "orders", partitions=16)
    headers: dict[str, Any] = {
        "JMSXGroupID": KEY,
        "region": "eu",
        "n": 7,
        "urgent": True,
        "price": decimal.Decimal("12.5"),
        "at": datetime.datetime(2026, 1, 2, 3, 4, 5),
        "nested": {"a": 1},
        "dropped": None,
    }
    props = pika.BasicProperties(
        headers=headers,
        message_id="msg-1",
        correlation_id="c-1",
        reply_to="replies",
        content_type="application/json",
        content_encoding="gzip",
        delivery_mode=2,
        priority=5,
        expiration="60000",
        app_id="billing",
        user_id="guest",
        timestamp=1_700_000_000,
        type="order.created",
    )

    def publish() -> None:
        with pika_channel(gateway, confirm=True) as (_, channel):
            channel.basic_publish("", "orders", b'{"a": 1}', props)
            channel.basic_publish(
                "",
                "orders",
                b"other",
                pika.BasicProperties(
                    headers={"QUEUE_PARTITION_KEY": "Customer-1", "JMSXGroupID": KEY}
                ),
            )

    await asyncio.to_thread(publish)
    rows = {r.payload: r for r in await sql.messages("orders")}
    assert len(rows) == 2
    row = rows[b'{"a": 1}']
    assert (row.key, row.partition) == (KEY, 3)
    assert row.topic is None
    assert row.producer == "amqp:pika-it"
    assert (row.dedup_id, row.correlation_id, row.reply_to) == ("msg-1", "c-1", "replies")
    assert row.content_type == "application/json"
    assert row.expire_at is not None
    assert row.expire_at - row.publish_time == pytest.approx(60, abs=1)
    p = row.properties
    assert (p["JMSXGroupID"], p["region"], p["n"], p["urgent"]) == (KEY, "eu", 7, True)
    assert p["price"] == "12.5"
    # A timestamp header ('T') is its integer, as sent (pika: the naive datetime as UTC).
    assert p["at"] == int(datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC).timestamp())
    assert p["nested"] == '{"a": 1}'
    assert "dropped" not in p
    assert p["amqp.message_id"] == "msg-1"
    assert (p["amqp.content_encoding"], p["amqp.delivery_mode"], p["amqp.priority"]) == (
        "gzip",
        2,
        5,
    )
    assert (p["amqp.type"], p["amqp.user_id"], p["amqp.timestamp"]) == (
        "order.created",
        "guest",
        1_700_000_000,
    )
    other = rows[b"other"]
    assert (other.key, other.partition) == ("Customer-1", partition_for("Customer-1", 16))


async def test_byte_array_header_is_stored_as_bytes(gateway: Gateway, sql: Sql) -> None:
    await declare(gateway, "orders")

    def publish() -> None:
        with pika_channel(gateway, confirm=True) as (_, channel):
            headers = {"blob": b"\x00\xff"}
            channel.basic_publish("", "orders", b"x", pika.BasicProperties(headers=headers))

    await asyncio.to_thread(publish)
    (row,) = await sql.messages("orders")
    assert row.properties["blob"] == b"\x00\xff"


async def test_mandatory_unroutable_publish_raises_unroutable_error_and_stores_nothing(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "orders", partitions=4, subscriptions=["orders/#"])

    def publish() -> None:
        with pika_channel(gateway, confirm=True) as (_, channel):
            with pytest.raises(pika.exceptions.UnroutableError):
                channel.basic_publish("amq.topic", "nowhere.eu", b"lost", mandatory=True)
            with pytest.raises(pika.exceptions.UnroutableError):
                channel.basic_publish("", "no-such-queue", b"lost", mandatory=True)
            channel.basic_publish("", "no-such-queue", b"dropped")  # not mandatory: acked

    await asyncio.to_thread(publish)
    assert await sql.messages("orders") == []


async def test_too_large_message_is_nacked_and_the_connection_survives(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "small", max_message_size=1000)

    def publish() -> None:
        with pika_channel(gateway, confirm=True) as (connection, channel):
            with pytest.raises(pika.exceptions.NackError):
                channel.basic_publish("", "small", b"x" * 1001)
            channel.basic_publish("", "small", b"y" * 1000)
            assert connection.is_open and channel.is_open

    await asyncio.to_thread(publish)
    assert [r.payload for r in await sql.messages("small")] == [b"y" * 1000]


async def test_aio_pika_200_publishes_in_flight_are_confirmed_and_stored_in_per_key_order(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "bulk", partitions=8)
    keys = [f"key-{k}" for k in range(5)]
    connection = await aio_pika.connect(host=HOST, port=gateway.ports["amqp"])
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        confirms = [
            channel.default_exchange.publish(
                aio_pika.Message(
                    f"{keys[i % 5]}:{i}".encode(), headers={"JMSXGroupID": keys[i % 5]}
                ),
                routing_key="bulk",
            )
            for i in range(200)
        ]
        results = await asyncio.gather(*confirms)
    assert all(isinstance(r, commands.Basic.Ack) for r in results)
    rows = await sql.wait_messages("bulk", 200)
    sent_order: dict[str, list[int]] = defaultdict(list)
    for row in sorted(rows, key=lambda r: r.seq):
        key, n = row.payload.decode().split(":")
        assert (row.key, row.partition) == (key, partition_for(key, 8))
        sent_order[key].append(int(n))
    assert sent_order == {key: list(range(k, 200, 5)) for k, key in enumerate(keys)}


async def test_amq_topic_binding_with_hash_routes_a_dotted_routing_key_into_the_queue(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "orders", partitions=16)

    def bind_and_publish() -> None:
        with pika_channel(gateway, confirm=True) as (_, channel):
            channel.queue_bind("orders", "amq.topic", "orders.#")
            channel.basic_publish(
                "amq.topic",
                "orders.eu",
                b"eu",
                pika.BasicProperties(headers={"JMSXGroupID": KEY}),
                mandatory=True,
            )

    await asyncio.to_thread(bind_and_publish)
    (row,) = await sql.messages("orders")
    assert (row.payload, row.topic, row.key, row.partition) == (b"eu", "orders/eu", KEY, 3)


async def test_queue_declare_with_x_partitions_creates_a_keygate_queue_in_kg_queues(
    gateway: Gateway, sql: Sql
) -> None:
    def declare() -> int:
        with pika_channel(gateway, confirm=True) as (_, channel):
            ok = channel.queue_declare("declared", arguments={"x-partitions": 12})
            channel.basic_publish(
                "",
                "declared",
                b"k",
                pika.BasicProperties(
                    headers={
                        "JMSXGroupID": KEY,
                    }
                ),
            )
        return int(ok.method.message_count)

    assert await asyncio.to_thread(declare) == 0
    assert await sql.queue_partitions("declared") == 12
    (row,) = await sql.messages("declared")
    assert (row.key, row.partition) == (KEY, partition_for(KEY, 12))


async def test_basic_consume_of_an_unknown_queue_is_404_and_the_connection_stays_usable(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "jobs")

    def consume() -> int:
        with pika_channel(gateway, confirm=False) as (connection, channel):
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as closed:
                channel.basic_consume("no-such-queue", lambda *args: None)
            again = connection.channel()
            again.confirm_delivery()
            again.basic_publish("", "jobs", b"still here")
        return int(closed.value.reply_code)

    assert await asyncio.to_thread(consume) == NOT_FOUND
    assert [r.payload for r in await sql.messages("jobs")] == [b"still here"]


async def test_basic_qos_with_a_prefetch_size_is_540_and_the_connection_stays_usable(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "jobs")

    def qos() -> tuple[int, str]:
        with pika_channel(gateway, confirm=False) as (connection, channel):
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as closed:
                channel.basic_qos(prefetch_size=1000, prefetch_count=1)
            again = connection.channel()
            again.confirm_delivery()
            again.basic_publish("", "jobs", b"still here")
        return int(closed.value.reply_code), str(closed.value.reply_text)

    assert await asyncio.to_thread(qos) == (540, "prefetch_size!=0 (1000)")
    assert [r.payload for r in await sql.messages("jobs")] == [b"still here"]


async def test_expiration_0_is_confirmed_and_expires_at_once(gateway: Gateway, sql: Sql) -> None:
    await declare(gateway, "jobs")

    def publish() -> None:
        with pika_channel(gateway, confirm=True) as (_, channel):
            # Confirmed, not nacked (basic_publish raises NackError on a nack).
            channel.basic_publish("", "jobs", b"now or never", pika.BasicProperties(expiration="0"))

    await asyncio.to_thread(publish)
    (row,) = await sql.messages("jobs")
    assert row.expire_at is not None
    assert row.expire_at - row.publish_time == pytest.approx(0.001, abs=1e-6)


def _publish_twice(gateway: Gateway, queue: str, message_id: str) -> None:
    """Two confirmed pika publishes with the same ``message_id`` (basic_publish raises if
    one is not confirmed)."""
    with pika_channel(gateway, confirm=True) as (_, channel):
        for payload in (b"order created", b"order paid"):
            props = pika.BasicProperties(message_id=message_id, headers={"JMSXGroupID": "o-42"})
            channel.basic_publish("", queue, payload, props)


async def test_message_ids_are_business_ids_on_a_queue_with_default_settings(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "orders", partitions=4)
    await asyncio.to_thread(_publish_twice, gateway, "orders", "order-42")
    assert [r.payload for r in await sql.messages("orders")] == [b"order created", b"order paid"]
    async with Client(native_url(gateway)) as client:
        consumer = await client.subscribe("orders", group="g")
        got = [await consumer.receive(timeout=10) for _ in range(2)]
    assert [m.payload for m in got] == [b"order created", b"order paid"]


async def test_a_dedup_enabled_queue_confirms_both_publishes_and_stores_one(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "payments", dedup_window=60)
    await asyncio.to_thread(_publish_twice, gateway, "payments", "tx-1")
    assert [r.payload for r in await sql.messages("payments")] == [b"order created"]


async def test_an_empty_message_id_is_no_dedup_id(gateway: Gateway, sql: Sql) -> None:
    """Clients that always send message_id send "" for none: both messages are stored."""
    await declare(gateway, "payments", dedup_window=60)
    await asyncio.to_thread(_publish_twice, gateway, "payments", "")
    rows = await sql.messages("payments")
    assert [(r.payload, r.dedup_id) for r in rows] == [
        (b"order created", None),
        (b"order paid", None),
    ]


async def test_the_same_message_id_from_two_users_is_stored_twice(db_url: str) -> None:
    users = {"alice": "a-pw", "bob": "b-pw"}
    gateway = await start_gateway(
        db_url,
        users=hashed_users(**users),
        permissions={"alice": ADMIN, "bob": Permission(publish=("payments",))},
    )
    try:
        async with Client(native_url(gateway), username="alice", password="a-pw") as admin:
            await admin.declare_queue("payments", dedup_window=60)

        def publish(user: str) -> None:
            # Same connection name, same message id: only the user differs.
            with pika_channel(gateway, confirm=True, user=(user, users[user])) as (_, channel):
                channel.basic_publish(
                    "", "payments", user.encode(), pika.BasicProperties(message_id="tx-1")
                )

        for user in users:
            await asyncio.to_thread(publish, user)
        async with open_sql(db_url) as sql:
            assert sorted(r.payload for r in await sql.messages("payments")) == [b"alice", b"bob"]
    finally:
        await gateway.stop()
