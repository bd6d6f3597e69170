"""The native codec: round trips, byte splits, trailing bytes, malformed and oversize input."""

from __future__ import annotations

import contextlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import InvalidArgument, ProtocolError
from core.model import AckMode, GroupMode, KeyOrder, Message, PropertyValue, StartPosition
from protocols.native import (
    DEFAULT_MAX_FRAME,
    MIN_MAX_FRAME,
    Ack,
    AckCumulative,
    Bind,
    BindOk,
    Close,
    Codec,
    Credit,
    DeclareQueue,
    DeleteQueue,
    Deliver,
    Error,
    Event,
    FlowClosed,
    FrameTooLarge,
    Hello,
    HelloOk,
    Nack,
    NackOutcome,
    NativeProtocolError,
    Ok,
    PartitionsChanged,
    Ping,
    Pong,
    Publish,
    PublishOk,
    QueueOk,
    Unbind,
    encode,
)
from protocols.native.encoding import append_deliver, append_publish_ok

PROPS: dict[str, PropertyValue] = {
    "s": "é",
    "i": -(2**63),
    "f": 1.5,
    "t": True,
    "n": False,
    "b": b"\x00\xff",
    "big": 2**63 - 1,
}

EVENTS: list[Event] = [
    Hello(request_id=1, client_name="app", username="u", password="p", max_frame=70_000),
    Hello(request_id=7),
    HelloOk(request_id=1, version=1, server_name="kg", session_id="s-1", max_frame=1 << 20),
    Publish(request_id=2, queue="orders", payload=b"hi"),
    Publish(
        request_id=0xFFFF_FFFF,
        topic="orders/eu",
        key="c-1",
        payload=b"\x00" * 1000,
        properties=PROPS,
        ttl=2.5,
        deliver_at=1.7e9,
        dedup_id="d",
        content_type="text/plain",
        correlation_id="c",
        reply_to="r",
    ),
    PublishOk(request_id=2, message_ids=("m1", "m2")),
    PublishOk(request_id=3, message_ids=(), duplicate=True),
    Bind(request_id=3, queue="q", group="g", window=100),
    Bind(
        request_id=4,
        queue="q",
        group="g",
        window=1,
        ack_mode=AckMode.AUTO,
        tags={"region": "eu", "tier": "gold"},
        mode=GroupMode.SHARED,
        key_order=KeyOrder.STRICT,
        start=StartPosition.LATEST,
        ack_timeout=30.0,
        previous_partitions=frozenset({0, 5, 65535}),
    ),
    Bind(request_id=5, queue="q", group="g", window=1, previous_partitions=frozenset()),
    BindOk(
        request_id=3, flow_id="f1", partitions=frozenset({1, 2}), mode=GroupMode.EXCLUSIVE, window=9
    ),
    Deliver(flow_id="f1", message_id="m1", partition=3, seq=2**64 - 1, key=None, payload=b""),
    Deliver(
        flow_id="f1",
        message_id="m1",
        partition=3,
        seq=10,
        key="k",
        payload=b"p",
        properties=PROPS,
        topic="a/b",
        publish_time=1.7e9,
        delivery_count=4,
        redelivered=True,
        content_type="ct",
        correlation_id="ci",
        reply_to="rt",
    ),
    Ack(flow_id="f1", message_ids=("a", "b", "c")),
    Ack(request_id=9, flow_id="f1", message_ids=()),
    AckCumulative(flow_id="f1", partition=7, seq=99),
    Nack(flow_id="f1", message_ids=("a",)),
    Nack(flow_id="f1", message_ids=("a",), outcome=NackOutcome.REJECT, delay=None),
    Nack(flow_id="f1", message_ids=("a",), outcome=NackOutcome.SHUTDOWN, delay=0.25),
    Credit(flow_id="f1", window=500),
    PartitionsChanged(flow_id="f1", partitions=frozenset()),
    PartitionsChanged(flow_id="f1", partitions=frozenset(range(100))),
    FlowClosed(flow_id="f1", code="queue-not-found", text="queue 'orders' does not exist"),
    Unbind(request_id=8, flow_id="f1", shutdown=True),
    Ok(request_id=8),
    DeclareQueue(request_id=10, name="q", settings={"partitions": 8, "rebalance_delay": 5.0}),
    DeclareQueue(
        request_id=11,
        name="q",
        settings={},
        subscriptions=("orders/#", "a,b/+"),
        exist_ok=False,
        passive=True,
    ),
    QueueOk(request_id=10, name="q", settings={"partitions": 8}, subscriptions=("x/#",)),
    DeleteQueue(request_id=12, name="q"),
    Ping(request_id=13),
    Pong(request_id=13),
    Error(request_id=2, code="queue-not-found", text="queue 'x' does not exist"),
    Error(code="protocol-error", text=""),
    Close(reason="bye"),
]

