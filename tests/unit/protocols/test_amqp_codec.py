from __future__ import annotations

import contextlib
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import body, commands, frame, header, heartbeat

from core.errors import ProtocolError
from protocols.amqp.codec import BadProtocolHeader, Frame, FrameReader, content_frames
from protocols.amqp.constants import PROTOCOL_HEADER, ReplyCode
from protocols.amqp.errors import AmqpConnectionError

STREAM = PROTOCOL_HEADER + b"".join(
    [
        frame.marshal(commands.Channel.Open(), 1),
        frame.marshal(commands.Basic.Publish(exchange="amq.topic", routing_key="a.b"), 1),
        content_frames(1, commands.Basic.Properties(headers={"JMSXGroupID": "k"}), b"x" * 300, 512),
        heartbeat.Heartbeat.marshal(),
        frame.marshal(commands.Channel.Close(200, "bye", 0, 0), 1),
    ]
)


def _describe(frames: list[Frame]) -> list[tuple[int, str]]:
    return [(f.channel, f.payload.name) for f in frames]


def _read_all(reader: FrameReader, chunks: list[bytes]) -> list[Frame]:
    frames = []
    for chunk in chunks:
        reader.feed(chunk)
        while (item := reader.next_frame()) is not None:
            frames.append(item)
    return frames


EXPECTED = [
    (1, "Channel.Open"),
    (1, "Basic.Publish"),
    (1, "ContentHeader"),
    (1, "ContentBody"),
    (0, "Heartbeat"),
    (1, "Channel.Close"),
]


def test_whole_stream_decodes_every_frame() -> None:
    assert _describe(_read_all(FrameReader(4096), [STREAM])) == EXPECTED


def test_byte_by_byte_gives_the_same_frames() -> None:
    chunks = [STREAM[i : i + 1] for i in range(len(STREAM))]
    assert _describe(_read_all(FrameReader(4096), chunks)) == EXPECTED


def test_trailing_partial_frame_waits_for_more_bytes() -> None:
    reader = FrameReader(4096)
    frames = _read_all(reader, [STREAM + STREAM[8:20]])
    assert _describe(frames) == EXPECTED
    assert reader.next_frame() is None


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
@settings(max_examples=200, deadline=None)
def test_any_split_gives_the_same_frames(cuts: list[int]) -> None:
    points = sorted({0, len(STREAM), *cuts})
    chunks = [STREAM[a:b] for a, b in itertools.pairwise(points)]
    assert _describe(_read_all(FrameReader(4096), chunks)) == EXPECTED


def test_body_frame_content_is_kept_and_header_carries_properties() -> None:
    frames = _read_all(FrameReader(4096), [STREAM])
    head, content = frames[2].payload, frames[3].payload
    assert isinstance(head, header.ContentHeader) and head.body_size == 300
    assert head.properties.headers == {"JMSXGroupID": "k"}
    assert isinstance(content, body.ContentBody) and content.value == b"x" * 300


def test_wrong_protocol_header_is_refused() -> None:
    reader = FrameReader(4096)
    reader.feed(b"HTTP/1.1")
    with pytest.raises(BadProtocolHeader):
        reader.next_frame()


def test_bad_frame_end_octet_is_a_frame_error() -> None:
    data = bytearray(PROTOCOL_HEADER + frame.marshal(commands.Channel.Open(), 1))
    data[-1] = 0
    reader = FrameReader(4096)
    reader.feed(bytes(data))
    with pytest.raises(AmqpConnectionError) as info:
        reader.next_frame()
    assert info.value.reply_code is ReplyCode.FRAME_ERROR


def test_frame_over_frame_max_is_refused_before_its_payload_arrives() -> None:
    reader = FrameReader(4096)
    reader.feed(PROTOCOL_HEADER + b"\x03\x00\x01\x00\x10\x00\x00")
    with pytest.raises(AmqpConnectionError) as info:
        reader.next_frame()
    assert info.value.reply_code is ReplyCode.FRAME_ERROR


def test_unknown_method_is_a_syntax_error() -> None:
    reader = FrameReader(4096)
    reader.feed(PROTOCOL_HEADER + b"\x01\x00\x01\x00\x00\x00\x04\x00\x63\x00\x07\xce")
    with pytest.raises(AmqpConnectionError) as info:
        reader.next_frame()
    assert info.value.reply_code is ReplyCode.SYNTAX_ERROR


