"""Bounds shared by every listener: what a peer may do before it has logged in, and
numbers read from text headers.

Before login (MQTT CONNECT, AMQP connection.start-ok/tune-ok/open, STOMP CONNECT, native
HELLO) a peer gets ``login_timeout`` seconds and frames of at most ``max_login_frame``
bytes; after login the protocol's negotiated frame size applies. Each listener takes a
``ConnectionLimits`` built once from the gateway configuration.

A number a peer writes as text (STOMP ``content-length``, ``heart-beat``, ``expires``,
AMQP ``expiration``) is read with ``parse_decimal``: ASCII digits only (``"²".isdigit()``
is true but ``int("²")`` raises), at most ``MAX_DECIMAL_DIGITS`` of them (Python refuses
to convert more than 4300 digits, and anything over 18 digits is no sensible duration or
length anyway), and no larger than the caller's maximum. The caller turns ``None`` into
its protocol's error, so a bad number is a clean protocol error and a closed connection,
never an exception that kills a reader task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

MAX_DECIMAL_DIGITS: Final = 18
"""The longest decimal a header may hold: every value below 10**18 fits in an int64."""

INT64_MAX: Final = 2**63 - 1
DEFAULT_LOGIN_TIMEOUT: Final = 10.0
DEFAULT_MAX_LOGIN_FRAME: Final = 64 * 1024


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """Per-connection bounds every listener enforces (docs/operations.md, "Limits")."""

    login_timeout: float = DEFAULT_LOGIN_TIMEOUT
    """Seconds from accept until the login frame must have been received."""
    max_login_frame: int = DEFAULT_MAX_LOGIN_FRAME
    """The largest frame accepted before login, in bytes."""


DEFAULT_LIMITS: Final = ConnectionLimits()


def parse_decimal(raw: str, maximum: int = INT64_MAX) -> int | None:
    """The non-negative integer ``raw`` spells, or None when it is not one or is over
    ``maximum``. Surrounding spaces are not allowed; the caller strips where its
    protocol allows them."""
    if not raw or len(raw) > MAX_DECIMAL_DIGITS or not (raw.isascii() and raw.isdigit()):
        return None
    value = int(raw)
    return value if value <= maximum else None


__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_LOGIN_TIMEOUT",
    "DEFAULT_MAX_LOGIN_FRAME",
    "INT64_MAX",
    "MAX_DECIMAL_DIGITS",
    "ConnectionLimits",
    "parse_decimal",
]
