"""Conversions between model objects and kg_ rows.

Property values are JSON: strings, numbers and booleans as themselves, bytes as
``{"$b64": "<base64>"}``, and the floats JSON cannot carry as floats as ``{"$f": "<repr>"}``:
infinities and NaN (not JSON at all; PostgreSQL refuses them) and those Python writes
with a positive exponent (``1e+20``), which PostgreSQL's JSONB turns into integers (an
exact numeric with no fraction: 1e300 came back as a 301-digit int). These are the only
object-valued property forms, so they cannot be confused with a user value. Ack ranges
are ``[[lo, hi], ...]``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any, Final

from core.actions import SeqRanges
from core.errors import StorageError
from core.model import (
    GroupConfig,
    GroupMode,
    KeyOrder,
    Message,
    Properties,
    PropertyValue,
    QueueConfig,
    StartPosition,
)
from storage.schema import kg_messages

B64_KEY: Final = "$b64"
FLOAT_KEY: Final = "$f"
# QueueConfig fields whose column is named differently (WINDOW is reserved in PostgreSQL).
_QUEUE_COLUMN: Final = {"window": "window_size"}
_QUEUE_FIELDS: Final = tuple(f.name for f in fields(QueueConfig) if f.name != "subscriptions")
# kg_messages' columns in table order: the order of INSERT values and of untyped reads.
MESSAGE_COLUMNS: Final = tuple(column.name for column in kg_messages.columns)


def encode_properties(properties: Properties) -> dict[str, Any]:
    return {name: _encode_value(value) for name, value in properties.items()}


def _encode_value(value: PropertyValue) -> Any:
    if isinstance(value, bytes):
        return {B64_KEY: base64.b64encode(value).decode("ascii")}
    if isinstance(value, float) and not (math.isfinite(value) and abs(value) < 1e16):
        return {FLOAT_KEY: repr(value)}
    return value


def _decode_value(name: str, value: Any) -> PropertyValue:
    if isinstance(value, dict):
        try:
            if FLOAT_KEY in value:
                return float(value[FLOAT_KEY])
            return base64.b64decode(value[B64_KEY], validate=True)
        except (KeyError, TypeError, ValueError, binascii.Error) as e:
            raise StorageError(f"property {name!r} holds an unreadable value") from e
    if isinstance(value, str | int | float | bool):
        return value
    raise StorageError(f"property {name!r} holds an unreadable value")


def decode_properties(raw: Mapping[str, Any] | None) -> dict[str, PropertyValue]:
    return {name: _decode_value(name, value) for name, value in (raw or {}).items()}


def salvage_properties(raw: Any) -> tuple[dict[str, PropertyValue], bool]:
    """Decode what can be decoded; an unreadable value is kept as its JSON text (so a
    dead-letter copy still shows it). Returns the properties and whether all were readable."""
    if not isinstance(raw, Mapping):
        return {"x-unreadable-properties": json.dumps(raw, default=repr)}, False
    properties: dict[str, PropertyValue] = {}
    readable = True
    for name, value in raw.items():
        try:
            properties[str(name)] = _decode_value(str(name), value)
        except StorageError:
            properties[str(name)] = json.dumps(value, default=repr)
            readable = False
    return properties, readable


def message_row(message: Message) -> dict[str, Any]:
    return {
        "queue": message.queue,
        "partition": message.partition,
        "seq": message.seq,
        "message_id": message.message_id,
        "key": message.key,
        "payload": message.payload,
        "properties": encode_properties(message.properties),
        "topic": message.topic,
        "publish_time": message.publish_time,
        "deliver_at": message.deliver_at,
        "expire_at": message.expire_at,
        "producer": message.producer,
        "dedup_id": message.dedup_id,
        "content_type": message.content_type,
        "correlation_id": message.correlation_id,
        "reply_to": message.reply_to,
        "size": message.size,
    }


def message_values(message: Message) -> tuple[Any, ...]:
    """``message_row`` as a tuple in ``MESSAGE_COLUMNS`` order, properties serialised:
    the publish hot path hands these straight to the driver's executemany."""
    return (
        message.queue,
        message.partition,
        message.seq,
        message.message_id,
        message.key,
        message.payload,
        json.dumps(encode_properties(message.properties)) if message.properties else "{}",
        message.topic,
        message.publish_time,
        message.deliver_at,
        message.expire_at,
        message.producer,
        message.dedup_id,
        message.content_type,
        message.correlation_id,
        message.reply_to,
        message.size,
    )


