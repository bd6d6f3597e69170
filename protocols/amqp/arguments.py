"""Queue.Declare ``x-`` arguments → QueueConfig, and RabbitMQ's re-declare equivalence rule.

RabbitMQ's own arguments map onto keygate settings where they mean the same thing
(``x-message-ttl`` → ttl, ``x-max-length`` → max_depth_messages, ``x-max-length-bytes`` →
max_depth_bytes, ``x-dead-letter-exchange ""`` + ``x-dead-letter-routing-key Q`` →
dead-letter queue Q, ``x-delivery-limit`` → max_deliveries); keygate's own ``x-``
arguments set the rest. Arguments keygate cannot honour are refused with 406
PRECONDITION_FAILED naming the argument; arguments that only tune RabbitMQ internals are
validated as RabbitMQ validates them and then ignored. docs/protocols/amqp.md has the
table. Unknown arguments are ignored, as RabbitMQ ignores them.

A declare of an existing queue succeeds when every setting it names equals the stored one;
a setting it does not name matches anything (keygate settings made with the CLI or the
admin API behave like RabbitMQ policies, which a declare never contradicts).
"""

from __future__ import annotations

import decimal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from core.errors import InvalidArgument
from core.model import QueueConfig
from core.settings import QUEUE_SETTINGS, QueueSetting
from protocols.amqp.constants import ReplyCode
from protocols.amqp.errors import AmqpChannelError

QUEUE_TYPES: Final = frozenset({"classic", "quorum"})
# RabbitMQ's overflow behaviours; keygate always refuses a publish beyond max depth.
OVERFLOW_REJECT: Final = "reject-publish"
_OVERFLOWS: Final = frozenset({"drop-head", OVERFLOW_REJECT, "reject-publish-dlx"})
_DLX: Final = "x-dead-letter-exchange"
_DLRK: Final = "x-dead-letter-routing-key"


def _precondition(text: str) -> AmqpChannelError:
    return AmqpChannelError(ReplyCode.PRECONDITION_FAILED, text)


def _invalid(name: str, value: Any, expected: str) -> AmqpChannelError:
    return _precondition(f"invalid arg '{name}': {_shown(value)} ({expected})")


def _shown(value: Any) -> str:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    return repr(value)[:60]


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(name, value, "an integer expected")
    return value


def _positive(name: str, value: Any) -> int:
    number = _int(name, value)
    if number <= 0:
        raise _invalid(name, value, "keygate needs a value > 0")
    return number


def _millis(name: str, value: Any) -> float:
    return _int(name, value) / 1000


def _str(name: str, value: Any) -> str:
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if not isinstance(value, str):
        raise _invalid(name, value, "a string expected")
    return value


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _invalid(name, value, "a boolean expected")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | decimal.Decimal):
        raise _invalid(name, value, "a number expected")
    return float(value)


def _converter(setting: QueueSetting) -> Callable[[str, Any], Any]:
    if setting.kind is bool:
        return _bool
    if setting.kind is str:
        return _str
    if setting.kind is int:
        return _int
    return _millis if setting.millis else _float


# x-argument → (QueueConfig field, converter), from the settings table (core.settings):
# durations are milliseconds throughout, the RabbitMQ convention set by x-message-ttl.
# Out-of-range values (a zero x-message-ttl, a negative x-max-length) are refused by
# QueueConfig's own checks, as 406.
QUEUE_ARGUMENTS: Final[Mapping[str, tuple[str, Callable[[str, Any], Any]]]] = {
    **{s.amqp: (s.name, _converter(s)) for s in QUEUE_SETTINGS if s.amqp is not None},
    # RabbitMQ's name for the same limit (quorum queues).
    "x-delivery-limit": ("max_deliveries", _int),
}


def _queue_type(name: str, value: Any) -> None:
    kind = _str(name, value)
    if kind == "stream":
        raise _precondition("x-queue-type 'stream' is not supported: keygate queues are classic")
    if kind not in QUEUE_TYPES:
        raise _precondition(f"unknown queue type {kind[:40]!r}: use 'classic' or 'quorum'")


