"""The consuming half of an AMQP channel, sans-IO: basic.consume, qos, ack, nack, reject,
recover and cancel in; deliveries in, basic.deliver frames out (docs/protocols/amqp.md).

How it works. Each ``basic.consume`` is one keygate flow (DESIGN.md §5b): the group is the
``x-group`` consume argument, the window the channel's ``basic.qos`` prefetch. Delivery
tags are numbered per channel, as AMQP says; ``ChannelConsumers`` remembers, for every
delivery not yet settled, the consumer (flow) and the message it carried, so an ack by tag
— ``multiple`` included, across the channel's consumers as RabbitMQ does — becomes settles
by message id for the right flows. An unknown delivery tag is a channel error (406), as
in RabbitMQ. ``basic.recover`` and ``basic.nack(requeue=true)`` retry with the queue's
backoff; ``requeue=false`` and ``basic.reject(requeue=false)`` dead-letter.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

from pamqp import commands

from core.model import GroupMode, KeyOrder, Message, StartPosition
from protocols.amqp.constants import ReplyCode
from protocols.amqp.errors import AmqpChannelError

GROUP_ARGUMENT: Final = "x-group"
DEFAULT_GROUP: Final = "default"
# Consume arguments with a group or flow setting of their own (the native BIND's):
# x-mode, x-key-order, x-start, x-ack-timeout (ms) and the tag filter x-tag-NAME.
TAG_PREFIX: Final = "x-tag-"


class Outcome(Enum):
    ACK = "ack"
    RETRY = "retry"  # nack/reject with requeue, recover
    REJECT = "reject"  # nack/reject without requeue: dead-letter now


@dataclass(frozen=True, slots=True)
class ConsumeRequest:
    """What a basic.consume asks for (the adapter binds a flow with it); None = the
    group's setting or default."""

    consumer_tag: str
    queue: str
    group: str
    no_ack: bool
    prefetch: int | None
    mode: GroupMode | None = None
    key_order: KeyOrder | None = None
    start: StartPosition | None = None
    ack_timeout: float | None = None  # seconds (x-ack-timeout is milliseconds)
    tags: Mapping[str, str] | None = None  # x-tag-NAME: VALUE


@dataclass(frozen=True, slots=True)
class Settled:
    """Deliveries of one consumer settled with one outcome, in delivery order.
    ``drained``: the consumer is cancelled and these were the last of its deliveries
    waiting for a settle, so its flow can go. Decided here, when the frame is read: the
    adapter performs the settles later, after the rest of the read changed this state."""

    consumer_tag: str
    outcome: Outcome
    message_ids: tuple[str, ...]
    drained: bool = False


@dataclass(frozen=True, slots=True)
class _Unacked:
    consumer_tag: str
    message_id: str


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _choice(arguments: Mapping[str, Any], name: str, kind: type[Enum]) -> Any:
    value = arguments.get(name)
    if value is None:
        return None
    try:
        return kind(_text(value))
    except ValueError:
        allowed = ", ".join(str(m.value) for m in kind)
        raise AmqpChannelError(
            ReplyCode.PRECONDITION_FAILED, f"invalid arg '{name}': use one of {allowed}"
        ) from None


def _ack_timeout(arguments: Mapping[str, Any]) -> float | None:
    value = arguments.get("x-ack-timeout")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AmqpChannelError(
            ReplyCode.PRECONDITION_FAILED, "invalid arg 'x-ack-timeout': milliseconds > 0"
        )
    return value / 1000


def consume_request(method: commands.Basic.Consume, prefetch: int | None) -> ConsumeRequest:
    """The consume's group and flow settings from its arguments (406 for a bad one)."""
    arguments = dict(method.arguments or {})
    group = _text(arguments.get(GROUP_ARGUMENT) or DEFAULT_GROUP)
    tags = {
        k[len(TAG_PREFIX) :]: _text(v) for k, v in arguments.items() if k.startswith(TAG_PREFIX)
    }
    return ConsumeRequest(
        consumer_tag=method.consumer_tag or f"amq.ctag-{uuid.uuid4().hex}",
        queue=method.queue,
        group=group,
        no_ack=bool(method.no_ack),
        prefetch=prefetch,
        mode=_choice(arguments, "x-mode", GroupMode),
        key_order=_choice(arguments, "x-key-order", KeyOrder),
        start=_choice(arguments, "x-start", StartPosition),
        ack_timeout=_ack_timeout(arguments),
        tags=tags or None,
    )