@pytest.mark.parametrize(
    "payload",
    [
        b"\x00\x3c\x00\x28\xff\xff",  # a Basic.Publish cut short (pamqp names its object)
        b"\x00\x0a\x00\x0b\xff\xff",  # a Connection.StartOk cut short (a struct error)
    ],
)
def test_an_undecodable_method_is_a_syntax_error_with_a_fixed_reason(payload: bytes) -> None:
    reader = FrameReader(4096)
    size = len(payload).to_bytes(4, "big")
    reader.feed(PROTOCOL_HEADER + b"\x01\x00\x01" + size + payload + b"\xce")
    with pytest.raises(AmqpConnectionError) as info:
        reader.next_frame()
    assert info.value.reply_code is ReplyCode.SYNTAX_ERROR
    assert info.value.message == "malformed frame"


def test_content_frames_split_bodies_by_frame_max() -> None:
    data = PROTOCOL_HEADER + content_frames(1, commands.Basic.Properties(), b"y" * 10_000, 4096)
    frames = _read_all(FrameReader(4096), [data])
    assert [f.payload.name for f in frames] == ["ContentHeader"] + ["ContentBody"] * 3
    assert b"".join(f.payload.value for f in frames[1:]) == b"y" * 10_000  # type: ignore[union-attr]


def test_content_headers_send_floats_as_doubles_and_bytes_as_byte_arrays() -> None:
    # A basic.return sends back the publisher's own (pamqp) properties: its doubles must
    # not be narrowed to 32 bits on the way out, nested or not.
    headers = {
        "price": 19.99,
        "blob": b"\x00\xff",
        "nested": {"at": 1795828034.8265262, "l": [0.1]},
    }
    properties = commands.Basic.Properties(headers=headers, message_id="m")
    data = PROTOCOL_HEADER + content_frames(1, properties, b"", 4096)
    (content_header,) = _read_all(FrameReader(4096), [data])
    assert isinstance(content_header.payload, header.ContentHeader)
    received = content_header.payload.properties
    assert received.message_id == "m"
    assert received.headers == {
        "price": 19.99,
        "blob": bytearray(b"\x00\xff"),
        "nested": {"at": 1795828034.8265262, "l": [0.1]},
    }
    assert content_frames(1, properties, b"", 4096) == data[len(PROTOCOL_HEADER) :]


@given(st.binary(max_size=300), st.booleans())
@settings(max_examples=300, deadline=None)
def test_fuzzed_input_raises_only_protocol_errors(data: bytes, with_header: bool) -> None:
    reader = FrameReader(4096)
    reader.feed((PROTOCOL_HEADER if with_header else b"") + data)
    try:
        while reader.next_frame() is not None:
            pass
    except ProtocolError:
        pass


@given(st.binary(min_size=1, max_size=200), st.sampled_from([1, 2]))
@settings(max_examples=300, deadline=None)
def test_fuzzed_method_and_header_payloads_raise_only_protocol_errors(
    payload: bytes, frame_type: int
) -> None:
    reader = FrameReader(4096)
    size = len(payload).to_bytes(4, "big")
    reader.feed(PROTOCOL_HEADER + bytes([frame_type, 0, 1]) + size + payload + b"\xce")
    with contextlib.suppress(ProtocolError):
        reader.next_frame()


METHOD_INDEXES = [
    commands.Connection.StartOk.index,
    commands.Queue.Declare.index,
    commands.Basic.Publish.index,
    commands.Exchange.Declare.index,
]


@given(st.sampled_from(METHOD_INDEXES), st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_fuzzed_arguments_of_known_methods_raise_only_protocol_errors(
    index: int, arguments: bytes
) -> None:
    payload = index.to_bytes(4, "big") + arguments
    reader = FrameReader(4096)
    reader.feed(PROTOCOL_HEADER + b"\x01\x00\x01" + len(payload).to_bytes(4, "big"))
    reader.feed(payload + b"\xce")
    with contextlib.suppress(ProtocolError):
        reader.next_frame()
