"""The stream codec: a receive buffer that yields events, and frame encoding.

``receive_data`` appends bytes; ``next_event`` returns the next complete frame as an event,
None when more bytes are needed, or raises ``NativeProtocolError`` (``FrameTooLarge`` as
soon as a length prefix above ``max_frame`` is seen, before the body arrives). After a
raise the stream is out of sync and the caller must send ERROR and close.
"""

from __future__ import annotations

from typing import Final

from protocols.native.decoding import decode_frame
from protocols.native.encoding import HEADER, HEADER_SIZE, encode
from protocols.native.errors import FrameTooLarge, NativeProtocolError
from protocols.native.events import DEFAULT_MAX_FRAME, Event

# type + request id: the smallest value the length prefix can take.
_MIN_LENGTH: Final = HEADER_SIZE - 4
# Compact the receive buffer only once the consumed prefix is large: deleting a bytearray
# prefix is a memmove, so doing it per frame would make a burst of small frames quadratic.
_COMPACT_AT: Final = 64 * 1024


class Codec:
    """Sans-IO framing for one direction pair of a connection."""

    __slots__ = ("_buf", "_pos", "max_frame")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._buf = bytearray()
        self._pos = 0
        self.max_frame = max_frame

    @property
    def buffered(self) -> int:
        """Bytes received and not yet consumed by ``next_event``."""
        return len(self._buf) - self._pos

    def receive_data(self, data: bytes) -> None:
        self._buf += data

    def next_event(self) -> Event | None:
        buf = self._buf
        pos = self._pos
        if len(buf) - pos < HEADER_SIZE:
            if len(buf) - pos >= 4:
                self._check_length(int.from_bytes(buf[pos : pos + 4], "big"))
            return None
        length, frame_type, request_id = HEADER.unpack_from(buf, pos)
        self._check_length(length)
        end = pos + 4 + length
        if len(buf) < end:
            return None
        body = bytes(buf[pos + HEADER_SIZE : end])
        self._pos = end
        if end == len(buf):
            buf.clear()
            self._pos = 0
        elif end >= _COMPACT_AT:
            del buf[:end]
            self._pos = 0
        return decode_frame(frame_type, request_id, body)

    def _check_length(self, length: int) -> None:
        if length > self.max_frame:
            raise FrameTooLarge(f"frame of {length} bytes exceeds the maximum {self.max_frame}")
        if length < _MIN_LENGTH:
            raise NativeProtocolError(f"frame length {length} is shorter than its header")

    def encode(self, event: Event) -> bytes:
        return encode(event, self.max_frame)


__all__ = ["Codec"]
