"""Protocol state kept in SQL survives a gateway restart (the same holds for a failover:
the next active gateway reads the same rows): AMQP exchanges, and MQTT sessions' QoS 2
packet ids waiting for PUBREL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pytest
from pamqp import commands

from core.errors import QueueFull, StorageError
from core.model import Message, QueueConfig
from protocols.mqtt import MQTT_5, Connect, MqttProperties, PubComp, Publish, PubRec, PubRel
from storage import SqlStore
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


def _message(queue: str, n: int) -> Message:
    return Message(f"m{n}", queue, 0, 0, "k", b"%d" % n, publish_time=1.0)


async def test_a_qos2_packet_id_is_recorded_in_the_same_transaction_as_its_message(
    store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Store and record, or neither: a crash between the two can no longer store a QoS 2
    message whose packet id the session does not know (the re-send would be stored
    again), nor record an id whose message was not stored (the re-send would be lost)."""
    await store.create_queue(QueueConfig("q2", partitions=1, max_depth_messages=2))
    await store.append([_message("q2", 1)], now=1.0, qos2=("client", 7))
    assert await store.mqtt_session("client", now=1.0) == {7}

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the session row cannot be written")

    monkeypatch.setattr(store, "change_qos2", broken)
    with pytest.raises(StorageError):
        await store.append([_message("q2", 2)], now=1.0, qos2=("client", 8))
    monkeypatch.undo()
    assert (await store.depth("q2"))[0] == 1  # the message of 8 was rolled back with it
    assert await store.mqtt_session("client", now=1.0) == {7}
    await store.append([_message("q2", 3)], now=1.0)
    with pytest.raises(QueueFull):  # refused: its id is not recorded either
        await store.append([_message("q2", 4)], now=1.0, qos2=("client", 9))
    assert await store.mqtt_session("client", now=1.0) == {7}


async def test_releases_and_expiry_change_a_session_without_losing_other_ids(
    store: SqlStore,
) -> None:
    await store.create_queue(QueueConfig("q3", partitions=1))
    for packet_id in (1, 2, 3):
        await store.append([_message("q3", packet_id)], now=1.0, qos2=("c", packet_id))
    await store.mqtt_released("c", frozenset({2}))
    await store.save_mqtt_session("c", expires_at=100.0)  # the client left: ids stay
    assert await store.mqtt_session("c", now=50.0) == {1, 3}
    assert await store.mqtt_session("c", now=150.0) is None  # expired


async def test_sessions_left_connected_by_an_earlier_run_get_an_expiry_at_start(
    store: SqlStore,
) -> None:
    """A crash leaves every session of a connected client marked connected (no expiry);
    the next start gives them one, so a client that never returns does not keep its row
    for ever, while one that comes back in time still finds its packet ids."""
    await store.create_queue(QueueConfig("q4", partitions=1))
    await store.append([_message("q4", 1)], now=1.0, qos2=("gone", 1))
    await store.append([_message("q4", 2)], now=1.0, qos2=("back", 2))
    await store.save_mqtt_session("left", expires_at=50.0)  # disconnected cleanly
    assert await store.orphan_mqtt_sessions(expires_at=200.0) == 2
    assert await store.mqtt_session("back", now=150.0) == {2}
    await store.save_mqtt_session("back", expires_at=None)  # it reconnected
    assert await store.expire_mqtt_sessions(now=250.0) == 2  # "gone" and "left"
    assert await store.mqtt_session("gone", now=1.0) is None
    assert await store.mqtt_session("back", now=250.0) == {2}
