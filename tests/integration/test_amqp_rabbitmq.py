"""AMQP as RabbitMQ clients expect it (docs/protocols/amqp.md, "Differences from RabbitMQ"),
and the ``x-delay`` header of RabbitMQ's delayed-message exchange.

Each test drives the real gateway with pika (on a worker thread) or aio-pika (on the loop)
and checks the answer a RabbitMQ application would see: the reply method, or the channel
close code and text, and what ended up in kg_queues / kg_messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import aio_pika
import aiormq
import pika
import pika.exceptions
import pytest
from pika.adapters.blocking_connection import BlockingChannel

from gateway.server import Gateway
from tests.integration.conftest import native_url
from tests.integration.sqlcheck import Sql, declare, open_sql
from tests.support.amqp import HOST, pika_channel
from tests.support.delay import DELAY_MS, DELAYED, UNDELAYED, assert_delay_honoured

NOT_FOUND, PRECONDITION_FAILED, NOT_IMPLEMENTED = 404, 406, 540


@pytest.fixture
async def sql(db_url: str) -> AsyncIterator[Sql]:
    async with open_sql(db_url) as opened:
        yield opened


def _closed_with(gateway: Gateway, operation: Callable[[BlockingChannel], object]) -> str:
    """Run ``operation`` on a fresh channel; it must close the channel. Returns
    "CODE text"; the connection must stay open."""
    with pika_channel(gateway, confirm=False) as (connection, channel):
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as closed:
            operation(channel)
        assert connection.is_open
        return f"{closed.value.reply_code} {closed.value.reply_text}"


async def test_x_delay_header_holds_a_message_back_while_a_later_undelayed_one_flows(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "later", partitions=4)

    def publish_both() -> None:
        with pika_channel(gateway, confirm=True) as (_, channel):
            for (payload, key), headers in (
                (DELAYED, {"x-delay": DELAY_MS}),
                (UNDELAYED, {}),
            ):
                props = pika.BasicProperties(headers={"JMSXGroupID": key, **headers})
                channel.basic_publish("", "later", payload, props)

    await assert_delay_honoured(native_url(gateway), "later", publish_both)
    delayed = next(r for r in await sql.messages("later") if r.payload == DELAYED[0])
    assert delayed.deliver_at is not None
    assert delayed.deliver_at - delayed.publish_time == pytest.approx(DELAY_MS / 1000)
    assert delayed.properties["x-delay"] == DELAY_MS  # kept, as RabbitMQ keeps it


async def test_an_x_delay_that_is_not_a_delay_is_nacked_or_closes_an_unconfirmed_channel(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "later")
    bad = pika.BasicProperties(headers={"x-delay": "soon"})

    def publish() -> str:
        with pika_channel(gateway, confirm=True) as (_, channel):
            with pytest.raises(pika.exceptions.NackError):
                channel.basic_publish("", "later", b"bad", bad)
            channel.basic_publish("", "later", b"good")
        return _closed_with(
            gateway,
            lambda ch: (ch.basic_publish("", "later", b"bad", bad), ch.queue_declare("later")),
        )

    assert await asyncio.to_thread(publish) == (
        "406 invalid x-delay 'soon': a delay in milliseconds (>= 0) expected"
    )
    assert [r.payload for r in await sql.messages("later")] == [b"good"]


async def test_a_delayed_message_exchange_declared_like_the_plugin_routes_and_delays(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "billing")
    connection = await aio_pika.connect(host=HOST, port=gateway.ports["amqp"])
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.declare_exchange(
            "delayed", "x-delayed-message", arguments={"x-delayed-type": "direct"}
        )
        queue = await channel.declare_queue("billing", passive=True)
        await queue.bind(exchange, "invoice")
        await exchange.publish(
            aio_pika.Message(b"later", headers={"x-delay": 60_000}), routing_key="invoice"
        )
    (row,) = await sql.messages("billing")
    assert row.deliver_at is not None
    assert row.deliver_at - row.publish_time == pytest.approx(60.0)


async def test_deleting_a_queue_or_exchange_that_does_not_exist_is_ok(gateway: Gateway) -> None:
    def delete() -> int:
        with pika_channel(gateway, confirm=False) as (_, channel):
            ok = channel.queue_delete("never-declared")
            channel.queue_delete("never-declared", if_empty=True)
            channel.exchange_delete("never-declared")
            assert channel.is_open
            return int(ok.method.message_count)

    assert await asyncio.to_thread(delete) == 0


async def test_unbinding_a_missing_binding_queue_or_exchange_is_ok(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "orders")

    def unbind() -> None:
        with pika_channel(gateway, confirm=False) as (_, channel):
            channel.queue_bind("orders", "amq.topic", "orders.#")
            channel.queue_unbind("orders", "amq.topic", "orders.#")
            channel.queue_unbind("orders", "amq.topic", "orders.#")  # already gone
            channel.queue_unbind("orders", "no-such-exchange", "x")
            channel.queue_unbind("no-such-queue", "amq.topic", "x")
            assert channel.is_open

    await asyncio.to_thread(unbind)
    row = await sql.queue("orders")
    assert row is not None and await sql.queue("no-such-queue") is None


async def test_passive_declares_bind_and_purge_of_missing_things_close_the_channel_with_404(
    gateway: Gateway,
) -> None:
    await declare(gateway, "orders")

    def refused() -> list[str]:
        return [
            _closed_with(gateway, lambda ch: ch.queue_declare("missing", passive=True)),
            _closed_with(gateway, lambda ch: ch.exchange_declare("missing", passive=True)),
            _closed_with(gateway, lambda ch: ch.queue_bind("orders", "missing", "k")),
            _closed_with(gateway, lambda ch: ch.queue_bind("missing", "amq.topic", "k")),
            _closed_with(gateway, lambda ch: ch.queue_purge("missing")),
        ]

    answers = await asyncio.to_thread(refused)
    assert [a.split()[0] for a in answers] == [str(NOT_FOUND)] * 5
    assert "missing" in answers[0] and "no exchange 'missing'" in answers[1]


async def test_redeclare_with_a_different_argument_is_406_and_omitting_arguments_is_ok(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "orders", partitions=16, max_depth_messages=100)

    def redeclare() -> str:
        with pika_channel(gateway, confirm=False) as (_, channel):
            channel.queue_declare("orders", durable=True)  # names nothing: matches
            channel.queue_declare("orders", arguments={"x-partitions": 16, "x-max-length": 100})
        return _closed_with(
            gateway, lambda ch: ch.queue_declare("orders", arguments={"x-max-length": 5})
        )

    answer = await asyncio.to_thread(redeclare)
    assert answer.startswith(f"{PRECONDITION_FAILED} inequivalent arg 'x-max-length'")
    row = await sql.queue("orders")
    assert row is not None and (row["partitions"], row["max_depth_messages"]) == (16, 100)


async def test_rabbitmq_queue_arguments_become_the_matching_keygate_settings(
    gateway: Gateway, sql: Sql
) -> None:
    connection = await aio_pika.connect(host=HOST, port=gateway.ports["amqp"])
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(
            "jobs",
            durable=True,
            arguments={
                "x-queue-type": "quorum",
                "x-message-ttl": 60_000,
                "x-max-length": 100,
                "x-max-length-bytes": 1_000_000,
                "x-overflow": "reject-publish",
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": "jobs-parked",
                "x-expires": 3_600_000,
                "x-single-active-consumer": True,
                "x-delivery-limit": 5,
            },
        )
    row = await sql.queue("jobs")
    assert row is not None
    assert (row["ttl"], row["max_depth_messages"], row["max_depth_bytes"]) == (
        60.0,
        100,
        1_000_000,
    )
    assert (row["dead_letter_queue"], row["max_deliveries"]) == ("jobs-parked", 5)
    assert await sql.queue("jobs-parked") is not None  # the dead-letter queue exists


REFUSED_ARGUMENTS: list[tuple[dict[str, Any], str]] = [
    ({"x-queue-type": "stream"}, "x-queue-type 'stream' is not supported"),
    ({"x-queue-type": "fancy"}, "unknown queue type 'fancy'"),
    ({"x-overflow": "drop-head"}, "x-overflow 'drop-head' is not supported"),
    ({"x-overflow": "sideways"}, "invalid arg 'x-overflow'"),
    ({"x-dead-letter-exchange": "dlx"}, "keygate dead-letters into a queue"),
    ({"x-dead-letter-routing-key": "q"}, "x-dead-letter-exchange not defined"),
    ({"x-message-ttl": 0}, "invalid arg 'x-message-ttl'"),
    ({"x-max-length": -1}, "invalid arg 'x-max-length'"),
    # Past what PostgreSQL's INTEGER column holds: a storage error there before.
    ({"x-window": 2**40}, f"(window must be between 1 and {2**31 - 1})"),
    ({"x-max-message-size": 2**63 - 1}, "invalid arg 'x-max-message-size'"),
    ({"x-expires": 0}, "invalid arg 'x-expires'"),
    ({"x-single-active-consumer": "yes"}, "invalid arg 'x-single-active-consumer'"),
]


@pytest.mark.parametrize(
    ("arguments", "reason"), REFUSED_ARGUMENTS, ids=[next(iter(a)) for a, _ in REFUSED_ARGUMENTS]
)
async def test_an_argument_keygate_cannot_honour_is_406_and_creates_nothing(
    gateway: Gateway, sql: Sql, arguments: dict[str, Any], reason: str
) -> None:
    connection = await aio_pika.connect(host=HOST, port=gateway.ports["amqp"])
    async with connection:
        channel = await connection.channel()
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed) as refused:
            await channel.declare_queue("refused", arguments=arguments)
        assert not connection.is_closed
    assert reason in str(refused.value)
    assert await sql.queue("refused") is None


async def test_x_max_length_refuses_publishes_beyond_it_as_reject_publish_does(
    gateway: Gateway, sql: Sql
) -> None:
    def publish() -> None:
        with pika_channel(gateway, confirm=True) as (_, channel):
            channel.queue_declare("bounded", arguments={"x-max-length": 2})
            channel.basic_publish("", "bounded", b"1")
            channel.basic_publish("", "bounded", b"2")
            with pytest.raises(pika.exceptions.NackError):
                channel.basic_publish("", "bounded", b"3")

    await asyncio.to_thread(publish)
    assert [r.payload for r in await sql.messages("bounded")] == [b"1", b"2"]


async def test_exchange_redeclare_with_another_type_is_406_and_headers_exchanges_are_540(
    gateway: Gateway,
) -> None:
    def declare_exchanges() -> list[str]:
        with pika_channel(gateway, confirm=False) as (_, channel):
            channel.exchange_declare("events", "topic")
            channel.exchange_declare("events", "topic", passive=True)
        return [
            _closed_with(gateway, lambda ch: ch.exchange_declare("events", "fanout")),
            _closed_with(gateway, lambda ch: ch.exchange_declare("by-header", "headers")),
            _closed_with(gateway, lambda ch: ch.exchange_bind("events", "amq.topic", "x")),
        ]

    redeclared, headers, e2e = await asyncio.to_thread(declare_exchanges)
    assert redeclared.startswith(f"{PRECONDITION_FAILED} inequivalent arg 'type'")
    assert headers.startswith(f"{NOT_IMPLEMENTED} headers exchanges are not supported")
    assert e2e.startswith(f"{NOT_IMPLEMENTED} exchange-to-exchange bindings")


async def test_delete_if_empty_of_a_queue_with_messages_is_406_and_keeps_it(
    gateway: Gateway, sql: Sql
) -> None:
    def delete() -> str:
        with pika_channel(gateway, confirm=True) as (_, channel):
            channel.queue_declare("full")
            channel.basic_publish("", "full", b"kept")
        return _closed_with(gateway, lambda ch: ch.queue_delete("full", if_empty=True))

    assert (await asyncio.to_thread(delete)).startswith(f"{PRECONDITION_FAILED} ")
    assert [r.payload for r in await sql.messages("full")] == [b"kept"]
