"""AMQP 0-9-1 reply codes and framing constants (spec section 1.2 / amqp0-9-1.xml)."""

from __future__ import annotations

from enum import IntEnum
from typing import Final

PROTOCOL_HEADER: Final = b"AMQP\x00\x00\x09\x01"
FRAME_HEADER_SIZE: Final = 7
FRAME_END: Final = 0xCE
FRAME_METHOD: Final = 1
FRAME_HEADER: Final = 2
FRAME_BODY: Final = 3
FRAME_HEARTBEAT: Final = 8
# Every peer must accept frames of this size before Tune-Ok (spec: frame-min-size).
FRAME_MIN_SIZE: Final = 4096
# Bytes a frame adds around its payload: 7-byte header plus the frame-end octet.
FRAME_OVERHEAD: Final = FRAME_HEADER_SIZE + 1
BASIC_CLASS_ID: Final = 60


class ReplyCode(IntEnum):
    """Reply codes; 3xx/4xx are channel (soft) errors, 5xx connection (hard) errors."""

    SUCCESS = 200
    CONTENT_TOO_LARGE = 311
    NO_ROUTE = 312
    CONNECTION_FORCED = 320
    ACCESS_REFUSED = 403
    NOT_FOUND = 404
    RESOURCE_LOCKED = 405
    PRECONDITION_FAILED = 406
    FRAME_ERROR = 501
    SYNTAX_ERROR = 502
    COMMAND_INVALID = 503
    CHANNEL_ERROR = 504
    UNEXPECTED_FRAME = 505
    RESOURCE_ERROR = 506
    NOT_ALLOWED = 530
    NOT_IMPLEMENTED = 540
    INTERNAL_ERROR = 541
