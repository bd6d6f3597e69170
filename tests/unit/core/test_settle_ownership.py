"""Which flow may settle a message (docs/native-protocol.md §4): an ACK settles what is in
flight to its flow, and what was taken back from that flow until it is delivered again;
any other flow's ACK of it settles nothing, as its NACK or reject does nothing."""

from __future__ import annotations

from core.model import GroupConfig, GroupMode, Message, QueueConfig
from tests.unit.core.driver import Driver


def shared(**group_settings: object) -> tuple[Driver, Message, Message]:
    """Flows a and b of a shared group hold one message each (windows of 1)."""
    group = GroupConfig("q", "g", mode=GroupMode.SHARED, **group_settings)  # type: ignore[arg-type]
    d = Driver(QueueConfig("q", backoff_initial=5.0, backoff_max=5.0), group)
    d.publish("k1")
    d.publish("k2")
    d.bind("a", window=1)
    d.bind("b", window=1)
    ((held_a,), (held_b,)) = d.received("a"), d.received("b")
    return d, held_a, held_b


def test_an_ack_settles_nothing_in_flight_to_another_flow() -> None:
    d, held_a, held_b = shared()
    assert d.ack("b", held_a) == []
    assert not d.settled(0, held_a.seq)
    d.nack("a", held_a, delay=0.0)
    assert [(x.message, x.delivery_count) for x in d.deliveries[2:]] == [(held_a, 2)]
    d.ack("b", held_a, held_b)  # its own is settled, the other one is not
    assert d.settled(0, held_b.seq) and not d.settled(0, held_a.seq)


def test_an_ack_from_another_flow_does_not_cancel_a_retry() -> None:
    d, held_a, _ = shared()
    d.nack("a", held_a, delay=3.0)
    d.ack("b", held_a)
    assert not d.settled(0, held_a.seq)
    d.advance(3.0)
    assert [(x.flow_id, x.message, x.delivery_count) for x in d.deliveries[2:]] == [
        ("a", held_a, 2)
    ]


def test_a_flow_acks_a_message_taken_back_from_it_until_it_is_delivered_again() -> None:
    d, held_a, _ = shared(ack_timeout=2.0)
    d.advance(2.0)  # both deliveries time out and wait 5 s for their retries
    d.ack("b", held_a)
    assert not d.settled(0, held_a.seq)
    d.ack("a", held_a)
    assert d.settled(0, held_a.seq)
    d.advance(5.0)
    assert [x.message for x in d.deliveries[2:]] == [d.received("b")[0]]


def test_a_late_ack_from_the_old_owner_settles_nothing_once_the_message_is_redelivered() -> None:
    queue = QueueConfig("q", partitions=2)
    d = Driver(queue, GroupConfig("q", "g"))
    m = d.publish("k", partition=1)
    d.publish("k", partition=0)
    d.bind("a")
    d.bind("b")
    d.advance(3.0)  # the handoff ends: a's message of partition 1 goes to b
    assert [x.flow_id for x in d.deliveries if x.message == m][-1] == "b"
    assert d.ack("a", m) == []
    assert not d.settled(1, m.seq)
    d.ack("b", m)
    assert d.settled(1, m.seq)
