from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import body, commands, encode, frame, header

from core.errors import AuthenticationFailed, MessageTooLarge, NoRoute, StorageError
from protocols.amqp import events as ev
from protocols.amqp.codec import Frame, content_frames
from protocols.amqp.connection import State
from protocols.amqp.constants import PROTOCOL_HEADER, ReplyCode
from tests.support.amqp_sansio import PLAIN, Client


def _names(frames: list[Frame]) -> list[str]:
    return [f.payload.name for f in frames]


@pytest.fixture
def client() -> Client:
    c = Client()
    c.open()
    c.channel(confirm=True)
    return c


def test_wrong_protocol_header_answers_ours_and_closes() -> None:
    c = Client()
    c.conn.receive_data(b"AMQP\x00\x00\x08\x00")
    assert isinstance(c.conn.next_event(), ev.ConnectionClosed)
    assert c.conn.data_to_send() == PROTOCOL_HEADER
    assert c.conn.state is State.CLOSED


def test_failed_authentication_closes_with_access_refused() -> None:
    c = Client()
    c.send(PROTOCOL_HEADER)
    c.method(0, commands.Connection.StartOk({}, "PLAIN", "\x00bob\x00wrong"))
    c.conn.authenticated(AuthenticationFailed("bad username or password"))
    [close] = c.replies()
    assert isinstance(close.payload, commands.Connection.Close)
    assert close.payload.reply_code == ReplyCode.ACCESS_REFUSED


def test_amqplain_credentials_are_read() -> None:
    c = Client()
    c.send(PROTOCOL_HEADER)
    response = encode.field_table({"LOGIN": "alice", "PASSWORD": "pw"})[4:].decode()
    c.method(0, commands.Connection.StartOk({}, "AMQPLAIN", response))
    [auth] = c.take()
    assert isinstance(auth, ev.Authenticate)
    assert (auth.username, auth.password) == ("alice", "pw")


def test_tune_ok_above_the_offer_is_not_allowed() -> None:
    c = Client()
    c.send(PROTOCOL_HEADER)
    c.method(0, commands.Connection.StartOk({}, "PLAIN", PLAIN))
    c.conn.authenticated(None, admin=True)
    c.replies()
    [close] = c.method(0, commands.Connection.TuneOk(16, 1 << 20, 30))
    assert close.payload.reply_code == ReplyCode.NOT_ALLOWED


def test_body_split_across_frames_is_reassembled(client: Client) -> None:
    props = commands.Basic.Properties(headers={"JMSXGroupID": "k1"}, message_id="id-1")
    data = frame.marshal(commands.Basic.Publish(exchange="", routing_key="q"), 1)
    data += content_frames(1, props, b"0123456789" * 2000, 4096)
    for i in range(len(data)):
        client.send(data[i : i + 1])
    [publish] = client.take()
    assert isinstance(publish, ev.Publish) and publish.publication is not None
    assert publish.publication.payload == b"0123456789" * 2000
    assert publish.publication.queue == "q"
    assert publish.publication.dedup_id == "id-1"
    assert publish.publication.properties["JMSXGroupID"] == "k1"
    assert publish.delivery_tag == 1


def test_contiguous_acks_are_coalesced_and_a_nack_breaks_the_run(client: Client) -> None:
    for i in range(5):
        client.publish(b"m%d" % i)
    publishes = client.take()
    outcomes = [None, None, StorageError("disk"), None, None]
    client.conn.published(list(zip(publishes, outcomes, strict=True)))  # type: ignore[arg-type]
    frames: list[Any] = [f.payload for f in client.replies()]
    assert [(f.name, f.delivery_tag, f.multiple) for f in frames] == [
        ("Basic.Ack", 2, True),
        ("Basic.Nack", 3, False),
        ("Basic.Ack", 5, True),
    ]


def test_mandatory_unroutable_publish_is_returned_then_acked(client: Client) -> None:
    data = frame.marshal(
        commands.Basic.Publish(exchange="amq.topic", routing_key="a.b", mandatory=True), 1
    ) + content_frames(1, commands.Basic.Properties(), b"hi", 8192)
    client.send(data)
    [publish] = client.take()
    assert isinstance(publish, ev.Publish)
    assert publish.publication is not None and publish.publication.topic == "a/b"
    client.conn.published([(publish, NoRoute("nothing"))])
    names = _names(client.replies())
    assert names == ["Basic.Return", "ContentHeader", "ContentBody", "Basic.Ack"]


