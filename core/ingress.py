"""Ingress validation: what every publication must satisfy before anything is stored.

How it works: ``validate_publication`` is called once per publication in the broker's
publish path (every listener and the admin API go through it), before routing. It checks
each field against a limit that both databases hold (storage/schema.py sizes the columns
from these constants) and that the native protocol can carry (u16-prefixed strings), so
that what is stored is always deliverable (DESIGN.md §3.7). A violation raises
``InvalidMessage`` with a short, fixed reason naming the field and the limit, never the
value; the caller rejects that publication alone.

Limits are in UTF-8 bytes. Text stored in text columns (and JSON on PostgreSQL, which
refuses ``\\u0000``) may not contain NUL, nor lone surrogates (not encodable as UTF-8).
Property values are str, int in the int64 range, finite float, bool or bytes; nothing else
(no null, list or object). ``message_size`` is what counts against ``max_message_size``
and ``max_depth_bytes`` is ``Message.size``: the payload plus every property and header.

The same module bounds the native session values that reach SQL or the timers: the client
name, the flow window (``kg_flows.client`` and ``kg_flows.window_size``, a 32-bit integer)
and a NACK's redelivery delay.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

from core.errors import InvalidArgument, InvalidMessage
from core.keys import key_from_properties
from core.model import Publication
from core.settings import INT32_MAX, INT64_MAX

MAX_KEY_BYTES: Final = 4096
MAX_TOPIC_BYTES: Final = 4096
# producer, dedup id, content type, correlation id, reply-to, AMQP app_id.
MAX_ID_BYTES: Final = 1024
MAX_PROPERTY_NAME_BYTES: Final = 1024
# The native protocol's u16 string length: a property string must fit a DELIVER frame.
MAX_PROPERTY_VALUE_BYTES: Final = 65_535
MAX_PROPERTIES: Final = 1024
MAX_CLIENT_NAME_BYTES: Final = 500
# kg_flows.window_size is a 32-bit integer; the broker may enforce a smaller maximum.
MAX_WINDOW: Final = INT32_MAX

_INT64_MIN: Final = -(2**63)


def _utf8_length(what: str, value: str) -> int:
    """Bytes of ``value`` in UTF-8; InvalidMessage for NUL or lone surrogates."""
    if "\x00" in value:
        raise InvalidMessage(f"message rejected: {what} contains a NUL character")
    if value.isascii():  # a flag of the string: no encoding to count the usual text
        return len(value)
    try:
        return len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidMessage(f"message rejected: {what} is not valid Unicode") from None


def _check_text(what: str, value: object, limit: int) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise InvalidMessage(f"message rejected: {what} must be a string")
    if _utf8_length(what, value) > limit:
        raise InvalidMessage(f"message rejected: {what} longer than {limit} bytes")


def _check_time(what: str, value: object, *, positive: bool) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidMessage(f"message rejected: {what} must be a number")
    if not math.isfinite(value):
        raise InvalidMessage(f"message rejected: {what} must be finite")
    if positive and value <= 0:
        raise InvalidMessage(f"message rejected: {what} must be positive")


def _check_value(name: str, value: object) -> None:
    # bool before int: bool is an int subclass (and always fine).
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if not _INT64_MIN <= value <= INT64_MAX:
            raise InvalidMessage(f"message rejected: property {name!r} is out of the int64 range")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidMessage(f"message rejected: property {name!r} is not a finite number")
    elif isinstance(value, str):
        _check_text(f"property {name!r}", value, MAX_PROPERTY_VALUE_BYTES)
    elif not isinstance(value, bytes):
        kind = "null" if value is None else type(value).__name__
        raise InvalidMessage(
            f"message rejected: property {name!r} has unsupported type {kind} "
            "(use str, int, float, bool or bytes)"
        )


def validate_properties(properties: object) -> None:
    """Property names and values, and their count."""
    if not isinstance(properties, Mapping):
        raise InvalidMessage("message rejected: properties must be a mapping")
    if len(properties) > MAX_PROPERTIES:
        raise InvalidMessage(f"message rejected: more than {MAX_PROPERTIES} properties")
    for name, value in properties.items():
        if not isinstance(name, str) or not name:
            raise InvalidMessage("message rejected: a property name must be a non-empty string")
        if _utf8_length("a property name", name) > MAX_PROPERTY_NAME_BYTES:
            raise InvalidMessage(
                f"message rejected: a property name is longer than {MAX_PROPERTY_NAME_BYTES} bytes"
            )
        _check_value(name[:64], value)


def validate_publication(publication: Publication) -> None:
    """Raise InvalidMessage unless ``publication`` can be stored and delivered as it is.
    (Every publish passes here: the fields most publications leave empty cost a test.)"""
    p = publication
    if not isinstance(p.payload, bytes):
        raise InvalidMessage("message rejected: payload must be bytes")
    if p.properties or type(p.properties) is not dict:
        validate_properties(p.properties)
        # The key a queue derives from the key properties (core.keys) must fit the key column.
        _check_text("key", key_from_properties(p.properties), MAX_KEY_BYTES)
    _check_text("key", p.key, MAX_KEY_BYTES)
    _check_text("topic", p.topic, MAX_TOPIC_BYTES)
    _check_text("producer", p.producer, MAX_ID_BYTES)
    if p.dedup_id is not None or p.content_type is not None or p.correlation_id is not None:
        _check_text("dedup id", p.dedup_id, MAX_ID_BYTES)
        _check_text("content type", p.content_type, MAX_ID_BYTES)
        _check_text("correlation id", p.correlation_id, MAX_ID_BYTES)
    if p.reply_to is not None or p.app_id is not None:
        _check_text("reply-to", p.reply_to, MAX_ID_BYTES)
        _check_text("app id", p.app_id, MAX_ID_BYTES)
    if p.ttl is not None or p.deliver_at is not None or p.expire_at is not None:
        _check_time("ttl", p.ttl, positive=True)
        _check_time("delivery time", p.deliver_at, positive=False)
        _check_time("expiry time", p.expire_at, positive=False)


def validate_client_name(name: str) -> str:
    """A consumer's client name as stored in ``kg_flows.client``."""
    if "\x00" in name:
        raise InvalidArgument("client name contains a NUL character")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_CLIENT_NAME_BYTES:
        raise InvalidArgument(f"client name longer than {MAX_CLIENT_NAME_BYTES} bytes")
    return name


def validate_window(window: int) -> int:
    """A flow window (BIND, CREDIT): 1 to MAX_WINDOW messages."""
    if not 1 <= window <= MAX_WINDOW:
        raise InvalidArgument(f"window must be between 1 and {MAX_WINDOW}")
    return window


def validate_delay(delay: float | None) -> float | None:
    """A redelivery delay (NACK): None (the queue's backoff) or finite seconds >= 0."""
    if delay is not None and not (math.isfinite(delay) and delay >= 0):
        raise InvalidArgument("delay must be a finite number of seconds >= 0")
    return delay


__all__ = [
    "MAX_CLIENT_NAME_BYTES",
    "MAX_ID_BYTES",
    "MAX_KEY_BYTES",
    "MAX_PROPERTIES",
    "MAX_PROPERTY_NAME_BYTES",
    "MAX_PROPERTY_VALUE_BYTES",
    "MAX_TOPIC_BYTES",
    "MAX_WINDOW",
    "validate_client_name",
    "validate_delay",
    "validate_properties",
    "validate_publication",
    "validate_window",
]
