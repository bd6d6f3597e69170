"""MQTT 3.1.1 and 5.0 packets as frozen, slotted event dataclasses.

One class per control packet. MQTT 5 properties live in one ``MqttProperties`` value (all
fields optional); an MQTT 3.1.1 packet simply carries the empty default. Reason codes are
plain ints on the events so any byte round-trips; ``ReasonCode`` names the ones we use.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Final, TypeAlias

from core.frozen import frozen

MQTT_3_1_1: Final = 4
MQTT_5: Final = 5


class PacketType(IntEnum):
    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14
    AUTH = 15


class ReasonCode(IntEnum):
    """MQTT 5 reason codes (OASIS mqtt-v5.0 §2.4)."""

    SUCCESS = 0x00
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    CONTINUE_AUTHENTICATION = 0x18
    REAUTHENTICATE = 0x19
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_IDENTIFIER_NOT_VALID = 0x85
    BAD_USER_NAME_OR_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BANNED = 0x8A
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_IDENTIFIER_IN_USE = 0x91
    PACKET_IDENTIFIER_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    MESSAGE_RATE_TOO_HIGH = 0x96
    QUOTA_EXCEEDED = 0x97
    ADMINISTRATIVE_ACTION = 0x98
    PAYLOAD_FORMAT_INVALID = 0x99
    RETAIN_NOT_SUPPORTED = 0x9A
    QOS_NOT_SUPPORTED = 0x9B
    USE_ANOTHER_SERVER = 0x9C
    SERVER_MOVED = 0x9D
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
    CONNECTION_RATE_EXCEEDED = 0x9F
    MAXIMUM_CONNECT_TIME = 0xA0
    SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2


class ConnectReturnCode(IntEnum):
    """MQTT 3.1.1 CONNACK return codes (§3.2.2.3)."""

    ACCEPTED = 0
    UNACCEPTABLE_PROTOCOL_VERSION = 1
    IDENTIFIER_REJECTED = 2
    SERVER_UNAVAILABLE = 3
    BAD_USER_NAME_OR_PASSWORD = 4
    NOT_AUTHORIZED = 5


@frozen
class MqttProperties:
    """MQTT 5 properties (§2.2.2.2). None / empty = absent."""

    payload_format_indicator: int | None = None
    message_expiry_interval: int | None = None
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    subscription_identifiers: tuple[int, ...] = ()
    session_expiry_interval: int | None = None
    assigned_client_identifier: str | None = None
    server_keep_alive: int | None = None
    authentication_method: str | None = None
    authentication_data: bytes | None = None
    request_problem_information: int | None = None
    will_delay_interval: int | None = None
    request_response_information: int | None = None
    response_information: str | None = None
    server_reference: str | None = None
    reason_string: str | None = None
    receive_maximum: int | None = None
    topic_alias_maximum: int | None = None
    topic_alias: int | None = None
    maximum_qos: int | None = None
    retain_available: int | None = None
    user_properties: tuple[tuple[str, str], ...] = ()
    maximum_packet_size: int | None = None
    wildcard_subscription_available: int | None = None
    subscription_identifier_available: int | None = None
    shared_subscription_available: int | None = None


NO_PROPERTIES: Final = MqttProperties()


@dataclass(frozen=True, slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int = 0
    retain: bool = False
    properties: MqttProperties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Connect:
    client_id: str
    protocol_level: int = MQTT_5
    clean_start: bool = True
    keep_alive: int = 60
    username: str | None = None
    password: bytes | None = None
    will: Will | None = None
    properties: MqttProperties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class ConnAck:
    """``reason_code`` is the MQTT 5 reason code, or the 3.1.1 return code on level 4."""

    session_present: bool = False
    reason_code: int = 0
    properties: MqttProperties = NO_PROPERTIES


@frozen
class Publish:
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int | None = None
    properties: MqttProperties = NO_PROPERTIES


@frozen
class PubAck:
    packet_id: int
    reason_code: int = 0
    properties: MqttProperties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class PubRec:
    packet_id: int
    reason_code: int = 0
    properties: MqttProperties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class PubRel:
    packet_id: int
    reason_code: int = 0
    properties: MqttProperties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class PubComp:
    packet_id: int
    reason_code: int = 0
    properties: MqttProperties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Subscription:
    """One topic filter of a SUBSCRIBE with its options byte split out (§3.8.3.1)."""

    topic_filter: str
    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


@dataclass(frozen=True, slots=True)
class Subscribe:
    packet_id: int
    subscriptions: tuple[Subscription, ...]
    properties: MqttProperties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class SubAck:
    packet_id: int
    reason_codes: tuple[int, ...]
    properties: MqttProperties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    packet_id: int
    topic_filters: tuple[str, ...]
    properties: MqttProperties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class UnsubAck:
    """MQTT 3.1.1 UNSUBACK has no reason codes: ``reason_codes`` is empty there."""

    packet_id: int
    reason_codes: tuple[int, ...] = ()
    properties: MqttProperties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class PingReq:
    pass


@dataclass(frozen=True, slots=True)
class PingResp:
    pass


@dataclass(frozen=True, slots=True)
class Disconnect:
    reason_code: int = 0
    properties: MqttProperties = NO_PROPERTIES


@dataclass(frozen=True, slots=True)
class Auth:
    reason_code: int = 0
    properties: MqttProperties = NO_PROPERTIES


Packet: TypeAlias = (
    Connect
    | ConnAck
    | Publish
    | PubAck
    | PubRec
    | PubRel
    | PubComp
    | Subscribe
    | SubAck
    | Unsubscribe
    | UnsubAck
    | PingReq
    | PingResp
    | Disconnect
    | Auth
)
