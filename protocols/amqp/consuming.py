"""The consuming half of the sans-IO AMQP connection (DESIGN.md §5b, docs/protocols/amqp.md).

How it works. ``Consuming`` is the part of ``AmqpConnection`` that turns basic.qos,
consume, cancel, get, ack, nack, reject and recover into events for the adapter
(``Consume``, ``Cancel``, ``Get``, ``SettleDeliveries``) and deliveries into basic.deliver
and basic.get-ok frames. The bookkeeping per channel — delivery tags, prefetch, which
consumer a tag belongs to — is ``ChannelConsumers``; this class only wires it to frames.
The adapter reports back with ``consumed``, ``cancelled`` and ``got``, and pushes
deliveries through ``deliver``; a channel that closes emits ``ChannelGone`` so its flows
are unbound (their unacked messages are redelivered, flagged, by the group).
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from pamqp import base, commands

from core.actions import Deliver
from core.errors import KeygateError
from core.model import Message
from protocols.amqp import events as ev
from protocols.amqp.channel import Channel
from protocols.amqp.codec import content_frames, method_frame
from protocols.amqp.constants import ReplyCode
from protocols.amqp.consumers import DEFAULT_GROUP, ConsumeRequest
from protocols.amqp.errors import AmqpChannelError
from protocols.amqp.mapping import delivery_properties

# The consumer tag basic.get deliveries are numbered under in ``ChannelConsumers``.
GET_TAG_PREFIX: Final = "amq.get-"


def get_tag(queue: str, group: str) -> str:
    return f"{GET_TAG_PREFIX}{group}@{queue}"


def _routing_key(message: Message) -> str:
    return message.topic if message.topic is not None else message.queue


class Consuming:
    """Consumer methods of ``AmqpConnection`` (which provides the attributes below)."""

    _channels: dict[int, Channel]
    _events: deque[ev.Event]
    _client_capabilities: dict[str, Any]
    _out: list[bytes]
    frame_max: int

    if TYPE_CHECKING:

        def is_current(self, operation: ev.ChannelOperation) -> bool: ...
        def _send(self, channel: int, method: base.Frame) -> None: ...
        def _reply(self, channel: Channel, method: base.Frame) -> None: ...
        def _soft_error(self, channel: Channel, error: KeygateError) -> None: ...

    def consume_handlers(self) -> dict[type[base.Frame], Any]:
        return {
            commands.Basic.Qos: self._basic_qos,
            commands.Basic.Consume: self._basic_consume,
            commands.Basic.Cancel: self._basic_cancel,
            commands.Basic.Get: self._basic_get,
            commands.Basic.Ack: self._basic_settle,
            commands.Basic.Nack: self._basic_settle,
            commands.Basic.Reject: self._basic_settle,
            commands.Basic.Recover: self._basic_recover,
        }

    # -- adapter surface ---------------------------------------------------------------

    def consumed(self, operation: ev.Consume, error: KeygateError | None) -> None:
        """The outcome of binding a consumer's flow."""
        if not self.is_current(operation):
            return
        channel = self._channels[operation.channel]
        tag = operation.request.consumer_tag
        if error is not None:
            channel.consumers.cancel(tag)
            self._soft_error(channel, error)
        elif not operation.nowait:
            self._reply(channel, commands.Basic.ConsumeOk(tag))

    def cancelled(self, operation: ev.Cancel) -> None:
        """The consumer's flow is unbound: confirm the client's basic.cancel."""
        if self.is_current(operation) and not operation.nowait:
            channel = self._channels[operation.channel]
            self._reply(channel, commands.Basic.CancelOk(operation.consumer_tag))

    def cancel_consumer(self, channel_number: int, serial: int, consumer_tag: str) -> None:
        """The gateway ended a consumer (its queue was deleted): tell a client that
        announced ``consumer_cancel_notify``, as RabbitMQ does."""
        channel = self._channels.get(channel_number)
        if channel is None or channel.serial != serial:
            return
        if channel.consumers.cancel(consumer_tag) is None:
            return
        if self._client_capabilities.get("consumer_cancel_notify"):
            self._send(channel_number, commands.Basic.Cancel(consumer_tag, nowait=True))

    def deliver(
        self, channel_number: int, serial: int, consumer_tag: str, deliveries: Sequence[Deliver]
    ) -> tuple[list[Deliver], list[str]]:
        """basic.deliver frames for a consumer's deliveries. Returns the deliveries that
        cannot be encoded (dead-lettered as undeliverable) and the ids of those sent.
        Deliveries to a channel that is gone are dropped: its unbind returns them."""
        channel = self._channels.get(channel_number)
        if channel is None or channel.serial != serial or consumer_tag not in channel.consumers:
            return [], []
        failed: list[Deliver] = []
        sent: list[str] = []
        for delivery in deliveries:
            message = delivery.message
            try:
                content = self._content(channel, delivery)
            except (ValueError, TypeError, struct.error, KeygateError):
                failed.append(delivery)
                continue
            tag = channel.consumers.delivery_tag(consumer_tag, message)
            method = commands.Basic.Deliver(
                consumer_tag, tag, delivery.redelivered, "", _routing_key(message)
            )
            self._out.append(method_frame(channel_number, method))
            self._out.append(content)
            sent.append(message.message_id)
        return failed, sent

    def got(self, operation: ev.Get, delivery: Deliver | None, remaining: int) -> bool:
        """Answer a basic.get: get-ok with the delivery, or get-empty. False when the
        delivery was not sent: the channel is gone, or the message cannot be encoded
        (then the answer is get-empty)."""
        if not self.is_current(operation):
            return False
        channel = self._channels[operation.channel]
        if delivery is None:
            self._reply(channel, commands.Basic.GetEmpty())
            return True
        try:
            content = self._content(channel, delivery)
        except (ValueError, TypeError, struct.error, KeygateError):
            self._reply(channel, commands.Basic.GetEmpty())
            return False
        tag = channel.consumers.delivery_tag(
            get_tag(operation.queue, operation.group), delivery.message
        )
        method = commands.Basic.GetOk(
            tag, delivery.redelivered, "", _routing_key(delivery.message), remaining
        )
        self._out.append(method_frame(channel.number, method))
        self._out.append(content)
        return True

    # -- frames --------------------------------------------------------------------------

    def _channel_gone(self, channel: Channel) -> None:
        if channel.consumers.consumers:
            self._events.append(ev.ChannelGone(channel.number, channel.serial))

    def _content(self, channel: Channel, delivery: Deliver) -> bytes:
        properties = delivery_properties(delivery.message, delivery.delivery_count)
        return content_frames(channel.number, properties, delivery.message.payload, self.frame_max)

    def _basic_qos(self, channel: Channel, method: commands.Basic.Qos) -> None:
        channel.consumers.qos(method)
        self._reply(channel, commands.Basic.QosOk())

    def _basic_consume(self, channel: Channel, method: commands.Basic.Consume) -> None:
        request = channel.consumers.consume(method)
        self._events.append(ev.Consume(channel.number, channel.serial, method.nowait, request))

    def _basic_cancel(self, channel: Channel, method: commands.Basic.Cancel) -> None:
        tag = method.consumer_tag or ""
        if channel.consumers.cancel(tag) is None:
            # Cancelling an unknown consumer is cancel-ok in RabbitMQ.
            if not method.nowait:
                self._reply(channel, commands.Basic.CancelOk(tag))
            return
        holds = channel.consumers.holds(tag)
        self._events.append(ev.Cancel(channel.number, channel.serial, method.nowait, tag, holds))

    def _basic_get(self, channel: Channel, method: commands.Basic.Get) -> None:
        # basic.get has no arguments to name a group: it polls the default one.
        group = DEFAULT_GROUP
        no_ack = bool(method.no_ack)
        tag = get_tag(method.queue, group)
        known = channel.consumers.consumers.get(tag)
        if known is None:
            channel.consumers.consumers[tag] = ConsumeRequest(
                consumer_tag=tag, queue=method.queue, group=group, no_ack=no_ack, prefetch=1
            )
        elif known.no_ack != no_ack:
            raise AmqpChannelError(
                ReplyCode.PRECONDITION_FAILED,
                "basic.get of one queue must keep its no_ack setting on a channel",
            )
        self._events.append(
            ev.Get(channel.number, channel.serial, False, method.queue, group, no_ack)
        )

    def _basic_settle(
        self,
        channel: Channel,
        method: commands.Basic.Ack | commands.Basic.Nack | commands.Basic.Reject,
    ) -> None:
        settled = channel.consumers.settle(method)
        self._events.append(
            ev.SettleDeliveries(channel.number, channel.serial, False, tuple(settled))
        )

    def _basic_recover(self, channel: Channel, method: commands.Basic.Recover) -> None:
        settled = channel.consumers.recover()
        if settled:
            self._events.append(
                ev.SettleDeliveries(channel.number, channel.serial, False, tuple(settled))
            )
        self._reply(channel, commands.Basic.RecoverOk())


__all__ = ["GET_TAG_PREFIX", "Consuming", "get_tag"]