class ChannelConsumers:
    """The consumers of one channel and its deliveries waiting for a settle."""

    def __init__(self) -> None:
        self.prefetch: int | None = None  # basic.qos prefetch_count; None = unlimited
        self.consumers: dict[str, ConsumeRequest] = {}
        self._next_tag = 1
        self._unacked: dict[int, _Unacked] = {}

    def __contains__(self, consumer_tag: str) -> bool:
        return consumer_tag in self.consumers

    def qos(self, method: commands.Basic.Qos) -> None:
        """The prefetch applies to consumers started after it, per consumer (RabbitMQ's
        default; ``global`` is taken as the same per-consumer limit, documented). A limit
        in bytes is refused with 540, as RabbitMQ refuses it."""
        if method.prefetch_size:
            raise AmqpChannelError(
                ReplyCode.NOT_IMPLEMENTED, f"prefetch_size!=0 ({method.prefetch_size})"
            )
        self.prefetch = method.prefetch_count or None

    def consume(self, method: commands.Basic.Consume) -> ConsumeRequest:
        """530 for a tag in use, which includes a cancelled consumer whose deliveries are
        not all settled: its flow is still bound, paused, under that tag until they are."""
        tag = method.consumer_tag
        if tag and (tag in self.consumers or self.holds(tag)):
            held = "" if tag in self.consumers else " (its deliveries are not settled yet)"
            raise AmqpChannelError(
                ReplyCode.NOT_ALLOWED, f"attempt to reuse consumer tag '{tag}'{held}"
            )
        request = consume_request(method, self.prefetch)
        self.consumers[request.consumer_tag] = request
        return request

    def cancel(self, consumer_tag: str) -> ConsumeRequest | None:
        """Forget the consumer. Its deliveries stay known and can still be settled (as in
        RabbitMQ): its flow stays bound, paused, until they are (protocols.amqp.flows)."""
        return self.consumers.pop(consumer_tag, None)

    def holds(self, consumer_tag: str) -> bool:
        """Whether deliveries of ``consumer_tag`` wait for a settle (cancelled or not)."""
        return any(u.consumer_tag == consumer_tag for u in self._unacked.values())

    def delivery_tag(self, consumer_tag: str, message: Message) -> int:
        """Number the next delivery of ``consumer_tag``; remembered unless no_ack."""
        tag = self._next_tag
        self._next_tag += 1
        if not self.consumers[consumer_tag].no_ack:
            self._unacked[tag] = _Unacked(consumer_tag, message.message_id)
        return tag

    def settle(
        self, method: commands.Basic.Ack | commands.Basic.Nack | commands.Basic.Reject
    ) -> list[Settled]:
        """The settles an ack, nack or reject means, grouped by consumer (406 for a tag
        that was never delivered or is settled already)."""
        tag = method.delivery_tag or 0
        multiple = getattr(method, "multiple", False)
        if isinstance(method, commands.Basic.Ack):
            outcome = Outcome.ACK
        else:
            outcome = Outcome.RETRY if method.requeue else Outcome.REJECT
        if multiple:
            tags = [t for t in self._unacked if tag == 0 or t <= tag]
            if tag != 0 and tag not in self._unacked:
                raise AmqpChannelError(ReplyCode.PRECONDITION_FAILED, f"unknown delivery tag {tag}")
        elif tag in self._unacked:
            tags = [tag]
        else:
            raise AmqpChannelError(ReplyCode.PRECONDITION_FAILED, f"unknown delivery tag {tag}")
        return self._take(tags, outcome)

    def recover(self) -> list[Settled]:
        """basic.recover: every unsettled delivery of the channel is retried."""
        return self._take(list(self._unacked), Outcome.RETRY)

    def _take(self, tags: list[int], outcome: Outcome) -> list[Settled]:
        by_consumer: dict[str, list[str]] = {}
        for tag in sorted(tags):
            unacked = self._unacked.pop(tag)
            by_consumer.setdefault(unacked.consumer_tag, []).append(unacked.message_id)
        return [
            Settled(c, outcome, tuple(ids), c not in self.consumers and not self.holds(c))
            for c, ids in by_consumer.items()
        ]


__all__ = [
    "DEFAULT_GROUP",
    "GROUP_ARGUMENT",
    "ChannelConsumers",
    "ConsumeRequest",
    "Outcome",
    "Settled",
    "consume_request",
]
