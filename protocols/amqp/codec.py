"""Frame reading and writing on top of pamqp.

How it works: ``FrameReader`` collects bytes. The first eight bytes must be the AMQP 0-9-1
protocol header. After that it reads the 7-byte frame header (type, channel, size),
checks the size against the negotiated frame_max before waiting for the payload, waits
for size + 1 bytes, checks the frame-end octet and only then decodes the frame, in place:
Basic.Publish and its content header with ``protocols.amqp.hotframes`` when they are
encoded the ordinary way, every other method and content-header frame (and any unusual
one) with ``pamqp.frame.unmarshal``. Body frames are sliced directly: their payload is
opaque and pamqp would only copy it. Every failure is an ``AmqpConnectionError`` with the
reply code the spec assigns (501 framing, 502 syntax).

Content headers going out (deliveries, basic.get-ok, basic.return) are pamqp's, except
for the ``headers`` table (``Properties``): pamqp writes a Python float as a 32-bit
float ('f') and refuses ``bytes``, while keygate's property values are doubles and bytes
(DESIGN.md §2), so a float goes out as a double ('d') and bytes as a byte array ('x');
and for timestamps, read as raw integers (fieldtables.py): an int ``timestamp`` property
and a ``Timestamp`` header value go out as the same 64-bit value (type 'T' in a table).
A content header cannot be split over frames: one larger than the negotiated frame_max
is not written (``content_frames`` raises), since the peer would close the connection.
"""

from __future__ import annotations

import struct
from typing import Any, Final, TypeAlias

from pamqp import base, body, commands, encode, frame, header, heartbeat

from core.frozen import frozen
from protocols.amqp.constants import (
    BASIC_CLASS_ID,
    FRAME_BODY,
    FRAME_END,
    FRAME_HEADER,
    FRAME_HEADER_SIZE,
    FRAME_HEARTBEAT,
    FRAME_METHOD,
    FRAME_OVERHEAD,
    PROTOCOL_HEADER,
    ReplyCode,
)
from protocols.amqp.errors import AmqpConnectionError
from protocols.amqp.fieldtables import Timestamp, encode_timestamp
from protocols.amqp.hotframes import decode_content_header, decode_publish

Payload: TypeAlias = base.Frame | header.ContentHeader | body.ContentBody | heartbeat.Heartbeat

_HEADER: Final = struct.Struct(">BHI")
_FRAME_END_BYTES: Final = bytes([FRAME_END])


@frozen
class Frame:
    """One decoded frame: its channel and pamqp's object for the payload (``frozen``: one
    is built for every frame)."""

    channel: int
    payload: Payload


class BadProtocolHeader(AmqpConnectionError):
    """The peer did not open with AMQP 0-9-1's header; answer with ours and close."""


class FrameReader:
    """Incremental frame decoder; ``frame_max`` may be lowered after Tune-Ok.

    Frames are read in place from one ``bytes`` object and an offset; what arrives while a
    frame is still incomplete waits in ``_pending`` and is joined to the unread rest only
    once that frame's bytes are all there, so a large frame arriving in small reads is
    copied once, not once per read.
    """

    def __init__(self, frame_max: int) -> None:
        self.frame_max = frame_max
        self._data = b""
        self._pos = 0
        self._pending: list[bytes] = []
        self._pending_size = 0
        self._header_seen = False

    def feed(self, data: bytes) -> None:
        self._pending.append(data)
        self._pending_size += len(data)

    def _gather(self, needed: int) -> bool:
        """Make at least ``needed`` unread bytes readable at ``_pos``; False if fewer have
        arrived."""
        unread = len(self._data) - self._pos
        if unread + self._pending_size < needed:
            return False
        if unread:
            self._pending.insert(0, self._data[self._pos :])
        self._data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pos = 0
        self._pending.clear()
        self._pending_size = 0
        return True

    def read_protocol_header(self) -> bool:
        """Consume the protocol header; False while more bytes are needed."""
        self._gather(0)
        size = len(PROTOCOL_HEADER)
        received = self._data[self._pos : self._pos + size]
        if received != PROTOCOL_HEADER[: len(received)]:
            raise BadProtocolHeader(ReplyCode.FRAME_ERROR, "bad protocol header")
        if len(received) < size:
            return False
        self._pos += size
        self._header_seen = True
        return True

    def next_frame(self) -> Frame | None:
        """The next complete frame, None when more bytes are needed; raise on bad input."""
        if not self._header_seen and not self.read_protocol_header():
            return None
        if len(self._data) - self._pos < FRAME_HEADER_SIZE and not self._gather(FRAME_HEADER_SIZE):
            return None
        data, pos = self._data, self._pos
        frame_type, channel, size = _HEADER.unpack_from(data, pos)
        if size + FRAME_OVERHEAD > self.frame_max:
            raise AmqpConnectionError(
                ReplyCode.FRAME_ERROR, f"frame of {size} bytes exceeds frame_max {self.frame_max}"
            )
        if len(data) - pos < size + FRAME_OVERHEAD:
            if not self._gather(size + FRAME_OVERHEAD):
                return None
            data, pos = self._data, 0
        start = pos + FRAME_HEADER_SIZE
        end = start + size
        if data[end] != FRAME_END:
            raise AmqpConnectionError(ReplyCode.FRAME_ERROR, "bad frame-end octet")
        payload: Payload
        if frame_type == FRAME_BODY:
            payload = body.ContentBody(data[start:end])
        elif frame_type in (FRAME_METHOD, FRAME_HEADER):
            hot = decode_publish if frame_type == FRAME_METHOD else decode_content_header
            decoded = hot(data, start, end)
            payload = _unmarshal(data[pos : end + 1], frame_type) if decoded is None else decoded
        elif frame_type == FRAME_HEARTBEAT:
            if channel != 0:
                raise AmqpConnectionError(ReplyCode.FRAME_ERROR, "heartbeat on a channel")
            payload = heartbeat.Heartbeat()
        else:
            raise AmqpConnectionError(ReplyCode.FRAME_ERROR, f"unknown frame type {frame_type}")
        self._pos = end + 1
        return Frame(channel, payload)