def test_a_return_that_would_exceed_frame_max_is_skipped_and_the_confirm_still_sent(
    client: Client,
) -> None:
    """pamqp writes floats as 32-bit 'f', keygate sends them back as doubles: a header
    frame just under frame_max (8192 here) would go back over it, which AMQP forbids."""
    properties = commands.Basic.Properties(headers={f"f{i:03}": 1.5 for i in range(780)})
    content_header = frame.marshal(header.ContentHeader(0, 2, properties), 1)
    assert len(content_header) <= 8192
    data = frame.marshal(
        commands.Basic.Publish(exchange="amq.topic", routing_key="a.b", mandatory=True), 1
    )
    client.send(data + content_header + frame.marshal(body.ContentBody(b"hi"), 1))
    [publish] = client.take()
    assert isinstance(publish, ev.Publish)
    client.conn.published([(publish, NoRoute("nothing"))])
    assert _names(client.replies()) == ["Basic.Ack"]


def test_message_over_the_size_limit_is_rejected_without_buffering() -> None:
    c = Client(max_message_size=100)
    c.open()
    c.channel(confirm=True)
    c.publish(b"z" * 500)
    [publish] = c.take()
    assert isinstance(publish, ev.Publish)
    assert isinstance(publish.rejected, MessageTooLarge) and publish.payload == b""
    c.conn.published([(publish, publish.rejected)])
    assert _names(c.replies()) == ["Basic.Nack"]


def test_body_without_header_is_an_unexpected_frame(client: Client) -> None:
    [close] = client.send(b"\x03\x00\x01\x00\x00\x00\x02hi\xce")
    assert isinstance(close.payload, commands.Connection.Close)
    assert close.payload.reply_code == ReplyCode.UNEXPECTED_FRAME
    assert client.conn.state is State.CLOSING
    client.method(0, commands.Connection.CloseOk())
    assert isinstance(client.take()[-1], ev.ConnectionClosed)


def test_method_while_content_is_expected_is_an_unexpected_frame(client: Client) -> None:
    client.method(1, commands.Basic.Publish(exchange="", routing_key="q"))
    [close] = client.method(1, commands.Basic.Qos())
    assert close.payload.reply_code == ReplyCode.UNEXPECTED_FRAME


def test_unsupported_methods_close_only_the_channel_with_540(client: Client) -> None:
    [close] = client.method(1, commands.Tx.Select())
    assert isinstance(close.payload, commands.Channel.Close)
    assert close.payload.reply_code == ReplyCode.NOT_IMPLEMENTED
    client.method(1, commands.Channel.CloseOk())
    client.channel(1)
    assert client.conn.state is State.OPEN


def test_publish_to_an_unknown_exchange_closes_the_channel_with_404(client: Client) -> None:
    [close] = client.publish(b"x", exchange="nope")
    assert close.payload.reply_code == ReplyCode.NOT_FOUND
    assert client.take() == []


def test_queue_declare_arguments_become_queue_config(client: Client) -> None:
    args: Any = {
        "x-partitions": 8,
        "x-message-ttl": 60000,
        "x-max-length": 10,
        "x-rebalance-delay": 500,
    }
    client.method(1, commands.Queue.Declare(queue="orders", arguments=args))
    [declare] = client.take()
    assert isinstance(declare, ev.DeclareQueue)
    config = declare.config
    assert (config.partitions, config.ttl, config.max_depth_messages) == (8, 60.0, 10)
    assert config.rebalance_delay == 0.5
    client.conn.operation_done(declare, 3, None)
    [ok] = client.replies()
    assert isinstance(ok.payload, commands.Queue.DeclareOk)
    assert (ok.payload.queue, ok.payload.message_count) == ("orders", 3)


def test_invalid_queue_argument_is_a_precondition_failure(client: Client) -> None:
    [close] = client.method(1, commands.Queue.Declare(queue="q", arguments={"x-partitions": "8"}))
    assert close.payload.reply_code == ReplyCode.PRECONDITION_FAILED


def test_passive_declare_ignores_arguments_as_rabbitmq_does(client: Client) -> None:
    args: Any = {"x-queue-type": "stream"}
    client.method(1, commands.Queue.Declare(queue="q", passive=True, arguments=args))
    [declare] = client.take()
    assert isinstance(declare, ev.DeclareQueue) and declare.passive and declare.given == {}


def test_unbind_from_a_missing_exchange_is_an_operation_with_nothing_to_remove(
    client: Client,
) -> None:
    client.method(1, commands.Queue.Unbind(queue="q", exchange="gone", routing_key="k"))
    [unbind] = client.take()
    assert isinstance(unbind, ev.BindQueue) and unbind.unbind and unbind.pattern is None
    client.conn.operation_done(unbind, 0, None)
    [ok] = client.replies()
    assert isinstance(ok.payload, commands.Queue.UnbindOk)


def test_an_invalid_x_delay_is_rejected_in_confirm_mode_and_closes_a_plain_channel(
    client: Client,
) -> None:
    client.channel(2)  # channel 1 is in confirm mode, channel 2 is not
    client.publish(b"x", headers={"x-delay": -1})
    [publish] = client.take()
    assert isinstance(publish, ev.Publish) and publish.publication is None
    assert publish.rejected is not None and "invalid x-delay" in publish.rejected.message
    client.conn.published([(publish, publish.rejected)])
    [nack] = client.replies()
    assert isinstance(nack.payload, commands.Basic.Nack)
    [close] = client.publish(b"x", channel=2, headers={"x-delay": "soon"})
    assert isinstance(close.payload, commands.Channel.Close)
    assert close.payload.reply_code == ReplyCode.PRECONDITION_FAILED
    assert "invalid x-delay" in close.payload.reply_text


