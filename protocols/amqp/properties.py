"""AMQP content properties → Publication, Queue.Declare arguments → QueueConfig.

Both raise ``AmqpChannelError`` (406 PRECONDITION_FAILED) for values keygate cannot
honour, naming the offending field, as RabbitMQ does for invalid arguments.
"""

from __future__ import annotations

import datetime
import decimal
import json
from collections.abc import Callable, Mapping
from typing import Any, Final

from pamqp import commands

from core.errors import InvalidArgument
from core.model import PropertyValue, Publication, QueueConfig
from protocols._limits import parse_decimal
from protocols.amqp.constants import ReplyCode
from protocols.amqp.errors import AmqpChannelError

# Basic.Properties fields with no Publication field of their own are kept as properties.
DELIVERY_MODE: Final = "amqp.delivery_mode"
PRIORITY: Final = "amqp.priority"
TYPE: Final = "amqp.type"
USER_ID: Final = "amqp.user_id"
TIMESTAMP: Final = "amqp.timestamp"
CONTENT_ENCODING: Final = "amqp.content_encoding"
MESSAGE_ID: Final = "amqp.message_id"


def _precondition(text: str) -> AmqpChannelError:
    return AmqpChannelError(ReplyCode.PRECONDITION_FAILED, text)


def _header_value(value: Any) -> PropertyValue | None:
    """A header table value as a property value; None (AMQP void) drops the header."""
    if value is None or isinstance(value, str | bool | int | float | bytes):
        return value
    if isinstance(value, bytearray):  # pamqp decodes byte-array fields ('x') as bytearray
        return bytes(value)
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    # Nested tables and arrays have no property equivalent: kept as JSON text.
    return json.dumps(value, default=str, sort_keys=True)


def _text(value: str | bytes | None) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return value


def to_publication(
    properties: commands.Basic.Properties,
    payload: bytes,
    *,
    queue: str | None,
    topic: str | None,
    producer: str | None,
) -> Publication:
    """Build the Publication for one published message (mapping in docs/protocols/amqp.md)."""
    props: dict[str, PropertyValue] = {}
    for name, value in (properties.headers or {}).items():
        converted = _header_value(value)
        if converted is not None:
            props[name] = converted
    optional: tuple[tuple[str, Any], ...] = (
        (DELIVERY_MODE, properties.delivery_mode),
        (PRIORITY, properties.priority),
        (TYPE, _text(properties.message_type)),
        (USER_ID, _text(properties.user_id)),
        (CONTENT_ENCODING, _text(properties.content_encoding)),
        (MESSAGE_ID, _text(properties.message_id)),
    )
    for name, value in optional:
        if value is not None:
            props[name] = value
    if properties.timestamp is not None:
        props[TIMESTAMP] = int(properties.timestamp.timestamp())
    ttl = None
    expiration = _text(properties.expiration)
    if expiration is not None:
        millis = parse_decimal(expiration)
        if millis is None:
            raise _precondition(f"invalid expiration {expiration[:40]!r}: milliseconds expected")
        ttl = millis / 1000
    return Publication(
        payload=payload,
        queue=queue,
        topic=topic,
        properties=props,
        ttl=ttl,
        producer=producer,
        dedup_id=_text(properties.message_id),
        content_type=_text(properties.content_type),
        correlation_id=_text(properties.correlation_id),
        reply_to=_text(properties.reply_to),
        app_id=_text(properties.app_id),
    )


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _precondition(f"argument {name} must be an integer, got {value!r}")
    return value


def _millis(name: str, value: Any) -> float:
    return _int(name, value) / 1000


def _str(name: str, value: Any) -> str:
    value = _text(value)
    if not isinstance(value, str):
        raise _precondition(f"argument {name} must be a string, got {value!r}")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _precondition(f"argument {name} must be a boolean, got {value!r}")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | decimal.Decimal):
        raise _precondition(f"argument {name} must be a number, got {value!r}")
    return float(value)


# x-argument → (QueueConfig field, converter). Durations are milliseconds throughout, the
# RabbitMQ convention set by x-message-ttl.
QUEUE_ARGUMENTS: Final[Mapping[str, tuple[str, Callable[[str, Any], Any]]]] = {
    "x-partitions": ("partitions", _int),
    "x-max-deliveries": ("max_deliveries", _int),
    "x-delivery-limit": ("max_deliveries", _int),
    "x-message-ttl": ("ttl", _millis),
    "x-dead-letter-queue": ("dead_letter_queue", _str),
    "x-rebalance-delay": ("rebalance_delay", _millis),
    "x-max-handoff-time": ("max_handoff_time", _millis),
    "x-max-length": ("max_depth_messages", _int),
    "x-max-length-bytes": ("max_depth_bytes", _int),
    "x-max-message-size": ("max_message_size", _int),
    "x-key-from": ("key_from", _str),
    "x-backoff-initial": ("backoff_initial", _millis),
    "x-backoff-multiplier": ("backoff_multiplier", _float),
    "x-backoff-max": ("backoff_max", _millis),
    "x-window": ("window", _int),
    "x-dedup-window": ("dedup_window", _millis),
    "x-dead-letter-expired": ("dead_letter_expired", _bool),
}


def queue_config(name: str, arguments: Mapping[str, Any] | None) -> QueueConfig:
    """The QueueConfig a Queue.Declare asks for; unknown arguments are ignored."""
    fields: dict[str, Any] = {}
    for key, value in (arguments or {}).items():
        spec = QUEUE_ARGUMENTS.get(key)
        if spec is not None:
            field_name, convert = spec
            fields[field_name] = convert(key, value)
    try:
        return QueueConfig(name=name, **fields)
    except InvalidArgument as e:
        raise _precondition(e.message) from e


__all__ = [
    "CONTENT_ENCODING",
    "DELIVERY_MODE",
    "MESSAGE_ID",
    "PRIORITY",
    "QUEUE_ARGUMENTS",
    "TIMESTAMP",
    "TYPE",
    "USER_ID",
    "queue_config",
    "to_publication",
]
