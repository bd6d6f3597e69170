"""Bounds shared by every listener: what a peer may do before it has logged in, and
numbers read from text headers.

Connections: one ``ConnectionCounter`` is shared by every listener. A listener opens an
``Admission`` when it accepts a socket (protocols/_accept.py; before a TLS handshake: the
total counts sockets still shaking hands or logging in, so a flood of silent peers fills
it too) and asks it to ``login`` the authenticated user: that
raises ``ConnectionLimitReached`` when the total is over ``max_connections`` or the user
already has ``max_connections_per_user`` logged-in connections, and the listener refuses
the login with its protocol's error. ``release`` (idempotent) gives both counts back.

Unconfirmed publishes: a ``ByteBudget`` per connection counts the bytes of publishes
received and not yet confirmed. The reader awaits ``acquire`` before taking the next
publish, so when the budget is spent the socket is not read until confirms free space
(back-pressure through TCP) instead of buffering without bound. ``peak`` records the
most ever held, for tests and metrics.

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

import asyncio
from dataclasses import dataclass, field
from typing import Final

from core.errors import ConnectionLimitReached
from core.model import Publication

MAX_DECIMAL_DIGITS: Final = 18
"""The longest decimal a header may hold: every value below 10**18 fits in an int64."""

INT64_MAX: Final = 2**63 - 1
DEFAULT_MAX_CONNECTIONS: Final = 10_000
DEFAULT_MAX_CONNECTIONS_PER_USER: Final = 1_000
DEFAULT_LOGIN_TIMEOUT: Final = 10.0
DEFAULT_MAX_LOGIN_FRAME: Final = 64 * 1024
DEFAULT_MAX_UNCONFIRMED_BYTES: Final = 16 * 1024 * 1024
PUBLICATION_OVERHEAD: Final = 1024
"""What a publish waiting for its commit costs besides its bytes (its event, publication,
message, the lot's entries and future), about: counted by ``publication_bytes``."""


class ByteBudget:
    """Bytes one connection holds for publishes not yet confirmed (see the module doc).

    One publish larger than the whole budget is still let through when nothing else is
    held, so every message the protocol allows can be sent."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._freed = asyncio.Event()

    def full_for(self, size: int) -> bool:
        """Whether ``acquire(size)`` would wait."""
        return bool(self.held) and self.held + size > self.limit

    async def acquire(self, size: int) -> None:
        """Wait until ``size`` more bytes fit, then hold them."""
        while self.full_for(size):
            self._freed.clear()
            await self._freed.wait()
        self.hold(size)

    def hold(self, size: int) -> None:
        """Hold ``size`` more bytes now (when ``full_for(size)`` is False)."""
        self.held += size
        self.peak = max(self.peak, self.held)

    def release(self, size: int) -> None:
        self.held -= size
        self._freed.set()


class ConnectionCounter:
    """Open connections across every listener, in total and per logged-in user
    (None = anonymous). A limit of 0 is no limit."""

    def __init__(self, max_connections: int = 0, max_connections_per_user: int = 0) -> None:
        self.max_connections = max_connections
        self.max_connections_per_user = max_connections_per_user
        self.total = 0
        self.per_user: dict[str | None, int] = {}
        # Open connections by protocol, for the keygate_open_connections gauge.
        self.per_protocol: dict[str, int] = {}

    def open(self, protocol: str) -> Admission:
        """Count an accepted socket; release the returned admission when it closes."""
        self.total += 1
        self.per_protocol[protocol] = self.per_protocol.get(protocol, 0) + 1
        return Admission(self, protocol)


class Admission:
    """One accepted connection's place in the shared ``ConnectionCounter``."""

    __slots__ = ("_counter", "_open", "_protocol", "_user")
    _user: tuple[str | None] | None

    def __init__(self, counter: ConnectionCounter, protocol: str) -> None:
        self._counter = counter
        self._protocol = protocol
        self._user = None
        self._open = True

    def login(self, user: str | None) -> None:
        """Count this connection for ``user``; raise ConnectionLimitReached (and leave it
        uncounted for the user) when a limit is reached."""
        counter = self._counter
        if counter.max_connections and counter.total > counter.max_connections:
            raise ConnectionLimitReached(
                f"connection limit reached ({counter.max_connections} connections)"
            )
        held = counter.per_user.get(user, 0)
        if counter.max_connections_per_user and held >= counter.max_connections_per_user:
            raise ConnectionLimitReached(
                f"connection limit reached ({counter.max_connections_per_user} per user)"
            )
        counter.per_user[user] = held + 1
        self._user = (user,)

    def release(self) -> None:
        """Give the connection's counts back; later calls do nothing."""
        if not self._open:
            return
        self._open = False
        counter = self._counter
        counter.total -= 1
        counter.per_protocol[self._protocol] -= 1
        if self._user is not None:
            (user,) = self._user
            counter.per_user[user] -= 1
            if not counter.per_user[user]:
                del counter.per_user[user]


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """Per-connection bounds every listener enforces (docs/operations.md, "Connection limits")."""

    login_timeout: float = DEFAULT_LOGIN_TIMEOUT
    """Seconds from accept until the login frame must have been received."""
    max_login_frame: int = DEFAULT_MAX_LOGIN_FRAME
    """The largest frame accepted before login, in bytes."""
    max_unconfirmed_bytes: int = DEFAULT_MAX_UNCONFIRMED_BYTES
    """Per connection: bytes of publishes received and not yet confirmed."""
    connections: ConnectionCounter = field(default_factory=ConnectionCounter)
    """Shared by every listener given these limits."""


DEFAULT_LIMITS: Final = ConnectionLimits()


def publication_bytes(publication: Publication) -> int:
    """What a publication costs in memory, about: its payload plus every text field and
    property (names and values), so a message of large headers counts as large, plus
    ``PUBLICATION_OVERHEAD``, so a flood of empty messages is not almost free."""
    p = publication
    # Once per publish on every protocol: a loop over a tuple, no generator (half the
    # time of the sum over a generator it replaced).
    size = PUBLICATION_OVERHEAD + len(p.payload)
    for text in (
        p.queue,
        p.topic,
        p.key,
        p.producer,
        p.dedup_id,
        p.content_type,
        p.correlation_id,
        p.reply_to,
        p.app_id,
    ):
        if text is not None:
            size += len(text)
    if p.properties:
        for name, value in p.properties.items():
            size += len(name) + (len(value) if isinstance(value, str | bytes) else 8)
    return size


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
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS_PER_USER",
    "DEFAULT_MAX_LOGIN_FRAME",
    "DEFAULT_MAX_UNCONFIRMED_BYTES",
    "INT64_MAX",
    "MAX_DECIMAL_DIGITS",
    "PUBLICATION_OVERHEAD",
    "Admission",
    "ByteBudget",
    "ConnectionCounter",
    "ConnectionLimits",
    "parse_decimal",
    "publication_bytes",
]