def _unmarshal(data: bytes, frame_type: int) -> Payload:
    try:
        _, _, value = frame.unmarshal(data)
    except Exception as e:
        # pamqp's field decoders surface hostile input as UnmarshalingException or as
        # whatever the stdlib raised (struct.error, UnicodeDecodeError, IndexError, decimal
        # errors...): all of it is a syntax error of the peer's, never ours to crash on. The
        # reply is a fixed reason (DESIGN.md §3.7): pamqp's texts name its objects by
        # address; the cause stays chained for the log.
        raise AmqpConnectionError(ReplyCode.SYNTAX_ERROR, "malformed frame") from e
    if isinstance(value, header.ContentHeader) and value.class_id != BASIC_CLASS_ID:
        raise AmqpConnectionError(ReplyCode.FRAME_ERROR, "content header for a non-Basic class")
    if frame_type == FRAME_METHOD and not isinstance(value, base.Frame):
        raise AmqpConnectionError(ReplyCode.FRAME_ERROR, "malformed method frame")
    if not isinstance(value, base.Frame | header.ContentHeader):
        raise AmqpConnectionError(ReplyCode.FRAME_ERROR, "unexpected frame payload")
    return value


# AMQP 0-9-1 field names are at most 128 bytes; pamqp truncates longer ones the same way.
_MAX_FIELD_NAME: Final = 128


def _table_value(value: object) -> bytes:
    if isinstance(value, Timestamp):
        return b"T" + encode_timestamp(value)
    if isinstance(value, float):
        return b"d" + encode.double(value)
    if isinstance(value, bytes):
        return b"x" + encode.byte_array(bytearray(value))
    if isinstance(value, dict):
        return b"F" + _field_table(value)
    if isinstance(value, list):
        items = b"".join(_table_value(item) for item in value)
        return b"A" + encode.long_uint(len(items)) + items
    return encode.encode_table_value(value)  # type: ignore[arg-type]


def _field_table(table: dict[str, object]) -> bytes:
    """pamqp's ``encode.field_table`` with floats as doubles and bytes as byte arrays."""
    parts = []
    for name, value in table.items():
        name = name.encode("utf-8")[:_MAX_FIELD_NAME].decode("utf-8", "ignore")
        parts.append(encode.short_string(name) + _table_value(value))
    data = b"".join(parts)
    return encode.long_uint(len(data)) + data


class Properties(commands.Basic.Properties):
    """Basic.Properties whose ``headers`` go out through ``field_table`` and whose
    ``timestamp`` is an integer, written as it is (module doc)."""

    def encode_property(self, name: str, value: Any) -> bytes:
        if name == "headers":
            return _field_table(value)
        if name == "timestamp" and isinstance(value, int):
            return encode_timestamp(value)
        return super().encode_property(name, value)


def _outgoing(properties: commands.Basic.Properties) -> Properties:
    if isinstance(properties, Properties):
        return properties
    copy = Properties()
    for name in commands.Basic.Properties.__slots__:
        setattr(copy, name, getattr(properties, name))
    return copy


def method_frame(channel: int, method: base.Frame) -> bytes:
    return frame.marshal(method, channel)


def content_frames(
    channel: int, properties: commands.Basic.Properties, payload: bytes, frame_max: int
) -> bytes:
    """A content header and as many body frames as ``frame_max`` requires. ValueError
    when the header frame alone is over ``frame_max``: AMQP cannot split it, and a peer
    may close the connection for it (the consumer's message is dead-lettered instead)."""
    content_header = header.ContentHeader(0, len(payload), _outgoing(properties))
    parts = [frame.marshal(content_header, channel)]
    if len(parts[0]) > frame_max:
        raise ValueError(f"content header of {len(parts[0])} bytes exceeds frame_max {frame_max}")
    chunk = frame_max - FRAME_OVERHEAD
    for start in range(0, len(payload), chunk):
        piece = payload[start : start + chunk]
        parts.append(_HEADER.pack(FRAME_BODY, channel, len(piece)) + piece + _FRAME_END_BYTES)
    return b"".join(parts)


HEARTBEAT_FRAME: Final = heartbeat.Heartbeat.marshal()

__all__ = [
    "HEARTBEAT_FRAME",
    "BadProtocolHeader",
    "Frame",
    "FrameReader",
    "Payload",
    "Properties",
    "content_frames",
    "method_frame",
]
