"""The domain model shared by every layer: messages, queues, groups, flows and their states.

Everything here is a frozen, slotted dataclass or an Enum so it can cross task and thread
boundaries freely. Times are float seconds since the Unix epoch, always passed in by the
caller (core/ never reads a clock).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Final, TypeAlias

from core.errors import AlreadyExists, InvalidArgument
from core.frozen import frozen
from core.settings import QUEUE_SETTINGS, typed_setting

PropertyValue: TypeAlias = str | int | float | bool | bytes
Properties: TypeAlias = Mapping[str, PropertyValue]

MIB: Final = 1024 * 1024
DEFAULT_MAX_MESSAGE_SIZE: Final = 5 * MIB
DEFAULT_MAX_DELIVERIES: Final = 16
DEFAULT_BACKOFF_INITIAL: Final = 1.0
DEFAULT_BACKOFF_MULTIPLIER: Final = 2.0
DEFAULT_BACKOFF_MAX: Final = 64.0
DEFAULT_REBALANCE_DELAY: Final = 5.0
DEFAULT_MAX_HANDOFF_TIME: Final = 3.0
DEFAULT_WINDOW: Final = 10_000
# Dedup is opt-in per queue (as in Pulsar and Azure Service Bus): many applications use
# AMQP message_id / STOMP message-id as a business id shared by several real messages.
DEFAULT_DEDUP_WINDOW: Final = 0.0
DLQ_SUFFIX: Final = ".dlq"
# What each property adds to Message.size besides its name and value (tag and lengths).
PROPERTY_OVERHEAD: Final = 4

# Property names with a meaning of their own (DESIGN.md §3.2, §4 dead letters).
PARTITION_KEY_PROPERTY: Final = "QUEUE_PARTITION_KEY"
GROUP_ID_PROPERTY: Final = "JMSXGroupID"
DEAD_LETTER_REASON: Final = "x-dead-letter-reason"
ORIGINAL_QUEUE: Final = "x-original-queue"
ORIGINAL_GROUP: Final = "x-original-group"
ORIGINAL_PARTITION: Final = "x-original-partition"
ORIGINAL_SEQ: Final = "x-original-seq"
DELIVERY_COUNT: Final = "x-delivery-count"
FIRST_DELIVERY_TIME: Final = "x-first-delivery-time"
REDRIVE_COUNT: Final = "x-redrive-count"
# What dead-lettering adds to a message; a redrive takes it off again.
DEAD_LETTER_PROPERTIES: Final = frozenset(
    {
        DEAD_LETTER_REASON,
        ORIGINAL_QUEUE,
        ORIGINAL_GROUP,
        ORIGINAL_PARTITION,
        ORIGINAL_SEQ,
        DELIVERY_COUNT,
        FIRST_DELIVERY_TIME,
    }
)
# The per-delivery headers the gateway adds over AMQP and STOMP (DESIGN.md §5b).
PARTITION_HEADER: Final = "x-partition"
SEQ_HEADER: Final = "x-seq"


def delivery_header(name: str, properties: Mapping[str, object]) -> str:
    """The name a per-delivery header (``x-delivery-count``, ``x-partition``, STOMP's
    ``redelivered`` ...) goes out under: its own, or ``x-keygate-<name without x->`` when
    the message carries a property of that name, which is the message's and wins (a dead
    letter's ``x-delivery-count`` is its original queue's, DESIGN.md §4)."""
    return "x-keygate-" + name.removeprefix("x-") if name in properties else name


# Queue and group names: letters, digits and . _ - ; 1 to 200 characters; not starting with
# a dot so that "<queue>.dlq" is always derived, never ambiguous with a hidden name.
_NAME_RE: Final = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,199}$")


def _text_size(text: str) -> int:
    # isascii() reads a flag of the string: the usual text is counted without encoding it.
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _finite(what: str, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise InvalidArgument(f"{what} must be a finite number")


def validate_name(kind: str, name: str) -> str:
    """Return ``name`` if it is a valid queue or group name, else raise InvalidArgument."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidArgument(
            f"invalid {kind} name {name!r}: use 1-200 of letters, digits, '.', '_', '-' "
            "(not starting with '.')"
        )
    return name


