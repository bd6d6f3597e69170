"""AMQP consumers as keygate flows: the adapter half of consuming (DESIGN.md §5b).

How it works. Each basic.consume binds one flow through ``Sink.bind`` with a
``_ConsumerOutput``; the group runtime pushes that consumer's deliveries into it and they
become basic.deliver frames in the connection's outbox (``protocols._io.Outbox``).
``no_ack`` deliveries are acked once the socket took them, so a consumer that reads
slowly holds at most its window. Acks, nacks, rejects and recovers arrive resolved to
message ids (``protocols.amqp.consumers``) and become ``Sink.settle`` calls; a closed
channel or the end of the connection unbinds (the rebalance delay applies, and the group
redelivers the unacked messages, flagged). A basic.cancel unbinds at once when the
consumer holds nothing unacked; otherwise, as in RabbitMQ, its deliveries stay the
channel's to settle: the flow is paused (a window of 0: nothing more is sent, and what
the group had already pushed is dropped and comes back at the unbind) and unbound once
the last of them is settled, or with the channel. Whether the consumer held any and which
settle was its last come with the events (``Cancel.holds``, ``Settled.drained``), decided
when the connection read the frames: by the time an event is performed the connection has
read on, maybe the whole tight loop of acks that followed the cancel.

basic.get has no flow of its own in AMQP; keygate gives each (channel, queue) that polls
one, bound on the first basic.get with a window of one: a getter is a member of the
``default`` group like any consumer (it holds partitions until its channel closes) and
each basic.get hands out the message the group pushed to it, or get-empty when none came
within ``GET_WAIT``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from core.actions import Deliver
from core.errors import KeygateError
from core.model import AckMode
from protocols import sink as settles
from protocols._io import FlowGate, Outbox, tell_backpressure
from protocols.amqp import events as ev
from protocols.amqp.connection import AmqpConnection
from protocols.amqp.consumers import ConsumeRequest, Outcome
from protocols.amqp.consuming import get_tag
from protocols.sink import BindRequest, Principal, Sink

# How long a basic.get waits for the group to push a message before get-empty; the first
# basic.get of a channel also binds its getter, which loads the partitions from storage.
GET_WAIT: Final = 0.1
FIRST_GET_WAIT: Final = 2.0

_OUTCOMES: Final = {
    Outcome.ACK: settles.Ack,
    Outcome.RETRY: settles.Nack,
    Outcome.REJECT: settles.Reject,
}

_Key = tuple[int, int, str]  # channel number, channel serial, consumer tag


@dataclass(eq=False)
class _ConsumerOutput:
    """``protocols.sink.FlowOutput`` of one AMQP consumer."""

    flows: ConsumerFlows
    key: _Key
    no_ack: bool
    flow_id: str = ""
    gate: FlowGate | None = None  # holds the flow back while the connection is behind

    def deliver(self, deliveries: Sequence[Deliver]) -> Sequence[Deliver]:
        if self.gate is not None:
            self.gate.check()
        channel, serial, tag = self.key
        failed, sent = self.flows.connection.deliver(channel, serial, tag, deliveries)
        self.flows.flush((self.flow_id, sent) if self.no_ack else None)
        return failed

    def partitions_changed(self, partitions: frozenset[int]) -> None:
        """AMQP has no frame for it: a consumer sees its partitions in ``x-partition``."""

    def terminate(self, error: KeygateError) -> None:
        self.flows.outputs.pop(self.key, None)
        channel, serial, tag = self.key
        self.flows.connection.cancel_consumer(channel, serial, tag)
        self.flows.flush(None)


@dataclass(eq=False)
class _GetterOutput:
    """``FlowOutput`` of a channel's basic.get: keeps what the group pushes until asked."""

    no_ack: bool
    flow_id: str = ""
    waiting: deque[Deliver] = field(default_factory=deque)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def deliver(self, deliveries: Sequence[Deliver]) -> Sequence[Deliver]:
        self.waiting.extend(deliveries)
        self.arrived.set()
        return ()

    def partitions_changed(self, partitions: frozenset[int]) -> None:
        """Nothing to tell: the next basic.get sees the new partitions' messages."""

    def terminate(self, error: KeygateError) -> None:
        self.waiting.clear()


