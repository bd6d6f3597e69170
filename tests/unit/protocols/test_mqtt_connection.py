"""The sans-IO MQTT server state machine and the session store, without sockets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.mqtt import (
    MQTT_3_1_1,
    MQTT_5,
    ConnAck,
    Connect,
    ConnectRequest,
    Disconnect,
    Limits,
    MqttCodec,
    MqttProperties,
    MqttProtocolError,
    Packet,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PublishRequest,
    PubRec,
    PubRel,
    ReasonCode,
    ServerConnection,
    SessionStore,
    UnsubAck,
    Unsubscribe,
    Will,
)
from protocols.mqtt.connection import AnsweredPublish, ReleaseRequest, Request, State
from protocols.mqtt.errors import PayloadFormatInvalid, publish_reason

LIMITS = Limits(max_packet_size=4096, receive_maximum=2, topic_alias_maximum=4)


class Harness:
    """A server connection plus a client-side codec to speak to it."""

    def __init__(self, version: int = MQTT_5, limits: Limits = LIMITS) -> None:
        self.conn = ServerConnection(limits)
        self.client = MqttCodec(version=version)
        self.version = version
        self.sessions = SessionStore()
        self.now = 100.0

    def feed(self, *packets: Packet) -> Request | None:
        for packet in packets:
            self.conn.receive_data(self.client.send(packet), self.now)
        return self.conn.next_event()

    def replies(self) -> list[Packet]:
        self.client.receive_data(self.conn.data_to_send())
        out = []
        while (packet := self.client.next_event()) is not None:
            out.append(packet)
        return out

    def connect(self, connect: Connect | None = None) -> ConnAck:
        request = self.feed(connect or Connect("c1", self.version, keep_alive=10))
        assert isinstance(request, ConnectRequest)
        session, present = self.sessions.open(
            request.client_id, request.connect.clean_start, self.now
        )
        self.conn.accept(session, present, request.client_id)
        [connack] = self.replies()
        assert isinstance(connack, ConnAck)
        return connack


def test_the_first_packet_must_be_connect() -> None:
    harness = Harness()
    with pytest.raises(MqttProtocolError):
        harness.feed(PingReq())
    assert harness.conn.state is State.CLOSED
    assert harness.replies() == []  # no DISCONNECT before a CONNACK


def test_connack_advertises_our_limits_in_v5() -> None:
    connack = Harness().connect()
    assert connack.properties.receive_maximum == 2
    assert connack.properties.maximum_packet_size == 4096
    assert connack.properties.topic_alias_maximum == 4
    assert connack.properties.shared_subscription_available == 0


def test_a_second_connect_is_a_protocol_error() -> None:
    harness = Harness()
    harness.connect()
    with pytest.raises(MqttProtocolError):
        harness.feed(Connect("c1"))
    assert harness.replies() == [Disconnect(ReasonCode.PROTOCOL_ERROR)]


def test_keep_alive_deadline_is_one_and_a_half_times_the_interval() -> None:
    harness = Harness()
    harness.connect()
    assert harness.conn.keep_alive_deadline == 115.0
    harness.now = 110.0
    harness.feed(PingReq())
    assert harness.replies() == [PingResp()]
    assert not harness.conn.keep_alive_expired(124.9)
    assert harness.conn.keep_alive_expired(125.0)
    assert harness.replies() == [Disconnect(ReasonCode.KEEP_ALIVE_TIMEOUT)]


def test_publish_becomes_a_request_and_is_acked_only_when_completed() -> None:
    harness = Harness()
    harness.connect()
    request = harness.feed(Publish("a/b", b"x", 1, packet_id=5))
    assert isinstance(request, PublishRequest)
    assert request.publication.topic == "a/b" and request.publication.producer == "mqtt:c1"
    assert harness.replies() == []
    harness.conn.complete(1, 5, ReasonCode.SUCCESS)
    assert harness.replies() == [PubAck(5)]


@pytest.mark.parametrize("qos", [1, 2])
def test_a_publish_refused_before_storage_is_acked_only_when_completed_in_its_turn(
    qos: int,
) -> None:
    harness = Harness()
    harness.connect()
    text = MqttProperties(payload_format_indicator=1)
    refused = harness.feed(Publish("a/b", b"\xff", qos, packet_id=5, properties=text))
    assert isinstance(refused, AnsweredPublish)
    assert isinstance(refused.error, PayloadFormatInvalid)
    assert (refused.topic, refused.qos, refused.packet_id) == ("a/b", qos, 5)
    assert harness.replies() == []  # the pipeline completes it after the publishes before it
    assert harness.conn.unacknowledged == 1
    reason = publish_reason(refused.error)
    assert reason == ReasonCode.PAYLOAD_FORMAT_INVALID
    harness.conn.complete(qos, 5, reason)
    assert harness.replies() == [(PubAck if qos == 1 else PubRec)(5, reason)]
    assert harness.conn.unacknowledged == 0


def test_receive_maximum_counts_unacknowledged_qos_1_and_2() -> None:
    harness = Harness()
    harness.connect()
    assert harness.feed(Publish("t", b"", 1, packet_id=1)) is not None
    assert harness.feed(Publish("t", b"", 2, packet_id=2)) is not None
    harness.conn.complete(1, 1, ReasonCode.SUCCESS)
    assert harness.feed(Publish("t", b"", 1, packet_id=3)) is not None
    with pytest.raises(MqttProtocolError) as caught:
        harness.feed(Publish("t", b"", 1, packet_id=4))
    assert caught.value.reason_code == ReasonCode.RECEIVE_MAXIMUM_EXCEEDED


def test_mqtt_3_1_1_has_no_receive_maximum() -> None:
    harness = Harness(MQTT_3_1_1)
    harness.connect(Connect("c1", MQTT_3_1_1))
    for packet_id in range(1, 10):
        assert harness.feed(Publish("t", b"", 1, packet_id=packet_id)) is not None


def test_qos2_exactly_once_within_a_connection() -> None:
    harness = Harness()
    harness.connect()
    assert harness.feed(Publish("t", b"x", 2, packet_id=9)) is not None
    # Re-sent while the first copy is still being stored: nothing new to do.
    assert harness.feed(Publish("t", b"x", 2, dup=True, packet_id=9)) is None
    harness.conn.complete(2, 9, ReasonCode.SUCCESS)
    # Re-sent once stored: answered in its turn (after acks before it), not stored again.
    resent = AnsweredPublish("t", 2, 9, None)
    assert harness.feed(Publish("t", b"x", 2, dup=True, packet_id=9)) == resent
    harness.conn.complete(2, 9, ReasonCode.SUCCESS)
    assert harness.replies() == [PubRec(9), PubRec(9)]
    # PUBREL: the listener makes the release durable first; PUBCOMP only after that.
    assert harness.feed(PubRel(9)) == ReleaseRequest(9)
    assert harness.replies() == []
    assert harness.feed(Publish("t", b"x", 2, dup=True, packet_id=9)) == resent  # still known
    harness.conn.complete(2, 9, ReasonCode.SUCCESS)
    harness.conn.released(9)
    assert harness.replies() == [PubRec(9), PubComp(9)]
    harness.feed(PubRel(9))
    assert harness.replies() == [PubComp(9, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND)]


def test_the_answer_to_a_resent_qos2_publish_does_not_undo_a_release() -> None:
    harness = Harness()
    harness.connect()
    harness.feed(Publish("t", b"x", 2, packet_id=9))
    harness.conn.complete(2, 9, ReasonCode.SUCCESS)
    assert harness.feed(Publish("t", b"x", 2, dup=True, packet_id=9)) is not None
    assert harness.feed(PubRel(9)) == ReleaseRequest(9)  # a client that did not wait
    harness.conn.released(9)
    harness.conn.complete(2, 9, ReasonCode.SUCCESS)  # the re-sent one's turn comes
    # Packet id 9 is free again: a new PUBLISH with it is a new message, to be stored.
    assert isinstance(harness.feed(Publish("t", b"y", 2, packet_id=9)), PublishRequest)


def test_a_qos2_commit_after_the_connection_closed_still_reaches_the_session() -> None:
    harness = Harness()
    harness.connect(Connect("c1", clean_start=False))
    harness.feed(Publish("t", b"x", 2, packet_id=3))
    harness.conn.disconnect(ReasonCode.SESSION_TAKEN_OVER)
    harness.conn.complete(2, 3, ReasonCode.SUCCESS)
    assert harness.conn.session is not None and harness.conn.session.qos2_received == {3}


def test_a_refused_qos2_publish_frees_its_packet_id() -> None:
    harness = Harness()
    harness.connect()
    harness.feed(Publish("t", b"x", 2, packet_id=3))
    harness.conn.complete(2, 3, ReasonCode.QUOTA_EXCEEDED)
    [pubrec] = harness.replies()
    assert isinstance(pubrec, PubRec) and pubrec.reason_code == ReasonCode.QUOTA_EXCEEDED
    assert harness.conn.unacknowledged == 0
    assert harness.feed(Publish("t", b"x", 2, packet_id=3)) is not None


@pytest.mark.parametrize("qos", [1, 2])
def test_an_mqtt311_refusal_closes_the_connection_instead_of_acknowledging(qos: int) -> None:
    harness = Harness(MQTT_3_1_1)
    harness.connect(Connect("c1", MQTT_3_1_1))
    harness.feed(Publish("t", b"a", qos, packet_id=1))
    harness.feed(Publish("t", b"b", qos, packet_id=2))
    harness.conn.complete(qos, 1, ReasonCode.SUCCESS)
    harness.conn.complete(qos, 2, ReasonCode.QUOTA_EXCEEDED, "queue 'q' is full")
    assert harness.replies() == [(PubAck if qos == 1 else PubRec)(1)]
    assert harness.conn.state is State.CLOSED


def test_reason_strings_are_dropped_when_the_client_asks_for_no_problem_information() -> None:
    harness = Harness()
    props = MqttProperties(request_problem_information=0)
    harness.connect(Connect("c1", properties=props))
    harness.feed(Publish("t", b"x", 1, packet_id=1))
    harness.conn.complete(1, 1, ReasonCode.QUOTA_EXCEEDED, "queue 'q' is full")
    assert harness.replies() == [PubAck(1, ReasonCode.QUOTA_EXCEEDED)]


def test_the_sink_error_message_becomes_the_reason_string() -> None:
    harness = Harness()
    harness.connect()
    harness.feed(Publish("t", b"x", 1, packet_id=1))
    harness.conn.complete(1, 1, ReasonCode.QUOTA_EXCEEDED, "queue 'q' is full")
    reason = MqttProperties(reason_string="queue 'q' is full")
    assert harness.replies() == [PubAck(1, ReasonCode.QUOTA_EXCEEDED, reason)]


@pytest.mark.parametrize("topic", ["a/+", "a/#", ""])
def test_publish_to_an_invalid_topic_name_is_refused(topic: str) -> None:
    harness = Harness()
    harness.connect()
    with pytest.raises(MqttProtocolError):
        harness.feed(Publish(topic, b"x"))


def test_topic_alias_beyond_our_maximum_is_0x94() -> None:
    harness = Harness()
    harness.connect()
    with pytest.raises(MqttProtocolError) as caught:
        harness.feed(Publish("t", b"x", properties=MqttProperties(topic_alias=5)))
    assert caught.value.reason_code == ReasonCode.TOPIC_ALIAS_INVALID


def test_unsubscribe_is_answered_no_subscription_existed() -> None:
    harness = Harness()
    harness.connect()
    harness.feed(Unsubscribe(4, ("a", "b")))
    assert harness.replies() == [UnsubAck(4, (0x11, 0x11))]


def test_normal_disconnect_drops_the_will_and_0x04_keeps_it() -> None:
    for reason, kept in ((ReasonCode.SUCCESS, False), (ReasonCode.DISCONNECT_WITH_WILL, True)):
        harness = Harness()
        will = Connect("c1", will=Will("w/t", b"bye"))
        harness.connect(will)
        assert harness.conn.will is not None
        harness.feed(Disconnect(reason))
        assert (harness.conn.will is not None) is kept
        assert harness.conn.state is State.CLOSED


def test_session_expiry_cannot_grow_from_zero_on_disconnect() -> None:
    harness = Harness()
    harness.connect()
    with pytest.raises(MqttProtocolError):
        harness.feed(Disconnect(0, MqttProperties(session_expiry_interval=30)))


def test_enhanced_authentication_is_refused_with_0x8c() -> None:
    harness = Harness()
    with pytest.raises(MqttProtocolError):
        harness.feed(Connect("c1", properties=MqttProperties(authentication_method="SCRAM")))
    assert harness.replies() == [ConnAck(False, ReasonCode.BAD_AUTHENTICATION_METHOD)]


def test_sessions_outlive_their_connection_for_their_expiry_interval() -> None:
    store = SessionStore()
    session, present = store.open("c", clean_start=False, now=0.0)
    assert not present
    session.qos2_received.add(1)
    session.expiry_interval = 10.0
    store.release(session, now=0.0)
    resumed, present = store.open("c", clean_start=False, now=9.0)
    assert present and resumed is session and resumed.qos2_received == {1}
    store.release(resumed, now=9.0)
    fresh, present = store.open("c", clean_start=False, now=19.5)
    assert not present and fresh.qos2_received == set()
    fresh.expiry_interval = 0.0
    store.release(fresh, now=20.0)
    assert len(store) == 0


def test_clean_start_discards_a_stored_session() -> None:
    store = SessionStore()
    session, _ = store.open("c", clean_start=False, now=0.0)
    session.expiry_interval = 60.0
    store.release(session, now=0.0)
    fresh, present = store.open("c", clean_start=True, now=1.0)
    assert not present and fresh is not session


CLIENT_PACKETS: list[Packet] = [
    Publish("a/b", b"x", 0),
    Publish("a/b", b"x", 1, packet_id=1),
    Publish("a/b", b"x", 2, packet_id=2),
    Publish("a/b", b"x", 2, dup=True, packet_id=2),
    Publish("a/b", b"\xff", 1, packet_id=3, properties=MqttProperties(payload_format_indicator=1)),
    Publish("a/b", b"x", 1, packet_id=4, properties=MqttProperties(topic_alias=1)),
    Publish("", b"x", 1, packet_id=5, properties=MqttProperties(topic_alias=1)),
    PubRel(2),
    PingReq(),
    Unsubscribe(9, ("a",)),
    Disconnect(),
]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([MQTT_3_1_1, MQTT_5]),
    st.lists(st.one_of(st.binary(max_size=40), st.sampled_from(CLIENT_PACKETS)), max_size=12),
)
def test_any_packet_sequence_after_connect_raises_nothing_but_protocol_errors(
    version: int, items: list[bytes | Packet]
) -> None:
    harness = Harness(version)
    codec = MqttCodec(version=version)
    chunks = [item if isinstance(item, bytes) else codec.send(item) for item in items]
    harness.connect(Connect("c1", version))
    for chunk in chunks:
        harness.conn.receive_data(chunk, harness.now)
        try:
            while (request := harness.conn.next_event()) is not None:
                if isinstance(request, ReleaseRequest):
                    harness.conn.released(request.packet_id)
                    continue
                if isinstance(request, AnsweredPublish):
                    reason = publish_reason(request.error)
                    harness.conn.complete(request.qos, request.packet_id, reason)
                    continue
                assert isinstance(request, PublishRequest)
                harness.conn.complete(request.qos, request.packet_id, ReasonCode.SUCCESS)
        except MqttProtocolError:
            assert harness.conn.state is State.CLOSED
            return


def test_a_client_publish_with_a_subscription_identifier_is_a_protocol_error() -> None:
    harness = Harness()
    harness.connect()
    with pytest.raises(MqttProtocolError):
        harness.feed(Publish("t", b"", properties=MqttProperties(subscription_identifiers=(1,))))


def test_a_first_packet_that_is_not_connect_is_refused_on_its_first_byte() -> None:
    h = Harness()
    h.conn.receive_data(b"\x30\xff\x7f", h.now)  # a PUBLISH header claiming ~16 KB
    with pytest.raises(MqttProtocolError, match="first packet must be CONNECT"):
        h.conn.next_event()