class GroupMode(StrEnum):
    PARTITIONED = "partitioned"
    EXCLUSIVE = "exclusive"
    SHARED = "shared"


class KeyOrder(StrEnum):
    PARTITION = "partition"
    STRICT = "strict"


class StartPosition(StrEnum):
    EARLIEST = "earliest"
    LATEST = "latest"


class AckMode(StrEnum):
    CLIENT = "client"
    AUTO = "auto"


class PartitionState(StrEnum):
    UNASSIGNED = "unassigned"
    READY = "ready"
    PAUSED = "paused"
    UNBOUND = "unbound"


class FlowState(StrEnum):
    RUNNING = "running"
    LEAVING = "leaving"
    EXITED = "exited"


class DeadLetterReason(StrEnum):
    MAX_DELIVERIES = "max-deliveries"
    REJECTED = "rejected"
    EXPIRED = "expired"
    # Stored but impossible to read or encode for delivery (a row from an older version).
    UNDELIVERABLE = "undeliverable"
    # Followed an earlier dead letter of its key (on_dead_letter = dead_letter_key, or a
    # parked key released with skip).
    KEY_DEAD_LETTERED = "key-dead-lettered"


class DeadLetterPolicy(StrEnum):
    """What happens to the rest of a key after one of its messages is dead-lettered for
    failing (max deliveries or rejected; not for expiry)."""

    CONTINUE = "continue"  # the key's later messages flow
    PARK_KEY = "park_key"  # the key waits until an operator releases it
    DEAD_LETTER_KEY = "dead_letter_key"  # the key's stored messages follow it to the DLQ


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """A queue's settings (DESIGN.md §2). ``partitions == 0`` means one internal partition."""

    name: str
    partitions: int = 0
    subscriptions: tuple[str, ...] = ()
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    max_depth_messages: int | None = None
    max_depth_bytes: int | None = None
    ttl: float | None = None
    max_deliveries: int = DEFAULT_MAX_DELIVERIES
    backoff_initial: float = DEFAULT_BACKOFF_INITIAL
    backoff_multiplier: float = DEFAULT_BACKOFF_MULTIPLIER
    backoff_max: float = DEFAULT_BACKOFF_MAX
    # None = "<name>.dlq"; "" = no dead-letter queue (dead letters are dropped and counted).
    dead_letter_queue: str | None = None
    rebalance_delay: float = DEFAULT_REBALANCE_DELAY
    max_handoff_time: float = DEFAULT_MAX_HANDOFF_TIME
    window: int = DEFAULT_WINDOW
    dedup_window: float = DEFAULT_DEDUP_WINDOW
    # Where the partition key comes from when no key property is present:
    # None, "app_id" (AMQP app_id) or "topic:N" (topic level N, 0-based).
    key_from: str | None = None
    dead_letter_expired: bool = False
    # Keep settled messages this long after publish (replay with a group reset, browse);
    # 0 = delete a message as soon as every group has settled it.
    retention: float = 0.0
    # A DeadLetterPolicy value (kept as text: the settings table and SQL hold strings).
    on_dead_letter: str = DeadLetterPolicy.CONTINUE.value

    def __post_init__(self) -> None:
        validate_name("queue", self.name)
        # Types and integer ranges first, against the settings table: every interface
        # (native, SDK, AMQP, CLI, HTTP) makes a QueueConfig, so this is the one check they
        # all share.
        for setting in QUEUE_SETTINGS:
            value = getattr(self, setting.name)
            typed = typed_setting(setting, value)
            if typed is not value:
                object.__setattr__(self, setting.name, typed)
        for attr in (
            "ttl",
            "backoff_initial",
            "backoff_multiplier",
            "backoff_max",
            "rebalance_delay",
            "max_handoff_time",
            "dedup_window",
        ):
            _finite(attr, getattr(self, attr))
        if self.ttl is not None and self.ttl <= 0:
            raise InvalidArgument("ttl must be > 0 or None")
        if self.backoff_initial < 0 or self.backoff_max < 0 or self.backoff_multiplier < 1:
            raise InvalidArgument("backoff: initial >= 0, max >= 0, multiplier >= 1")
        if self.rebalance_delay < 0 or self.max_handoff_time < 0:
            raise InvalidArgument("rebalance_delay and max_handoff_time must be >= 0")
        if self.dedup_window < 0:
            raise InvalidArgument("dedup_window must be >= 0")
        if not 0 <= self.retention < float("inf"):
            raise InvalidArgument("retention must be a finite number of seconds >= 0")
        if self.dead_letter_queue:
            validate_name("dead-letter queue", self.dead_letter_queue)
            if self.dead_letter_queue == self.name:
                raise InvalidArgument("a queue cannot be its own dead-letter queue")
        if self.key_from is not None and self.key_from != "app_id":
            level = self.key_from.removeprefix("topic:")
            if not (self.key_from.startswith("topic:") and level.isdigit()):
                raise InvalidArgument(
                    f"key_from must be 'app_id' or 'topic:N', got {self.key_from!r}"
                )
        if self.on_dead_letter not in DeadLetterPolicy.__members__.values():
            choices = ", ".join(DeadLetterPolicy)
            raise InvalidArgument(f"on_dead_letter must be one of {choices}")

    @property
    def dead_letter_policy(self) -> DeadLetterPolicy:
        return DeadLetterPolicy(self.on_dead_letter)

    @property
    def slots(self) -> int:
        """Number of internal partitions (at least one)."""
        return max(1, self.partitions)

    @property
    def dlq_name(self) -> str | None:
        """The dead-letter queue's name, or None when dead letters are dropped."""
        if self.dead_letter_queue == "":
            return None
        return self.dead_letter_queue or self.name + DLQ_SUFFIX

    def setting(self, name: str) -> object:
        """A setting's value as it takes effect (the dead-letter queue by its name)."""
        return self.dlq_name if name == "dead_letter_queue" else getattr(self, name)

    def check_same(self, wanted: QueueConfig, names: Iterable[str]) -> None:
        """AlreadyExists naming the first of ``names`` (the settings a declare gave) whose
        value in ``wanted`` differs from this queue's: a declare of an existing queue
        checks what it names, and takes the rest as stored."""
        for name in names:
            current, asked = self.setting(name), wanted.setting(name)
            if current != asked:
                raise AlreadyExists(
                    f"queue {self.name!r} exists with {name}={current!r}, not {asked!r}"
                )


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """A consumer group's settings (DESIGN.md §2)."""

    queue: str
    name: str
    mode: GroupMode = GroupMode.PARTITIONED
    key_order: KeyOrder = KeyOrder.PARTITION
    start: StartPosition = StartPosition.EARLIEST
    # Property equality filter; messages that do not match are skipped for this group.
    tags: Mapping[str, str] | None = None
    # Visibility timeout in seconds: unacked past it -> redelivered. None = no timeout.
    ack_timeout: float | None = None

    def __post_init__(self) -> None:
        validate_name("queue", self.queue)
        validate_name("group", self.name)
        _finite("ack_timeout", self.ack_timeout)
        for name, value in (self.tags or {}).items():
            # Stored as JSON (PostgreSQL JSONB holds no NUL) and compared as text.
            if not (isinstance(name, str) and isinstance(value, str)) or "\x00" in name + value:
                raise InvalidArgument("tag names and values must be text without NUL")
        if self.ack_timeout is not None and self.ack_timeout <= 0:
            raise InvalidArgument("ack_timeout must be > 0 or None")


