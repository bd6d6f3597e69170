"""Exchange and queue methods of the sans-IO AMQP connection (docs/protocols/amqp.md).

``Declaring`` is the part of ``AmqpConnection`` that handles exchange.declare/delete
(kept by ``Exchanges`` in the connection, stored by the adapter) and turns queue.declare,
delete, purge, bind and unbind into operations for the adapter, which performs them
through the ``Sink`` in order and answers with ``operation_done``.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from pamqp import base, commands

from protocols.amqp import events as ev
from protocols.amqp.arguments import declared_queue
from protocols.amqp.channel import Channel
from protocols.amqp.constants import ReplyCode
from protocols.amqp.errors import AmqpChannelError
from protocols.amqp.exchanges import Exchanges, binding_pattern
from protocols.amqp.negotiation import server_named_queue


class Declaring:
    """Exchange and queue methods of ``AmqpConnection`` (which provides the attributes)."""

    exchanges: Exchanges
    username: str | None
    _admin: bool
    _events: deque[ev.Event]

    if TYPE_CHECKING:

        def _reply(self, channel: Channel, method: base.Frame) -> None: ...

    def declare_handlers(self) -> dict[type[base.Frame], Any]:
        return {
            commands.Exchange.Declare: self._exchange_declare,
            commands.Exchange.Delete: self._exchange_delete,
            commands.Queue.Declare: self._queue_declare,
            commands.Queue.Delete: self._queue_delete,
            commands.Queue.Purge: self._queue_purge,
            commands.Queue.Bind: self._queue_bind,
            commands.Queue.Unbind: self._queue_bind,
        }

    def _exchange_declare(self, channel: Channel, method: commands.Exchange.Declare) -> None:
        self.exchanges.declare(
            method.exchange,
            method.exchange_type,
            passive=method.passive,
            create=self._admin,
            arguments=method.arguments,
        )
        if not method.nowait:
            self._reply(channel, commands.Exchange.DeclareOk())

    def _exchange_delete(self, channel: Channel, method: commands.Exchange.Delete) -> None:
        if not self._admin:
            raise AmqpChannelError(
                ReplyCode.ACCESS_REFUSED, f"{self.username!r} may not delete exchanges"
            )
        self.exchanges.delete(method.exchange)
        if not method.nowait:
            self._reply(channel, commands.Exchange.DeleteOk())

    def _queue_declare(self, channel: Channel, method: commands.Queue.Declare) -> None:
        name = method.queue
        if not name:
            if method.passive:
                raise AmqpChannelError(ReplyCode.NOT_FOUND, "passive declare of an unnamed queue")
            name = server_named_queue()
        elif name.startswith("amq.") and not method.passive:
            raise AmqpChannelError(ReplyCode.ACCESS_REFUSED, f"queue name '{name}' is reserved")
        # A passive declare only checks existence: RabbitMQ ignores its arguments.
        declared = declared_queue(name, None if method.passive else method.arguments)
        self._events.append(
            ev.DeclareQueue(
                channel.number,
                channel.serial,
                method.nowait,
                declared.config,
                method.passive,
                declared.given,
            )
        )

    def _queue_delete(self, channel: Channel, method: commands.Queue.Delete) -> None:
        if_unused, if_empty = method.if_unused, method.if_empty
        operation = ev.DeleteQueue(
            channel.number, channel.serial, method.nowait, method.queue, if_unused, if_empty
        )
        self._events.append(operation)

    def _queue_purge(self, channel: Channel, method: commands.Queue.Purge) -> None:
        self._events.append(
            ev.PurgeQueue(channel.number, channel.serial, method.nowait, method.queue)
        )

    def _queue_bind(
        self, channel: Channel, method: commands.Queue.Bind | commands.Queue.Unbind
    ) -> None:
        unbind = isinstance(method, commands.Queue.Unbind)
        pattern = None
        # Unbinding is idempotent in RabbitMQ (since 3.2): a missing exchange is unbind-ok.
        if not (unbind and self.exchanges.find(method.exchange) is None):
            pattern = binding_pattern(self.exchanges.get(method.exchange), method.routing_key)
        nowait = not unbind and bool(getattr(method, "nowait", False))
        self._events.append(
            ev.BindQueue(channel.number, channel.serial, nowait, method.queue, pattern, unbind)
        )


__all__ = ["Declaring"]
