"""Protocol state kept in SQL survives a gateway restart (the same holds for a failover:
the next active gateway reads the same rows): AMQP exchanges, and MQTT sessions' QoS 2
packet ids waiting for PUBREL."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aio_pika
import pytest
from pamqp import commands

from protocols.mqtt import MQTT_5, Connect, MqttProperties, PubComp, Publish, PubRec, PubRel
from tests.integration.conftest import start_gateway
from tests.integration.sqlcheck import Sql, declare, open_sql
from tests.support.mqtt_raw import RawMqtt

HOST = "127.0.0.1"


@pytest.fixture
async def sql(db_url: str) -> AsyncIterator[Sql]:
    async with open_sql(db_url) as opened:
        yield opened


async def test_a_declared_exchange_is_usable_after_a_restart_without_declaring_it_again(
    db_url: str, sql: Sql
) -> None:
    first = await start_gateway(db_url)
    try:
        await declare(first, "readings", partitions=2)
        async with await aio_pika.connect(host=HOST, port=first.ports["amqp"]) as connection:
            channel = await connection.channel(publisher_confirms=True)
            sensors = await channel.declare_exchange("sensors", aio_pika.ExchangeType.TOPIC)
            queue = await channel.declare_queue("readings", passive=True)
            await queue.bind(sensors, "room.*")
            ack = await sensors.publish(aio_pika.Message(b"before"), routing_key="room.1")
            assert isinstance(ack, commands.Basic.Ack)
    finally:
        await first.stop()
    second = await start_gateway(db_url)
    try:
        async with await aio_pika.connect(host=HOST, port=second.ports["amqp"]) as connection:
            channel = await connection.channel(publisher_confirms=True)
            sensors = await channel.get_exchange("sensors", ensure=False)
            ack = await sensors.publish(aio_pika.Message(b"after"), routing_key="room.2")
            assert isinstance(ack, commands.Basic.Ack)
            # Declaring it again with another type is still refused (406).
            with pytest.raises(aio_pika.exceptions.ChannelPreconditionFailed):
                await channel.declare_exchange("sensors", aio_pika.ExchangeType.FANOUT)
    finally:
        await second.stop()
    assert sorted(r.payload for r in await sql.messages("readings")) == [b"after", b"before"]


async def test_a_qos2_publish_resent_after_a_restart_is_stored_once(db_url: str, sql: Sql) -> None:
    session = Connect(
        "exactly-once",
        MQTT_5,
        clean_start=False,
        properties=MqttProperties(session_expiry_interval=600),
    )
    first = await start_gateway(db_url)
    try:
        await declare(first, "orders", partitions=4, subscriptions=["orders/#"])
        client = await RawMqtt.connected(first.ports["mqtt"], session)
        await client.send(Publish("orders/q2", b"once", 2, packet_id=7))
        assert await client.receive() == PubRec(7)
        client.abort()  # the PUBREC is "lost": the client re-sends the PUBLISH elsewhere
    finally:
        await first.stop()
    second = await start_gateway(db_url)
    try:
        client = await RawMqtt.connected(second.ports["mqtt"], session)
        assert client.connack.session_present
        await client.send(Publish("orders/q2", b"once", 2, dup=True, packet_id=7))
        assert await client.receive() == PubRec(7)
        await client.send(PubRel(7))
        assert await client.receive() == PubComp(7)
        # Released: the packet id is free again and carries a new message.
        await client.send(Publish("orders/q2", b"next", 2, packet_id=7))
        assert await client.receive() == PubRec(7)
        await client.send(PubRel(7))
        assert await client.receive() == PubComp(7)
        client.abort()
    finally:
        await second.stop()
    assert sorted(r.payload for r in await sql.messages("orders")) == [b"next", b"once"]
