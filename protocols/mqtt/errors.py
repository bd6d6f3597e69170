"""MQTT protocol errors: each carries the MQTT 5 reason code the server answers with.

A decoder or state-machine failure is raised as one of these; the listener turns it into a
DISCONNECT with ``reason_code`` (MQTT 5, after a successful CONNECT) or a closed socket
(MQTT 3.1.1, or before CONNECT).
"""

from __future__ import annotations

from typing import ClassVar, Final

from core.errors import (
    InvalidMessage,
    KeygateError,
    MessageTooLarge,
    NoRoute,
    NotFound,
    PermissionDenied,
    ProtocolError,
    QueueFull,
    StorageError,
    Unavailable,
)
from protocols.mqtt.events import ReasonCode


class PayloadFormatInvalid(InvalidMessage):
    """A payload that is not UTF-8 under Payload Format Indicator 1 (PUBACK/PUBREC 0x99)."""

    code = "payload-format-invalid"

    def __init__(self) -> None:
        super().__init__("the payload is not UTF-8 but its Payload Format Indicator says so")


# A publish not stored (refused by the sink or by the connection): the PUBACK/PUBREC
# reason, first match wins; any other KeygateError is 0x83.
_PUBLISH_REASONS: Final[tuple[tuple[type[KeygateError], ReasonCode], ...]] = (
    (PayloadFormatInvalid, ReasonCode.PAYLOAD_FORMAT_INVALID),
    (StorageError, ReasonCode.UNSPECIFIED_ERROR),  # not stored: the client may retry
    (Unavailable, ReasonCode.UNSPECIFIED_ERROR),
    (NoRoute, ReasonCode.NO_MATCHING_SUBSCRIBERS),
    (NotFound, ReasonCode.NO_MATCHING_SUBSCRIBERS),
    (PermissionDenied, ReasonCode.NOT_AUTHORIZED),
    (QueueFull, ReasonCode.QUOTA_EXCEEDED),
    # PUBACK has no 0x95 (§3.4.2.1): 0x83 is "valid but not accepted", with the reason.
    (MessageTooLarge, ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR),
)


def publish_reason(error: KeygateError) -> ReasonCode:
    """The MQTT reason code for a publish the gateway did not store."""
    return next(
        (code for cls, code in _PUBLISH_REASONS if isinstance(error, cls)),
        ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR,
    )


class MqttProtocolError(ProtocolError):
    """Bad MQTT input. ``reason_code`` is the MQTT 5 reason code for the DISCONNECT."""

    code = "mqtt-protocol-error"
    default_reason: ClassVar[ReasonCode] = ReasonCode.PROTOCOL_ERROR

    def __init__(self, message: str, reason_code: ReasonCode | None = None) -> None:
        super().__init__(message)
        self.reason_code: ReasonCode = reason_code or self.default_reason


class MalformedPacket(MqttProtocolError):
    """The bytes do not form a valid packet (0x81)."""

    default_reason = ReasonCode.MALFORMED_PACKET


class PacketTooLarge(MqttProtocolError):
    """The packet is larger than the Maximum Packet Size we advertised (0x95)."""

    default_reason = ReasonCode.PACKET_TOO_LARGE


class UnsupportedProtocolVersion(MqttProtocolError):
    """CONNECT named a protocol level other than 4 (3.1.1) or 5 (0x84)."""

    default_reason = ReasonCode.UNSUPPORTED_PROTOCOL_VERSION

    def __init__(self, level: int) -> None:
        super().__init__(f"unsupported MQTT protocol level {level}")
        self.level = level


__all__ = [
    "MalformedPacket",
    "MqttProtocolError",
    "PacketTooLarge",
    "PayloadFormatInvalid",
    "UnsupportedProtocolVersion",
    "publish_reason",
]