@frozen
class Message:
    """A stored message. ``seq`` is strictly increasing within (queue, partition)."""

    message_id: str
    queue: str
    partition: int
    seq: int
    key: str | None
    payload: bytes
    properties: Properties = field(default_factory=dict)
    topic: str | None = None
    publish_time: float = 0.0
    deliver_at: float | None = None
    expire_at: float | None = None
    producer: str | None = None
    dedup_id: str | None = None
    content_type: str | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    # The authenticated user that published it (None: anonymous). With producer and
    # dedup_id it forms the dedup namespace (DESIGN.md §3.6); not a kg_messages column.
    publisher: str | None = None
    # ``size``, once computed: every stage of a publish asks for it (limits, depth, buffer
    # accounting, the INSERT), and the message is immutable.
    _size: int | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def size(self) -> int:
        """Bytes counted against ``max_message_size`` and ``max_depth_bytes``: the payload,
        every property (name, value and a fixed overhead) and every header the publisher set
        (DESIGN.md §3.7; the producer is the gateway's label, not the publisher's)."""
        if self._size is None:
            object.__setattr__(self, "_size", self._measure())
        assert self._size is not None
        return self._size

    def _measure(self) -> int:
        size = len(self.payload)
        for name, value in self.properties.items():
            size += PROPERTY_OVERHEAD + _text_size(name)
            if isinstance(value, str):
                size += _text_size(value)
            elif isinstance(value, bytes):
                size += len(value)
            else:
                size += 8
        for header in (
            self.key,
            self.topic,
            self.dedup_id,
            self.content_type,
            self.correlation_id,
            self.reply_to,
        ):
            if header is not None:
                size += _text_size(header)
        return size


