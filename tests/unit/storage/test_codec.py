"""Row conversions: properties (with bytes), ack ranges and queue settings round-trip."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import StorageError
from core.model import Message, QueueConfig
from storage.base import MESSAGE_COLUMNS
from storage.codec import (
    B64_KEY,
    decode_properties,
    decode_ranges,
    encode_properties,
    encode_ranges,
    message_from_row,
    message_row,
    message_values,
    queue_from_row,
    queue_row,
    ranges_count,
    with_seq,
)

property_values = st.one_of(
    st.text(), st.integers(), st.floats(allow_nan=False), st.booleans(), st.binary()
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(), property_values))
def test_properties_survive_a_json_round_trip(properties: dict[str, object]) -> None:
    stored = json.loads(json.dumps(encode_properties(properties)))  # type: ignore[arg-type]
    assert decode_properties(stored) == properties


def test_bytes_are_stored_as_base64_objects() -> None:
    assert encode_properties({"b": b"\x00\x01"}) == {"b": {B64_KEY: "AAE="}}


@pytest.mark.parametrize("value", [{"other": 1}, {B64_KEY: "not base64!"}, [1, 2], None])
def test_an_unreadable_property_value_is_a_storage_error(value: object) -> None:
    with pytest.raises(StorageError):
        decode_properties({"p": value})


def test_ack_ranges_round_trip_and_count() -> None:
    ranges = ((3, 3), (5, 9))
    assert decode_ranges(json.loads(json.dumps(encode_ranges(ranges)))) == ranges
    assert ranges_count(ranges) == 6
    assert decode_ranges(None) == ()


def test_queue_settings_map_window_to_window_size() -> None:
    config = QueueConfig("orders", partitions=3, window=7, subscriptions=("a/#",), ttl=5.0)
    row = queue_row(config)
    assert row["window_size"] == 7 and "window" not in row and "subscriptions" not in row
    assert queue_from_row(row, ("a/#",)) == config


def test_driver_values_follow_the_table_columns() -> None:
    message = Message(
        "id", "q", 2, 7, "k", b"xy", {"b": b"\x01"}, "t", 1.0, 2.0, 3.0, "p", "d", "c", "r", "to"
    )
    row = message_row(message)
    row["properties"] = json.dumps(row["properties"])
    assert message_values(message) == tuple(row[name] for name in MESSAGE_COLUMNS)
    expected = dataclasses.replace(message, seq=9)
    assert with_seq(message, 9) is message and message == expected


def test_a_message_read_back_is_the_one_stored_and_counts_its_stored_size() -> None:
    message = Message("id", "q", 2, 7, "k", b"xy", {"b": b"\x01"}, "t", 1.0, None, 3.0)
    row = message_row(message)
    assert message_from_row(row) == message
    assert message_from_row(row).size == message.size
    # The size column decides, not a new measurement (rows other writers stored included).
    assert message_from_row({**row, "size": message.size + 100}).size == message.size + 100
