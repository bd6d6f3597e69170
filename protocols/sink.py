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
from typing import Protocol

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
        self, username: str | None, password: str | None, *, protocol: str, client_id: str | None
    ) -> Principal:
        """Check credentials; raise AuthenticationFailed."""
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

    # --- protocol state kept by the gateway, so it survives a restart or failover ------

    async def amqp_exchanges(self) -> dict[str, str]:
        """Every declared AMQP exchange: name -> type."""
        ...

    async def save_amqp_exchange(self, name: str, type_name: str | None) -> None:
        """Store a declared exchange, or delete it (``type_name`` None)."""
        ...

    async def mqtt_session(self, client_id: str) -> set[int] | None:
        """The QoS 2 packet ids an unexpired stored MQTT session waits PUBREL for; None
        when no such session is stored."""
        ...

    async def save_mqtt_session(
        self, client_id: str, qos2_waiting: frozenset[int], *, expires_in: float | None
    ) -> None:
        """Store an MQTT session: ``expires_in`` None while its client is connected, else
        the seconds it outlives its connection."""
        ...

    async def drop_mqtt_session(self, client_id: str) -> None:
        """Forget an MQTT session (clean start, or it ended with its connection)."""
        ...


class Listener(Protocol):
    """A protocol server the gateway starts and stops."""

    name: str

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Start accepting; return the bound port (``port`` 0 picks a free one)."""
        ...

    async def close(self) -> None:
        """Stop accepting, close every connection (flushing what was confirmed)."""
        ...


__all__ = ["Listener", "Principal", "Receipt", "Sink"]
