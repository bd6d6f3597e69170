"""MQTT publishers through the real gateway into SQL (docs/protocols/mqtt.md).

paho-mqtt (v5 and 3.1.1) and amqtt publish to a started Gateway; every assertion reads
kg_messages with SQL. paho runs its network loop on its own thread, so its acks are
surfaced as thread events the test awaits through ``asyncio.to_thread``. The QoS 2
"PUBREC lost, PUBLISH re-sent on a resumed session" case needs control over which
packets are sent, so it speaks the project's own codec over a socket.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from core.keys import murmur3_32, partition_for
from gateway.server import Gateway
from protocols.mqtt import (
    MQTT_5,
    Connect,
    Disconnect,
    MqttProperties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
)
from tests.integration.conftest import native_url
from tests.integration.sqlcheck import KEY, Sql, declare, open_sql
from tests.support.delay import DELAY_MS, DELAYED, UNDELAYED, assert_delay_honoured
from tests.support.mqtt_raw import RawMqtt as Raw

WAIT = 10.0


@pytest.fixture
async def sql(db_url: str) -> AsyncIterator[Sql]:
    async with open_sql(db_url) as opened:
        yield opened


class Paho:
    """A paho-mqtt 2.x client on its network thread, with each publish's outcome by mid."""

    def __init__(self, port: int, client_id: str, protocol: Any = paho.MQTTv5) -> None:
        self.port = port
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=protocol,
            reconnect_on_failure=False,
        )
        self.connected = threading.Event()
        self.acks: dict[int, int] = {}
        self.acked = threading.Condition()
        self.disconnected = threading.Event()
        self.client.on_connect = lambda _c, _u, _f, _rc, _p: self.connected.set()
        self.client.on_disconnect = lambda _c, _u, _f, _rc, _p: self.disconnected.set()
        self.client.on_publish = self._on_publish

    def _on_publish(self, _c: Any, _u: Any, mid: int, rc: Any, _p: Any) -> None:
        with self.acked:
            self.acks[mid] = int(rc.value)
            self.acked.notify_all()

    async def connect(self) -> None:
        await asyncio.to_thread(self.client.connect, "127.0.0.1", self.port, 30)
        self.client.loop_start()
        assert await asyncio.to_thread(self.connected.wait, WAIT), "no CONNACK"

    def publish(
        self, topic: str, payload: bytes, qos: int, properties: Properties | None = None
    ) -> int:
        return int(self.client.publish(topic, payload, qos, properties=properties).mid)

    async def ack(self, mid: int) -> int:
        """The reason code of ``mid``'s PUBACK (QoS 1) or PUBCOMP (QoS 2: paho ignores the
        PUBREC's code and always sends PUBREL)."""

        def wait() -> int:
            with self.acked:
                assert self.acked.wait_for(lambda: mid in self.acks, WAIT), f"no ack for {mid}"
                return self.acks[mid]

        return await asyncio.to_thread(wait)

    async def stop(self) -> None:
        self.client.disconnect()
        await asyncio.to_thread(self.client.loop_stop)


def _properties(**user: str) -> Properties:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.UserProperty = list(user.items())
    return props


async def test_test_vector_key_hashes_to_partition_3_of_16() -> None:
    assert murmur3_32(KEY) == 3112179635
    assert murmur3_32(KEY) & 0x7FFFFFFF == 964695987
    assert partition_for(KEY, 16) == 964695987 % 16 == 3


