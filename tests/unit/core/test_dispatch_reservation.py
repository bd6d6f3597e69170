"""Dispatch reservations (docs/performance.md): one record covers the first sends that
follow it, a partition that cannot send gives its reservation back, and recovery never
dead-letters a message only because it lay inside a reservation."""

from __future__ import annotations

from core.actions import (
    Deliver,
    DeliveryRecord,
    GroupSnapshot,
    OffsetUpdate,
    PartitionSnapshot,
    RecordDispatch,
)
from core.model import DeadLetterReason, GroupConfig, Message, QueueConfig
from core.pump import DISPATCH_AHEAD
from tests.unit.core.driver import Driver


def make(**queue_settings: object) -> Driver:
    queue = QueueConfig("q", **queue_settings)  # type: ignore[arg-type]
    return Driver(queue, GroupConfig("q", "g"))


def kinds(actions: list[object]) -> list[str]:
    wanted = (RecordDispatch, Deliver, OffsetUpdate)
    return [type(a).__name__ for a in actions if isinstance(a, wanted)]


def test_first_sends_inside_the_reservation_need_no_record() -> None:
    d = make()
    d.bind("a")
    first = d.call(d.machine.append, [Message("m1", "q", 0, 1, "k", b"")])
    assert kinds(first) == ["RecordDispatch", "Deliver", "OffsetUpdate"]
    record = next(a for a in first if isinstance(a, RecordDispatch))
    assert record.reserved_seq == 1 + DISPATCH_AHEAD
    second = d.call(d.machine.append, [Message("m2", "q", 0, 2, "k", b"")])
    assert kinds(second) == ["Deliver", "OffsetUpdate"]
    assert (d.offsets[0].dispatched_seq, d.offsets[0].reserved_seq) == (2, 1 + DISPATCH_AHEAD)


def test_a_send_beyond_the_reservation_records_a_new_one() -> None:
    d = make()
    d.bind("a", window=DISPATCH_AHEAD + 10)
    d.publish("k")
    for _ in range(DISPATCH_AHEAD):
        d.publish("k")
    actions = d.call(d.machine.append, [Message("last", "q", 0, DISPATCH_AHEAD + 2, "k", b"")])
    assert kinds(actions)[:2] == ["RecordDispatch", "Deliver"]
    assert len(d.deliveries) == DISPATCH_AHEAD + 2


def test_a_partition_whose_window_is_full_gives_its_reservation_back() -> None:
    d = make()
    ms = [d.publish("k") for _ in range(3)]
    d.bind("a", window=2)
    assert (d.offsets[0].dispatched_seq, d.offsets[0].reserved_seq) == (2, 2)
    d.ack("a", ms[0])  # room for seq 3: beyond the reservation, so recorded first
    assert [x.message.seq for x in d.deliveries] == [1, 2, 3]


def test_a_flow_leaving_gives_the_reservation_back() -> None:
    d = make()
    d.bind("a")
    d.publish("k")
    assert d.offsets[0].reserved_seq == 1 + DISPATCH_AHEAD
    d.call(d.machine.unbind, "a", shutdown=True)
    d.publish("k")
    assert (d.offsets[0].dispatched_seq, d.offsets[0].reserved_seq) == (1, 1)


def recovered(max_deliveries: int, *, dispatched: int, reserved: int) -> Driver:
    store = {0: [Message("m1", "q", 0, 1, "k", b"")]}
    snapshot = GroupSnapshot(
        {0: PartitionSnapshot(dispatched_seq=dispatched, reserved_seq=reserved)}
    )
    queue = QueueConfig("q", max_deliveries=max_deliveries)
    d = Driver(queue, GroupConfig("q", "g"), store=store, snapshot=snapshot)
    d.bind("a")
    return d


def test_a_maybe_seen_message_is_redelivered_not_dead_lettered_at_recovery() -> None:
    d = recovered(1, dispatched=0, reserved=5)
    assert d.dead == []
    [delivery] = d.deliveries
    # Counted as seen, capped at max_deliveries, flagged, and recorded before it is sent.
    assert (delivery.delivery_count, delivery.redelivered) == (1, True)
    d.nack("a", d.store[0][0])
    assert [(x.reason, x.delivery_count) for x in d.dead] == [(DeadLetterReason.MAX_DELIVERIES, 1)]


def test_a_maybe_seen_message_counts_one_more_delivery_below_the_limit() -> None:
    d = recovered(3, dispatched=0, reserved=5)
    assert [(x.delivery_count, x.redelivered) for x in d.deliveries] == [(2, True)]


def test_a_message_at_or_below_dispatched_seq_keeps_the_strict_rule() -> None:
    d = recovered(1, dispatched=1, reserved=5)
    assert d.deliveries == []
    assert [(x.reason, x.delivery_count) for x in d.dead] == [(DeadLetterReason.MAX_DELIVERIES, 1)]


def test_a_recorded_delivery_above_dispatched_seq_counts_as_recorded() -> None:
    store = {0: [Message("m1", "q", 0, 1, "k", b"")]}
    partition = PartitionSnapshot(
        dispatched_seq=0, reserved_seq=5, deliveries=(DeliveryRecord(1, 1, 3.0),)
    )
    queue = QueueConfig("q", max_deliveries=1)
    d = Driver(queue, GroupConfig("q", "g"), store=store, snapshot=GroupSnapshot({0: partition}))
    d.bind("a")
    assert d.deliveries == []
    assert [(x.reason, x.delivery_count) for x in d.dead] == [(DeadLetterReason.MAX_DELIVERIES, 1)]