def with_seq(message: Message, seq: int) -> Message:
    """``message`` given ``seq``, in place: only for a message built for the write that
    stores it (an append's, a redrive's copy), which nothing else reads before its COMMIT;
    a copy of its 17 fields cost more than the rest of the seq allocation (1.2 µs a
    publish). A write that fails or runs again simply stamps it again."""
    object.__setattr__(message, "seq", seq)
    return message


def _sized(message: Message, size: int) -> Message:
    """``message`` with its ``size`` already known (Message measures it on first use,
    property by property)."""
    object.__setattr__(message, "_size", size)
    return message


def message_from_row(row: Mapping[Any, Any]) -> Message:
    return _message(_values(row), decode_properties(row["properties"]))


def salvage_message(row: Mapping[Any, Any]) -> tuple[Message, bool]:
    """``message_from_row`` that never fails on properties: (message, readable)."""
    properties, readable = salvage_properties(row["properties"])
    return _message(_values(row), properties), readable


def salvage_values(values: Sequence[Any], *, json_text: bool) -> tuple[Message, bool]:
    """A kg_messages row as a tuple in ``MESSAGE_COLUMNS`` order, as read with no column
    types (the delivery read's hot path: no per-row processing by SQLAlchemy), to a message
    that never fails on its properties: (message, readable). Properties come as JSON text
    (``json_text``: SQLite) or already decoded (PostgreSQL's JSONB); text that is not JSON
    comes back as it is under ``x-unreadable-properties``."""
    raw = values[6]
    if raw == {} or (json_text and raw == "{}"):
        properties: dict[str, PropertyValue] = {}
        readable = True
    else:
        if json_text and isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except ValueError:
                return _message(values, {"x-unreadable-properties": raw}), False
        properties, readable = salvage_properties(raw)
    return _message(values, properties), readable


def _values(row: Mapping[Any, Any]) -> list[Any]:
    return [row[name] for name in MESSAGE_COLUMNS]


def _message(values: Sequence[Any], properties: dict[str, PropertyValue]) -> Message:
    """A row in ``MESSAGE_COLUMNS`` order as a Message: its columns from ``topic`` to
    ``reply_to`` are the Message's fields after ``properties``, in the same order; its
    size is the ``size`` column, what the message counted as when it was stored."""
    queue, partition, seq, message_id, key, payload = values[:6]
    message = Message(
        message_id, queue, partition, seq, key, bytes(payload), properties, *values[7:16]
    )
    return _sized(message, values[16])


def queue_row(config: QueueConfig) -> dict[str, Any]:
    return {_QUEUE_COLUMN.get(name, name): getattr(config, name) for name in _QUEUE_FIELDS}


def queue_from_row(row: Mapping[Any, Any], subscriptions: tuple[str, ...]) -> QueueConfig:
    values = {name: row[_QUEUE_COLUMN.get(name, name)] for name in _QUEUE_FIELDS}
    return QueueConfig(subscriptions=subscriptions, **values)


def group_row(config: GroupConfig) -> dict[str, Any]:
    return {
        "queue": config.queue,
        "group_name": config.name,
        "mode": config.mode.value,
        "key_order": config.key_order.value,
        "start_position": config.start.value,
        "tags": dict(config.tags) if config.tags is not None else None,
        "ack_timeout": config.ack_timeout,
    }


def group_from_row(row: Mapping[Any, Any]) -> GroupConfig:
    return GroupConfig(
        queue=row["queue"],
        name=row["group_name"],
        mode=GroupMode(row["mode"]),
        key_order=KeyOrder(row["key_order"]),
        start=StartPosition(row["start_position"]),
        tags=row["tags"],
        ack_timeout=row["ack_timeout"],
    )


def encode_ranges(ranges: SeqRanges) -> list[list[int]]:
    return [[lo, hi] for lo, hi in ranges]


def decode_ranges(raw: Any) -> SeqRanges:
    return tuple((int(lo), int(hi)) for lo, hi in raw or ())


def ranges_count(ranges: SeqRanges) -> int:
    return sum(hi - lo + 1 for lo, hi in ranges)
