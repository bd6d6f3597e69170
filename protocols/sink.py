"""The boundary between the wire protocols and the gateway.

A protocol listener (MQTT, AMQP, STOMP) knows nothing of storage or of the broker: it is
given a ``Sink`` and calls it. The gateway's broker implements ``Sink``; unit tests of a
listener use a small in-memory implementation. Every method may raise a
``core.errors.KeygateError``; the listener maps it to its wire's error (reason code, reply
code, ERROR frame) and keeps the server alive.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from core.model import Publication, QueueConfig


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is connected, after authentication. ``username`` None = anonymous."""

    username: str | None
    protocol: str
    client_id: str | None = None


@dataclass(frozen=True, slots=True)
class Receipt:
    """A confirmed (committed) publication. ``duplicate`` when dedup suppressed a store."""

    message_ids: tuple[str, ...]
    queues: tuple[str, ...]
    duplicate: bool = False


class Sink(Protocol):
    """What a protocol listener may ask of the gateway. All calls are coroutines."""

    @property
    def max_message_size(self) -> int:
        """The largest payload any queue accepts; codecs bound their frames with it."""
        ...

    @property
    def blocked(self) -> bool:
        """True while the gateway applies backpressure (AMQP connection.blocked)."""
        ...

    async def authenticate(
        self,
        username: str | None,
        password: str | None,
        *,
        protocol: str,
        client_id: str | None,
        peer: str | None = None,
        certificate_user: str | None = None,
    ) -> Principal:
        """Check credentials; raise AuthenticationFailed (bad credentials, throttled) or
        PermissionDenied (anonymous from a non-loopback peer). ``peer`` is the client's IP
        address as the listener's socket sees it; ``certificate_user`` the subject CN of a
        client certificate the TLS handshake verified (see ``peer_identity``)."""
        ...

    def may_administer(self, principal: Principal) -> bool:
        """Whether the principal may create and delete queues and exchanges."""
        ...

    async def publish(self, principal: Principal, publication: Publication) -> Receipt:
        """Route, store and commit one publication; return only after commit.

        Raises NoRoute (topic matched nothing, or unknown queue as QueueNotFound),
        MessageTooLarge, QueueFull, PermissionDenied, StorageError.
        """
        ...

    async def publish_many(
        self, principal: Principal, publications: Sequence[Publication]
    ) -> list[Receipt]:
        """Store all publications in one transaction, or none of them (STOMP COMMIT)."""
        ...

    async def declare_queue(
        self, principal: Principal, config: QueueConfig, *, passive: bool = False
    ) -> QueueConfig:
        """Create the queue (and its dead-letter queue) or check it exists.

        Passive: raise QueueNotFound if absent. Existing with different partitions:
        raise AlreadyExists. Returns the queue as stored.
        """
        ...

    async def delete_queue(self, principal: Principal, name: str) -> int:
        """Delete a queue; returns the number of messages it held."""
        ...

    async def purge_queue(self, principal: Principal, name: str) -> int:
        """Drop every message of the queue; returns how many."""
        ...

    async def queue_depth(self, principal: Principal, name: str) -> int:
        """Messages currently stored in the queue (for AMQP declare-ok)."""
        ...

    async def subscribe(self, principal: Principal, queue: str, pattern: str) -> None:
        """Add a topic subscription (MQTT-style pattern with '/', '+', '#') to a queue."""
        ...

    async def unsubscribe(self, principal: Principal, queue: str, pattern: str) -> None: ...


class TransportInfo(Protocol):
    """What ``peer_identity`` reads: an asyncio transport or StreamWriter."""

    def get_extra_info(self, name: str, default: Any = None) -> Any: ...


def peer_identity(transport: TransportInfo) -> tuple[str | None, str | None]:
    """The peer's IP address and, on TLS with a verified client certificate, its subject
    common name: the ``peer`` and ``certificate_user`` of ``Sink.authenticate``."""
    address = transport.get_extra_info("peername")
    peer = str(address[0]) if isinstance(address, tuple) and address else None
    certificate = transport.get_extra_info("peercert")
    common_name = None
    if certificate:  # only a certificate the handshake verified against the CA is here
        for rdn in certificate.get("subject", ()):
            for key, value in rdn:
                if key == "commonName":
                    common_name = str(value)
    return peer, common_name


class Listener(Protocol):
    """A protocol server the gateway starts and stops."""

    name: str

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Start accepting; return the bound port (``port`` 0 picks a free one)."""
        ...

    async def close(self) -> None:
        """Stop accepting, close every connection (flushing what was confirmed)."""
        ...


__all__ = ["Listener", "Principal", "Receipt", "Sink", "TransportInfo", "peer_identity"]