@frozen
class Publication:
    """What a publisher hands to the gateway, before routing (DESIGN.md §3).

    Exactly one of ``queue`` and ``topic`` is set. ``key`` is a key from a protocol field
    that is not a property (the native KEY field); the key properties, when present, win
    over it (core.keys, DESIGN.md §3.2).
    """

    payload: bytes
    queue: str | None = None
    topic: str | None = None
    key: str | None = None
    properties: Properties = field(default_factory=dict)
    ttl: float | None = None
    deliver_at: float | None = None
    expire_at: float | None = None
    # Seconds after the publish time (a delay header, core.schedule); ignored when
    # ``deliver_at`` is set.
    delay: float | None = None
    producer: str | None = None
    dedup_id: str | None = None
    content_type: str | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    app_id: str | None = None

    def __post_init__(self) -> None:
        if (self.queue is None) == (self.topic is None):
            raise InvalidArgument("a publication names exactly one of queue and topic")
        if self.delay is not None and not (math.isfinite(self.delay) and self.delay >= 0):
            raise InvalidArgument("delay must be a finite number of seconds >= 0")


class ResetKind(StrEnum):
    EARLIEST = "earliest"
    LATEST = "latest"
    SEQ = "seq"
    TIME = "time"


@dataclass(frozen=True, slots=True)
class ResetPosition:
    """Where ``keygate group reset`` moves a group: the earliest retained message, the
    latest (skip everything stored), given seqs per partition (the first seq to deliver;
    partitions not named keep their position), or the first message published at or after
    ``time``."""

    kind: ResetKind
    seqs: Mapping[int, int] = field(default_factory=dict)
    time: float | None = None

    @classmethod
    def parse(cls, text: str) -> ResetPosition:
        """``earliest``, ``latest``, ``seq:P=N,P=N`` or ``time:ISO8601``."""
        kind, _, rest = text.partition(":")
        if text in (ResetKind.EARLIEST, ResetKind.LATEST):
            return cls(ResetKind(text))
        if kind == ResetKind.SEQ and rest:
            seqs = {}
            for pair in rest.split(","):
                partition, sep, seq = pair.partition("=")
                if not (sep and partition.isdigit() and seq.isdigit() and int(seq) >= 1):
                    raise InvalidArgument(f"bad partition position {pair!r}: use P=N, N >= 1")
                seqs[int(partition)] = int(seq)
            return cls(ResetKind.SEQ, seqs=seqs)
        if kind == ResetKind.TIME and rest:
            try:
                moment = datetime.fromisoformat(rest)
            except ValueError:
                raise InvalidArgument(f"bad time {rest!r}: use ISO 8601") from None
            if moment.tzinfo is None:
                raise InvalidArgument(f"time {rest!r} needs a UTC offset (e.g. Z or +02:00)")
            return cls(ResetKind.TIME, time=moment.timestamp())
        raise InvalidArgument(
            f"bad reset position {text!r}: use earliest, latest, seq:P=N,... or time:ISO8601"
        )
