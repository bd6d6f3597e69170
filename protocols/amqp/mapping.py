"""AMQP content properties → Publication, and a stored Message → the content properties
of its delivery (Queue.Declare arguments: arguments.py). The tables of
docs/protocols/amqp.md "Publishing" and "Consuming" say the same.

How it works. A published message keeps every basic property: those with a Publication
field of their own go there (content_type, correlation_id, reply_to, message_id as the
dedup id, expiration as the TTL), the rest become ``amqp.*`` properties (``_FIELDS``). A
delivery reads them back from the same table: an ``amqp.*`` property whose value fits its
field becomes that field again and leaves the headers, so a message published over AMQP
comes back with the properties and headers it was published with, and any publisher may
set them (a value that does not fit stays a header). Then the gateway adds its own
per-delivery headers (``x-partition``, ``x-seq``, ``x-delivery-count``, ``x-message-id``):
a stored property of the same name is the message's and wins (a dead letter carries the
``x-delivery-count`` of its original queue, DESIGN.md §4); the gateway's value then goes
under ``x-keygate-<name>`` (``x-keygate-delivery-count``: this delivery's count). A
content type, correlation id or reply-to longer than a basic property holds (255 bytes;
keygate takes 1,024 from other protocols) goes in a header instead (``x-correlation-id``
...), so that no message is undeliverable over AMQP for its length.

A timestamp (the basic property and header values of type 'T', read as ``Timestamp`` by
fieldtables.py) is stored as its integer, unchanged whatever its size, as RabbitMQ keeps
it; property integers are int64, so one of 2^63 and up is stored as its decimal text,
which ``amqp.timestamp`` delivers as the timestamp again.

A bad ``expiration`` is ``AmqpChannelError`` (406 PRECONDITION_FAILED), as in RabbitMQ;
a bad ``x-delay`` header is ``InvalidArgument``, which rejects that one publish.
"""

from __future__ import annotations

import datetime
import decimal
import json
from collections.abc import Callable
from typing import Any, Final

from pamqp import commands

from core.frozen import bare
from core.model import (
    DELIVERY_COUNT,
    GROUP_ID_PROPERTY,
    PARTITION_HEADER,
    SEQ_HEADER,
    Message,
    PropertyValue,
    Publication,
    delivery_header,
)
from core.schedule import DELAY_HEADER, delay_seconds
from protocols._limits import parse_decimal
from protocols.amqp.codec import Properties
from protocols.amqp.constants import ReplyCode
from protocols.amqp.errors import AmqpChannelError
from protocols.amqp.fieldtables import Timestamp

# Basic.Properties fields with no Publication field of their own are kept as properties.
DELIVERY_MODE: Final = "amqp.delivery_mode"
PRIORITY: Final = "amqp.priority"
TYPE: Final = "amqp.type"
USER_ID: Final = "amqp.user_id"
TIMESTAMP: Final = "amqp.timestamp"
CONTENT_ENCODING: Final = "amqp.content_encoding"
MESSAGE_ID: Final = "amqp.message_id"
APP_ID: Final = "amqp.app_id"

# The gateway's per-delivery headers (DESIGN.md §5b) and where each goes when the message
# carries a property of that name.
MESSAGE_ID_HEADER: Final = "x-message-id"  # keygate's id (kg_messages.message_id)
# Message fields that are basic properties, and the header each goes in when it is longer
# than one holds (keygate takes up to 1,024 bytes, core.ingress).
_TEXT_FIELDS: Final = (
    ("content_type", "x-content-type"),
    ("correlation_id", "x-correlation-id"),
    ("reply_to", "x-reply-to"),
)
_MAX_TIMESTAMP: Final = 2**64 - 1  # an AMQP timestamp is an unsigned 64-bit integer
_MAX_INT_PROPERTY: Final = 2**63 - 1  # core.ingress: property integers are int64


def _short_text(value: object) -> bool:
    return isinstance(value, str) and len(value.encode("utf-8", "surrogatepass")) <= 255