ALL_BYTES = b"".join(encode(e) for e in EVENTS)


def drain(codec: Codec) -> list[Event]:
    events = []
    while (event := codec.next_event()) is not None:
        events.append(event)
    return events


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_frame_round_trips_fed_whole(event: Event) -> None:
    codec = Codec()
    codec.receive_data(encode(event))
    assert codec.next_event() == event
    assert codec.next_event() is None
    assert codec.buffered == 0


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_frame_round_trips_fed_one_byte_at_a_time(event: Event) -> None:
    codec = Codec()
    data = encode(event)
    for i in range(len(data) - 1):
        codec.receive_data(data[i : i + 1])
        assert codec.next_event() is None
    codec.receive_data(data[-1:])
    assert codec.next_event() == event


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_frame_round_trips_with_trailing_bytes_kept_for_the_next_frame(event: Event) -> None:
    codec = Codec()
    trailing = encode(Ping(request_id=77))
    codec.receive_data(encode(event) + trailing[:4])
    assert codec.next_event() == event
    assert codec.next_event() is None
    codec.receive_data(trailing[4:])
    assert codec.next_event() == Ping(request_id=77)


def test_the_frame_header_is_length_type_and_request_id_big_endian() -> None:
    assert encode(Ping(request_id=0x01020304)) == bytes.fromhex("00000005 12 01020304")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(ALL_BYTES)), max_size=30))
def test_any_split_of_the_stream_yields_the_same_events(cuts: list[int]) -> None:
    codec = Codec()
    events: list[Event] = []
    previous = 0
    for cut in [*sorted(cuts), len(ALL_BYTES)]:
        codec.receive_data(ALL_BYTES[previous:cut])
        previous = cut
        events.extend(drain(codec))
    assert events == EVENTS


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_raises_only_protocol_errors(data: bytes) -> None:
    codec = Codec(MIN_MAX_FRAME)
    codec.receive_data(data)
    with contextlib.suppress(ProtocolError):
        drain(codec)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(EVENTS), st.data())
def test_corrupted_frames_raise_only_protocol_errors(event: Event, data: st.DataObject) -> None:
    frame = bytearray(encode(event))
    position = data.draw(st.integers(min_value=4, max_value=len(frame) - 1))
    frame[position] = data.draw(st.integers(min_value=0, max_value=255))
    cut = data.draw(st.integers(min_value=5, max_value=len(frame)))
    body = frame[4:cut]
    codec = Codec()
    codec.receive_data(struct.pack(">I", len(body)) + bytes(body))
    with contextlib.suppress(ProtocolError):
        drain(codec)


def test_a_frame_longer_than_max_frame_is_rejected_from_its_length_prefix() -> None:
    codec = Codec(MIN_MAX_FRAME)
    codec.receive_data(struct.pack(">I", MIN_MAX_FRAME + 1))
    with pytest.raises(FrameTooLarge):
        codec.next_event()


