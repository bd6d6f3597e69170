"""Delayed delivery asked for by a header publishers already use (DESIGN.md §3.6 Delay).

RabbitMQ's delayed-message exchange reads the AMQP header ``x-delay``, ActiveMQ the STOMP
header ``AMQ_SCHEDULED_DELAY``; keygate reads both, and the MQTT 5 user property
``x-delay``. Each is a number of milliseconds after the publish; it becomes
``Publication.delay`` (seconds) and the broker sets ``deliver_at = publish_time + delay``.
The header itself stays in the message's properties, as RabbitMQ and ActiveMQ keep it.

One parser for every protocol: AMQP hands over typed header values (int, float, Decimal,
str), STOMP and MQTT strings. Anything that is not a finite, non-negative number — a
negative value, text that is not plain digits, NaN, infinity, a boolean, bytes — is
refused with ``InvalidArgument`` naming the header, and the publish is rejected.
"""

from __future__ import annotations

import decimal
import math
import re
from typing import Final

from core.errors import InvalidArgument

DELAY_HEADER: Final = "x-delay"
STOMP_DELAY_HEADER: Final = "AMQ_SCHEDULED_DELAY"
# Digits with an optional fraction: what a publisher writes; no sign, exponent or spaces.
_MILLIS_RE: Final = re.compile(r"^[0-9]{1,18}(\.[0-9]{1,9})?$")


def delay_seconds(name: str, value: object) -> float:
    """Seconds of delay for header ``name`` holding ``value`` milliseconds.

    Raises InvalidArgument unless ``value`` is a finite non-negative number (or a string
    of digits with an optional fraction).
    """
    millis: float | None = None
    if isinstance(value, str):
        if _MILLIS_RE.match(value):
            millis = float(value)
    elif isinstance(value, int | float | decimal.Decimal) and not isinstance(value, bool):
        try:
            millis = float(value)
        except (OverflowError, ValueError):  # a huge int, a signalling Decimal NaN
            millis = None
    if millis is None or not math.isfinite(millis) or millis < 0:
        shown = repr(value)[:40]
        raise InvalidArgument(f"invalid {name} {shown}: a delay in milliseconds (>= 0) expected")
    return millis / 1000.0


__all__ = ["DELAY_HEADER", "STOMP_DELAY_HEADER", "delay_seconds"]
