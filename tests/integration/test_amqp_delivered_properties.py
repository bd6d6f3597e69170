"""What an AMQP consumer sees of a message (docs/protocols/amqp.md "Consuming"): header
values exactly as stored, whatever protocol published them.

aio-pika (pamqp) runs on the test's event loop; pika's BlockingConnection on a worker
thread, as in the other AMQP integration tests. pika reads every float header as an
integer (its decoder truncates 'f' and 'd' alike), so floats are checked with aio-pika.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aio_pika

from gateway.client import Client
from gateway.server import Gateway
from tests.integration.conftest import native_url
from tests.integration.sqlcheck import declare

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
