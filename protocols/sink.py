"""The boundary between the wire protocols and the gateway, both ways.

A protocol listener (native, MQTT, AMQP, STOMP) knows nothing of storage or of the broker:
it is given a ``Sink`` and calls it. Publishing: ``publish``/``publish_many``. Consuming:
``bind`` with a ``BindRequest`` and a ``FlowOutput`` (one per consumer: the group runtime
pushes that consumer's deliveries into it), then ``settle`` with one of the frozen settle
events (``Ack``, ``AckCumulative``, ``Nack``, ``Reject``, ``Credit``, ``Unbind``) naming
the flow. A flow belongs to the connection that bound it (``Principal.connection``): the
sink refuses to settle it for anyone else.

The gateway's broker implements ``Sink``; unit tests of a listener use a small in-memory
implementation. Every method may raise a ``core.errors.KeygateError``; the listener maps
it to its wire's error (reason code, reply code, ERROR frame) and keeps the server alive.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from core.actions import Deliver
from core.errors import KeygateError
from core.model import (
    AckMode,
    GroupConfig,
    GroupMode,
    KeyOrder,
    Publication,
    QueueConfig,
    StartPosition,
)


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is connected, after authentication. ``username`` None = anonymous.

    ``connection`` names one connection, unique in the gateway; the listener sets it when
    it authenticates. A flow bound by a principal can be settled only by a principal with
    the same ``connection``.
    """

    username: str | None
    protocol: str
    client_id: str | None = None
    connection: str = ""


@dataclass(frozen=True, slots=True)
class Receipt:
    """A confirmed (committed) publication. ``duplicate`` when dedup suppressed a store."""

    message_ids: tuple[str, ...]
    queues: tuple[str, ...]
    duplicate: bool = False


class FlowOutput(Protocol):
    """Where one bound flow's traffic goes: one consumer on one connection."""

    def deliver(self, deliveries: Sequence[Deliver]) -> Sequence[Deliver]:
        """Queue messages for sending; must not block. Returns the deliveries the output
        could not encode for its protocol (the group dead-letters them as undeliverable);
        an output that encodes later settles those it then cannot as ``Undeliverable``."""

    def partitions_changed(self, partitions: frozenset[int]) -> None:
        """Tell the consumer its partition set changed."""

    def terminate(self, error: KeygateError) -> None:
        """The group ended the flow (its queue was deleted, or this output raised in
        ``deliver``/``partitions_changed`` and the flow was unbound): end it with this
        error."""


@dataclass(frozen=True, slots=True)
class BindRequest:
    """Attach a consumer to ``group`` of ``queue`` (the group is created on first bind).

    ``client`` identifies the consumer across reconnects (its partitions are kept for it
    through the rebalance delay); ``window`` None takes the queue's; ``previous`` are the
    partitions a reconnecting consumer held. None elsewhere means the group's default.
    """

    queue: str
    group: str
    client: str
    window: int | None = None
    ack_mode: AckMode = AckMode.CLIENT
    tags: Mapping[str, str] | None = None
    mode: GroupMode | None = None
    key_order: KeyOrder | None = None
    start: StartPosition | None = None
    ack_timeout: float | None = None
    previous: frozenset[int] | None = None


@dataclass(frozen=True, slots=True)
class BindResult:
    """A bound flow: its id, its first partition set, the group and the window in force."""

    flow_id: str
    partitions: frozenset[int]
    group: GroupConfig
    window: int


@dataclass(frozen=True, slots=True)
class Ack:
    """These deliveries are done."""

    message_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AckCumulative:
    """Everything the flow holds of ``partition`` up to ``seq`` (inclusive) is done."""

    partition: int
    seq: int


@dataclass(frozen=True, slots=True)
class Nack:
    """Deliver these again, after ``delay`` seconds (None: the queue's backoff)."""

    message_ids: tuple[str, ...]
    delay: float | None = None


@dataclass(frozen=True, slots=True)
class Reject:
    """Never deliver these again: dead-letter them."""

    message_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Undeliverable:
    """The protocol could not write these for the flow (a field longer than its wire
    carries, a frame over the peer's limit), found when it wrote them rather than when
    ``FlowOutput.deliver`` was called: dead-letter them as undeliverable."""

    message_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Credit:
    """Set the flow's window (messages outstanding at once; 0 pauses the flow)."""

    window: int


@dataclass(frozen=True, slots=True)
class Backpressure:
    """The flow's connection has more than its write buffer waiting for the socket
    (``on``: send the flow nothing more for now, as if its window were full), or has
    caught up (not ``on``). Sent by the protocol, not by the client (``FlowGate``)."""

    on: bool


@dataclass(frozen=True, slots=True)
class Unbind:
    """Detach the flow. ``shutdown`` releases its partitions at once; otherwise they are
    kept for the same client through the rebalance delay."""

    shutdown: bool = False


Settle = Ack | AckCumulative | Nack | Reject | Undeliverable | Credit | Backpressure | Unbind


