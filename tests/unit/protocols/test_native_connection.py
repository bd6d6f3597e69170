"""Native connection state machines: handshake, roles, request ids, negotiation."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import ProtocolError
from core.model import GroupMode, Message
from protocols.native import (
    DEFAULT_MAX_FRAME,
    MIN_MAX_FRAME,
    Ack,
    Bind,
    BindOk,
    ClientConnection,
    Close,
    ConnectionState,
    Deliver,
    Error,
    Hello,
    HelloOk,
    NativeProtocolError,
    Ok,
    Ping,
    Pong,
    Publish,
    PublishOk,
    ServerConnection,
    UnsupportedVersion,
    encode,
)

FRAMES = [
    encode(Hello(client_name="a")),
    encode(Publish(request_id=2, queue="q", payload=b"p")),
    encode(Publish(request_id=0, queue="q", payload=b"p")),
    encode(Bind(request_id=3, queue="q", group="g", window=1)),
    encode(Ack(flow_id="f", message_ids=("m",))),
    encode(PublishOk(request_id=2, message_ids=())),
    encode(Ping(request_id=4)),
    encode(Close()),
]


def handshake(
    client_max: int = 0, server_max: int = DEFAULT_MAX_FRAME
) -> tuple[ClientConnection, ServerConnection]:
    client = ClientConnection()
    server = ServerConnection(max_frame=server_max)
    server.receive_data(client.send(Hello(client_name="app", max_frame=client_max)))
    hello = server.next_event()
    assert isinstance(hello, Hello)
    client.receive_data(server.send(server.accept("kg", "session-1")))
    assert isinstance(client.next_event(), HelloOk)
    return client, server


def test_handshake_opens_both_sides_with_negotiated_values() -> None:
    client, server = handshake(client_max=1 << 20)
    assert client.state is server.state is ConnectionState.OPEN
    assert client.max_frame == server.max_frame == 1 << 20
    assert client.session_id == "session-1"
    assert server.client_name == "app"


def test_max_frame_never_drops_below_the_floor() -> None:
    client, server = handshake(client_max=10)
    assert client.max_frame == server.max_frame == MIN_MAX_FRAME


def test_server_rejects_any_frame_before_hello() -> None:
    server = ServerConnection()
    server.receive_data(encode(Publish(request_id=1, queue="q", payload=b"")))
    with pytest.raises(NativeProtocolError, match="before the HELLO"):
        server.next_event()


def test_server_rejects_a_second_hello() -> None:
    _client, server = handshake()
    server.receive_data(encode(Hello(request_id=5)))
    with pytest.raises(NativeProtocolError, match="after the handshake"):
        server.next_event()


def test_server_rejects_frames_only_a_server_may_send() -> None:
    _client, server = handshake()
    server.receive_data(
        encode(Deliver(flow_id="f", message_id="m", partition=0, seq=1, key=None, payload=b""))
    )
    with pytest.raises(NativeProtocolError, match="may not be sent by the peer"):
        server.next_event()


def test_requests_needing_a_response_must_carry_an_id() -> None:
    client, server = handshake()
    server.receive_data(encode(Publish(request_id=0, queue="q", payload=b"")))
    with pytest.raises(NativeProtocolError, match="non-zero request id"):
        server.next_event()
    with pytest.raises(RuntimeError):
        client.send(Ping(request_id=0))


def test_the_server_appends_delivers_and_publish_oks_only_while_open() -> None:
    """The frames the gateway writes in runs, without events, go through the same state
    machine: not before the handshake, not after CLOSE, a PUBLISH_OK never with id 0."""
    message = Message("m", "q", 0, 1, None, b"p")
    server = ServerConnection()
    out = bytearray()
    with pytest.raises(RuntimeError):
        server.append_deliver(out, "f", message, 1, False)
    client, server = handshake()
    server.append_deliver(out, "f", message, 1, False)
    server.append_publish_ok(out, 2, ("m",), False)
    with pytest.raises(RuntimeError):
        server.append_publish_ok(out, 0, ("m",), False)
    client.receive_data(bytes(out))
    assert isinstance(client.next_event(), Deliver)
    with pytest.raises(NativeProtocolError):  # the client never sent request 2
        client.next_event()
    server.send(Close())
    with pytest.raises(RuntimeError):
        server.append_deliver(out, "f", message, 1, False)


def test_server_refuses_a_version_it_does_not_speak() -> None:
    server = ServerConnection()
    server.receive_data(encode(Hello(version=0)))
    server.next_event()
    with pytest.raises(UnsupportedVersion):
        server.accept("kg", "s")


def test_newer_client_is_offered_version_one() -> None:
    server = ServerConnection()
    server.receive_data(encode(Hello(version=9)))
    server.next_event()
    assert server.accept("kg", "s").version == 1


def test_client_rejects_a_response_to_an_id_it_never_sent() -> None:
    client, server = handshake()
    client.receive_data(server.send(PublishOk(request_id=42, message_ids=("m",))))
    with pytest.raises(NativeProtocolError, match="not pending"):
        client.next_event()


def test_client_rejects_a_response_of_the_wrong_kind() -> None:
    client, server = handshake()
    rid = client.next_request_id()
    client.send(Bind(request_id=rid, queue="q", group="g", window=1))
    client.receive_data(server.send(PublishOk(request_id=rid, message_ids=())))
    with pytest.raises(NativeProtocolError, match="cannot answer Bind"):
        client.next_event()


def test_client_matches_pipelined_responses_in_any_order() -> None:
    client, server = handshake()
    ids = [client.next_request_id() for _ in range(3)]
    for rid in ids:
        client.send(Publish(request_id=rid, queue="q", payload=b""))
    assert client.outstanding == 3
    for rid in reversed(ids):
        client.receive_data(server.send(PublishOk(request_id=rid, message_ids=(str(rid),))))
    client.receive_data(server.send(Error(request_id=ids[0], code="x", text="late")))
    assert [client.next_event() for _ in range(3)] == [
        PublishOk(request_id=rid, message_ids=(str(rid),)) for rid in reversed(ids)
    ]
    with pytest.raises(NativeProtocolError):
        client.next_event()


def test_error_answers_a_request_and_keeps_the_connection_open() -> None:
    client, server = handshake()
    rid = client.next_request_id()
    client.send(Bind(request_id=rid, queue="q", group="g", window=1))
    client.receive_data(server.send(Error(request_id=rid, code="queue-not-found", text="no")))
    assert client.next_event() == Error(request_id=rid, code="queue-not-found", text="no")
    assert client.state is ConnectionState.OPEN


def test_acks_without_id_expect_nothing_and_with_id_expect_ok() -> None:
    client, server = handshake()
    server.receive_data(client.send(Ack(flow_id="f", message_ids=("m",))))
    assert server.next_event() == Ack(flow_id="f", message_ids=("m",))
    assert client.outstanding == 0
    client.send(Ack(request_id=client.next_request_id(), flow_id="f", message_ids=()))
    client.receive_data(server.send(Ok(request_id=1)))
    assert client.next_event() == Ok(request_id=1)


def test_both_sides_may_ping() -> None:
    client, server = handshake()
    client.receive_data(server.send(Ping(request_id=3)))
    assert client.next_event() == Ping(request_id=3)
    server.receive_data(client.send(Pong(request_id=3)))
    assert server.next_event() == Pong(request_id=3)


def test_close_is_a_handshake_the_closer_still_reads_the_answers_to_what_it_sent() -> None:
    client, server = handshake()
    publish = Publish(request_id=2, queue="q", payload=b"x")
    server.receive_data(client.send(publish) + client.send(Close(reason="bye")))
    assert client.state is ConnectionState.CLOSING
    with pytest.raises(RuntimeError):
        client.send(Ping(request_id=1))  # the closer sends nothing more
    assert server.next_event() == publish
    assert server.next_event() == Close(reason="bye")
    assert server.state is ConnectionState.CLOSING
    server.receive_data(b"garbage")
    assert server.next_event() is None  # nothing is read after the peer's CLOSE
    answer = PublishOk(request_id=2, message_ids=("m",))
    client.receive_data(server.send(answer) + server.send(Close(reason="bye")))
    assert server.state is ConnectionState.CLOSED
    assert client.next_event() == answer
    assert client.next_event() == Close(reason="bye")
    assert client.state is ConnectionState.CLOSED
    with pytest.raises(RuntimeError):
        server.send(Ping(request_id=1))


def test_server_may_not_send_before_accepting() -> None:
    server = ServerConnection()
    with pytest.raises(RuntimeError):
        server.send(
            BindOk(
                request_id=1, flow_id="f", partitions=frozenset(), mode=GroupMode.SHARED, window=1
            )
        )
    with pytest.raises(RuntimeError):
        server.accept("kg", "s")


def test_request_ids_skip_outstanding_ones_when_wrapping() -> None:
    client, _ = handshake()
    client.send(Ping(request_id=client.next_request_id()))
    client._next_id = 0xFFFF_FFFF
    assert client.next_request_id() == 0xFFFF_FFFF
    assert client.next_request_id() == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(FRAMES), max_size=8), st.binary(max_size=40))
def test_any_frame_sequence_gives_events_or_protocol_errors_only(
    frames: list[bytes], garbage: bytes
) -> None:
    server = ServerConnection()
    server.receive_data(b"".join(frames) + garbage)
    with contextlib.suppress(ProtocolError):
        while server.next_event() is not None:
            pass