def _octet(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 255


def _timestamp(value: object) -> bool:
    """A stored timestamp (``_stored_timestamp``): an integer, or the decimal text of one
    past the int64 range, in the unsigned 64-bit range."""
    if isinstance(value, str):
        if not (value.isascii() and value.isdigit()) or len(value) > 20:
            return False
        return _MAX_INT_PROPERTY < int(value) <= _MAX_TIMESTAMP
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_TIMESTAMP


def _stored_timestamp(value: int) -> int | str:
    """An AMQP timestamp as a property value: its integer, unchanged; the decimal text of
    one past the int64 range that properties hold (2^63 and up)."""
    value = int(value)  # a plain int: Timestamp is the AMQP codec's
    return value if value <= _MAX_INT_PROPERTY else str(value)


# (property name, Basic.Properties attribute, whether a stored value fits the field) of
# the basic properties kept as properties.
_FIELDS: Final[tuple[tuple[str, str, Callable[[object], bool]], ...]] = (
    (MESSAGE_ID, "message_id", _short_text),
    (APP_ID, "app_id", _short_text),
    (TYPE, "message_type", _short_text),
    (USER_ID, "user_id", _short_text),
    (CONTENT_ENCODING, "content_encoding", _short_text),
    (DELIVERY_MODE, "delivery_mode", _octet),
    (PRIORITY, "priority", _octet),
    (TIMESTAMP, "timestamp", _timestamp),
)


def _precondition(text: str) -> AmqpChannelError:
    return AmqpChannelError(ReplyCode.PRECONDITION_FAILED, text)


def _header_value(value: Any) -> PropertyValue | None:
    """A header table value as a property value; None (AMQP void) drops the header."""
    if isinstance(value, Timestamp):
        return _stored_timestamp(value)
    if value is None or isinstance(value, str | bool | int | float | bytes):
        return value
    if isinstance(value, bytearray):  # pamqp decodes byte-array fields ('x') as bytearray
        return bytes(value)
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, datetime.datetime):  # a frame pamqp decoded (hotframes.py)
        return int(value.timestamp())
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
    for name, attribute, _ in _FIELDS:
        value = getattr(properties, attribute)
        if isinstance(value, bytes):
            value = _text(value)
        elif isinstance(value, Timestamp):
            value = _stored_timestamp(value)
        elif isinstance(value, datetime.datetime):  # a frame pamqp decoded (hotframes.py)
            value = int(value.timestamp())
        if value is not None:
            props[name] = value
    raw_delay = (properties.headers or {}).get(DELAY_HEADER)
    delay = None if raw_delay is None else delay_seconds(DELAY_HEADER, raw_delay)
    ttl = None
    expiration = _text(properties.expiration)
    if expiration is not None:
        millis = parse_decimal(expiration)
        if millis is None:
            raise _precondition(f"invalid expiration {expiration[:40]!r}: milliseconds expected")
        # "0" expires unless delivered at once (RabbitMQ); keygate's nearest: 1 ms.
        ttl = (millis or 1) / 1000
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


def delivery_properties(message: Message, delivery_count: int) -> Properties:
    """The content properties of a delivery of ``message`` (module doc): its basic
    properties as published, its properties as headers, the gateway's per-delivery
    headers and the key as ``JMSXGroupID``."""
    headers: dict[str, Any] = dict(message.properties)
    fields: dict[str, Any] = {}
    for name, attribute, fits in _FIELDS:
        value = headers.get(name)
        if value is not None and fits(value):
            fields[attribute] = headers.pop(name)
    fields["timestamp"] = int(fields.get("timestamp", message.publish_time))
    if "message_id" not in fields:  # another protocol's publisher id, else keygate's id
        dedup_id = message.dedup_id
        fields["message_id"] = dedup_id if _short_text(dedup_id) else message.message_id
    fields.setdefault("delivery_mode", 2)  # every keygate message is durable
    for name, value in (
        (PARTITION_HEADER, message.partition),
        (SEQ_HEADER, message.seq),
        (DELIVERY_COUNT, delivery_count),
        (MESSAGE_ID_HEADER, message.message_id),
    ):
        headers[delivery_header(name, headers)] = value
    if message.key is not None:
        headers.setdefault(GROUP_ID_PROPERTY, message.key)
    for attribute, name in _TEXT_FIELDS:
        value = getattr(message, attribute)
        if _short_text(value):
            fields[attribute] = value
        elif value is not None:  # longer than a basic property holds (255 bytes)
            headers.setdefault(name, value)
    expiration = None
    if message.expire_at is not None:
        expiration = str(max(0, round((message.expire_at - message.publish_time) * 1000)))
    return Properties(expiration=expiration, headers=headers, **fields)


__all__ = [
    "APP_ID",
    "CONTENT_ENCODING",
    "DELIVERY_MODE",
    "MESSAGE_ID",
    "PRIORITY",
    "TIMESTAMP",
    "TYPE",
    "USER_ID",
    "delivery_properties",
    "to_publication",
]
