"""AMQP content properties → Publication (Queue.Declare arguments: arguments.py).

A bad ``expiration`` is ``AmqpChannelError`` (406 PRECONDITION_FAILED), as in RabbitMQ;
a bad ``x-delay`` header is ``InvalidArgument``, which rejects that one publish.
"""

from __future__ import annotations

import datetime
import decimal
import json
from typing import Any, Final

from pamqp import commands

from core.frozen import bare
from core.model import PropertyValue, Publication
from core.schedule import DELAY_HEADER, delay_seconds
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

# (property name, Basic.Properties attribute) of the fields kept as properties.
_KEPT: Final = (
    (DELIVERY_MODE, "delivery_mode"),
    (PRIORITY, "priority"),
    (TYPE, "message_type"),
    (USER_ID, "user_id"),
    (CONTENT_ENCODING, "content_encoding"),
    (MESSAGE_ID, "message_id"),
)


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
    """Build the Publication for one published message (mapping in docs/protocols/amqp.md).

    Raises InvalidArgument for an ``x-delay`` header that is not a delay (the channel
    nacks that publish) and AmqpChannelError for a bad ``expiration`` (406, as RabbitMQ).
    """
    props: dict[str, PropertyValue] = {}
    for name, value in (properties.headers or {}).items():
        converted = _header_value(value)
        if converted is not None:
            props[name] = converted
    for name, attribute in _KEPT:
        value = getattr(properties, attribute)
        if isinstance(value, bytes):
            value = _text(value)
        if value is not None:
            props[name] = value
    if properties.timestamp is not None:
        props[TIMESTAMP] = int(properties.timestamp.timestamp())
    raw_delay = (properties.headers or {}).get(DELAY_HEADER)
    delay = None if raw_delay is None else delay_seconds(DELAY_HEADER, raw_delay)
    ttl = None
    expiration = _text(properties.expiration)
    if expiration is not None:
        millis = parse_decimal(expiration)
        if millis is None:
            raise _precondition(f"invalid expiration {expiration[:40]!r}: milliseconds expected")
        ttl = millis / 1000
    made = bare(Publication)  # core.frozen: keywords without a dict of them
    Publication.__init__(
        made,
        payload=payload,
        queue=queue,
        topic=topic,
        properties=props,
        ttl=ttl,
        delay=delay,
        producer=producer,
        dedup_id=_text(properties.message_id),
        content_type=_text(properties.content_type),
        correlation_id=_text(properties.correlation_id),
        reply_to=_text(properties.reply_to),
        app_id=_text(properties.app_id),
    )
    return made


__all__ = [
    "CONTENT_ENCODING",
    "DELIVERY_MODE",
    "MESSAGE_ID",
    "PRIORITY",
    "TIMESTAMP",
    "TYPE",
    "USER_ID",
    "to_publication",
]
