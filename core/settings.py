"""The queue settings table: one row per ``QueueConfig`` setting, with its type, unit,
help text and AMQP ``x-`` argument. Every interface that takes queue settings (CLI flags,
the admin API and its OpenAPI document, the native DECLARE_QUEUE map, AMQP queue.declare
arguments) reads this table instead of keeping a list of its own.

The names are ``QueueConfig``'s field names; the HTTP/JSON, SDK and native names are the
same; the CLI flag is the name with dashes. AMQP durations are milliseconds (RabbitMQ's
convention, set by ``x-message-ttl``); everywhere else they are seconds.

Every integer setting has a range (``minimum``, ``maximum``) that both databases can
store: an ``INTEGER`` column is 32 bits on PostgreSQL, a ``BIGINT`` 64 (storage.schema).
A value outside it is an InvalidArgument naming the setting and the range, the same on
SQLite and PostgreSQL, rather than a driver error at the INSERT.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from core.errors import InvalidArgument

SettingType = type[int] | type[float] | type[str] | type[bool]

# The largest value of an INTEGER and of a BIGINT column (PostgreSQL's int4 and int8).
INT32_MAX: Final = 2**31 - 1
INT64_MAX: Final = 2**63 - 1
# The most partitions a queue may have.
MAX_PARTITIONS: Final = 65_536


@dataclass(frozen=True, slots=True)
class QueueSetting:
    name: str
    kind: SettingType
    help: str
    unit: str = ""
    optional: bool = False  # None (JSON null) is a value: "no limit" / "default"
    amqp: str | None = None  # the queue.declare x- argument
    millis: bool = False  # the AMQP argument is in milliseconds (the setting in seconds)
    minimum: int | None = None  # an integer setting's range, both ends included
    maximum: int | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


QUEUE_SETTINGS: Final = (
    QueueSetting("partitions", int, "number of partitions (0 = one internal partition)",
                 amqp="x-partitions", minimum=0, maximum=MAX_PARTITIONS),
    QueueSetting("max_message_size", int, "largest message accepted, properties included",
                 "bytes", amqp="x-max-message-size", minimum=1, maximum=INT32_MAX),
    QueueSetting("max_depth_messages", int, "reject publishes beyond this many stored messages",
                 "messages", optional=True, amqp="x-max-length", minimum=1, maximum=INT64_MAX),
    QueueSetting("max_depth_bytes", int, "reject publishes beyond this many stored bytes",
                 "bytes", optional=True, amqp="x-max-length-bytes", minimum=1,
                 maximum=INT64_MAX),
    QueueSetting("ttl", float, "default time to live of a message", "s", optional=True,
                 amqp="x-message-ttl", millis=True),
    QueueSetting("max_deliveries", int, "deliveries before a message is dead-lettered "
                 "(0 = unlimited)", amqp="x-max-deliveries", minimum=0, maximum=INT32_MAX),
    QueueSetting("backoff_initial", float, "first redelivery delay after a nack", "s",
                 amqp="x-backoff-initial", millis=True),
    QueueSetting("backoff_multiplier", float, "redelivery delay growth per delivery",
                 amqp="x-backoff-multiplier"),
    QueueSetting("backoff_max", float, "longest redelivery delay", "s",
                 amqp="x-backoff-max", millis=True),
    QueueSetting("dead_letter_queue", str, "dead-letter queue name ('' = drop dead letters; "
                 "default <queue>.dlq)", optional=True, amqp="x-dead-letter-queue"),
    QueueSetting("rebalance_delay", float, "how long a disconnected consumer's partitions "
                 "wait for it", "s", amqp="x-rebalance-delay", millis=True),
    QueueSetting("max_handoff_time", float, "how long a handoff waits for the old owner's "
                 "acks", "s", amqp="x-max-handoff-time", millis=True),
    QueueSetting("window", int, "default window: delivered-unacked messages per consumer",
                 "messages", amqp="x-window", minimum=1, maximum=INT32_MAX),
    QueueSetting("dedup_window", float, "how long a dedup id is remembered (0 = dedup off)",
                 "s", amqp="x-dedup-window", millis=True),
    QueueSetting("key_from", str, "partition key when no key property: 'app_id' or "
                 "'topic:N'", optional=True, amqp="x-key-from"),
    QueueSetting("dead_letter_expired", bool, "dead-letter expired messages instead of "
                 "dropping them", amqp="x-dead-letter-expired"),
    QueueSetting("retention", float, "keep settled messages this long after publish, for "
                 "replay and browsing (0 = delete once settled)", "s", amqp="x-retention",
                 millis=True),
    QueueSetting("on_dead_letter", str, "after a message fails into the dead-letter queue: "
                 "'continue' (its key flows on), 'park_key' (its key waits for `keygate key "
                 "release`) or 'dead_letter_key' (its key's stored messages follow it)",
                 amqp="x-on-dead-letter"),
)  # fmt: skip

_BY_NAME: Final = {s.name: s for s in QUEUE_SETTINGS}
# Every setting's name: what a map of queue settings (native DECLARE_QUEUE, the SDK) may hold.
SETTING_NAMES: Final = frozenset(_BY_NAME)
# Settings given as a list rather than one value (topic subscriptions).
_LISTS: Final = frozenset({"subscriptions"})


def queue_settings(values: Mapping[str, object]) -> dict[str, object]:
    """Check queue settings from an untyped source (JSON, TOML, a wire map) against the
    table, so a wrong type is an InvalidArgument naming the setting, never a crash deeper
    in. ``subscriptions`` lists become tuples; ints are accepted where a float is expected.
    (``QueueConfig`` checks its fields with ``typed_setting`` too, so a source that builds
    one directly gets the same answer.)"""
    out: dict[str, object] = {}
    for name, value in values.items():
        if name in _LISTS:
            if not (isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)):
                raise InvalidArgument(f"{name} must be a list of strings")
            out[name] = tuple(value)
            continue
        setting = _BY_NAME.get(name)
        if setting is None:
            raise InvalidArgument(f"unknown queue setting {name!r}")
        out[name] = typed_setting(setting, value)
    return out


def typed_setting(setting: QueueSetting, value: object) -> object:
    """``value`` as ``setting``'s type and within its range, or InvalidArgument naming the
    setting and the type or range. A bool is not an int; an int is taken where a float is
    expected, as that float."""
    kind = setting.kind
    if value is None and setting.optional:
        return None
    if isinstance(value, bool) == (kind is bool):
        if kind is float and isinstance(value, int | float):
            return float(value)
        if type(value) is kind:
            _in_range(setting, value)
            return value
    raise InvalidArgument(
        f"{setting.name} must be of type {kind.__name__}, not {type(value).__name__}"
    )


def _in_range(setting: QueueSetting, value: object) -> None:
    low, high = setting.minimum, setting.maximum
    if low is None or high is None or not isinstance(value, int):
        return
    if not low <= value <= high:
        raise InvalidArgument(f"{setting.name} must be between {low} and {high}")


__all__ = [
    "INT32_MAX",
    "INT64_MAX",
    "MAX_PARTITIONS",
    "QUEUE_SETTINGS",
    "SETTING_NAMES",
    "QueueSetting",
    "SettingType",
    "queue_settings",
    "typed_setting",
]