def test_x_delay_header_becomes_the_publication_delay(client: Client) -> None:
    client.publish(b"x", headers={"x-delay": 2500})
    [publish] = client.take()
    assert isinstance(publish, ev.Publish) and publish.publication is not None
    assert publish.publication.delay == 2.5
    assert publish.publication.properties["x-delay"] == 2500


def test_result_for_a_reopened_channel_is_dropped(client: Client) -> None:
    client.method(1, commands.Queue.Declare(queue="q"))
    [declare] = client.take()
    client.method(1, commands.Channel.Close(200, "", 0, 0))
    client.channel(1)
    client.conn.operation_done(declare, 0, None)  # type: ignore[arg-type]
    assert client.replies() == []


def test_blocked_is_announced_to_clients_that_support_it(client: Client) -> None:
    client.conn.set_blocked(True)
    client.conn.set_blocked(True)
    client.conn.set_blocked(False)
    assert _names(client.replies()) == ["Connection.Blocked", "Connection.Unblocked"]


def test_exchange_redeclared_with_another_type_fails_the_channel(client: Client) -> None:
    client.method(1, commands.Exchange.Declare(exchange="ex", exchange_type="topic"))
    [close] = client.method(1, commands.Exchange.Declare(exchange="ex", exchange_type="direct"))
    assert close.payload.reply_code == ReplyCode.PRECONDITION_FAILED


def test_unknown_exchange_type_is_a_connection_error(client: Client) -> None:
    [close] = client.method(1, commands.Exchange.Declare(exchange="h", exchange_type="bogus"))
    assert isinstance(close.payload, commands.Connection.Close)
    assert close.payload.reply_code == ReplyCode.COMMAND_INVALID


def test_headers_exchange_is_refused_with_540_on_its_channel(client: Client) -> None:
    [close] = client.method(1, commands.Exchange.Declare(exchange="h", exchange_type="headers"))
    assert isinstance(close.payload, commands.Channel.Close)
    assert close.payload.reply_code == ReplyCode.NOT_IMPLEMENTED


_INDEXES = sorted(commands.INDEX_MAPPING)


@given(
    st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=3),
            st.sampled_from(_INDEXES),
            st.binary(max_size=60),
        ),
        max_size=8,
    )
)
@settings(max_examples=300, deadline=None)
def test_fuzzed_methods_on_an_open_connection_never_raise(
    frames: list[tuple[int, int, bytes]],
) -> None:
    c = Client()
    c.open()
    c.channel(1, confirm=True)
    for channel, index, arguments in frames:
        payload = index.to_bytes(4, "big") + arguments
        data = bytes([1]) + channel.to_bytes(2, "big") + len(payload).to_bytes(4, "big")
        c.send(data + payload + b"\xce")
    for event in c.take():
        if isinstance(event, ev.ChannelOperation) and c.conn.is_current(event):
            c.conn.operation_done(event, 0, None)
    c.replies()


def test_long_non_ascii_error_texts_still_fit_a_short_string(client: Client) -> None:
    # pamqp refuses to encode such a name, so swap it in after encoding (same byte length).
    data = frame.marshal(commands.Queue.Declare(queue="x" * 200), 1)
    [close] = client.send(data.replace(b"x" * 200, "é".encode() * 100))
    assert close.payload.reply_code == ReplyCode.PRECONDITION_FAILED
    assert len(close.payload.reply_text.encode()) <= 255


def _header_only(channel: int, body_size: int) -> bytes:
    """A publish and its content header announcing ``body_size``, without the body."""
    method = commands.Basic.Publish(exchange="", routing_key="q")
    props = header.ContentHeader(0, body_size, commands.Basic.Properties())
    return frame.marshal(method, channel) + frame.marshal(props, channel)


def test_partial_bodies_across_channels_over_the_budget_close_with_506() -> None:
    client = Client(max_unconfirmed_bytes=1_500_000)
    client.open()
    client.channel(1)
    client.channel(2)
    assert client.send(_header_only(1, 900_000)) == []
    [close] = client.send(_header_only(2, 900_000))
    assert isinstance(close.payload, commands.Connection.Close)
    assert close.payload.reply_code == ReplyCode.RESOURCE_ERROR


def test_one_message_at_a_time_may_be_as_large_as_the_message_limit() -> None:
    client = Client(max_unconfirmed_bytes=100_000)
    client.open()
    client.channel(1)
    client.channel(2)
    client.publish(b"x" * 900_000, channel=1)
    client.publish(b"y" * 900_000, channel=2)
    assert [type(e) for e in client.take()] == [ev.Publish, ev.Publish]
