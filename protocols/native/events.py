"""The native protocol's frames as events: one frozen, slotted dataclass per frame type.

Every event carries ``request_id`` (the frame header's u32 correlation id). Requests use a
non-zero id chosen by the sender; the response echoes it. Unsolicited frames (DELIVER,
PARTITIONS_CHANGED, CLOSE, a connection-level ERROR) use 0. All fields are keyword-only so
that adding an optional field in a later protocol version never reorders callers.

docs/native-protocol.md gives the byte layout of each frame; the field order there is the
field order here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Final, TypeAlias

from core.frozen import frozen
from core.model import AckMode, GroupMode, KeyOrder, Properties, StartPosition

PROTOCOL_VERSION: Final = 1
SUPPORTED_VERSIONS: Final = frozenset({1})
DEFAULT_MAX_FRAME: Final = 16 * 1024 * 1024
# Below this a frame could not even carry a DECLARE_QUEUE with a full settings map.
MIN_MAX_FRAME: Final = 64 * 1024


class FrameType(IntEnum):
    HELLO = 0x01
    HELLO_OK = 0x02
    PUBLISH = 0x03
    PUBLISH_OK = 0x04
    BIND = 0x05
    BIND_OK = 0x06
    DELIVER = 0x07
    ACK = 0x08
    ACK_CUMULATIVE = 0x09
    NACK = 0x0A
    CREDIT = 0x0B
    PARTITIONS_CHANGED = 0x0C
    UNBIND = 0x0D
    OK = 0x0E
    DECLARE_QUEUE = 0x0F
    QUEUE_OK = 0x10
    DELETE_QUEUE = 0x11
    PING = 0x12
    PONG = 0x13
    ERROR = 0x14
    CLOSE = 0x15
    FLOW_CLOSED = 0x16


class NackOutcome(IntEnum):
    """Solace settle outcomes for NACK (DESIGN.md §4)."""

    RETRY = 0
    REJECT = 1
    SHUTDOWN = 2


# Wire codes of the core enums (u8 on the wire; the order is part of the protocol).
ACK_MODE_CODES: Final[tuple[AckMode, ...]] = (AckMode.CLIENT, AckMode.AUTO)
GROUP_MODE_CODES: Final[tuple[GroupMode, ...]] = (
    GroupMode.PARTITIONED,
    GroupMode.EXCLUSIVE,
    GroupMode.SHARED,
)
KEY_ORDER_CODES: Final[tuple[KeyOrder, ...]] = (KeyOrder.PARTITION, KeyOrder.STRICT)
START_CODES: Final[tuple[StartPosition, ...]] = (StartPosition.EARLIEST, StartPosition.LATEST)


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """First frame of a client. ``version`` is the highest version the client speaks;
    ``max_frame`` the largest frame it accepts (0 = the default, 16 MiB)."""

    request_id: int = 1
    version: int = PROTOCOL_VERSION
    client_name: str = ""
    username: str | None = None
    password: str | None = None
    max_frame: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class HelloOk:
    """``version`` and ``max_frame`` are the negotiated values both sides now use."""

    request_id: int
    version: int
    server_name: str
    session_id: str
    max_frame: int


@frozen(kw_only=True)
class Publish:
    """Exactly one of ``queue`` and ``topic`` is set (checked by the gateway)."""

    request_id: int
    payload: bytes
    queue: str | None = None
    topic: str | None = None
    key: str | None = None
    properties: Properties = field(default_factory=dict)
    ttl: float | None = None
    deliver_at: float | None = None
    dedup_id: str | None = None
    content_type: str | None = None
    correlation_id: str | None = None
    reply_to: str | None = None


@frozen(kw_only=True)
class PublishOk:
    """Sent after commit. A topic publish copied into N queues has N ids."""

    request_id: int
    message_ids: tuple[str, ...]
    duplicate: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Bind:
    """``previous_partitions`` None = a new client; a set = the partitions it held before a
    reconnect (kept if it comes back within the rebalance delay)."""

    request_id: int
    queue: str
    group: str
    window: int
    ack_mode: AckMode = AckMode.CLIENT
    tags: Mapping[str, str] | None = None
    mode: GroupMode | None = None
    key_order: KeyOrder | None = None
    start: StartPosition | None = None
    ack_timeout: float | None = None
    previous_partitions: frozenset[int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BindOk:
    request_id: int
    flow_id: str
    partitions: frozenset[int]
    mode: GroupMode
    window: int


@frozen(kw_only=True)
class Deliver:
    request_id: int = 0
    flow_id: str
    message_id: str
    partition: int
    seq: int
    key: str | None
    payload: bytes
    properties: Properties = field(default_factory=dict)
    topic: str | None = None
    publish_time: float = 0.0
    delivery_count: int = 1
    redelivered: bool = False
    content_type: str | None = None
    correlation_id: str | None = None
    reply_to: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Ack:
    """Settles the listed messages. ``request_id`` 0 = no response wanted, else OK."""

    request_id: int = 0
    flow_id: str
    message_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class AckCumulative:
    """Settles every message of ``partition`` delivered to this flow with seq <= ``seq``."""

    request_id: int = 0
    flow_id: str
    partition: int
    seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Nack:
    request_id: int = 0
    flow_id: str
    message_ids: tuple[str, ...]
    outcome: NackOutcome = NackOutcome.RETRY
    delay: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Credit:
    """Sets the flow's window (absolute: max delivered-unacked), not an increment."""

    request_id: int = 0
    flow_id: str
    window: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionsChanged:
    request_id: int = 0
    flow_id: str
    partitions: frozenset[int]


