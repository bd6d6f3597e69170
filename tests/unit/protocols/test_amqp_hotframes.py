"""protocols.amqp.hotframes against pamqp: the same objects for every frame it decodes,
and pamqp's own encoding of a publish is always decoded (never left to the fallback).

The reference is pamqp with one change: its timestamp decoder replaced by keygate's
(protocols.amqp.fieldtables.timestamp), which reads the raw 64-bit value where pamqp
rescales values above 2^32 - 1 and refuses those past year 9999. Every other value and
the whole framing are pamqp's own reading. Timestamps beyond pamqp's range (which its
encoder cannot write) are checked against keygate's encoder instead."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import commands, decode, frame, header

from protocols.amqp.codec import content_frames
from protocols.amqp.constants import FRAME_HEADER_SIZE
from protocols.amqp.fieldtables import Timestamp, timestamp
from protocols.amqp.hotframes import decode_content_header, decode_publish


def _short_text(max_bytes: int = 255) -> st.SearchStrategy[str]:
    return st.text(max_size=80).filter(lambda t: len(t.encode()) <= max_bytes)


_exchange_names = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:", max_size=127
)
_timestamps = st.integers(min_value=0, max_value=2**32 - 1).map(
    lambda s: datetime.datetime.fromtimestamp(s, tz=datetime.UTC)
)
_field_values = st.recursive(
    st.none()
    | st.booleans()
    | _timestamps
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, width=32)
    | st.text(max_size=40)
    | st.binary(max_size=20).map(bytearray),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_short_text(40), inner, max_size=4),
    max_leaves=8,
)
_properties = st.builds(
    commands.Basic.Properties,
    content_type=st.none() | _short_text(),
    content_encoding=st.none() | _short_text(),
    headers=st.none() | st.dictionaries(_short_text(40), _field_values, max_size=5),
    delivery_mode=st.none() | st.sampled_from([1, 2]),
    priority=st.none() | st.integers(0, 255),
    correlation_id=st.none() | _short_text(),
    reply_to=st.none() | _short_text(),
    expiration=st.none() | _short_text(),
    message_id=st.none() | _short_text(),
    timestamp=st.none() | _timestamps,
    message_type=st.none() | _short_text(),
    user_id=st.none() | _short_text(),
    app_id=st.none() | _short_text(),
)


def _payload(data: bytes) -> tuple[bytes, int, int]:
    """A marshalled frame with the bounds of its payload."""
    return data, FRAME_HEADER_SIZE, len(data) - 1


def _slots(value: Any) -> dict[str, Any]:
    return {name: getattr(value, name) for name in value.__slots__}


@contextmanager
def _raw_timestamps() -> Iterator[None]:
    """pamqp reading timestamps as keygate does (module doc)."""
    with (
        mock.patch.dict(decode.TABLE_MAPPING, {b"T": timestamp}),
        mock.patch.dict(decode.METHODS, {"timestamp": timestamp}),
    ):
        yield


def _reference(data: bytes) -> Any:
    with _raw_timestamps():
        return frame.unmarshal(data)[2]


def _same_publish(hot: commands.Basic.Publish, data: bytes) -> None:
    reference = _reference(data)
    assert type(hot) is type(reference)
    assert _slots(hot) == _slots(reference)


def _same_header(hot: header.ContentHeader, data: bytes) -> None:
    reference = _reference(data)
    assert isinstance(reference, header.ContentHeader)
    assert (hot.class_id, hot.weight, hot.body_size) == (
        reference.class_id,
        reference.weight,
        reference.body_size,
    )
    assert type(hot.properties) is type(reference.properties)
    # repr: the same types too (a Timestamp is not a plain int, a list not a tuple).
    assert repr(_slots(hot.properties)) == repr(_slots(reference.properties))


@given(_exchange_names, _short_text(), st.booleans(), st.booleans(), st.integers(1, 65535))
@settings(max_examples=300, deadline=None)
def test_publish_decodes_as_pamqp_does(
    exchange: str, routing_key: str, mandatory: bool, immediate: bool, channel: int
) -> None:
    method = commands.Basic.Publish(
        exchange=exchange, routing_key=routing_key, mandatory=mandatory, immediate=immediate
    )
    data = frame.marshal(method, channel)
    hot = decode_publish(*_payload(data))
    assert hot is not None
    _same_publish(hot, data)


@given(_properties, st.integers(0, 2**63 - 1))
@settings(max_examples=300, deadline=None)
def test_content_header_decodes_as_pamqp_does(
    properties: commands.Basic.Properties, body_size: int
) -> None:
    data = frame.marshal(header.ContentHeader(0, body_size, properties), 1)
    hot = decode_content_header(*_payload(data))
    assert hot is not None
    _same_header(hot, data)


def test_other_methods_are_left_to_pamqp() -> None:
    data = frame.marshal(commands.Basic.Ack(7), 1)
    assert decode_publish(*_payload(data)) is None


@given(st.data(), st.binary(min_size=1, max_size=8))
@settings(max_examples=500, deadline=None)
def test_damaged_publish_is_decoded_as_pamqp_does_or_left_to_it(
    data: st.DataObject, noise: bytes
) -> None:
    method = commands.Basic.Publish(exchange="amq.topic", routing_key="a.b", mandatory=True)
    payload = bytearray(frame.marshal(method, 1)[FRAME_HEADER_SIZE:-1])
    at = data.draw(st.integers(0, len(payload)))
    payload[at : at + data.draw(st.integers(0, len(noise)))] = noise
    encoded = b"\x01\x00\x01" + len(payload).to_bytes(4, "big") + bytes(payload) + b"\xce"
    hot = decode_publish(*_payload(encoded))
    if hot is not None:
        _same_publish(hot, encoded)


# A table followed by further properties: damage to the table must not be read differently.
_RICH = commands.Basic.Properties(
    content_type="text/plain",
    headers={"JMSXGroupID": "k", "n": 5, "list": [1, "a"], "t": {"x": True}},
    delivery_mode=2,
    message_id="m-1",
    timestamp=datetime.datetime(2026, 1, 2, tzinfo=datetime.UTC),
    app_id="bench",
)


@given(st.data(), st.binary(min_size=1, max_size=4))
@settings(max_examples=1000, deadline=None)
def test_damaged_content_header_is_decoded_as_pamqp_does_or_left_to_it(
    data: st.DataObject, noise: bytes
) -> None:
    payload = bytearray(frame.marshal(header.ContentHeader(0, 10, _RICH), 1)[7:-1])
    at = data.draw(st.integers(0, len(payload)))
    payload[at : at + data.draw(st.integers(0, 2))] = noise
    encoded = b"\x02\x00\x01" + len(payload).to_bytes(4, "big") + bytes(payload) + b"\xce"
    hot = decode_content_header(*_payload(encoded))
    if hot is not None:
        _same_header(hot, encoded)


_u64 = st.integers(min_value=0, max_value=2**64 - 1)


@given(_u64, st.dictionaries(_short_text(40), _u64.map(Timestamp), max_size=3), _u64)
@settings(max_examples=300, deadline=None)
def test_any_64_bit_timestamp_is_read_as_written(
    value: int, headers: dict[str, Timestamp], nested: int
) -> None:
    """As RabbitMQ: never rescaled (pamqp divides values above 2^32 - 1 by 1000), never
    refused (pamqp raises past year 9999), in the property and in tables at any depth."""
    table = {**headers, "list": [Timestamp(nested)], "table": {"t": Timestamp(nested)}}
    properties = commands.Basic.Properties(timestamp=value, headers=table, app_id="a")
    data = content_frames(1, properties, b"", 4096)
    hot = decode_content_header(*_payload(data))
    assert hot is not None
    assert repr((hot.properties.timestamp, hot.properties.headers)) == repr(
        (Timestamp(value), table)
    )
    assert hot.properties.app_id == "a"
