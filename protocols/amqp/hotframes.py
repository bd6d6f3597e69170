"""Direct decoders for the two frames every publish sends: Basic.Publish and its header.

Why: pamqp decodes any method or property list generically — a type name looked up per
field, the rest of the frame sliced after each one — and that was a fifth of the
gateway's samples under a confirmed-publish load. These decoders read the same fields
straight from the reader's buffer and build the very objects pamqp would (same classes,
same attribute values, no validation, as pamqp's unmarshal does none).

They only accept the ordinary case: a frame whose fields end exactly at its end, with
well-formed UTF-8 and no property-flag continuation. Anything else returns None and the
frame goes to ``pamqp.frame.unmarshal`` as every other frame does, so pamqp alone decides
how odd input is read or refused. Timestamps, in the ``timestamp`` property and in the
``headers`` table, are the exception: pamqp rescales and refuses legal values, so they are
read as raw integers (fieldtables.py), tables with pamqp's decoders for every other type.
(A frame left to pamqp, which no client sends, still gets pamqp's reading of them.)
tests/unit/protocols/test_amqp_hotframes.py checks both decoders against pamqp, with
pamqp's timestamp decoder replaced by the raw one, on generated frames.
"""

from __future__ import annotations

import struct
from typing import Final

from pamqp import commands, header

from protocols.amqp.constants import BASIC_CLASS_ID
from protocols.amqp.fieldtables import field_table, timestamp

_PUBLISH_INDEX: Final = commands.Basic.Publish.index
_INDEX: Final = struct.Struct(">I")
_SHORT: Final = struct.Struct(">H")
_CONTENT_HEADER: Final = struct.Struct(">HHQH")

_SHORTSTR: Final = 0
_OCTET: Final = 1
_TABLE: Final = 2
_TIMESTAMP: Final = 3
_KINDS: Final = {"shortstr": _SHORTSTR, "octet": _OCTET, "table": _TABLE, "timestamp": _TIMESTAMP}
# (flag bit, attribute, kind) in wire order, from pamqp's own property definitions.
_PROPERTIES: Final = tuple(
    (
        commands.Basic.Properties.flags[name],
        name,
        _KINDS[getattr(commands.Basic.Properties, "_" + name)],
    )
    for name in commands.Basic.Properties.__slots__
)
# Bits 0 (another flag word follows) and 1 (unassigned): left to pamqp.
_UNUSUAL_FLAGS: Final = 0x0003


def decode_publish(data: bytes, start: int, end: int) -> commands.Basic.Publish | None:
    """The Basic.Publish in ``data[start:end]`` (a method frame's payload), or None when
    the payload is another method or anything but the plain encoding."""
    if end - start < 9 or _INDEX.unpack_from(data, start)[0] != _PUBLISH_INDEX:
        return None
    (ticket,) = _SHORT.unpack_from(data, start + 4)
    offset = start + 6
    exchange, offset = _short_str(data, offset, end)
    if exchange is None:
        return None
    routing_key, offset = _short_str(data, offset, end)
    if routing_key is None or offset + 1 != end:
        return None
    bits = data[offset]
    method = commands.Basic.Publish.__new__(commands.Basic.Publish)
    method.ticket = ticket
    method.exchange = exchange
    method.routing_key = routing_key
    method.mandatory = bool(bits & 1)
    method.immediate = bool(bits & 2)
    return method


def decode_content_header(data: bytes, start: int, end: int) -> header.ContentHeader | None:
    """The Basic content header in ``data[start:end]``, or None when it is not the plain
    encoding of one."""
    if end - start < _CONTENT_HEADER.size:
        return None
    class_id, weight, body_size, flags = _CONTENT_HEADER.unpack_from(data, start)
    if class_id != BASIC_CLASS_ID or flags & _UNUSUAL_FLAGS:
        return None
    properties = commands.Basic.Properties()
    offset = start + _CONTENT_HEADER.size
    for flag, name, kind in _PROPERTIES:
        if not flags & flag:
            continue
        value: object
        if kind == _SHORTSTR:
            value, offset = _short_str(data, offset, end)
            if value is None:
                return None
        elif kind == _OCTET:
            if offset >= end:
                return None
            value = data[offset]
            offset += 1
        else:
            if offset + 4 > end:
                return None
            size = 4 + _INDEX.unpack_from(data, offset)[0] if kind == _TABLE else 8
            if offset + size > end:
                return None
            decoder = field_table if kind == _TABLE else timestamp
            try:
                # The rest of the payload, as pamqp gives it: a table value may run past
                # the table's end, and it is read as pamqp reads it.
                _, value = decoder(data[offset:end])
            except Exception:
                # A malformed table (refused with whatever the stdlib raised): let pamqp
                # decode the whole frame and say so.
                return None
            offset += size
        setattr(properties, name, value)
    if offset != end:
        return None
    content_header = header.ContentHeader(weight, body_size, properties)
    content_header.class_id = class_id
    return content_header


def _short_str(data: bytes, offset: int, end: int) -> tuple[str | None, int]:
    """A short string at ``offset`` and the offset after it; None if it overruns ``end``
    or is not UTF-8."""
    if offset >= end:
        return None, offset
    stop = offset + 1 + data[offset]
    if stop > end:
        return None, offset
    try:
        return data[offset + 1 : stop].decode("utf-8"), stop
    except UnicodeDecodeError:
        return None, offset


__all__ = ["decode_content_header", "decode_publish"]