async def test_paho_v5_user_properties_decide_the_partition_at_every_qos(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "orders", partitions=16, subscriptions=["orders/#"])
    client = Paho(gateway.ports["mqtt"], "paho5")
    await client.connect()
    keys = {0: KEY, 1: "Customer-17", 2: "Customer-42"}
    # Not UTF-8 at QoS 2: correlation_id is then the lowercase hex of the bytes.
    correlation = {0: b"corr-0", 1: b"corr-1", 2: b"\xff\x02"}
    try:
        mids = []
        for qos in (0, 1, 2):
            props = _properties(JMSXGroupID=keys[qos], region="eu", qos=str(qos))
            if qos == 1:
                # QUEUE_PARTITION_KEY wins over JMSXGroupID (DESIGN.md §3.2).
                props = _properties(JMSXGroupID=KEY, QUEUE_PARTITION_KEY=keys[1], region="eu")
            props.MessageExpiryInterval = 120
            props.ContentType = "application/json"
            props.CorrelationData = correlation[qos]
            props.ResponseTopic = "replies/paho5"
            mids.append(client.publish(f"orders/eu/{qos}", f"m{qos}".encode(), qos, props))
        assert [await client.ack(mid) for mid in mids[1:]] == [0, 0]
        rows = await sql.wait_messages("orders", 3)
    finally:
        await client.stop()
    by_payload = {r.payload: r for r in rows}
    for qos, key in keys.items():
        row = by_payload[f"m{qos}".encode()]
        assert row.key == key
        assert row.partition == partition_for(key, 16)
        assert row.topic == f"orders/eu/{qos}"
        assert row.properties["region"] == "eu"
        assert row.properties["x-mqtt-correlation-data"] == correlation[qos]
        assert row.correlation_id == ("ff02" if qos == 2 else correlation[qos].decode())
        assert row.content_type == "application/json"
        assert row.reply_to == "replies/paho5"
        assert row.producer == "mqtt:paho5"
        assert row.expire_at is not None
        assert row.expire_at - row.publish_time == pytest.approx(120, abs=1)
    assert by_payload[b"m0"].partition == 3
    assert by_payload[b"m0"].properties["JMSXGroupID"] == KEY
    assert by_payload[b"m0"].properties["qos"] == "0"
    first = by_payload[b"m1"].properties
    assert (first["JMSXGroupID"], first["QUEUE_PARTITION_KEY"]) == (KEY, "Customer-17")


