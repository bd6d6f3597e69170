"""The MQTT codec: every packet round-trips whole, byte by byte and followed by more bytes;
bad input raises only MqttProtocolError subclasses."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.mqtt import (
    MQTT_3_1_1,
    MQTT_5,
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    MalformedPacket,
    MqttCodec,
    MqttProperties,
    MqttProtocolError,
    Packet,
    PacketTooLarge,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    UnsupportedProtocolVersion,
    Will,
)

RICH = MqttProperties(
    payload_format_indicator=1,
    message_expiry_interval=30,
    content_type="application/json",
    response_topic="replies/1",
    correlation_data=b"\x00\xffcorr",
    user_properties=(("JMSXGroupID", "order-1"), ("a", "1"), ("a", "2")),
)

COMMON: list[Packet] = [
    ConnAck(True, 0),
    Publish("orders/eu", b"payload", 0),
    Publish("orders/eu", b"", 1, retain=True, dup=True, packet_id=1),
    Publish("x/\u00e9", b"\x00" * 300, 2, packet_id=65535),
    PubAck(1),
    PubRec(2),
    PubRel(3),
    PubComp(4),
    Subscribe(5, (Subscription("a/+/b", 1), Subscription("#", 2))),
    SubAck(5, (0, 1, 0x80)),
    Unsubscribe(6, ("a/+/b", "c")),
    PingReq(),
    PingResp(),
    Disconnect(),
]
V3: list[Packet] = [
    *COMMON,
    Connect("client-1", MQTT_3_1_1, clean_start=False, keep_alive=0),
    Connect("c", MQTT_3_1_1, True, 30, "user", b"\x00pw", Will("wills/c", b"gone", 1, True)),
    UnsubAck(6),
]
V5: list[Packet] = [
    *COMMON,
    Connect("client-1", MQTT_5, clean_start=False, keep_alive=0),
    Connect(
        "",
        MQTT_5,
        True,
        30,
        None,
        b"pw-without-user",
        Will("wills/c", b"gone", 2, False, MqttProperties(will_delay_interval=5)),
        MqttProperties(session_expiry_interval=60, receive_maximum=10, maximum_packet_size=999),
    ),
    ConnAck(
        False,
        0,
        MqttProperties(
            assigned_client_identifier="kg-1",
            receive_maximum=1024,
            topic_alias_maximum=64,
            maximum_packet_size=1 << 20,
            wildcard_subscription_available=0,
        ),
    ),
    ConnAck(False, ReasonCode.BAD_USER_NAME_OR_PASSWORD),
    Publish("orders/eu", b"{}", 1, packet_id=9, properties=RICH),
    Publish("", b"aliased", 0, properties=MqttProperties(topic_alias=3)),
    PubAck(1, ReasonCode.NO_MATCHING_SUBSCRIBERS),
    PubAck(1, ReasonCode.QUOTA_EXCEEDED, MqttProperties(reason_string="full")),
    PubRec(2, ReasonCode.PAYLOAD_FORMAT_INVALID),
    PubRel(3, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND),
    PubComp(4, 0, MqttProperties(user_properties=(("k", "v"),))),
    Subscribe(
        7,
        (Subscription("s/#", 2, no_local=True, retain_as_published=True, retain_handling=2),),
        MqttProperties(subscription_identifiers=(12,)),
    ),
    SubAck(7, (0x83,), MqttProperties(reason_string="no")),
    UnsubAck(6, (0x11, 0x11)),
    Disconnect(ReasonCode.SESSION_TAKEN_OVER, MqttProperties(reason_string="bye")),
    Disconnect(ReasonCode.DISCONNECT_WITH_WILL),
    Auth(ReasonCode.CONTINUE_AUTHENTICATION, MqttProperties(authentication_method="SCRAM")),
]
CASES = [(MQTT_3_1_1, p) for p in V3] + [(MQTT_5, p) for p in V5]


def _decode_all(codec: MqttCodec, chunks: list[bytes]) -> list[Packet]:
    events = []
    for chunk in chunks:
        codec.receive_data(chunk)
        while (event := codec.next_event()) is not None:
            events.append(event)
    return events


@pytest.mark.parametrize(("version", "packet"), CASES, ids=lambda v: type(v).__name__)
def test_every_packet_round_trips_whole_byte_by_byte_and_with_trailing_bytes(
    version: int, packet: Packet
) -> None:
    data = MqttCodec(version=version).send(packet)
    whole = _decode_all(MqttCodec(version=version), [data])
    one_by_one = _decode_all(MqttCodec(version=version), [bytes([b]) for b in data])
    codec = MqttCodec(version=version)
    head = data[: len(data) - 1]  # an incomplete start of the next packet
    trailing = _decode_all(codec, [data + head])
    assert whole == one_by_one == trailing == [packet]
    codec.receive_data(data[len(head) :])
    assert codec.next_event() == packet


def test_connect_teaches_the_codec_its_protocol_level() -> None:
    client = MqttCodec(version=MQTT_3_1_1)
    server = MqttCodec()
    data = client.send(Connect("c", MQTT_3_1_1)) + client.send(Publish("t", b"x", 1, packet_id=1))
    assert _decode_all(server, [data])[1] == Publish("t", b"x", 1, packet_id=1)
    assert server.version == MQTT_3_1_1


def test_v5_ack_with_only_a_packet_id_means_success() -> None:
    codec = MqttCodec(version=MQTT_5)
    codec.receive_data(b"\x40\x02\x00\x07")
    assert codec.next_event() == PubAck(7, 0)


def test_variable_byte_integer_lengths_span_one_to_four_bytes() -> None:
    codec = MqttCodec(version=MQTT_5)
    for size in (0, 127, 128, 16383, 16384, 2_097_152):
        packet = Publish("t", b"x" * size)
        codec.receive_data(codec.send(packet))
        assert codec.next_event() == packet


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"\x30\xff\xff\xff\xff\x01", MalformedPacket),  # 5-byte remaining length
        (b"\x36\x03\x00\x01t", MalformedPacket),  # PUBLISH QoS 3
        (b"\x38\x03\x00\x01t", MalformedPacket),  # DUP on QoS 0
        (b"\x62\x02\x00\x00", MalformedPacket),  # packet identifier 0
        (b"\x60\x02\x00\x01", MalformedPacket),  # PUBREL without its 0b0010 flags
        (b"\xc1\x00", MalformedPacket),  # PINGREQ with flags
        (b"\x00\x00", MalformedPacket),  # reserved packet type 0
        (b"\xc0\x01\x00", MalformedPacket),  # PINGREQ with a body
        (b"\x30\x04\x00\x02\xc3\x28", MalformedPacket),  # invalid UTF-8 topic
        (b"\x30\x04\x00\x02a\x00", MalformedPacket),  # U+0000 in topic
        (b"\x30\x03\x00\x05a", MalformedPacket),  # string longer than the packet
        (b"\x82\x03\x00\x01\x00", MalformedPacket),  # SUBSCRIBE without filters
        (b"\x30\x05\x00\x01t\x02\x63", MalformedPacket),  # unknown property 0x63
        (b"\x30\x05\x00\x01t\x02\x11", MalformedPacket),  # property not allowed in PUBLISH
        (b"\x30\x07\x00\x01t\x04\x01\x01\x01\x01", MqttProtocolError),  # repeated property
        (b"\x10\x0a\x00\x04MQTT\x06\x02\x00\x3c\x00", UnsupportedProtocolVersion),
        (b"\x10\x0a\x00\x04MQTT\x04\x03\x00\x3c\x00\x00", MalformedPacket),  # reserved bit
        (b"\x10\x0a\x00\x04MQTT\x04\x18\x00\x3c\x00\x00", MalformedPacket),  # will QoS 3 alone
    ],
)
def test_bad_bytes_raise_the_right_protocol_error(data: bytes, error: type[Exception]) -> None:
    codec = MqttCodec(version=MQTT_5)
    codec.receive_data(data)
    with pytest.raises(error):
        codec.next_event()


def test_a_packet_over_the_maximum_size_is_refused_from_its_header() -> None:
    codec = MqttCodec(version=MQTT_5, max_packet_size=100)
    codec.receive_data(b"\x30\xe8\x07")  # announces 1000 bytes, none of them sent
    with pytest.raises(PacketTooLarge) as caught:
        codec.next_event()
    assert caught.value.reason_code == ReasonCode.PACKET_TOO_LARGE


def test_mqtt_3_1_1_has_no_auth_packet() -> None:
    codec = MqttCodec(version=MQTT_3_1_1)
    codec.receive_data(b"\xf0\x00")
    with pytest.raises(MalformedPacket):
        codec.next_event()


def _feed(version: int, data: bytes) -> None:
    codec = MqttCodec(version=version, max_packet_size=4096)
    codec.receive_data(data)
    try:
        while codec.next_event() is not None:
            pass
    except MqttProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([MQTT_3_1_1, MQTT_5]), st.binary(max_size=200))
def test_random_bytes_raise_nothing_but_protocol_errors(version: int, data: bytes) -> None:
    _feed(version, data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(CASES), st.data())
def test_mutated_valid_packets_raise_nothing_but_protocol_errors(
    case: tuple[int, Packet], data: st.DataObject
) -> None:
    version, packet = case
    raw = bytearray(MqttCodec(version=version).send(packet))
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, len(raw) - 1))
        raw[index] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    _feed(version, bytes(raw[:cut]) + bytes(raw))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(1, 40), max_size=20))
def test_any_split_of_a_stream_gives_the_same_packets(
    case: tuple[int, Packet], sizes: list[int]
) -> None:
    version, packet = case
    data = MqttCodec(version=version).send(packet) * 2
    chunks, pos = [], 0
    for size in sizes:
        chunks.append(data[pos : pos + size])
        pos += size
    chunks.append(data[pos:])
    assert _decode_all(MqttCodec(version=version), chunks) == [packet, packet]


# type 0 is reserved; AUTH with flags 5; SUBSCRIBE without its 0b0010; PUBACK with flags 4.
@pytest.mark.parametrize("first", [0x00, 0xF5, 0x80, 0x44])
def test_an_impossible_first_byte_is_refused_before_its_claimed_body(first: int) -> None:
    codec = MqttCodec(version=MQTT_5)
    codec.receive_data(bytes([first, 0xFF, 0x7F]))  # claims ~16 KB that never comes
    with pytest.raises(MalformedPacket):
        codec.next_event()
