"""The consuming half of a STOMP connection, sans-IO: SUBSCRIBE, UNSUBSCRIBE, ACK and NACK
frames in, events out; deliveries in, MESSAGE frames out (docs/protocols/stomp.md).

How it works. ``Subscriptions`` remembers each subscription (its id, a serial unique on
the connection, queue and ack mode) and every message it sent that still waits for an
ACK, in the order sent (a redelivery goes last). The client names a delivery by the
``ack`` header in 1.2 — ``<serial>:<message id>``, so the same message delivered to two
subscriptions of the connection has two ack ids — and by ``message-id`` plus
``subscription`` in 1.1 (1.0 has no ``subscription``: the first subscription holding the
message). An ACK or NACK is resolved to the subscription and messages it settles and
handed on as a ``Settle``; an ack id it does not know is a protocol error, as ActiveMQ and
RabbitMQ treat it.

Ack modes: ``auto`` settles a message when it is written (nothing to ACK);
``client-individual`` settles exactly the message named; ``client`` is cumulative, as the
spec says ("the message and all messages sent to the subscription before it"), but per
partition — keygate's order is per partition, so it settles the messages of this
subscription in the named message's partition sent up to it, not a later redelivery of
an earlier one. A NACK always names one message (retry with the queue's backoff).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Final

from core.model import (
    DELIVERY_COUNT,
    GROUP_ID_PROPERTY,
    PARTITION_HEADER,
    SEQ_HEADER,
    Message,
    delivery_header,
)
from protocols._limits import parse_decimal
from protocols.stomp.errors import InvalidFrame
from protocols.stomp.events import Settle, Subscribe, Unsubscribe
from protocols.stomp.frames import Frame, Version
from protocols.stomp.mapping import QUEUE_PREFIX, destination_of

ACK_MODES: Final = frozenset({"auto", "client", "client-individual"})
DEFAULT_GROUP: Final = "default"
# Prefetch headers, first found wins: ActiveMQ's, then RabbitMQ's.
PREFETCH_HEADERS: Final = ("activemq.prefetchSize", "prefetch-count")
GROUP_HEADER: Final = "x-group"
# The MESSAGE headers STOMP 1.2 gives the server: always its own, so a published property
# of one of these names cannot reach a STOMP consumer (docs/protocols/stomp.md).
SERVER_HEADERS: Final = frozenset(
    {"destination", "message-id", "subscription", "ack", "content-length"}
)
# ActiveMQ's redelivery flag: a per-delivery header like x-delivery-count (a property of
# that name wins, keygate's value goes under x-keygate-redelivered).
REDELIVERED_HEADER: Final = "redelivered"
MAX_PREFETCH: Final = 2**31 - 1


@dataclass(slots=True)
class _Subscription:
    serial: int
    queue: str
    ack: str
    # message id -> partition of the messages sent and not settled yet, in send order.
    unacked: dict[str, int] = field(default_factory=dict)


def _prefetch(frame: Frame, receipt: str | None) -> int | None:
    for name in PREFETCH_HEADERS:
        raw = frame.header(name)
        if raw is None:
            continue
        prefetch = parse_decimal(raw, MAX_PREFETCH)
        if not prefetch:
            raise InvalidFrame(
                f"{name} must be an integer from 1 to {MAX_PREFETCH}", receipt_id=receipt
            )
        return prefetch
    return None


class Subscriptions:
    """The subscriptions of one connection and the messages they wait to have acked."""

    def __init__(self) -> None:
        self._subs: dict[str, _Subscription] = {}
        self._serials = itertools.count(1)

    def __len__(self) -> int:
        return len(self._subs)

    def ack_mode(self, subscription: str) -> str | None:
        sub = self._subs.get(subscription)
        return None if sub is None else sub.ack

    def subscribe(self, frame: Frame) -> Subscribe:
        receipt = frame.header("receipt")
        subscription = frame.header("id")
        if subscription is None:
            raise InvalidFrame("SUBSCRIBE frame without an id header", receipt_id=receipt)
        if subscription in self._subs:
            raise InvalidFrame(f"subscription {subscription!r} already exists", receipt_id=receipt)
        destination = frame.header("destination")
        queue, _ = destination_of(destination, receipt)
        if queue is None:
            raise InvalidFrame(
                f"keygate consumes queues: subscribe to {QUEUE_PREFIX}NAME, not {destination!r}",
                receipt_id=receipt,
            )
        ack = frame.header("ack") or "auto"
        if ack not in ACK_MODES:
            raise InvalidFrame(
                f"ack mode {ack[:40]!r}: use auto, client or client-individual",
                receipt_id=receipt,
            )
        group = frame.header(GROUP_HEADER) or DEFAULT_GROUP
        prefetch = _prefetch(frame, receipt)
        serial = next(self._serials)
        self._subs[subscription] = _Subscription(serial, queue, ack)
        return Subscribe(subscription, queue, group, ack, prefetch, receipt, serial)

    def unsubscribe(self, frame: Frame) -> Unsubscribe:
        receipt = frame.header("receipt")
        subscription = frame.header("id")
        if subscription is None or self._subs.pop(subscription, None) is None:
            raise InvalidFrame(f"no subscription {subscription!r}", receipt_id=receipt)
        return Unsubscribe(subscription, receipt)

    def forget(self, subscription: str) -> None:
        """The gateway ended the subscription (its queue was deleted)."""
        self._subs.pop(subscription, None)

    def settle(self, frame: Frame, version: Version) -> Settle:
        """Resolve an ACK or NACK frame (protocol error for an unknown ack id)."""
        name, sub, message_id = self._find(frame, version)
        if frame.command == "ACK" and sub.ack == "client":
            partition = sub.unacked[message_id]
            settled: list[str] = []
            for sent, sent_partition in sub.unacked.items():
                if sent_partition == partition:
                    settled.append(sent)
                if sent == message_id:
                    break
        else:
            settled = [message_id]
        for sent in settled:
            del sub.unacked[sent]
        return Settle(name, tuple(settled), frame.command == "ACK", frame.header("receipt"))

    def check(self, frame: Frame, version: Version) -> None:
        """Raise as ``settle`` would for an unknown ack id, settling nothing (an ACK or
        NACK inside a transaction is settled at COMMIT)."""
        self._find(frame, version)

    def _find(self, frame: Frame, version: Version) -> tuple[str, _Subscription, str]:
        """The subscription and message an ACK or NACK names, still unacked."""
        if version is Version.V1_2:
            ack_id = frame.header("id")
            serial, _, message_id = (ack_id or "").partition(":")
            candidates = [(n, s) for n, s in self._subs.items() if str(s.serial) == serial]
        else:
            ack_id = message_id = frame.header("message-id") or ""
            named = frame.header("subscription")
            candidates = [(s, self._subs[s]) for s in (named,) if s in self._subs]
            if named is None:  # STOMP 1.0 has no subscription header
                candidates = list(self._subs.items())
        for name, sub in candidates:
            if message_id in sub.unacked:
                return name, sub, message_id
        raise InvalidFrame(
            f"{frame.command} of unknown message {ack_id!r}: it was never delivered, is "
            "already settled, or belongs to another subscription",
            receipt_id=frame.header("receipt"),
        )

    def message(
        self,
        subscription: str,
        serial: int,
        message: Message,
        delivery_count: int,
        redelivered: bool,
    ) -> Frame | None:
        """The MESSAGE frame for a delivery to subscription ``serial``, remembered for its
        ACK unless ``auto``; None when that subscription is gone (UNSUBSCRIBE read, the
        flow not unbound yet): its unbind returns the message for redelivery."""
        sub = self._subs.get(subscription)
        if sub is None or sub.serial != serial:
            return None
        if sub.ack != "auto":
            # A message sent again (a redelivery) is the last one sent.
            sub.unacked.pop(message.message_id, None)
            sub.unacked[message.message_id] = message.partition
        properties = message.properties
        headers: list[tuple[str, str]] = [
            ("subscription", subscription),
            ("message-id", message.message_id),
            ("destination", QUEUE_PREFIX + message.queue),
        ]
        if sub.ack != "auto":
            headers.append(("ack", f"{sub.serial}:{message.message_id}"))
        headers += [
            (delivery_header(name, properties), value)
            for name, value in (
                (REDELIVERED_HEADER, "true" if redelivered else "false"),
                (DELIVERY_COUNT, str(delivery_count)),
                (PARTITION_HEADER, str(message.partition)),
                (SEQ_HEADER, str(message.seq)),
            )
        ]
        if message.key is not None and GROUP_ID_PROPERTY not in properties:
            headers.append((GROUP_ID_PROPERTY, message.key))
        for name, value in (
            ("content-type", message.content_type),
            ("correlation-id", message.correlation_id),
            ("reply-to", message.reply_to),
        ):
            if value is not None:
                headers.append((name, value))
        if message.expire_at is not None:
            headers.append(("expires", str(int(message.expire_at * 1000))))
        taken = SERVER_HEADERS.union(name for name, _ in headers)
        headers += [(name, _text(value)) for name, value in properties.items() if name not in taken]
        headers.append(("content-length", str(len(message.payload))))
        return Frame("MESSAGE", tuple(headers), message.payload)


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


__all__ = ["ACK_MODES", "DEFAULT_GROUP", "Subscriptions"]
