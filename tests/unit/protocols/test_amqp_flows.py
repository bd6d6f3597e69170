"""AMQP consumers as flows: what a basic.cancel and the settles after it do to the flow
(protocols.amqp.flows), driven through the sans-IO connection onto a MemorySink.

A client's frames are read whole before the worker performs the events they became, so
these tests feed a cancel and the settles after it in one read, as a client that acks in
a tight loop sends them."""

from __future__ import annotations

from pamqp import base, commands, frame

from core.actions import Deliver
from core.model import Message, QueueConfig
from protocols.amqp import events as ev
from protocols.amqp.flows import ConsumerFlows
from protocols.sink import Ack, Credit, Nack, Principal, Reject, Unbind
from tests.support.amqp_sansio import Client
from tests.support.memory_sink import MemorySink

PRINCIPAL = Principal("guest", "amqp", connection="c1")


class Consumer:
    """One pika-like consumer holding five deliveries: its connection, flows and sink."""

    def __init__(self) -> None:
        self.sink = MemorySink(queues={"jobs": QueueConfig("jobs")})
        self.client = Client()
        self.client.open()
        self.client.channel()
        self.flows = ConsumerFlows(self.sink, self.client.conn, lambda _: None)
        self.flow_id = ""

    async def hold_five(self) -> None:
        self.client.method(1, commands.Basic.Qos(prefetch_count=5))
        self.client.method(1, commands.Basic.Consume(queue="jobs", consumer_tag="c"))
        await self.perform()
        [(self.flow_id, bound)] = self.sink.flows.items()
        messages = [Message(f"m{i}", "jobs", 0, i, "k", b"x") for i in range(5)]
        bound.output.deliver([Deliver(self.flow_id, m, 1, False) for m in messages])
        self.client.replies()

    async def read(self, *methods: base.Frame) -> None:
        """The methods arrive in one read; then the worker performs their events."""
        self.client.send(b"".join(frame.marshal(m, 1) for m in methods))
        await self.perform()

    async def perform(self) -> None:
        for op in self.client.take():
            assert isinstance(op, ev.Consume | ev.Cancel | ev.SettleDeliveries)
            await self.flows.perform(PRINCIPAL, op)

    def settled(self) -> list[object]:
        return [event for flow_id, event in self.sink.settled if flow_id == self.flow_id]


async def test_acks_read_with_the_cancel_all_count_and_the_last_one_unbinds() -> None:
    consumer = Consumer()
    await consumer.hold_five()
    acks = [commands.Basic.Ack(delivery_tag=tag) for tag in range(1, 6)]
    await consumer.read(commands.Basic.Cancel("c", nowait=True), *acks)
    assert consumer.settled() == [
        Credit(0),
        *(Ack((f"m{i}",)) for i in range(5)),
        Unbind(),
    ]


async def test_acks_read_together_after_a_cancel_all_count() -> None:
    consumer = Consumer()
    await consumer.hold_five()
    await consumer.read(commands.Basic.Cancel("c"))
    await consumer.read(*(commands.Basic.Ack(delivery_tag=tag) for tag in range(1, 6)))
    assert consumer.settled() == [
        Credit(0),
        *(Ack((f"m{i}",)) for i in range(5)),
        Unbind(),
    ]


async def test_nacks_and_rejects_between_the_acks_after_a_cancel_count_too() -> None:
    consumer = Consumer()
    await consumer.hold_five()
    await consumer.read(commands.Basic.Cancel("c"), commands.Basic.Ack(delivery_tag=1))
    assert consumer.settled() == [Credit(0), Ack(("m0",))]  # four held: still bound
    await consumer.read(
        commands.Basic.Nack(delivery_tag=2, requeue=True),
        commands.Basic.Reject(delivery_tag=3, requeue=False),
        commands.Basic.Ack(delivery_tag=4),
        commands.Basic.Reject(delivery_tag=5, requeue=True),
    )
    assert consumer.settled() == [
        Credit(0),
        Ack(("m0",)),
        Nack(("m1",)),
        Reject(("m2",)),
        Ack(("m3",)),
        Nack(("m4",)),
        Unbind(),
    ]


async def test_a_cancel_read_after_the_last_ack_unbinds_at_once() -> None:
    consumer = Consumer()
    await consumer.hold_five()
    await consumer.read(
        commands.Basic.Ack(delivery_tag=5, multiple=True), commands.Basic.Cancel("c")
    )
    assert consumer.settled() == [Ack(tuple(f"m{i}" for i in range(5))), Unbind()]