async def test_paho_v311_key_is_the_third_topic_level_with_key_from_topic_2(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(
        gateway, "devices", partitions=16, subscriptions=["devices/#"], key_from="topic:2"
    )
    client = Paho(gateway.ports["mqtt"], "paho3", paho.MQTTv311)
    await client.connect()
    try:
        mids = [
            client.publish(f"devices/eu/{key}/temp", key.encode(), 1)
            for key in (KEY, "sensor-9", KEY)
        ]
        assert [await client.ack(mid) for mid in mids] == [0, 0, 0]
    finally:
        await client.stop()
    rows = await sql.wait_messages("devices", 3)
    assert sorted((r.key, r.partition) for r in rows) == sorted(
        [(KEY, 3), (KEY, 3), ("sensor-9", partition_for("sensor-9", 16))]
    )
    assert all(r.properties == {} and r.producer == "mqtt:paho3" for r in rows)
    same_key = [r.seq for r in rows if r.key == KEY]
    assert same_key == sorted(same_key) and len(set(same_key)) == 2


async def test_amqtt_client_publish_at_qos_1_is_stored(gateway: Gateway, sql: Sql) -> None:
    from amqtt.client import MQTTClient

    await declare(gateway, "orders", partitions=4, subscriptions=["orders/#"])
    client = MQTTClient(client_id="amqtt-1", config={"auto_reconnect": False})
    await client.connect(f"mqtt://127.0.0.1:{gateway.ports['mqtt']}/")
    try:
        await client.publish("orders/amqtt", b"hello from amqtt", qos=1)
    finally:
        await client.disconnect()
    (row,) = await sql.wait_messages("orders", 1)
    assert (row.payload, row.topic, row.producer) == (
        b"hello from amqtt",
        "orders/amqtt",
        "mqtt:amqtt-1",
    )


async def test_v5_publish_to_a_topic_no_queue_subscribes_to_gets_0x10_and_stores_nothing(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "orders", partitions=4, subscriptions=["orders/#"])
    client = Paho(gateway.ports["mqtt"], "lost")
    await client.connect()
    try:
        assert await client.ack(client.publish("nowhere/1", b"lost", 1)) == 0x10
        client.publish("nowhere/0", b"lost", 0)
        assert await client.ack(client.publish("orders/1", b"kept", 1)) == 0
    finally:
        await client.stop()
    assert [r.payload for r in await sql.messages("orders")] == [b"kept"]


async def test_a_topic_routes_to_the_queues_subscribed_at_the_time_of_the_publish(
    gateway: Gateway, sql: Sql
) -> None:
    """Routes are cached by topic (gateway/broker.py): a queue created, re-subscribed or
    deleted changes where the very next publish goes."""
    await declare(gateway, "first", subscriptions=["orders/#"])
    client = Paho(gateway.ports["mqtt"], "router")
    await client.connect()
    try:
        assert await client.ack(client.publish("orders/1", b"1", 1)) == 0
        await declare(gateway, "second", subscriptions=["orders/+"])
        assert await client.ack(client.publish("orders/1", b"2", 1)) == 0
        await gateway.broker.alter_queue("first", subscriptions=["invoices/#"])
        assert await client.ack(client.publish("orders/1", b"3", 1)) == 0
        assert [r.payload for r in await sql.messages("second")] == [b"2", b"3"]
        await gateway.broker.delete_queue_named("second")
        assert await client.ack(client.publish("orders/1", b"4", 1)) == 0x10
    finally:
        await client.stop()
    assert [r.payload for r in await sql.messages("first")] == [b"1", b"2"]


async def test_message_over_the_queue_max_message_size_gets_0x83_and_the_connection_survives(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "small", subscriptions=["small/#"], max_message_size=1000)
    client = Paho(gateway.ports["mqtt"], "big")
    await client.connect()
    try:
        assert await client.ack(client.publish("small/1", b"x" * 1001, 1)) == 0x83
        # The size counts the topic as well as the payload (DESIGN.md §3.7).
        assert await client.ack(client.publish("small/2", b"x" * (1000 - 7), 1)) == 0
    finally:
        await client.stop()
    assert [len(r.payload) for r in await sql.messages("small")] == [993]


async def test_publish_beyond_max_depth_gets_0x97_quota_exceeded(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "tiny", subscriptions=["tiny/#"], max_depth_messages=2)
    client = Paho(gateway.ports["mqtt"], "quota")
    await client.connect()
    try:
        codes = [await client.ack(client.publish("tiny/x", str(i).encode(), 1)) for i in range(3)]
    finally:
        await client.stop()
    assert codes == [0, 0, 0x97]
    # paho ignores a PUBREC's reason code (it sends PUBREL regardless), so QoS 2 is raw.
    raw = await Raw.connected(gateway.ports["mqtt"], Connect("quota2"))
    try:
        await raw.send(Publish("tiny/x", b"3", 2, packet_id=1))
        pubrec = await raw.receive()
        assert isinstance(pubrec, PubRec) and (pubrec.packet_id, pubrec.reason_code) == (1, 0x97)
        assert pubrec.properties.reason_string  # says which limit refused it
    finally:
        raw.writer.close()
    assert [r.payload for r in await sql.messages("tiny")] == [b"0", b"1"]


async def test_mqtt311_gets_a_puback_only_for_stored_messages_and_is_closed_at_the_first_refusal(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "tiny", subscriptions=["tiny/#"], max_depth_messages=5)
    client = Paho(gateway.ports["mqtt"], "paho311-full", paho.MQTTv311)
    await client.connect()
    try:
        mids = [client.publish("tiny/x", str(i).encode(), 1) for i in range(10)]
        assert await asyncio.to_thread(client.disconnected.wait, WAIT), "not closed"
    finally:
        await client.stop()
    stored = await sql.messages("tiny")
    assert [r.payload for r in stored] == [str(i).encode() for i in range(5)]
    assert sorted(client.acks) == mids[:5]  # one PUBACK per stored message, none more
    assert gateway.broker is not None
    metrics = gateway.broker.metrics.render().decode()
    assert 'keygate_listener_unconfirmed_closes_total{listener="mqtt"} 1.0' in metrics


async def test_qos2_publish_resent_after_reconnect_of_the_same_session_is_stored_once(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "orders", partitions=16, subscriptions=["orders/#"])
    port = gateway.ports["mqtt"]
    session = Connect(
        "exactly-once",
        MQTT_5,
        clean_start=False,
        properties=MqttProperties(session_expiry_interval=60),
    )
    key = MqttProperties(user_properties=(("JMSXGroupID", KEY),))
    first = await Raw.connected(port, session)
    await first.send(Publish("orders/q2", b"once", 2, packet_id=7, properties=key))
    assert await first.receive() == PubRec(7)
    first.writer.transport.abort()  # the PUBREC is "lost": the client re-sends the PUBLISH
    second = await Raw.connected(port, session)
    try:
        assert second.connack.session_present
        await second.send(Publish("orders/q2", b"once", 2, dup=True, packet_id=7, properties=key))
        assert await second.receive() == PubRec(7)
        await second.send(PubRel(7))
        assert await second.receive() == PubComp(7)
        await second.send(Publish("orders/q2", b"next", 1, packet_id=8, properties=key))
        assert await second.receive() == PubAck(8)
        await second.send(Disconnect())
    finally:
        second.writer.close()
    rows = await sql.messages("orders")
    assert [(r.payload, r.partition) for r in rows] == [(b"once", 3), (b"next", 3)]


async def test_will_message_is_stored_when_the_client_drops_without_disconnect(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "orders", partitions=16, subscriptions=["orders/#"])
    client = Paho(gateway.ports["mqtt"], "mortal")
    will = Properties(PacketTypes.WILLMESSAGE)  # type: ignore[no-untyped-call]
    will.UserProperty = [("JMSXGroupID", KEY)]
    will.ContentType = "text/plain"
    client.client.will_set("orders/wills/mortal", b"gone", qos=1, properties=will)
    await client.connect()
    assert await client.ack(client.publish("orders/alive", b"alive", 1)) == 0
    await asyncio.to_thread(client.client.loop_stop)
    sock = client.client.socket()
    assert isinstance(sock, socket.socket)
    sock.close()  # an ungraceful end: no DISCONNECT packet
    rows = await sql.wait_messages("orders", 2)
    will_row = next(r for r in rows if r.payload == b"gone")
    assert (will_row.topic, will_row.key, will_row.partition) == ("orders/wills/mortal", KEY, 3)
    assert will_row.content_type == "text/plain"
    assert will_row.producer == "mqtt:mortal"


async def test_v5_x_delay_user_property_holds_a_message_back_while_a_later_one_flows(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "later", partitions=4, subscriptions=["later/#"])
    client = Paho(gateway.ports["mqtt"], "delayer")
    await client.connect()
    mids: list[int] = []

    def publish_both() -> None:
        for (payload, key), delay in ((DELAYED, {"x-delay": str(DELAY_MS)}), (UNDELAYED, {})):
            mids.append(
                client.publish("later/1", payload, 1, _properties(JMSXGroupID=key, **delay))
            )

    try:
        await assert_delay_honoured(native_url(gateway), "later", publish_both)
        assert [await client.ack(mid) for mid in mids] == [0, 0]
    finally:
        await client.stop()
    delayed = next(r for r in await sql.messages("later") if r.payload == DELAYED[0])
    assert delayed.deliver_at is not None
    assert delayed.deliver_at - delayed.publish_time == pytest.approx(DELAY_MS / 1000)
    assert delayed.properties["x-delay"] == str(DELAY_MS)


async def test_v5_x_delay_that_is_not_a_delay_gets_0x83_and_the_connection_survives(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "later", subscriptions=["later/#"])
    client = Paho(gateway.ports["mqtt"], "bad-delay")
    await client.connect()
    try:
        bad = _properties(**{"x-delay": "tomorrow"})
        assert await client.ack(client.publish("later/1", b"bad", 1, bad)) == 0x83
        assert await client.ack(client.publish("later/1", b"good", 1)) == 0
    finally:
        await client.stop()
    assert [r.payload for r in await sql.messages("later")] == [b"good"]


async def test_mqtt5_dedup_id_user_property_is_deduped_on_a_dedup_enabled_queue(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "payments", subscriptions=["payments/#"], dedup_window=60)
    await declare(gateway, "orders", subscriptions=["orders/#"])
    client = Paho(gateway.ports["mqtt"], "paho5-dedup")
    await client.connect()
    try:
        mids = [
            client.publish(f"{queue}/eu", payload, 1, _properties(**{"dedup-id": "tx-1"}))
            for queue in ("payments", "orders")
            for payload in (b"first", b"again")
        ]
        assert [await client.ack(mid) for mid in mids] == [0, 0, 0, 0]
    finally:
        await client.stop()
    (row,) = await sql.messages("payments")
    assert (row.payload, row.dedup_id) == (b"first", "tx-1")
    # A queue that did not enable dedup stores both.
    assert [r.payload for r in await sql.messages("orders")] == [b"first", b"again"]


async def test_mqtt5_empty_dedup_id_is_no_dedup_id(gateway: Gateway, sql: Sql) -> None:
    await declare(gateway, "payments", subscriptions=["payments/#"], dedup_window=60)
    client = Paho(gateway.ports["mqtt"], "paho5-empty-dedup")
    await client.connect()
    try:
        mids = [
            client.publish("payments/eu", payload, 1, _properties(**{"dedup-id": ""}))
            for payload in (b"first", b"second")
        ]
        assert [await client.ack(mid) for mid in mids] == [0, 0]
    finally:
        await client.stop()
    rows = await sql.messages("payments")
    assert [(r.payload, r.dedup_id) for r in rows] == [(b"first", None), (b"second", None)]


async def test_v5_publishes_refused_before_storage_are_acked_in_arrival_order(
    gateway: Gateway, sql: Sql
) -> None:
    """[MQTT-4.6.0-2/3]: a PUBLISH the connection refuses itself (payload not UTF-8 under
    Payload Format Indicator 1: 0x99; an x-delay that is not a delay: 0x83) waits for the
    acks of the publishes before it, which wait for their commit."""
    await declare(gateway, "orders", partitions=4, subscriptions=["orders/#"])
    client = await Raw.connected(gateway.ports["mqtt"], Connect("ack-order"))
    text = MqttProperties(payload_format_indicator=1)
    soon = MqttProperties(user_properties=(("x-delay", "soon"),))
    try:
        await client.send_together(
            *(Publish("orders/a", b"%d" % i, 1, packet_id=i) for i in (1, 2, 3)),
            Publish("orders/a", b"\xff", 1, packet_id=4, properties=text),
            Publish("orders/a", b"x", 2, packet_id=5, properties=soon),
            Publish("orders/a", b"\xff", 0, properties=text),
            Publish("orders/a", b"6", 1, packet_id=6),
        )
        replies = [await client.receive() for _ in range(6)]
    finally:
        client.writer.close()
    acks = [
        (type(r), r.packet_id, r.reason_code) for r in replies if isinstance(r, PubAck | PubRec)
    ]
    assert acks == [
        (PubAck, 1, 0),
        (PubAck, 2, 0),
        (PubAck, 3, 0),
        (PubAck, 4, ReasonCode.PAYLOAD_FORMAT_INVALID),
        (PubRec, 5, ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR),
        (PubAck, 6, 0),
    ]
    assert sorted(r.payload for r in await sql.messages("orders")) == [b"1", b"2", b"3", b"6"]
    assert gateway.broker is not None
    metrics = gateway.broker.metrics.render().decode()
    assert 'keygate_listener_qos0_dropped_total{listener="mqtt"} 1.0' in metrics


async def test_a_resent_qos2_publish_already_stored_is_acked_after_the_publishes_before_it(
    gateway: Gateway, sql: Sql
) -> None:
    """[MQTT-4.6.0-3]: a QoS 2 PUBLISH re-sent after it was stored (its PUBREC lost) is
    answered PUBREC again, not stored again — in its turn, after the PUBACK of a QoS 1
    publish sent before it, which waits for its commit."""
    await declare(gateway, "orders", partitions=4, subscriptions=["orders/#"])
    client = await Raw.connected(gateway.ports["mqtt"], Connect("resender"))
    try:
        await client.send_together(Publish("orders/a", b"2", 2, packet_id=2))
        first = await client.receive()
        await client.send_together(
            Publish("orders/a", b"1", 1, packet_id=1),
            Publish("orders/a", b"2", 2, packet_id=2, dup=True),
        )
        replies = [await client.receive() for _ in range(2)]
    finally:
        client.writer.close()
    assert (type(first), first.packet_id) == (PubRec, 2)
    assert [(type(r), r.packet_id, r.reason_code) for r in replies] == [
        (PubAck, 1, 0),
        (PubRec, 2, 0),
    ]
    assert sorted(r.payload for r in await sql.messages("orders")) == [b"1", b"2"]


async def test_v5_any_correlation_data_is_stored_with_a_correlation_id_where_one_fits(
    gateway: Gateway, sql: Sql
) -> None:
    """Correlation Data is binary (MQTT 5 §3.3.2.3.6): ``correlation_id`` is its text when
    it is UTF-8 without NUL and fits 1,024 bytes, else its hex when that fits, else none;
    the exact bytes are always in ``x-mqtt-correlation-data``."""
    await declare(gateway, "replies", subscriptions=["replies/#"])
    expected = {
        b"\x00\x00\x00\x2a": "0000002a",  # valid UTF-8, but NUL has no place in text
        b"c" * 1024: "c" * 1024,
        b"\xff" * 512: "ff" * 512,
        b"c\x00" * 300: None,  # hex would be 1,200 bytes
        b"\xff" * 600: None,
        b"c" * 40_000: None,
    }
    client = Paho(gateway.ports["mqtt"], "correlated")
    await client.connect()
    try:
        mids = []
        for i, data in enumerate(expected):
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            props.CorrelationData = data
            mids.append(client.publish("replies/x", b"%d" % i, 1, props))
        assert [await client.ack(mid) for mid in mids] == [0] * len(expected)
    finally:
        await client.stop()
    rows = {r.payload: r for r in await sql.messages("replies")}
    for i, (data, correlation_id) in enumerate(expected.items()):
        row = rows[b"%d" % i]
        assert row.properties["x-mqtt-correlation-data"] == data
        assert row.correlation_id == correlation_id


async def test_v5_message_expiry_interval_0_is_stored_without_expiry(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "forever", subscriptions=["forever/#"])
    client = Paho(gateway.ports["mqtt"], "no-expiry")
    await client.connect()
    try:
        mids = []
        for qos in (0, 1, 2):
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            props.MessageExpiryInterval = 0
            mids.append(client.publish("forever/x", b"%d" % qos, qos, props))
        assert [await client.ack(mid) for mid in mids[1:]] == [0, 0]
    finally:
        await client.stop()
    rows = await sql.wait_messages("forever", 3)
    assert sorted((r.payload, r.expire_at) for r in rows) == [
        (b"0", None),
        (b"1", None),
        (b"2", None),
    ]