def _overflow(name: str, value: Any) -> None:
    mode = _str(name, value)
    if mode not in _OVERFLOWS:
        raise _invalid(name, value, "drop-head, reject-publish or reject-publish-dlx")
    if mode != OVERFLOW_REJECT:
        raise _precondition(
            f"x-overflow '{mode}' is not supported: keygate refuses publishes beyond "
            "x-max-length (reject-publish)"
        )


# Arguments that are checked as RabbitMQ checks them, then ignored (no keygate meaning).
_CHECKED_ONLY: Final[Mapping[str, Callable[[str, Any], Any]]] = {
    "x-queue-type": _queue_type,
    "x-overflow": _overflow,
    "x-expires": _positive,
    "x-single-active-consumer": _bool,
}


def _dead_letter_queue(arguments: Mapping[str, Any]) -> str | None:
    """The dead-letter queue that x-dead-letter-exchange/-routing-key name, if any."""
    if _DLX not in arguments:
        if _DLRK in arguments:
            raise _precondition(f"{_DLRK} defined, but {_DLX} not defined")
        return None
    exchange = _str(_DLX, arguments[_DLX])
    if exchange != "" or _DLRK not in arguments:
        raise _precondition(
            "keygate dead-letters into a queue: use x-dead-letter-exchange '' with "
            "x-dead-letter-routing-key QUEUE (or x-dead-letter-queue)"
        )
    return _str(_DLRK, arguments[_DLRK])


@dataclass(frozen=True, slots=True)
class DeclaredQueue:
    """What a Queue.Declare asks for: the config, and which argument set each field."""

    config: QueueConfig
    # QueueConfig field → the x-argument that named it (for re-declare checks).
    given: Mapping[str, str]


def declared_queue(name: str, arguments: Mapping[str, Any] | None) -> DeclaredQueue:
    """The queue a Queue.Declare asks for; 406 for an argument keygate cannot honour."""
    arguments = arguments or {}
    fields: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in arguments.items():
        spec = QUEUE_ARGUMENTS.get(key)
        if spec is not None:
            field_name, convert = spec
            fields[field_name] = convert(key, value)
            given[field_name] = key
        elif key in _CHECKED_ONLY:
            _CHECKED_ONLY[key](key, value)
    dead_letter_queue = _dead_letter_queue(arguments)
    if dead_letter_queue is not None:
        fields["dead_letter_queue"] = dead_letter_queue
        given["dead_letter_queue"] = _DLRK
    try:
        return DeclaredQueue(QueueConfig(name=name, **fields), given)
    except InvalidArgument as e:
        raise _culprit(name, arguments, fields, given) or _precondition(e.message) from e


def _culprit(
    name: str, arguments: Mapping[str, Any], fields: Mapping[str, Any], given: Mapping[str, str]
) -> AmqpChannelError | None:
    """Name the argument whose value QueueConfig refuses, as RabbitMQ's 406 does."""
    for field_name, argument in given.items():
        try:
            QueueConfig(name=name, **{field_name: fields[field_name]})
        except InvalidArgument as e:
            return _invalid(argument, arguments[argument], e.message)
    return None


def check_equivalent(
    stored: QueueConfig, wanted_config: QueueConfig, given: Mapping[str, str]
) -> None:
    """406 when the declare names (``given``) a setting that differs from the stored one."""
    for field_name, argument in given.items():
        wanted, current = wanted_config.setting(field_name), stored.setting(field_name)
        if wanted != current:
            raise _precondition(
                f"inequivalent arg '{argument}' for queue '{stored.name}' in vhost '/': "
                f"received {field_name}={wanted!r} but current is {field_name}={current!r}"
            )


__all__ = ["QUEUE_ARGUMENTS", "QUEUE_TYPES", "DeclaredQueue", "check_equivalent", "declared_queue"]