class Sink(Protocol):
    """What a protocol listener may ask of the gateway. All calls but ``settle`` are
    coroutines."""

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

    async def publish(
        self,
        principal: Principal,
        publication: Publication,
        *,
        qos2_packet_id: int | None = None,
    ) -> Receipt:
        """Route, store and commit one publication; return only after commit.

        ``qos2_packet_id``: an MQTT QoS 2 PUBLISH; its packet id is recorded as received
        in the MQTT session of ``principal.client_id`` in the same transaction, so a
        PUBLISH re-sent after a failover is answered, not stored twice.

        Raises NoRoute (topic matched nothing, or unknown queue as QueueNotFound),
        MessageTooLarge, QueueFull, PermissionDenied, StorageError.
        """
        ...

    async def publish_many(
        self, principal: Principal, publications: Sequence[Publication]
    ) -> list[Receipt]:
        """Store all publications in one transaction, or none of them (STOMP COMMIT)."""
        ...

    def publish_each(
        self, principal: Principal, publications: Sequence[Publication]
    ) -> Awaitable[list[Receipt | KeygateError]]:
        """Queue ``publications`` for storage at once, behind everything queued before,
        so a connection may hand over its next lot before this one is committed and the
        order holds. Each is stored or refused alone (the errors ``publish`` raises); the
        awaitable gives one outcome per publication, after COMMIT, and does not raise for
        a refusal."""
        ...

    async def declare_queue(
        self,
        principal: Principal,
        config: QueueConfig,
        *,
        passive: bool = False,
        exist_ok: bool = True,
        given: Collection[str] | None = None,
    ) -> QueueConfig:
        """Create the queue (and its dead-letter queue) or check it exists.

        Passive: raise QueueNotFound if absent. Existing at all when not ``exist_ok``, or
        differing in a setting named in ``given`` (the settings the declare gave; None:
        the partition count only): raise AlreadyExists. Returns the queue as stored.
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

    async def bind(
        self, principal: Principal, request: BindRequest, output: FlowOutput
    ) -> BindResult:
        """Bind a consumer; its deliveries go to ``output`` from now on.

        Raises QueueNotFound, PermissionDenied, InvalidArgument (window), Conflict (the
        group exists with another mode or tag filter), GroupLeased, Unavailable.
        """
        ...

    def settle(self, principal: Principal, flow_id: str, event: Settle) -> None:
        """Apply one settle event to a flow. Not a coroutine: it only hands the event to
        the group's machine, so settles take effect in the order they arrive.

        Raises PermissionDenied ("flow belongs to another connection") when the flow was
        bound by another connection, InvalidArgument for a bad window. A flow that is gone
        is a no-op: its messages were already returned for redelivery.
        """
        ...

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

    async def save_mqtt_session(self, client_id: str, *, expires_in: float | None) -> None:
        """Store that an MQTT session exists: ``expires_in`` None while its client is
        connected, else the seconds it outlives its connection. Its QoS 2 packet ids are
        recorded with the publish (``publish(..., qos2_packet_id=)``) and released with
        ``mqtt_released``."""
        ...

    async def mqtt_released(self, client_id: str, packet_ids: frozenset[int]) -> None:
        """PUBREL: the stored session no longer waits for these packet ids; returns once
        that is committed (then PUBCOMP may go out)."""
        ...

    async def drop_mqtt_session(self, client_id: str) -> None:
        """Forget an MQTT session (clean start, or it ended with its connection)."""
        ...


class TransportInfo(Protocol):
    """What ``peer_identity`` reads: an asyncio transport or StreamWriter."""

    def get_extra_info(self, name: str, default: Any = None) -> Any: ...


def peer_identity(transport: TransportInfo) -> tuple[str | None, str | None]:
    """The peer's IP address and, on TLS with a verified client certificate, its subject
    common name: the ``peer`` and ``certificate_user`` of ``Sink.authenticate``. A subject
    with more than one common name names no one (``/CN=meter-17/CN=admin`` must not pass
    for either)."""
    address = transport.get_extra_info("peername")
    peer = str(address[0]) if isinstance(address, tuple) and address else None
    certificate = transport.get_extra_info("peercert")
    names = []
    if certificate:  # only a certificate the handshake verified against the CA is here
        for rdn in certificate.get("subject", ()):
            names += [str(value) for key, value in rdn if key == "commonName"]
    return peer, names[0] if len(names) == 1 else None


class Listener(Protocol):
    """A protocol server the gateway starts and stops."""

    name: str

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        """Start accepting; return the bound port (``port`` 0 picks a free one)."""
        ...

    async def close(self) -> None:
        """Stop accepting, close every connection (flushing what was confirmed)."""
        ...


__all__ = [
    "Ack",
    "AckCumulative",
    "Backpressure",
    "BindRequest",
    "BindResult",
    "Credit",
    "FlowOutput",
    "Listener",
    "Nack",
    "Principal",
    "Receipt",
    "Reject",
    "Settle",
    "Sink",
    "TransportInfo",
    "Unbind",
    "peer_identity",
]
