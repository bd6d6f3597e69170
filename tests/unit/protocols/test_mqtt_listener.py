"""The MQTT listener against an in-memory sink, driven by real clients (paho-mqtt v5 and
3.1.1, amqtt) and by a raw socket speaking our own codec for the corner cases."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from core.model import QueueConfig
from protocols.mqtt import (
    MQTT_3_1_1,
    MQTT_5,
    ConnAck,
    Connect,
    Disconnect,
    MqttListener,
    MqttProperties,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    Subscribe,
    Subscription,
    Will,
)
from protocols.sink import Principal
from tests.support.memory_sink import MemorySink
from tests.support.mqtt_raw import RawMqtt as Raw

WAIT = 10.0
ADMIN = Principal("admin", "test")


@pytest.fixture
async def sink() -> MemorySink:
    memory = MemorySink()
    await memory.declare_queue(ADMIN, QueueConfig("orders", subscriptions=("orders/#",)))
    return memory


@pytest.fixture(autouse=True)
async def close_raw_clients() -> AsyncIterator[None]:
    yield
    await Raw.close_all()


@dataclass
class Served:
    listener: MqttListener
    port: int


@pytest.fixture
async def served(sink: MemorySink) -> AsyncIterator[Served]:
    server = MqttListener(sink, max_packet_size=64 * 1024, receive_maximum=8)
    yield Served(server, await server.start("127.0.0.1", 0, None))
    await server.close()


class Paho:
    """A paho-mqtt 2.x client on its network thread, with acks surfaced as events."""

    def __init__(self, port: int, protocol: Any = paho.MQTTv5, client_id: str = "", **auth: str):
        self.port = port
        self.v5 = protocol == paho.MQTTv5
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=protocol,
            reconnect_on_failure=False,
        )
        if auth:
            self.client.username_pw_set(auth["username"], auth["password"])
        self.connected = threading.Event()
        self.connack: Any = None
        self.subscribed = threading.Event()
        self.suback: list[Any] = []
        self.acks: dict[int, Any] = {}
        self.acked = threading.Condition()
        self.client.on_connect = self._on_connect
        self.client.on_publish = self._on_publish
        self.client.on_subscribe = self._on_subscribe
        self.client.on_connect_fail = lambda *a: self.connected.set()

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        self.connack = rc
        self.connected.set()

    def _on_publish(self, client: Any, userdata: Any, mid: int, rc: Any, props: Any) -> None:
        with self.acked:
            self.acks[mid] = rc
            self.acked.notify_all()

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, codes: Any, props: Any) -> None:
        self.suback = list(codes)
        self.subscribed.set()

    async def connect(self) -> Any:
        self.client.connect("127.0.0.1", self.port, keepalive=30)
        self.client.loop_start()
        assert await asyncio.to_thread(self.connected.wait, WAIT)
        return self.connack

    async def wait_ack(self, mid: int, within: float = WAIT) -> Any:
        def wait() -> Any:
            with self.acked:
                self.acked.wait_for(lambda: mid in self.acks, within)
                return self.acks.get(mid)

        return await asyncio.to_thread(wait)

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _user_props(**values: str) -> Properties:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.UserProperty = list(values.items())
    return props


async def test_paho_v5_publishes_at_every_qos_arrive_with_their_properties(
    served: Served, sink: MemorySink
) -> None:
    client = Paho(served.port, client_id="paho5")
    assert (await client.connect()) == 0
    try:
        mids = []
        for qos in (0, 1, 2):
            props = _user_props(JMSXGroupID=f"group-{qos}", region="eu")
            props.CorrelationData = b"\xff\x01"
            props.ResponseTopic = "replies/paho5"
            props.MessageExpiryInterval = 60
            props.ContentType = "text/plain"
            info = client.client.publish(f"orders/{qos}", f"m{qos}".encode(), qos, properties=props)
            mids.append(info.mid)
        for mid in mids[1:]:
            assert (await client.wait_ack(mid)) == 0
        stored = await sink.wait_stored(3)
    finally:
        client.stop()
    by_topic = {s.publication.topic or "": s.publication for s in stored}
    assert sorted(by_topic) == ["orders/0", "orders/1", "orders/2"]
    pub = by_topic["orders/2"]
    assert pub.payload == b"m2"
    assert pub.properties["JMSXGroupID"] == "group-2"
    assert pub.properties["region"] == "eu"
    assert pub.properties["x-mqtt-correlation-data"] == b"\xff\x01"
    assert pub.correlation_id == "ff01"
    assert (pub.reply_to, pub.ttl, pub.content_type) == ("replies/paho5", 60.0, "text/plain")
    assert pub.producer == "mqtt:paho5"


async def test_paho_v311_publish_at_qos_1_is_stored_in_order(
    served: Served, sink: MemorySink
) -> None:
    client = Paho(served.port, paho.MQTTv311, client_id="paho3")
    assert (await client.connect()) == 0
    try:
        infos = [client.client.publish("orders/x", str(i).encode(), 1) for i in range(50)]
        for info in infos:
            await client.wait_ack(info.mid)
        stored = await sink.wait_stored(50)
    finally:
        client.stop()
    assert [s.publication.payload for s in stored] == [str(i).encode() for i in range(50)]


async def test_amqtt_client_publishes_at_qos_1(served: Served, sink: MemorySink) -> None:
    from amqtt.client import MQTTClient

    client = MQTTClient(client_id="amqtt-1", config={"auto_reconnect": False})
    await client.connect(f"mqtt://127.0.0.1:{served.port}/")
    try:
        await client.publish("orders/amqtt", b"hello", qos=1)
    finally:
        await client.disconnect()
    stored = await sink.wait_stored(1)
    assert stored[0].publication.payload == b"hello"
    assert stored[0].publication.producer == "mqtt:amqtt-1"


async def test_puback_is_sent_only_after_the_commit(served: Served, sink: MemorySink) -> None:
    client = Paho(served.port, client_id="gated")
    await client.connect()
    try:
        sink.gate.clear()
        info = client.client.publish("orders/gated", b"x", 1)
        assert await client.wait_ack(info.mid, within=0.5) is None
        assert sink.stored == []
        sink.gate.set()
        assert (await client.wait_ack(info.mid)) == 0
        assert len(sink.stored) == 1
    finally:
        sink.gate.set()
        client.stop()


async def test_unroutable_topic_gets_puback_0x10_in_v5(served: Served) -> None:
    client = Paho(served.port)
    await client.connect()
    try:
        info = client.client.publish("nowhere/1", b"x", 1)
        assert (await client.wait_ack(info.mid)) == ReasonCode.NO_MATCHING_SUBSCRIBERS
    finally:
        client.stop()


async def test_unroutable_qos0_publish_is_counted_as_dropped(
    served: Served, sink: MemorySink
) -> None:
    client = await Raw.connected(served.port, Connect("q0"))
    await client.send(Publish("nowhere/0", b"lost"))
    await client.send(Publish("orders/1", b"kept", 1, packet_id=1))
    assert await client.receive() == PubAck(1)  # acks follow arrival order
    assert served.listener.stats.qos0_dropped == 1
    assert [s.publication.payload for s in sink.stored] == [b"kept"]


@pytest.mark.parametrize(
    ("protocol", "expected"), [(paho.MQTTv5, 0x86), (paho.MQTTv311, 4)], ids=["v5", "v311"]
)
async def test_bad_credentials_are_refused(sink: MemorySink, protocol: Any, expected: int) -> None:
    sink.users = {"alice": "secret"}
    server = MqttListener(sink)
    port = await server.start("127.0.0.1", 0, None)
    client = Paho(port, protocol, client_id="x", username="alice", password="wrong")
    try:
        # paho reports the 3.1.1 return code 4 as its MQTT 5 equivalent, 0x86.
        assert (await client.connect()) == 0x86
    finally:
        client.client.loop_stop()
    raw = await Raw.open(port, protocol)
    await raw.send(Connect("x", protocol, username="alice", password=b"wrong"))
    try:
        reply = await raw.receive()
        assert isinstance(reply, ConnAck) and reply.reason_code == expected
        assert await raw.receive() is None
    finally:
        await server.close()


async def test_subscribe_is_refused_and_the_connection_stays_usable(
    served: Served, sink: MemorySink
) -> None:
    client = Paho(served.port)
    await client.connect()
    try:
        client.client.subscribe("orders/#", 1)
        assert await asyncio.to_thread(client.subscribed.wait, WAIT)
        assert [int(code.value) for code in client.suback] == [0x83]
        info = client.client.publish("orders/after", b"still here", 1)
        assert (await client.wait_ack(info.mid)) == 0
    finally:
        client.stop()
    assert (await sink.wait_stored(1))[0].publication.payload == b"still here"


async def test_qos2_duplicate_after_reconnect_is_stored_once(
    served: Served, sink: MemorySink
) -> None:
    port = served.port
    persistent = Connect(
        "q2", MQTT_5, clean_start=False, properties=MqttProperties(session_expiry_interval=60)
    )
    first = await Raw.connected(port, persistent)
    await first.send(Publish("orders/q2", b"once", 2, packet_id=7))
    assert await first.receive() == PubRec(7)
    first.abort()  # the PUBREC is "lost": the client will re-send the PUBLISH
    second = await Raw.connected(port, persistent)
    assert second.connack.session_present
    await second.send(Publish("orders/q2", b"once", 2, dup=True, packet_id=7))
    assert await second.receive() == PubRec(7)
    await second.send(PubRel(7))
    assert await second.receive() == PubComp(7)
    await second.send(Publish("orders/q2", b"next", 1, packet_id=8))
    assert await second.receive() == PubAck(8)
    assert [s.publication.payload for s in sink.stored] == [b"once", b"next"]
    await second.send(Disconnect())


async def test_will_message_is_published_when_the_socket_drops(
    served: Served, sink: MemorySink
) -> None:
    will = Will("orders/wills", b"gone", 1, properties=MqttProperties(content_type="text/plain"))
    client = await Raw.connected(served.port, Connect("w1", will=will))
    client.abort()
    stored = await sink.wait_stored(1)
    assert stored[0].publication.payload == b"gone"
    assert stored[0].publication.content_type == "text/plain"


async def test_a_delayed_will_is_cancelled_when_the_client_reconnects_in_time(
    served: Served, sink: MemorySink
) -> None:
    delayed = Will("orders/wills", b"gone", properties=MqttProperties(will_delay_interval=60))
    expiry = MqttProperties(session_expiry_interval=60)
    first = await Raw.connected(served.port, Connect("w3", will=delayed, properties=expiry))
    first.abort()
    again = await Raw.connected(served.port, Connect("w3", clean_start=False))
    await again.send(Publish("orders/marker", b"marker", 1, packet_id=1))
    assert await again.receive() == PubAck(1)
    await served.listener.close()  # would publish a pending will if it were still due
    assert [s.publication.payload for s in sink.stored] == [b"marker"]


async def test_will_message_is_dropped_on_a_normal_disconnect(
    served: Served, sink: MemorySink
) -> None:
    port = served.port
    client = await Raw.connected(port, Connect("w2", will=Will("orders/wills", b"gone")))
    await client.send(Disconnect())
    assert await client.receive() is None  # the server closed after DISCONNECT
    # The same client id reconnecting proves the first connection has fully ended.
    again = await Raw.connected(port, Connect("w2"))
    await again.send(Publish("orders/marker", b"marker", 1, packet_id=1))
    assert await again.receive() == PubAck(1)
    assert [s.publication.payload for s in sink.stored] == [b"marker"]
    assert served.listener.stats.wills == 0


async def test_session_takeover_disconnects_the_old_connection_with_0x8e(
    served: Served,
) -> None:
    port = served.port
    old = await Raw.connected(port, Connect("dup"))
    await Raw.connected(port, Connect("dup"))
    assert await old.receive() == Disconnect(ReasonCode.SESSION_TAKEN_OVER)
    assert await old.receive() is None


async def test_oversize_packet_gets_disconnect_0x95(served: Served) -> None:
    client = await Raw.connected(served.port, Connect("big"))
    assert client.connack.properties.maximum_packet_size == 64 * 1024
    await client.send(Publish("orders/big", b"x" * (64 * 1024), 1, packet_id=1))
    assert await client.receive() == Disconnect(ReasonCode.PACKET_TOO_LARGE)
    assert await client.receive() is None


async def test_malformed_bytes_close_the_connection_and_the_server_keeps_serving(
    served: Served, sink: MemorySink
) -> None:
    port = served.port
    garbage = await Raw.open(port)
    garbage.writer.write(b"\x10\x05\x00\x04MQ\xff\xff\xff")
    assert await garbage.receive() is None
    v3 = await Raw.connected(port, Connect("v3", MQTT_3_1_1))
    v3.writer.write(b"\x36\x03\x00\x01t")  # PUBLISH at QoS 3
    assert await v3.receive() is None  # 3.1.1: closed without a DISCONNECT
    v5 = await Raw.connected(port, Connect("v5"))
    v5.writer.write(b"\x30\x04\x00\x02\xc3\x28")  # invalid UTF-8 topic
    assert await v5.receive() == Disconnect(ReasonCode.MALFORMED_PACKET)
    client = Paho(port)
    await client.connect()
    try:
        info = client.client.publish("orders/ok", b"ok", 1)
        assert (await client.wait_ack(info.mid)) == 0
    finally:
        client.stop()
    assert served.listener.stats.protocol_errors == 3


async def test_exceeding_receive_maximum_gets_disconnect_0x93(
    served: Served, sink: MemorySink
) -> None:
    client = await Raw.connected(served.port, Connect("flood"))
    assert client.connack.properties.receive_maximum == 8
    sink.gate.clear()
    for packet_id in range(1, 10):
        await client.send(Publish("orders/f", b"x", 1, packet_id=packet_id))
    assert await client.receive() == Disconnect(ReasonCode.RECEIVE_MAXIMUM_EXCEEDED)
    sink.gate.set()


async def test_topic_alias_names_the_topic_of_later_publishes(
    served: Served, sink: MemorySink
) -> None:
    client = await Raw.connected(served.port, Connect("alias"))
    alias = MqttProperties(topic_alias=1)
    await client.send(Publish("orders/aliased", b"1", 1, packet_id=1, properties=alias))
    await client.send(Publish("", b"2", 1, packet_id=2, properties=alias))
    assert [await client.receive(), await client.receive()] == [PubAck(1), PubAck(2)]
    assert [s.publication.topic for s in sink.stored] == ["orders/aliased"] * 2
    await client.send(Publish("", b"3", 0, properties=MqttProperties(topic_alias=2)))
    assert await client.receive() == Disconnect(ReasonCode.PROTOCOL_ERROR)


async def test_storage_failure_is_puback_0x80_in_v5_and_a_closed_socket_in_v311(
    served: Served, sink: MemorySink
) -> None:
    port = served.port
    sink.fail_writes = True
    v5 = await Raw.connected(port, Connect("fail5"))
    await v5.send(Publish("orders/f", b"x", 1, packet_id=1))
    reply = await v5.receive()
    assert isinstance(reply, PubAck) and reply.reason_code == ReasonCode.UNSPECIFIED_ERROR
    v3 = await Raw.connected(port, Connect("fail3", MQTT_3_1_1))
    await v3.send(Publish("orders/f", b"x", 1, packet_id=1))
    assert await v3.receive() is None


async def test_invalid_utf8_with_payload_format_1_gets_puback_0x99(
    served: Served, sink: MemorySink
) -> None:
    client = await Raw.connected(served.port, Connect("pfi"))
    text = MqttProperties(payload_format_indicator=1)
    await client.send(Publish("orders/t", b"\xff", 1, packet_id=1, properties=text))
    reply = await client.receive()
    assert isinstance(reply, PubAck) and reply.reason_code == ReasonCode.PAYLOAD_FORMAT_INVALID
    assert sink.stored == []


async def test_connect_rules_for_client_ids_and_protocol_levels(served: Served) -> None:
    port = served.port
    v3 = await Raw.open(port, MQTT_3_1_1)
    await v3.send(Connect("", MQTT_3_1_1, clean_start=False))
    assert await v3.receive() == ConnAck(False, 2)  # identifier rejected
    v5 = await Raw.connected(port, Connect(""))
    assigned = v5.connack.properties.assigned_client_identifier
    assert assigned and assigned.startswith("keygate-")
    old = await Raw.open(port, MQTT_3_1_1)
    old.writer.write(b"\x10\x0c\x00\x06MQIsdp\x03\x02\x00\x3c")
    assert await old.receive() == ConnAck(False, 1)  # unacceptable protocol version


async def test_keep_alive_is_enforced_at_one_and_a_half_times(served: Served) -> None:
    client = await Raw.connected(served.port, Connect("idle", keep_alive=1))
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await client.receive() == Disconnect(ReasonCode.KEEP_ALIVE_TIMEOUT)
    assert loop.time() - start >= 1.4


async def test_a_packet_before_connect_closes_the_socket(served: Served) -> None:
    client = await Raw.open(served.port)
    await client.send(Subscribe(1, (Subscription("a"),)))
    assert await client.receive() is None


async def test_close_ends_every_connection(sink: MemorySink) -> None:
    server = MqttListener(sink)
    port = await server.start("127.0.0.1", 0, None)
    client = await Raw.connected(port, Connect("c"))
    await server.close()
    assert await client.receive() == Disconnect(ReasonCode.SERVER_SHUTTING_DOWN)
    assert await client.receive() is None


async def test_pubcomp_waits_for_the_durable_release_and_a_failed_one_closes(
    served: Served, sink: MemorySink
) -> None:
    """The client reuses a packet id after PUBCOMP: the stored session must have let the
    id go first, or after a failover the next message with that id would be dropped as a
    re-send. When the release cannot be stored, no PUBCOMP: the client sends PUBREL again."""
    lasting = MqttProperties(session_expiry_interval=600)
    client = await Raw.connected(served.port, Connect("rel", clean_start=False, properties=lasting))
    await client.send(Publish("orders/r", b"x", 2, packet_id=5))
    assert await client.receive() == PubRec(5)
    assert sink.mqtt_sessions["rel"] == {5}
    await client.send(PubRel(5))
    assert await client.receive() == PubComp(5)
    assert sink.mqtt_sessions["rel"] == frozenset()
    await client.send(Publish("orders/r", b"y", 2, packet_id=6))
    assert await client.receive() == PubRec(6)
    sink.fail_writes = True
    await client.send(PubRel(6))
    assert await client.receive() is None  # closed, no PUBCOMP
    assert sink.mqtt_sessions["rel"] == {6}  # the session still waits for that PUBREL
