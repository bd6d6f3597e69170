"""Ingress validation: every field a publisher controls is bounded before it is stored."""

from __future__ import annotations

import math
from typing import Any

import pytest

from core.errors import InvalidArgument, InvalidMessage
from core.ingress import (
    MAX_ID_BYTES,
    MAX_KEY_BYTES,
    MAX_PROPERTIES,
    MAX_PROPERTY_VALUE_BYTES,
    MAX_TOPIC_BYTES,
    MAX_WINDOW,
    validate_client_name,
    validate_delay,
    validate_publication,
    validate_window,
)
from core.model import GroupConfig, Message, Publication, QueueConfig


def _pub(**fields: Any) -> Publication:
    fields.setdefault("queue", "q")
    return Publication(payload=fields.pop("payload", b"x"), **fields)


def test_an_ordinary_publication_passes() -> None:
    validate_publication(
        _pub(
            key="k" * MAX_KEY_BYTES,
            properties={"s": "é" * 100, "i": -(2**63), "f": 1.5, "b": True, "raw": b"\0"},
            ttl=1.0,
            dedup_id="d" * MAX_ID_BYTES,
            content_type="text/plain",
        )
    )


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"key": "k" * (MAX_KEY_BYTES + 1)}, f"key longer than {MAX_KEY_BYTES} bytes"),
        ({"key": "é" * (MAX_KEY_BYTES // 2 + 1)}, f"key longer than {MAX_KEY_BYTES} bytes"),
        ({"properties": {"JMSXGroupID": "g" * 5000}}, f"key longer than {MAX_KEY_BYTES} bytes"),
        ({"queue": None, "topic": "t/" * MAX_TOPIC_BYTES}, "topic longer than"),
        ({"content_type": "c" * (MAX_ID_BYTES + 1)}, "content type longer than"),
        ({"correlation_id": "c" * 40_000}, "correlation id longer than"),
        ({"producer": "mqtt:" + "p" * 2000}, "producer longer than"),
        ({"reply_to": "r" * 2000}, "reply-to longer than"),
        ({"dedup_id": "a\0b"}, "dedup id contains a NUL character"),
        ({"key": "\ud800"}, "key is not valid Unicode"),
        ({"properties": {"a": None}}, "property 'a' has unsupported type null"),
        ({"properties": {"a": [1]}}, "property 'a' has unsupported type list"),
        ({"properties": {"a": {"b": 1}}}, "property 'a' has unsupported type dict"),
        ({"properties": {"a": math.nan}}, "property 'a' is not a finite number"),
        ({"properties": {"a": math.inf}}, "property 'a' is not a finite number"),
        ({"properties": {"a": 2**63}}, "property 'a' is out of the int64 range"),
        ({"properties": {"a": "x\0"}}, "property 'a' contains a NUL character"),
        ({"properties": {"h": "v" * 70_000}}, f"longer than {MAX_PROPERTY_VALUE_BYTES} bytes"),
        ({"properties": {"": "v"}}, "a property name must be a non-empty string"),
        ({"properties": {f"p{i}": i for i in range(MAX_PROPERTIES + 1)}}, "more than"),
        ({"ttl": math.nan}, "ttl must be finite"),
        ({"ttl": -1.0}, "ttl must be positive"),
        ({"ttl": "5"}, "ttl must be a number"),
        ({"deliver_at": math.inf}, "delivery time must be finite"),
        ({"payload": "text"}, "payload must be bytes"),
    ],
)
def test_a_field_out_of_bounds_is_rejected_with_a_short_reason(
    fields: dict[str, Any], reason: str
) -> None:
    with pytest.raises(InvalidMessage) as caught:
        validate_publication(_pub(**fields))
    assert caught.value.message.startswith("message rejected: ")
    assert reason in caught.value.message
    assert len(caught.value.message) < 200  # never the value itself


def test_message_size_counts_properties_and_headers_as_well_as_the_payload() -> None:
    bare = Message("id", "q", 0, 0, None, b"12345")
    full = Message("id", "q", 0, 0, "key", b"12345", {"name": "value", "n": 1}, correlation_id="c")
    assert bare.size == 5
    assert full.size == 5 + 3 + (4 + 4 + 5) + (4 + 1 + 8) + 1
    accented = Message("id", "q", 0, 0, "ü", b"", {"é": "ßß"})
    assert accented.size == 2 + (4 + 2 + 4)  # UTF-8 bytes, not characters


@pytest.mark.parametrize("window", [0, -1, MAX_WINDOW + 1, 3_000_000_000])
def test_a_window_outside_the_storable_range_is_refused(window: int) -> None:
    with pytest.raises(InvalidArgument):
        validate_window(window)
    assert validate_window(MAX_WINDOW) == MAX_WINDOW


def test_a_long_client_name_or_a_nan_delay_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="client name longer than 500 bytes"):
        validate_client_name("c" * 600)
    with pytest.raises(InvalidArgument):
        validate_delay(math.nan)
    with pytest.raises(InvalidArgument):
        validate_delay(-1.0)
    assert validate_delay(None) is None


@pytest.mark.parametrize(
    "settings",
    [{"ttl": math.nan}, {"backoff_max": math.inf}, {"rebalance_delay": math.nan}],
)
def test_queue_settings_refuse_nan_and_infinity(settings: dict[str, float]) -> None:
    with pytest.raises(InvalidArgument, match="finite"):
        QueueConfig("q", **settings)  # type: ignore[arg-type]


def test_group_settings_refuse_a_nan_ack_timeout() -> None:
    with pytest.raises(InvalidArgument, match="finite"):
        GroupConfig("q", "g", ack_timeout=math.nan)


def test_group_tags_must_be_text_without_nul() -> None:
    with pytest.raises(InvalidArgument, match="without NUL"):
        GroupConfig("q", "g", tags={"region": "e\0u"})