class ConsumerFlows:
    """The flows of one AMQP connection's consumers and getters."""

    def __init__(
        self,
        sink: Sink,
        connection: AmqpConnection,
        flush: Callable[[tuple[str, Sequence[str]] | None], None],
        outbox: Outbox | None = None,
    ) -> None:
        self.sink = sink
        self.connection = connection
        self.flush = flush
        self.outbox = outbox  # the connection's, whose backlog holds consumers back
        self._session = uuid.uuid4().hex[:12]
        self.outputs: dict[_Key, _ConsumerOutput | _GetterOutput] = {}

    async def perform(
        self,
        principal: Principal,
        op: ev.Consume | ev.Cancel | ev.SettleDeliveries | ev.Get | ev.ChannelGone,
    ) -> None:
        if isinstance(op, ev.ChannelGone):
            for key in [k for k in self.outputs if k[:2] == (op.channel, op.serial)]:
                self._unbind(principal, key)
        elif isinstance(op, ev.Consume):
            await self._consume(principal, op)
        elif isinstance(op, ev.Cancel):
            key = (op.channel, op.serial, op.consumer_tag)
            output = self.outputs.get(key)
            if isinstance(output, _ConsumerOutput) and op.holds:
                self.sink.settle(principal, output.flow_id, settles.Credit(0))
            else:
                self._unbind(principal, key)
            self.connection.cancelled(op)
        elif isinstance(op, ev.SettleDeliveries):
            for settled in op.settled:
                key = (op.channel, op.serial, settled.consumer_tag)
                output = self.outputs.get(key)
                if output is None:  # its flow is unbound: its deliveries went back
                    continue
                event = _OUTCOMES[settled.outcome](settled.message_ids)
                self.sink.settle(principal, output.flow_id, event)
                if settled.drained:  # the last settle of a cancelled consumer
                    self._unbind(principal, key)
        else:
            await self._get(principal, op)

    @property
    def _client(self) -> str:
        """The consumer's client name: the connection's ``connection_name`` when it gave
        one (shown by the console and SQL), else one per connection."""
        return f"amqp:{self.connection.client_id or self._session}"

    def unbind_all(self, principal: Principal) -> None:
        for key in list(self.outputs):
            self._unbind(principal, key)

    def settle_written(self, principal: Principal, flow_id: str, ids: tuple[str, ...]) -> None:
        self.sink.settle(principal, flow_id, settles.Ack(ids))

    def _unbind(self, principal: Principal, key: _Key) -> None:
        output = self.outputs.pop(key, None)
        if output is not None:
            self.sink.settle(principal, output.flow_id, settles.Unbind())

    async def _bind(
        self,
        principal: Principal,
        request: ConsumeRequest,
        output: _ConsumerOutput | _GetterOutput,
    ) -> None:
        result = await self.sink.bind(
            principal,
            BindRequest(
                queue=request.queue,
                group=request.group,
                client=self._client,
                window=request.prefetch,
                ack_mode=AckMode.AUTO if request.no_ack else AckMode.CLIENT,
                tags=request.tags,
                mode=request.mode,
                key_order=request.key_order,
                start=request.start,
                ack_timeout=request.ack_timeout,
            ),
            output,
        )
        output.flow_id = result.flow_id

    async def _consume(self, principal: Principal, op: ev.Consume) -> None:
        request = op.request
        key = (op.channel, op.serial, request.consumer_tag)
        output = _ConsumerOutput(self, key, request.no_ack)
        if self.outbox is not None:

            def tell(on: bool) -> None:
                tell_backpressure(self.sink, principal, output.flow_id, on)

            output.gate = FlowGate(self.outbox, tell)
        try:
            await self._bind(principal, request, output)
        except KeygateError as e:
            self.connection.consumed(op, e)
            return
        self.outputs[key] = output
        if not self.connection.is_current(op):
            self._unbind(principal, key)  # the channel closed while the flow was bound
            return
        self.connection.consumed(op, None)

    async def _get(self, principal: Principal, op: ev.Get) -> None:
        tag = get_tag(op.queue, op.group)
        key = (op.channel, op.serial, tag)
        getter = self.outputs.get(key)
        wait = GET_WAIT
        if not isinstance(getter, _GetterOutput):
            getter = _GetterOutput(op.no_ack)
            request = ConsumeRequest(tag, op.queue, op.group, op.no_ack, prefetch=1)
            try:
                await self._bind(principal, request, getter)
            except KeygateError as e:
                self.connection.operation_done(op, 0, e)
                return
            self.outputs[key] = getter
            wait = FIRST_GET_WAIT
        if not getter.waiting:
            getter.arrived.clear()
            try:
                async with asyncio.timeout(wait):
                    await getter.arrived.wait()
            except TimeoutError:
                pass
        delivery = getter.waiting.popleft() if getter.waiting else None
        if not self.connection.got(op, delivery, len(getter.waiting)):
            if delivery is not None and self.connection.is_current(op):
                # Not encodable for AMQP: dead-lettered, as a consumer's would be.
                self.sink.settle(
                    principal, getter.flow_id, settles.Reject((delivery.message.message_id,))
                )
            elif delivery is not None:  # the channel went away: its unbind returns it
                getter.waiting.appendleft(delivery)
            return
        if delivery is not None and op.no_ack:
            self.flush((getter.flow_id, (delivery.message.message_id,)))


__all__ = ["FIRST_GET_WAIT", "GET_WAIT", "ConsumerFlows"]
