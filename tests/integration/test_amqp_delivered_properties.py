"""What an AMQP consumer sees of a message (docs/protocols/amqp.md "Consuming"): the basic
properties it was published with, header values exactly as stored, a dead letter's own
x-delivery-count, whatever protocol published it.

aio-pika (pamqp) runs on the test's event loop; pika's BlockingConnection on a worker
thread, as in the other AMQP integration tests. pika reads every float header as an
integer (its decoder truncates 'f' and 'd' alike), so floats are checked with aio-pika.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Any

import aio_pika
import pika

from gateway.client import Client
from gateway.server import Gateway
from tests.integration.conftest import native_url
from tests.integration.sqlcheck import declare, open_sql
from tests.support.amqp import pika_channel
from tests.support.consume import take

WAIT = 20.0
# Doubles a 32-bit float cannot hold: 19.99 came back as 19.989999771118164, a Unix time
# up to a minute off.
FLOATS: dict[str, Any] = {"price": 19.99, "at": 1795828034.8265262, "pi": 3.141592653589793}


async def _first_delivery(gateway: Gateway, queue: str) -> aio_pika.abc.AbstractIncomingMessage:
    connection = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{gateway.ports['amqp']}/")
    try:
        channel = await connection.channel()
        amqp_queue = await channel.get_queue(queue, ensure=False)
        async with amqp_queue.iterator() as messages:
            async for message in messages:
                await message.ack()
                return message
    finally:
        await connection.close()
    raise AssertionError("the consumer ended without a delivery")


async def test_float_and_bytes_headers_reach_a_consumer_exactly_as_stored(
    gateway: Gateway,
) -> None:
    await declare(gateway, "prices", partitions=0)
    async with Client(native_url(gateway)) as client:
        await client.publish("prices", b"x", properties={**FLOATS, "blob": b"\x00\xff"})
    message = await asyncio.wait_for(_first_delivery(gateway, "prices"), WAIT)
    assert message.headers is not None
    assert {name: message.headers[name] for name in FLOATS} == FLOATS
    assert bytes(message.headers["blob"]) == b"\x00\xff"  # type: ignore[arg-type]


async def test_basic_get_carries_floats_as_doubles(gateway: Gateway) -> None:
    await declare(gateway, "polled", partitions=0)
    async with Client(native_url(gateway)) as client:
        await client.publish("polled", b"x", properties=FLOATS)
    connection = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{gateway.ports['amqp']}/")
    try:
        channel = await connection.channel()
        queue = await channel.get_queue("polled", ensure=False)
        message = await queue.get(no_ack=True, timeout=WAIT)
    finally:
        await connection.close()
    assert message is not None and message.headers is not None
    assert {name: message.headers[name] for name in FLOATS} == FLOATS


def _consume(
    gateway: Gateway, queue: str, *, count: int = 1, nacks: int = 0
) -> list[tuple[Any, Any, bytes]]:
    """pika: consume ``queue``, nack (requeue) the first ``nacks`` deliveries and ack the
    next ``count``; every delivery as (method, properties, body)."""
    seen: list[tuple[Any, Any, bytes]] = []
    with pika_channel(gateway, confirm=False) as (connection, channel):

        def on_message(_: Any, method: Any, properties: Any, body: bytes) -> None:
            seen.append((method, properties, body))
            if len(seen) > nacks:
                channel.basic_ack(method.delivery_tag)
            else:
                channel.basic_nack(method.delivery_tag, requeue=True)

        channel.basic_consume(queue, on_message)
        deadline = time.monotonic() + WAIT
        while len(seen) < nacks + count and time.monotonic() < deadline:
            connection.process_data_events(time_limit=0.1)
    assert len(seen) == nacks + count, f"{len(seen)} deliveries of {queue}"
    return seen


async def test_a_message_published_over_amqp_comes_back_with_its_basic_properties(
    gateway: Gateway,
) -> None:
    await declare(gateway, "orders", partitions=4)
    published = pika.BasicProperties(
        headers={"QUEUE_PARTITION_KEY": "Order-3459134", "h": 1},
        message_id="biz-1",
        app_id="myapp",
        type="t.x",
        content_encoding="gzip",
        priority=3,
        correlation_id="c1",
        reply_to="r1",
        content_type="text/plain",
        timestamp=1_700_000_000,
        user_id="guest",
        delivery_mode=1,
        expiration="60000",
    )

    def round_trip() -> list[tuple[Any, Any, bytes]]:
        with pika_channel(gateway, confirm=True) as (_, channel):
            channel.basic_publish("", "orders", b"hello", published, mandatory=True)
        return _consume(gateway, "orders")

    ((_, got, body),) = await asyncio.to_thread(round_trip)
    assert body == b"hello"
    fields = ("message_id", "app_id", "type", "content_encoding", "priority", "correlation_id")
    fields += ("reply_to", "content_type", "timestamp", "user_id", "delivery_mode", "expiration")
    assert {f: getattr(got, f) for f in fields} == {f: getattr(published, f) for f in fields}
    headers = dict(got.headers)
    keygate_id = headers.pop("x-message-id")
    assert isinstance(keygate_id, str) and keygate_id != "biz-1"
    assert headers == {
        "QUEUE_PARTITION_KEY": "Order-3459134",
        "h": 1,
        "JMSXGroupID": "Order-3459134",
        "x-partition": 964695987 % 4,  # DESIGN.md §3.3's test vector
        "x-seq": 1,
        "x-delivery-count": 1,
    }


async def test_a_message_published_elsewhere_gets_its_publisher_id_and_keygate_s_time(
    gateway: Gateway,
) -> None:
    await declare(gateway, "events", partitions=0)
    async with Client(native_url(gateway)) as client:
        keygate_id = await client.publish("events", b"x", dedup_id="evt-7", ttl=30)
        plain_id = await client.publish("events", b"y", properties={"amqp.priority": "high"})
    before = time.time()
    (_, first, _), (_, second, _) = await asyncio.to_thread(_consume, gateway, "events", count=2)
    assert (first.message_id, first.headers["x-message-id"]) == ("evt-7", keygate_id)
    assert (second.message_id, second.headers["x-message-id"]) == (plain_id, plain_id)
    assert (first.delivery_mode, first.expiration, first.app_id) == (2, "30000", None)
    assert before - 60 < first.timestamp <= before  # the store time
    # A value that does not fit the basic property stays a header.
    assert (second.priority, second.headers["amqp.priority"]) == (None, "high")


async def test_a_dead_letter_s_consumer_sees_the_original_delivery_count(
    gateway: Gateway,
) -> None:
    await declare(gateway, "poison", partitions=1, max_deliveries=3, backoff_initial=0.05)
    async with Client(native_url(gateway)) as client:
        await client.publish("poison", b"bad", key="a", properties={"x-seq": "mine"})
    nacked = await asyncio.to_thread(_consume, gateway, "poison", count=0, nacks=3)
    assert [p.headers["x-delivery-count"] for _, p, _ in nacked] == [1, 2, 3]
    # The stored x-seq is the message's: this delivery's seq is under x-keygate-seq.
    assert {(p.headers["x-seq"], p.headers["x-keygate-seq"]) for _, p, _ in nacked} == {("mine", 1)}
    (_, _, _), (method, letter, body) = await asyncio.to_thread(
        _consume, gateway, "poison.dlq", nacks=1
    )
    assert body == b"bad"
    assert letter.headers["x-delivery-count"] == 3  # DESIGN.md §4: max_deliveries
    assert letter.headers["x-original-queue"] == "poison"
    assert isinstance(letter.headers["x-first-delivery-time"], int)  # pika: see module doc
    assert letter.headers["x-keygate-delivery-count"] == 2  # the DLQ's own: redelivered once
    assert method.redelivered


async def test_text_fields_longer_than_amqp_holds_arrive_as_headers(gateway: Gateway) -> None:
    """keygate takes ids and content types of up to 1,024 bytes; an AMQP basic property
    holds 255. Published elsewhere longer, they reach an AMQP consumer as headers
    (x-correlation-id, x-reply-to, x-content-type) instead of making it undeliverable."""
    await declare(gateway, "long", partitions=0)
    long_id, long_reply, long_type = "c" * 300, "r" * 256, "t/" + "x" * 400
    async with Client(native_url(gateway)) as client:
        await client.publish(
            "long", b"x", correlation_id=long_id, reply_to=long_reply, content_type=long_type
        )
    message = await asyncio.wait_for(_first_delivery(gateway, "long"), WAIT)
    assert message.headers is not None
    assert (message.correlation_id, message.reply_to, message.content_type) == (None, None, None)
    assert message.headers["x-correlation-id"] == long_id
    assert message.headers["x-reply-to"] == long_reply
    assert message.headers["x-content-type"] == long_type


async def test_a_message_whose_header_frame_exceeds_frame_max_is_dead_lettered_for_that_group(
    gateway: Gateway,
) -> None:
    """180 KB of properties are a legal message but a content header over pika's
    frame_max (131,072), which AMQP cannot split: that group dead-letters it as
    undeliverable, its connection and the messages behind it flow, other groups get it."""
    await declare(gateway, "wide", partitions=1)
    wide = {f"h{i}": "h" * 60_000 for i in range(3)}
    async with Client(native_url(gateway)) as client:
        await client.publish("wide", b"wide", key="k", properties=wide)
        await client.publish("wide", b"next", key="k")
        ((_, _, body),) = await asyncio.to_thread(_consume, gateway, "wide")
        assert body == b"next"
        sdk = await client.subscribe("wide", group="sdk")
        assert [m.payload for m in await take(sdk, 2)] == [b"wide", b"next"]
        letters = await client.subscribe("wide.dlq", group="g")
        (letter,) = await take(letters, 1)
    assert letter.payload == b"wide"
    assert letter.properties["x-dead-letter-reason"] == "undeliverable"
    assert letter.properties["x-original-group"] == "default"
    assert {name: letter.properties[name] for name in wide} == wide


async def test_any_64_bit_timestamp_reaches_a_consumer_unchanged(
    gateway: Gateway, db_url: str
) -> None:
    """As RabbitMQ: seconds, milliseconds (node amqplib users send Date.now()), 2^62 or
    2^64 - 1 are stored and delivered as sent — pamqp divided everything above 2^32 - 1
    by 1000 and refused 2^62 by closing the publisher's connection. A header of type 'T'
    (pika writes a datetime as one) is stored as its integer, not rescaled either."""
    await declare(gateway, "stamps", partitions=1)
    now = int(time.time())
    stamps = [now, 0, 2**32, now * 1000, 2**62, 2**64 - 1]
    in_2200 = datetime.datetime(2200, 1, 1, tzinfo=datetime.UTC)  # 7,258,118,400 > 2^32

    def round_trip() -> list[tuple[Any, Any, bytes]]:
        with pika_channel(gateway, confirm=True) as (_, channel):
            for stamp in stamps:
                props = pika.BasicProperties(timestamp=stamp, headers={"at": in_2200})
                channel.basic_publish("", "stamps", str(stamp).encode(), props)
        return _consume(gateway, "stamps", count=len(stamps))

    delivered = await asyncio.to_thread(round_trip)
    assert [(int(body), got.timestamp) for _, got, body in delivered] == [
        (stamp, stamp) for stamp in stamps
    ]
    assert {got.headers["at"] for _, got, _ in delivered} == {7_258_118_400}
    async with open_sql(db_url) as sql:
        rows = await sql.messages("stamps")
    assert [r.properties["amqp.timestamp"] for r in rows] == [*stamps[:-1], str(2**64 - 1)]
