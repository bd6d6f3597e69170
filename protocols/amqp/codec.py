"""Frame reading and writing on top of pamqp.

How it works: ``FrameReader`` buffers bytes. The first eight bytes must be the AMQP 0-9-1
protocol header. After that it reads the 7-byte frame header (type, channel, size),
checks the size against the negotiated frame_max before buffering the payload, waits for
size + 1 bytes, checks the frame-end octet and only then hands the whole frame to
``pamqp.frame.unmarshal`` (method and content-header frames). Body frames are sliced
directly: their payload is opaque and pamqp would only copy it. Every failure is an
``AmqpConnectionError`` with the reply code the spec assigns (501 framing, 502 syntax).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final, TypeAlias

from pamqp import base, body, commands, frame, header, heartbeat
from pamqp.exceptions import UnmarshalingException

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

Payload: TypeAlias = base.Frame | header.ContentHeader | body.ContentBody | heartbeat.Heartbeat

_HEADER: Final = struct.Struct(">BHI")
_FRAME_END_BYTES: Final = bytes([FRAME_END])


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame: its channel and pamqp's object for the payload."""

    channel: int
    payload: Payload


class BadProtocolHeader(AmqpConnectionError):
    """The peer did not open with AMQP 0-9-1's header; answer with ours and close."""


class FrameReader:
    """Incremental frame decoder; ``frame_max`` may be lowered after Tune-Ok."""

    def __init__(self, frame_max: int) -> None:
        self.frame_max = frame_max
        self._buffer = bytearray()
        self._header_seen = False

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def read_protocol_header(self) -> bool:
        """Consume the protocol header; False while more bytes are needed."""
        buffer = self._buffer
        size = len(PROTOCOL_HEADER)
        if buffer[:size] != PROTOCOL_HEADER[: len(buffer)]:
            raise BadProtocolHeader(ReplyCode.FRAME_ERROR, "bad protocol header")
        if len(buffer) < size:
            return False
        del buffer[:size]
        self._header_seen = True
        return True

    def next_frame(self) -> Frame | None:
        """The next complete frame, None when more bytes are needed; raise on bad input."""
        if not self._header_seen and not self.read_protocol_header():
            return None
        buffer = self._buffer
        if len(buffer) < FRAME_HEADER_SIZE:
            return None
        frame_type, channel, size = _HEADER.unpack_from(buffer)
        if size + FRAME_OVERHEAD > self.frame_max:
            raise AmqpConnectionError(
                ReplyCode.FRAME_ERROR, f"frame of {size} bytes exceeds frame_max {self.frame_max}"
            )
        end = FRAME_HEADER_SIZE + size
        if len(buffer) <= end:
            return None
        if buffer[end] != FRAME_END:
            raise AmqpConnectionError(ReplyCode.FRAME_ERROR, "bad frame-end octet")
        if frame_type == FRAME_BODY:
            result = Frame(channel, body.ContentBody(bytes(buffer[FRAME_HEADER_SIZE:end])))
        elif frame_type == FRAME_HEARTBEAT:
            if channel != 0:
                raise AmqpConnectionError(ReplyCode.FRAME_ERROR, "heartbeat on a channel")
            result = Frame(0, heartbeat.Heartbeat())
        elif frame_type in (FRAME_METHOD, FRAME_HEADER):
            result = Frame(channel, _unmarshal(bytes(buffer[: end + 1]), frame_type))
        else:
            raise AmqpConnectionError(ReplyCode.FRAME_ERROR, f"unknown frame type {frame_type}")
        del buffer[: end + 1]
        return result


def _unmarshal(data: bytes, frame_type: int) -> Payload:
    try:
        _, _, value = frame.unmarshal(data)
    except UnmarshalingException as e:
        raise AmqpConnectionError(ReplyCode.SYNTAX_ERROR, f"malformed frame: {e}") from e
    except Exception as e:
        # pamqp's field decoders surface hostile input as whatever the stdlib raised
        # (struct.error, UnicodeDecodeError, IndexError, decimal errors...): all of it is a
        # syntax error of the peer's, never ours to crash on.
        raise AmqpConnectionError(ReplyCode.SYNTAX_ERROR, f"undecodable frame: {e!r}") from e
    if isinstance(value, header.ContentHeader) and value.class_id != BASIC_CLASS_ID:
        raise AmqpConnectionError(ReplyCode.FRAME_ERROR, "content header for a non-Basic class")
    if frame_type == FRAME_METHOD and not isinstance(value, base.Frame):
        raise AmqpConnectionError(ReplyCode.FRAME_ERROR, "malformed method frame")
    if not isinstance(value, base.Frame | header.ContentHeader):
        raise AmqpConnectionError(ReplyCode.FRAME_ERROR, "unexpected frame payload")
    return value


def method_frame(channel: int, method: base.Frame) -> bytes:
    return frame.marshal(method, channel)


def content_frames(
    channel: int, properties: commands.Basic.Properties, payload: bytes, frame_max: int
) -> bytes:
    """A content header and as many body frames as ``frame_max`` requires."""
    parts = [frame.marshal(header.ContentHeader(0, len(payload), properties), channel)]
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
    "content_frames",
    "method_frame",
]
