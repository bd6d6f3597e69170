"""Chained key-granular handoffs (DESIGN.md §4 Handoff, Per-key control): a partition
that moves again while a handoff is pending keeps every earlier holder's keys waiting, each
until that holder settles them or its own max_handoff_time ends."""

from __future__ import annotations

from core.model import GroupConfig, Message, PartitionState, QueueConfig
from tests.unit.core.driver import Driver


def make(partitions: int, **queue_settings: object) -> Driver:
    queue = QueueConfig("q", partitions=partitions, **queue_settings)  # type: ignore[arg-type]
    return Driver(queue, GroupConfig("q", "g"))


def first_handoff(d: Driver) -> tuple[int, Message]:
    """A holds a message of key "a" in both partitions; B binds and takes one of them,
    which waits for A's "a". Returns that partition and A's message of it."""
    held = {p: d.publish("a", partition=p) for p in (0, 1)}
    d.bind("a")
    d.bind("b")
    (moving,) = d.machine.partitions_of("b")
    assert d.assignment[moving] == (PartitionState.PAUSED, "b")
    return moving, held[moving]


def deliveries_to(d: Driver, flow: str) -> list[tuple[str | None, int, bool]]:
    return [
        (x.message.key, x.delivery_count, x.redelivered) for x in d.deliveries if x.flow_id == flow
    ]


def test_a_second_move_keeps_the_first_holders_keys_waiting_when_the_new_owner_shuts_down() -> None:
    d = make(2, max_handoff_time=6.0)
    moving, held = first_handoff(d)
    d.bind("c")  # standby
    d.advance(1.0)
    d.call(d.machine.unbind, "b", shutdown=True)
    assert d.machine.partitions_of("c") == frozenset({moving})
    assert d.assignment[moving] == (PartitionState.PAUSED, "c")
    later = d.publish("a", partition=moving)
    other = d.publish("x", partition=moving)
    assert d.received("c") == [other]  # "a" waits for A, which still holds it
    d.ack("a", held)
    assert d.received("c") == [other, later]
    assert deliveries_to(d, "c") == [("x", 1, False), ("a", 1, False)]
    assert d.assignment[moving] == (PartitionState.READY, "c")


def test_a_second_move_after_the_new_owner_disconnects_keeps_the_first_holders_deadline() -> None:
    d = make(2, max_handoff_time=6.0, rebalance_delay=1.0)
    moving, held = first_handoff(d)
    d.bind("c")
    d.call(d.machine.unbind, "b")  # a dropped connection: reserved through the delay
    d.advance(1.0)
    assert d.machine.partitions_of("c") == frozenset({moving})
    later = d.publish("a", partition=moving)
    d.advance(4.9)
    assert d.received("c") == []
    assert d.assignment[moving] == (PartitionState.PAUSED, "c")
    d.advance(0.1)  # A's deadline: 6 s after the first handoff, not after the second move
    assert d.received("c") == [held, later]
    assert deliveries_to(d, "c") == [("a", 2, True), ("a", 1, False)]
    assert d.assignment[moving] == (PartitionState.READY, "c")


def test_each_earlier_holder_keeps_its_own_keys_waiting_until_its_own_deadline() -> None:
    # Four partitions: B takes 2 and 3 from A; C's arrival moves 3 on from B to C.
    d = make(4, max_handoff_time=6.0)
    a1 = d.publish("a", partition=3)
    d.bind("a")
    d.bind("b")
    assert d.machine.partitions_of("b") == frozenset({2, 3})
    b1 = d.publish("b", partition=3)
    assert d.received("b") == [b1]
    d.advance(2.0)
    d.bind("c")
    assert d.machine.partitions_of("c") == frozenset({3})
    assert d.assignment[3] == (PartitionState.PAUSED, "c")
    a2 = d.publish("a", partition=3)
    b2 = d.publish("b", partition=3)
    c1 = d.publish("c", partition=3)
    assert d.received("c") == [c1]
    assert d.machine.next_deadline() == 6.0
    d.advance(4.0)  # A's deadline (t=6): its leftover first, flagged, then the rest of "a"
    assert d.received("c") == [c1, a1, a2]
    assert d.assignment[3] == (PartitionState.PAUSED, "c")  # "b" still waits for B
    assert d.machine.next_deadline() == 8.0
    d.advance(2.0)  # B's deadline (t=8)
    assert d.received("c") == [c1, a1, a2, b1, b2]
    assert deliveries_to(d, "c")[1:] == [
        ("a", 2, True),
        ("a", 1, False),
        ("b", 2, True),
        ("b", 1, False),
    ]
    assert d.assignment[3] == (PartitionState.READY, "c")


def test_an_earlier_holder_that_settles_releases_its_keys_while_another_still_waits() -> None:
    d = make(4, max_handoff_time=6.0)
    a1 = d.publish("a", partition=3)
    d.bind("a")
    d.bind("b")
    b1 = d.publish("b", partition=3)
    d.bind("c")
    a2 = d.publish("a", partition=3)
    b2 = d.publish("b", partition=3)
    d.ack("b", b1)
    assert d.received("c") == [b2]
    assert d.assignment[3] == (PartitionState.PAUSED, "c")
    d.ack("a", a1)
    assert d.received("c") == [b2, a2]
    assert all(not x.redelivered for x in d.deliveries if x.flow_id == "c")
    assert d.assignment[3] == (PartitionState.READY, "c")


def test_a_paused_partition_says_since_when_its_waiting_keys_wait_through_a_chain() -> None:
    # Four partitions: B takes 3 from A at t=1, C takes it from B at t=3 (kg_key_status).
    d = make(4, max_handoff_time=6.0)
    a1 = d.publish("a", partition=3)
    d.bind("a")
    d.advance(1.0)
    d.bind("b")
    b1 = d.publish("b", partition=3)
    d.advance(2.0)
    d.bind("c")
    assert d.assignment[3] == (PartitionState.PAUSED, "c")
    assert d.handoff_since[3] == 1.0  # A's "a" has waited since the first move
    d.ack("a", a1)
    assert d.handoff_since[3] == 3.0  # only B's "b" waits, since the second move
    d.ack("b", b1)
    assert (d.assignment[3], d.handoff_since[3]) == ((PartitionState.READY, "c"), None)


def test_moving_back_to_an_earlier_holder_makes_its_unacked_messages_its_own_again() -> None:
    d = make(4, max_handoff_time=6.0)
    a1 = d.publish("a", partition=3)
    d.bind("a")
    d.bind("b")
    b1 = d.publish("b", partition=3)
    d.bind("c")
    d.call(d.machine.unbind, "c", shutdown=True)  # 3 goes back to B; A's "a" still waits
    assert d.machine.partitions_of("b") == frozenset({2, 3})
    assert d.assignment[3] == (PartitionState.PAUSED, "b")
    b2 = d.publish("b", partition=3)
    assert d.received("b") == [b1, b2]
    d.ack("a", a1)
    assert d.assignment[3] == (PartitionState.READY, "b")


def test_a_reclaimed_partition_stays_paused_while_an_earlier_holder_settles() -> None:
    d = make(2, max_handoff_time=6.0, rebalance_delay=3.0)
    moving, held = first_handoff(d)
    d.call(d.machine.unbind, "b")
    d.bind("b2", client="b", previous=frozenset({moving}))
    assert d.assignment[moving] == (PartitionState.PAUSED, "b2")
    later = d.publish("a", partition=moving)
    assert d.received("b2") == []
    d.ack("a", held)
    assert d.received("b2") == [later]
    assert d.assignment[moving] == (PartitionState.READY, "b2")
