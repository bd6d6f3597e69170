"""Limits a peer runs into: a number in a header that is too long, too large or not a
number is a clean protocol error and a closed connection within seconds, while other
clients keep publishing and consuming."""

from __future__ import annotations

import asyncio

import pika
import pytest

from gateway.client import Client
from gateway.server import Gateway
from tests.integration.conftest import native_url

CLOSE_WITHIN = 5.0


async def _answer_then_close(port: int, data: bytes) -> bytes:
    """Send ``data``; return everything the gateway answered before closing the socket."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        answer = b""
        async with asyncio.timeout(CLOSE_WITHIN):
            while chunk := await reader.read(65536):
                answer += chunk
        return answer
    finally:
        writer.close()


def _connect(*headers: str) -> bytes:
    lines = ["CONNECT", "accept-version:1.2", "host:/", *headers]
    return ("\n".join(lines) + "\n\n\0").encode()


MALFORMED_STOMP = {
    "content-length of 5,000 digits": _connect("content-length:" + "9" * 5000),
    "heart-beat of 400 digits": _connect("heart-beat:" + "9" * 400 + ",0"),
    "heart-beat over one day": _connect("heart-beat:0,86400001"),
    "content-length in superscript digits": _connect("content-length:²"),
    "expires of 500 digits": _connect()
    + b"SEND\ndestination:/queue/orders\nexpires:"
    + b"9" * 500
    + b"\n\nx\0",
}


@pytest.mark.parametrize("frames", MALFORMED_STOMP.values(), ids=MALFORMED_STOMP.keys())
async def test_a_stomp_number_that_is_no_number_is_an_error_and_a_closed_connection(
    gateway: Gateway, frames: bytes
) -> None:
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=2)
        before = await client.publish("orders", b"before", key="k")
        answer = await _answer_then_close(gateway.ports["stomp"], frames)
        after = await client.publish("orders", b"after", key="k")
        consumer = await client.subscribe("orders", group="g")
        got = [(await consumer.receive(timeout=5)).message_id for _ in range(2)]
    assert b"ERROR" in answer
    assert b"Traceback" not in answer
    assert got == [before, after]


def _publish_with_expiration(port: int, expiration: str) -> str:
    """The channel-closing reply code and text pika reports for one publish."""
    params = pika.ConnectionParameters("127.0.0.1", port, connection_attempts=1)
    with pika.BlockingConnection(params) as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        try:
            channel.basic_publish("", "orders", b"x", pika.BasicProperties(expiration=expiration))
        except pika.exceptions.ChannelClosedByBroker as e:
            return f"{e.reply_code} {e.reply_text}"
    return "published"


@pytest.mark.parametrize("expiration", ["²", "9" * 200, "-1"])
async def test_an_amqp_expiration_that_is_no_number_closes_the_channel_with_406(
    gateway: Gateway, expiration: str
) -> None:
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=2)
        outcome = await asyncio.to_thread(
            _publish_with_expiration, gateway.ports["amqp"], expiration
        )
        confirmed = await client.publish("orders", b"after", key="k")
        consumer = await client.subscribe("orders", group="g")
        got = await consumer.receive(timeout=5)
    assert outcome.startswith("406 ")
    assert got.message_id == confirmed
