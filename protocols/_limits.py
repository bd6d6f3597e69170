"""Bounds shared by every listener: numbers read from text headers.

A number a peer writes as text (STOMP ``content-length``, ``heart-beat``, ``expires``,
AMQP ``expiration``) is read with ``parse_decimal``: ASCII digits only (``"²".isdigit()``
is true but ``int("²")`` raises), at most ``MAX_DECIMAL_DIGITS`` of them (Python refuses
to convert more than 4300 digits, and anything over 18 digits is no sensible duration or
length anyway), and no larger than the caller's maximum. The caller turns ``None`` into
its protocol's error, so a bad number is a clean protocol error and a closed connection,
never an exception that kills a reader task.
"""

from __future__ import annotations

from typing import Final

MAX_DECIMAL_DIGITS: Final = 18
"""The longest decimal a header may hold: every value below 10**18 fits in an int64."""

INT64_MAX: Final = 2**63 - 1


def parse_decimal(raw: str, maximum: int = INT64_MAX) -> int | None:
    """The non-negative integer ``raw`` spells, or None when it is not one or is over
    ``maximum``. Surrounding spaces are not allowed; the caller strips where its
    protocol allows them."""
    if not raw or len(raw) > MAX_DECIMAL_DIGITS or not (raw.isascii() and raw.isdigit()):
        return None
    value = int(raw)
    return value if value <= maximum else None


__all__ = ["INT64_MAX", "MAX_DECIMAL_DIGITS", "parse_decimal"]
