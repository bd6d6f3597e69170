"""The consuming half of an AMQP channel: tags, prefetch and settles by delivery tag."""

from __future__ import annotations

import pytest
from pamqp import commands

from core.model import Message
from protocols.amqp.consumers import ChannelConsumers, Outcome, Settled
from protocols.amqp.errors import AmqpChannelError


def _message(n: int) -> Message:
    return Message(f"m{n}", "orders", n % 2, n, "k", b"x", {"color": "red"}, publish_time=100.0)


def _channel(*tags: str, no_ack: bool = False) -> ChannelConsumers:
    channel = ChannelConsumers()
    channel.qos(commands.Basic.Qos(prefetch_count=10))
    for tag in tags:
        channel.consume(
            commands.Basic.Consume(
                queue="orders", consumer_tag=tag, no_ack=no_ack, arguments={"x-group": "billing"}
            )
        )
    return channel


def test_consume_takes_group_prefetch_and_generates_a_tag_when_none_is_given() -> None:
    channel = _channel()
    request = channel.consume(commands.Basic.Consume(queue="orders"))
    assert request.consumer_tag.startswith("amq.ctag-")
    assert (request.group, request.prefetch, request.no_ack) == ("default", 10, False)
    with pytest.raises(AmqpChannelError) as reused:
        channel.consume(commands.Basic.Consume(queue="orders", consumer_tag=request.consumer_tag))
    assert reused.value.reply_code == 530


def test_multiple_ack_settles_every_earlier_tag_across_consumers() -> None:
    channel = _channel("a", "b")
    tags = [channel.delivery_tag("ab"[n % 2], _message(n)) for n in range(4)]
    assert tags == [1, 2, 3, 4]
    settled = channel.settle(commands.Basic.Ack(delivery_tag=3, multiple=True))
    assert settled == [
        Settled("a", Outcome.ACK, ("m0", "m2")),
        Settled("b", Outcome.ACK, ("m1",)),
    ]
    with pytest.raises(AmqpChannelError) as twice:
        channel.settle(commands.Basic.Ack(delivery_tag=2))
    assert twice.value.reply_code == 406
    assert channel.settle(commands.Basic.Nack(delivery_tag=0, multiple=True, requeue=True)) == [
        Settled("b", Outcome.RETRY, ("m3",))
    ]


def test_reject_without_requeue_dead_letters_and_recover_retries_the_rest() -> None:
    channel = _channel("a")
    for n in range(3):
        channel.delivery_tag("a", _message(n))
    assert channel.settle(commands.Basic.Reject(delivery_tag=2, requeue=False)) == [
        Settled("a", Outcome.REJECT, ("m1",))
    ]
    assert channel.recover() == [Settled("a", Outcome.RETRY, ("m0", "m2"))]
    assert channel.recover() == []


def test_no_ack_deliveries_are_not_remembered() -> None:
    channel = _channel("a", no_ack=True)
    tag = channel.delivery_tag("a", _message(1))
    with pytest.raises(AmqpChannelError):
        channel.settle(commands.Basic.Ack(delivery_tag=tag))


def test_a_cancelled_consumers_deliveries_can_still_be_acked_the_last_drains_it() -> None:
    channel = _channel("a")
    first, second = (channel.delivery_tag("a", _message(n)) for n in range(2))
    assert channel.cancel("a") is not None
    assert channel.settle(commands.Basic.Ack(delivery_tag=first)) == [
        Settled("a", Outcome.ACK, ("m0",), drained=False)
    ]
    assert channel.settle(commands.Basic.Nack(delivery_tag=second)) == [
        Settled("a", Outcome.RETRY, ("m1",), drained=True)
    ]


def test_a_cancelled_consumers_tag_is_reused_only_once_its_deliveries_are_settled() -> None:
    """A consume under the tag of a cancelled consumer still holding deliveries replaced
    its flow, which then stayed bound (paused, its partitions held) past the channel."""
    channel = _channel("a")
    tag = channel.delivery_tag("a", _message(0))
    channel.cancel("a")
    again = commands.Basic.Consume(queue="orders", consumer_tag="a")
    with pytest.raises(AmqpChannelError) as reused:
        channel.consume(again)
    assert reused.value.reply_code == 530
    assert "not settled yet" in str(reused.value)
    channel.settle(commands.Basic.Ack(delivery_tag=tag))
    assert channel.consume(again).consumer_tag == "a"


def test_settles_of_a_live_consumer_never_drain_it() -> None:
    channel = _channel("a")
    tag = channel.delivery_tag("a", _message(1))
    [settled] = channel.settle(commands.Basic.Ack(delivery_tag=tag))
    assert not settled.drained
