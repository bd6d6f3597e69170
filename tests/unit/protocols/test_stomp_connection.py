"""The sans-IO STOMP server connection: negotiation, SEND mapping, transactions, errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.actions import Deliver
from core.errors import AuthenticationFailed, QueueNotFound
from core.model import Message
from protocols.stomp import (
    Codec,
    Commit,
    Connect,
    Disconnect,
    Event,
    Frame,
    InvalidDestination,
    InvalidFrame,
    Publish,
    ReceiptRequest,
    ServerConnection,
    State,
    StompProtocolError,
    Subscribe,
    TransactionTooLarge,
    UnsupportedVersion,
    Version,
)
from protocols.stomp.connection import MAX_OPEN_TRANSACTIONS


def frame(command: str, *headers: tuple[str, str], body: bytes = b"") -> bytes:
    return Codec(version=Version.V1_2).send(Frame(command, headers, body))


def events(conn: ServerConnection, data: bytes) -> list[Event]:
    conn.receive_data(data)
    out = []
    while (event := conn.next_event()) is not None:
        out.append(event)
    return out


def decode(data: bytes, version: Version = Version.V1_2) -> Frame:
    codec = Codec(version=version)
    codec.receive_data(data)
    result = codec.next_event()
    assert result is not None
    return result


def connected(version: str = "1.2", heartbeat: str = "0,0") -> ServerConnection:
    conn = ServerConnection(heartbeat=(1000, 2000))
    (event,) = events(
        conn, frame("CONNECT", ("accept-version", version), ("heart-beat", heartbeat))
    )
    assert isinstance(event, Connect)
    conn.connected("s1")
    conn.data_to_send()  # the CONNECTED frame
    return conn


@pytest.mark.parametrize(
    ("offered", "chosen"),
    [
        (None, Version.V1_0),
        ("1.0", Version.V1_0),
        ("1.0,1.1", Version.V1_1),
        ("1.2,1.1", Version.V1_2),
        ("1.1, 2.0", Version.V1_1),
    ],
)
def test_version_is_the_highest_offered_and_absent_means_1_0(
    offered: str | None, chosen: Version
) -> None:
    conn = ServerConnection()
    headers = () if offered is None else (("accept-version", offered),)
    (event,) = events(conn, frame("STOMP", *headers))
    assert isinstance(event, Connect)
    assert event.version is chosen
    conn.connected("abc")
    reply = decode(conn.data_to_send())
    assert reply.command == "CONNECTED"
    assert reply.header("version") == chosen.value
    assert reply.header("session") == "abc"
    assert (reply.header("heart-beat") is None) == (chosen is Version.V1_0)


def test_no_common_version_is_an_error_listing_the_supported_ones() -> None:
    conn = ServerConnection()
    with pytest.raises(UnsupportedVersion) as info:
        events(conn, frame("CONNECT", ("accept-version", "2.0")))
    conn.error(info.value)
    reply = decode(conn.data_to_send())
    assert reply.command == "ERROR"
    assert reply.header("version") == "1.0,1.1,1.2"
    assert conn.state is State.CLOSED


def test_heartbeats_are_negotiated_as_the_larger_of_both_sides() -> None:
    conn = connected(heartbeat="500,3000")
    # server (sx=1000, sy=2000), client (cx=500, cy=3000)
    assert conn.send_interval == 3.0
    assert conn.receive_timeout == 2.0 * 2.0
    silent = connected(heartbeat="0,0")
    assert silent.send_interval is None
    assert silent.receive_timeout is None


def test_credentials_and_host_are_passed_on_unescaped() -> None:
    conn = ServerConnection()
    (event,) = events(conn, b"CONNECT\naccept-version:1.2\nhost:vh\nlogin:u\npasscode:p\\c\n\n\x00")
    assert event == Connect(Version.V1_2, "u", "p\\c", "vh", (0, 0))


def test_frames_before_connect_are_refused() -> None:
    with pytest.raises(InvalidFrame, match="not allowed"):
        events(ServerConnection(), frame("SEND", ("destination", "/queue/q")))


def test_send_maps_headers_to_publication_fields_and_properties() -> None:
    conn = connected()
    (event,) = events(
        conn,
        frame(
            "SEND",
            ("destination", "/queue/orders"),
            ("JMSXGroupID", "Order-1"),
            ("JMSXGroupID", "ignored"),
            ("persistent", "true"),
            ("priority", "4"),
            ("expires", "1700000000500"),
            ("correlation-id", "c1"),
            ("reply-to", "/queue/replies"),
            ("message-id", "m-9"),
            ("content-type", "application/json"),
            ("receipt", "r1"),
            ("content-length", "2"),
            body=b"{}",
        ),
    )
    assert isinstance(event, Publish)
    assert event.receipt == "r1"
    pub = event.publication
    assert pub.queue == "orders"
    assert pub.topic is None
    assert pub.payload == b"{}"
    assert pub.properties == {"JMSXGroupID": "Order-1", "persistent": "true", "priority": "4"}
    assert pub.expire_at == 1700000000.5
    assert pub.correlation_id == "c1"
    assert pub.reply_to == "/queue/replies"
    assert pub.dedup_id == "m-9"
    assert pub.content_type == "application/json"
    assert pub.producer == "stomp:s1"


def test_topic_destination_dots_become_slashes_and_expires_zero_means_none() -> None:
    (event,) = events(connected(), frame("SEND", ("destination", "/topic/a.b.c"), ("expires", "0")))
    assert isinstance(event, Publish)
    assert event.publication.topic == "a/b/c"
    assert event.publication.expire_at is None


@pytest.mark.parametrize(
    "destination", ["/exchange/x", "orders", "/queue/", "/queue/a/b", "/topic/", "/topic/a.#"]
)
def test_other_destinations_are_refused_with_the_receipt_id(destination: str) -> None:
    conn = connected()
    with pytest.raises(InvalidDestination) as info:
        events(conn, frame("SEND", ("destination", destination), ("receipt", "r7")))
    conn.error(info.value)
    reply = decode(conn.data_to_send())
    assert reply.header("message") == "unknown destination"
    assert reply.header("receipt-id") == "r7"
    assert reply.header("content-type") == "text/plain"


def test_invalid_expires_is_refused() -> None:
    with pytest.raises(InvalidFrame, match="expires"):
        events(connected(), frame("SEND", ("destination", "/queue/q"), ("expires", "soon")))


def test_transaction_is_buffered_until_commit() -> None:
    conn = connected()
    got = events(
        conn,
        frame("BEGIN", ("transaction", "t"), ("receipt", "b"))
        + frame("SEND", ("destination", "/queue/q"), ("transaction", "t"), body=b"1")
        + frame("SEND", ("destination", "/queue/q"), ("transaction", "t"), body=b"2")
        + frame("SEND", ("destination", "/queue/q"), body=b"plain")
        + frame("COMMIT", ("transaction", "t"), ("receipt", "c")),
    )
    assert got[0] == ReceiptRequest("b")
    assert isinstance(got[1], Publish)
    assert got[1].publication.payload == b"plain"
    assert isinstance(got[2], Commit)
    assert [p.payload for p in got[2].publications] == [b"1", b"2"]
    assert got[2].receipt == "c"
    assert len(got) == 3


def test_abort_discards_and_a_finished_transaction_is_unknown() -> None:
    conn = connected()
    got = events(
        conn,
        frame("BEGIN", ("transaction", "t"))
        + frame("SEND", ("destination", "/queue/q"), ("transaction", "t"), body=b"1")
        + frame("ABORT", ("transaction", "t")),
    )
    assert got == []
    with pytest.raises(InvalidFrame, match="unknown transaction"):
        events(conn, frame("COMMIT", ("transaction", "t")))


@pytest.mark.parametrize(
    "data",
    [
        frame("COMMIT", ("transaction", "nope")),
        frame("ABORT", ("transaction", "nope")),
        frame("SEND", ("destination", "/queue/q"), ("transaction", "nope")),
        frame("BEGIN"),
        frame("BEGIN", ("transaction", "t")) + frame("BEGIN", ("transaction", "t")),
    ],
)
def test_unknown_missing_or_repeated_transactions_are_errors(data: bytes) -> None:
    with pytest.raises(InvalidFrame):
        events(connected(), data)


def test_open_transactions_are_bounded() -> None:
    conn = connected()
    data = b"".join(frame("BEGIN", ("transaction", str(i))) for i in range(MAX_OPEN_TRANSACTIONS))
    assert events(conn, data) == []
    with pytest.raises(TransactionTooLarge):
        events(conn, frame("BEGIN", ("transaction", "one-more")))


def test_subscribe_then_ack_become_consume_events() -> None:
    conn = connected()
    (subscribe,) = events(
        conn,
        frame(
            "SUBSCRIBE",
            ("id", "s1"),
            ("destination", "/queue/q"),
            ("ack", "client-individual"),
            ("x-group", "billing"),
            ("receipt", "r"),
        ),
    )
    assert subscribe == Subscribe("s1", "q", "billing", "client-individual", None, "r", 1)
    message = Message(
        message_id="m1", queue="q", partition=3, seq=9, key="k", payload=b"hi", publish_time=1.0
    )
    conn.message("s1", 1, Deliver("f", message, 2, True))
    sent = decode(conn.data_to_send())
    assert sent.command == "MESSAGE"
    assert sent.header("x-partition") == "3" and sent.header("redelivered") == "true"
    (ack,) = events(conn, frame("ACK", ("id", sent.header("ack") or "")))
    assert (ack.subscription, ack.message_ids, ack.ack) == ("s1", ("m1",), True)
    (unsubscribe,) = events(conn, frame("UNSUBSCRIBE", ("id", "s1")))
    assert unsubscribe.subscription == "s1"


def test_disconnect_closes_and_drops_open_transactions() -> None:
    conn = connected()
    got = events(
        conn,
        frame("BEGIN", ("transaction", "t"))
        + frame("SEND", ("destination", "/queue/q"), ("transaction", "t"))
        + frame("DISCONNECT", ("receipt", "bye"))
        + frame("SEND", ("destination", "/queue/q")),
    )
    assert got == [Disconnect("bye")]
    assert conn.state is State.CLOSED
    assert conn.next_event() is None


def test_gateway_errors_become_error_frames_with_body_and_length() -> None:
    conn = connected("1.1")
    conn.error(QueueNotFound("orders"), "r2")
    reply = decode(conn.data_to_send(), Version.V1_1)
    assert reply.header("message") == "unknown destination"
    assert reply.header("receipt-id") == "r2"
    assert reply.body == b"queue-not-found: queue 'orders' does not exist\n"
    assert reply.header("content-length") == str(len(reply.body))
    refused = ServerConnection()
    refused.error(AuthenticationFailed("bad\npassword"))
    auth = decode(refused.data_to_send(), Version.V1_0)
    assert auth.header("message") == "authentication failed"


def test_client_id_names_the_producer_so_dedup_spans_reconnects() -> None:
    conn = ServerConnection()
    (event,) = events(conn, frame("CONNECT", ("accept-version", "1.2"), ("client-id", "app-7")))
    assert isinstance(event, Connect) and event.client_id == "app-7"
    conn.connected("s9")
    (send,) = events(conn, frame("SEND", ("destination", "/queue/q"), ("message-id", "m1")))
    assert isinstance(send, Publish)
    assert send.publication.producer == "stomp:app-7"
    assert send.publication.dedup_id == "m1"


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400), chunk=st.integers(min_value=1, max_value=50))
def test_arbitrary_bytes_after_connect_raise_only_stomp_protocol_errors(
    data: bytes, chunk: int
) -> None:
    conn = connected()
    prefix = frame("BEGIN", ("transaction", "t")) + b"SEND\ndestination:/queue/q\n"
    wire = prefix + data
    try:
        for i in range(0, len(wire), chunk):
            conn.receive_data(wire[i : i + chunk])
            while conn.next_event() is not None:
                pass
    except StompProtocolError:
        conn.data_to_send()
        conn.error(StompProtocolError("x"))
        assert decode(conn.data_to_send()).command == "ERROR"
