"""What the sans-IO STOMP connection hands its listener: one event per client frame that
needs the gateway (a SEND inside a transaction is buffered until COMMIT)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from core.frozen import frozen
from core.model import Publication
from protocols.stomp.frames import Version


@dataclass(frozen=True, slots=True)
class Connect:
    """CONNECT or STOMP, version already negotiated; authenticate, then ``connected()``."""

    version: Version
    login: str | None
    passcode: str | None
    host: str | None
    heartbeat: tuple[int, int]
    client_id: str | None = None


@frozen
class Publish:
    """A SEND outside any transaction."""

    publication: Publication
    receipt: str | None


@dataclass(frozen=True, slots=True)
class ReceiptRequest:
    """A frame with nothing to store (BEGIN, ABORT, a transactional SEND) asked a receipt."""

    receipt: str


@dataclass(frozen=True, slots=True)
class Disconnect:
    receipt: str | None


@dataclass(frozen=True, slots=True)
class Subscribe:
    """SUBSCRIBE to ``/queue/NAME``: bind a flow of ``group`` (DESIGN.md §5b). ``serial``
    tells this subscription from a later one of the same id on the connection."""

    subscription: str
    queue: str
    group: str
    ack: str  # one of ACK_MODES
    prefetch: int | None
    receipt: str | None
    serial: int


@dataclass(frozen=True, slots=True)
class Unsubscribe:
    subscription: str
    receipt: str | None


@dataclass(frozen=True, slots=True)
class Settle:
    """An ACK or NACK resolved to the messages it settles: one, or for a cumulative ACK
    (ack mode ``client``) the messages of its partition sent up to it."""

    subscription: str
    message_ids: tuple[str, ...]
    ack: bool
    receipt: str | None


@dataclass(frozen=True, slots=True)
class Commit:
    """COMMIT: every SEND of the transaction, in order, to be stored atomically, then its
    ACKs and NACKs (resolved at COMMIT) to carry out."""

    transaction: str
    publications: tuple[Publication, ...]
    receipt: str | None
    settles: tuple[Settle, ...] = ()


Event: TypeAlias = (
    Connect | Publish | Commit | ReceiptRequest | Disconnect | Subscribe | Unsubscribe | Settle
)


__all__ = [
    "Commit",
    "Connect",
    "Disconnect",
    "Event",
    "Publish",
    "ReceiptRequest",
    "Settle",
    "Subscribe",
    "Unsubscribe",
]