@dataclass(frozen=True, slots=True, kw_only=True)
class FlowClosed:
    """The gateway ended one flow (its queue was deleted): ``code`` and ``text`` say why,
    as in ERROR. The connection and its other flows go on."""

    request_id: int = 0
    flow_id: str
    code: str
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Unbind:
    request_id: int
    flow_id: str
    shutdown: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Ok:
    """Generic success response (UNBIND, DELETE_QUEUE, ACK/NACK/CREDIT with an id)."""

    request_id: int


SettingValue: TypeAlias = str | int | float | bool | bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class DeclareQueue:
    """``settings`` uses QueueConfig's field names (absent = default); ``subscriptions``
    None = leave as is / none. ``passive``: only check the queue exists."""

    request_id: int
    name: str
    settings: Mapping[str, SettingValue] = field(default_factory=dict)
    subscriptions: tuple[str, ...] | None = None
    exist_ok: bool = True
    passive: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueOk:
    """The queue as stored; settings that are None are absent from the map."""

    request_id: int
    name: str
    settings: Mapping[str, SettingValue] = field(default_factory=dict)
    subscriptions: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteQueue:
    request_id: int
    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Ping:
    request_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Pong:
    request_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Error:
    """``request_id`` 0 = connection-level (the sender closes the connection after it)."""

    request_id: int = 0
    code: str
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Close:
    """Orderly end of the connection; the sender stops sending and closes after it."""

    request_id: int = 0
    reason: str = ""


Event: TypeAlias = (
    Hello
    | HelloOk
    | Publish
    | PublishOk
    | Bind
    | BindOk
    | Deliver
    | Ack
    | AckCumulative
    | Nack
    | Credit
    | PartitionsChanged
    | FlowClosed
    | Unbind
    | Ok
    | DeclareQueue
    | QueueOk
    | DeleteQueue
    | Ping
    | Pong
    | Error
    | Close
)

__all__ = [
    "ACK_MODE_CODES",
    "DEFAULT_MAX_FRAME",
    "GROUP_MODE_CODES",
    "KEY_ORDER_CODES",
    "MIN_MAX_FRAME",
    "PROTOCOL_VERSION",
    "START_CODES",
    "SUPPORTED_VERSIONS",
    "Ack",
    "AckCumulative",
    "Bind",
    "BindOk",
    "Close",
    "Credit",
    "DeclareQueue",
    "DeleteQueue",
    "Deliver",
    "Error",
    "Event",
    "FlowClosed",
    "FrameType",
    "Hello",
    "HelloOk",
    "Nack",
    "NackOutcome",
    "Ok",
    "PartitionsChanged",
    "Ping",
    "Pong",
    "Publish",
    "PublishOk",
    "QueueOk",
    "SettingValue",
    "Unbind",
]