def test_encoding_a_frame_over_max_frame_is_refused() -> None:
    with pytest.raises(FrameTooLarge):
        encode(Publish(request_id=1, queue="q", payload=b"x" * MIN_MAX_FRAME), MIN_MAX_FRAME)
    assert (
        len(encode(Publish(request_id=1, queue="q", payload=b"x" * MIN_MAX_FRAME)))
        < DEFAULT_MAX_FRAME
    )


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        ("00000004 12 000000", "shorter than its header"),
        ("00000005 7f 00000001", "unknown frame type"),
        ("00000006 12 00000001 00", "trailing bytes"),
        ("00000008 15 00000000 0005 61", "truncated"),
        ("00000009 15 00000000 0002 ff fe", "UTF-8"),
        ("0000000b 0b 00000000 0001 66 000000", "truncated"),
        ("00000009 0d 00000001 0001 66 02", "flag byte"),
        ("0000000e 0a 00000000 0001 66 00000000 07 00", "nack outcome"),
        ("00000012 03 00000001 00 00 00 00000000 0001 0001 6b 09", "type tag"),
        ("0000000e 08 00000000 0001 66 ffffffff 0000", "count exceeds"),
    ],
)
def test_malformed_frames_raise_native_protocol_errors(frame: str, message: str) -> None:
    codec = Codec()
    codec.receive_data(bytes.fromhex(frame))
    with pytest.raises(NativeProtocolError, match=message):
        codec.next_event()


@pytest.mark.parametrize(
    "event",
    [
        Publish(request_id=1, queue="q", payload=b"", properties={"x": 2**63}),
        Publish(request_id=1, queue="q", payload=b"", properties={"x": None}),  # type: ignore[dict-item]
        Publish(request_id=1, queue="q" * 70_000, payload=b""),
        Ping(request_id=2**32),
    ],
)
def test_unencodable_fields_raise_invalid_argument(event: Event) -> None:
    with pytest.raises(InvalidArgument):
        encode(event)


DELIVERS = [e for e in EVENTS if isinstance(e, Deliver)]


@pytest.mark.parametrize("event", DELIVERS)
def test_a_deliver_written_from_its_message_is_the_deliver_event_encoded(event: Deliver) -> None:
    """The gateway writes DELIVERs from messages, appended to a run: the same bytes."""
    message = Message(
        event.message_id,
        "q",
        event.partition,
        event.seq,
        event.key,
        event.payload,
        event.properties,
        event.topic,
        event.publish_time,
        content_type=event.content_type,
        correlation_id=event.correlation_id,
        reply_to=event.reply_to,
    )
    out = bytearray(b"before")
    for source in (message, event):
        append_deliver(
            out, event.flow_id, source, event.delivery_count, event.redelivered, DEFAULT_MAX_FRAME
        )
    assert out == b"before" + encode(event) * 2


@pytest.mark.parametrize("event", [e for e in EVENTS if isinstance(e, PublishOk)])
def test_a_publish_ok_appended_to_a_run_is_the_publish_ok_event_encoded(event: PublishOk) -> None:
    out = bytearray(b"before")
    append_publish_ok(out, event.request_id, event.message_ids, event.duplicate, MIN_MAX_FRAME)
    assert out == b"before" + encode(event)
    with pytest.raises(FrameTooLarge):
        append_publish_ok(out, 1, ("m" * 100,) * 1000, False, MIN_MAX_FRAME)
    assert out == b"before" + encode(event)


@pytest.mark.parametrize(
    ("message", "max_frame", "error"),
    [
        (Message("m", "q", 0, 1, "k" * 70_000, b""), DEFAULT_MAX_FRAME, InvalidArgument),
        (Message("m", "q", 0, 1, None, b"", {"x": 2**63}), DEFAULT_MAX_FRAME, InvalidArgument),
        (Message("m", "q", 0, 1, None, b"x" * MIN_MAX_FRAME), MIN_MAX_FRAME, FrameTooLarge),
    ],
)
def test_a_deliver_that_cannot_be_written_leaves_the_run_as_it_was(
    message: Message, max_frame: int, error: type[Exception]
) -> None:
    out = bytearray(b"earlier frames")
    with pytest.raises(error):
        append_deliver(out, "f", message, 1, False, max_frame)
    assert out == b"earlier frames"


def test_a_large_burst_of_small_frames_is_decoded_in_order() -> None:
    codec = Codec()
    frames = [Ack(flow_id="f", message_ids=(str(i),)) for i in range(20_000)]
    codec.receive_data(b"".join(encode(f) for f in frames))
    assert drain(codec) == frames
