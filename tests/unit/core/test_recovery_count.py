"""What a restart counts (DESIGN.md §4 Crash semantics, docs/performance.md *Dispatch
reservations*): the dispatched_seq written is a low-water mark (every unsettled message
at or below it was sent), a clean shutdown leaves nothing to guess, and after a crash a
message that cannot have been sent is neither counted nor dead-lettered."""

from __future__ import annotations

from core.actions import (
    DeliveryRecord,
    GroupSnapshot,
    PartitionSnapshot,
    RecordDispatch,
)
from core.model import GroupConfig, KeyOrder, Message, QueueConfig
from core.pump import DISPATCH_AHEAD
from tests.unit.core.driver import Driver

STRICT = GroupConfig("q", "g", key_order=KeyOrder.STRICT)
PARTITION = GroupConfig("q", "g")


def make(group: GroupConfig = PARTITION, **queue_settings: object) -> Driver:
    queue = QueueConfig("q", **queue_settings)  # type: ignore[arg-type]
    return Driver(queue, group)


def restart(d: Driver, group: GroupConfig, **queue_settings: object) -> Driver:
    """A new machine on what the driver's storage holds, as ``load_group`` recovers it
    after ``forget_consumers`` ended the reservation at the head (a crash, or after
    ``close`` a clean stop)."""
    partitions = {}
    for p, stored in d.store.items():
        head = stored[-1].seq if stored else 0
        update = d.offsets.get(p)
        counts: dict[int, int] = {}
        for q, seq, count in d.recorded:
            if q == p and not d.settled(p, seq):
                counts[seq] = max(count, counts.get(seq, 0))
        partitions[p] = PartitionSnapshot(
            committed_seq=update.committed_seq if update else 0,
            acked_above=update.acked_above if update else (),
            dispatched_seq=d.dispatched[p],
            reserved_seq=min(d.reserved[p], head),
            deliveries=tuple(DeliveryRecord(s, c, 1.0) for s, c in sorted(counts.items())),
        )
    queue = QueueConfig("q", **queue_settings)  # type: ignore[arg-type]
    again = Driver(queue, group, store=dict(d.store), snapshot=GroupSnapshot(partitions))
    again.now = d.now
    return again


def stop(d: Driver) -> None:
    """A clean shutdown: the machine's final state is written."""
    d.run(d.machine.close())


def seen(d: Driver) -> dict[int, tuple[int, bool]]:
    """(delivery count, redelivered) of each seq delivered."""
    return {x.message.seq: (x.delivery_count, x.redelivered) for x in d.deliveries}


# -- the position written is a low-water mark ---------------------------------------------


def test_a_scheduled_message_keeps_dispatched_seq_below_it() -> None:
    d = make()
    d.bind("a")
    d.publish("s", deliver_at=100.0)
    later = d.publish("n")
    d.ack("a", later)
    assert [x.message.seq for x in d.deliveries] == [2]
    assert d.offsets[0].dispatched_seq == 0
    assert d.dispatched[0] == 0


def test_a_held_back_message_keeps_dispatched_seq_below_it() -> None:
    d = make(STRICT)
    d.bind("a")
    d.publish("k")
    d.publish("k")  # held behind the first, unacked
    d.ack("a", d.publish("j"))
    assert [x.message.seq for x in d.deliveries] == [1, 3]
    assert d.dispatched[0] == 1


def test_dispatched_seq_moves_up_once_the_held_message_is_sent() -> None:
    d = make(STRICT)
    d.bind("a")
    first = d.publish("k")
    d.publish("k")
    d.publish("j")
    d.ack("a", first)
    assert [x.message.seq for x in d.deliveries] == [1, 3, 2]
    assert d.dispatched[0] == 3


# -- a clean shutdown is exact ------------------------------------------------------------


def test_after_a_clean_stop_a_scheduled_message_is_a_first_delivery() -> None:
    d = make(max_deliveries=1)
    d.bind("a")
    d.publish("s", deliver_at=12.0)
    d.ack("a", d.publish("n"))
    stop(d)
    again = restart(d, PARTITION, max_deliveries=1)
    again.bind("a")
    assert again.deliveries == [] and again.dead == []
    again.advance(12.0)
    assert seen(again) == {1: (1, False)}


def test_after_a_clean_stop_only_what_was_sent_counts_one_more() -> None:
    d = make(STRICT, max_deliveries=2)
    d.bind("a")
    d.publish("k")  # sent, unacked at the stop
    d.publish("k")  # held behind it, never sent
    d.ack("a", d.publish("j"))
    stop(d)
    again = restart(d, STRICT, max_deliveries=2)
    again.bind("a")
    [first] = again.deliveries
    assert (first.message.seq, first.delivery_count, first.redelivered) == (1, 2, True)
    again.ack("a", first.message)
    assert [(x.message.seq, x.delivery_count, x.redelivered) for x in again.deliveries[1:]] == [
        (2, 1, False)
    ]
    assert again.dead == []


def test_a_clean_stop_records_each_unacked_first_send_and_ends_the_reservation() -> None:
    d = make(STRICT)
    d.bind("a")
    d.publish("k")
    d.publish("k")
    d.ack("a", d.publish("j"))
    assert d.reserved[0] == 1 + DISPATCH_AHEAD
    actions = d.machine.close()
    [record] = [a for a in actions if isinstance(a, RecordDispatch)]
    assert [(seq, count) for seq, count, _ in record.redeliveries] == [(1, 1)]
    d.run(actions)
    assert (d.dispatched[0], d.reserved[0]) == (1, 1)


def test_after_a_clean_stop_a_message_held_behind_a_retry_is_a_first_delivery() -> None:
    d = make(max_deliveries=2, backoff_initial=20.0)
    d.bind("a")
    d.nack("a", d.publish("k"))
    d.publish("k")  # behind the retry of the first, never sent
    d.ack("a", d.publish("j"))
    assert seen(d) == {1: (1, False), 3: (1, False)}
    stop(d)
    again = restart(d, PARTITION, max_deliveries=2)
    again.bind("a")
    assert again.dead == []
    assert seen(again) == {1: (2, True), 2: (1, False)}


# -- after a crash ------------------------------------------------------------------------


def recovered(
    group: GroupConfig,
    messages: list[Message],
    *,
    dispatched: int,
    reserved: int,
    acked: tuple[tuple[int, int], ...] = (),
    records: tuple[DeliveryRecord, ...] = (),
    max_deliveries: int = 1,
) -> Driver:
    partition = PartitionSnapshot(
        acked_above=acked, dispatched_seq=dispatched, reserved_seq=reserved, deliveries=records
    )
    queue = QueueConfig("q", max_deliveries=max_deliveries)
    d = Driver(queue, group, store={0: messages}, snapshot=GroupSnapshot({0: partition}))
    d.bind("a")
    return d


def m(seq: int, key: str, payload: bytes, **fields: object) -> Message:
    return Message(f"m{seq}", "q", 0, seq, key, payload, **fields)  # type: ignore[arg-type]


def test_a_crash_never_counts_a_message_not_due_yet() -> None:
    # Stored as the earlier high-water mark had it: the scheduled message below it.
    messages = [m(1, "s", b"scheduled", deliver_at=12.0), m(2, "n", b"normal")]
    d = recovered(PARTITION, messages, dispatched=2, reserved=2, acked=((2, 2),))
    assert d.dead == [] and d.deliveries == []
    d.advance(12.0)
    assert seen(d) == {1: (1, False)}


def test_a_crash_counts_a_scheduled_message_that_was_due() -> None:
    messages = [m(1, "s", b"scheduled", deliver_at=-1.0)]
    d = recovered(PARTITION, messages, dispatched=1, reserved=1, max_deliveries=2)
    assert seen(d) == {1: (2, True)}


def test_in_strict_order_a_crash_counts_only_the_first_unsettled_message_of_a_key() -> None:
    messages = [m(1, "k", b"K1"), m(2, "k", b"K2"), m(3, "j", b"J1")]
    d = recovered(STRICT, messages, dispatched=1, reserved=3, acked=((3, 3),), max_deliveries=2)
    assert seen(d) == {1: (2, True)}
    d.ack("a", messages[0])
    assert seen(d) == {1: (2, True), 2: (1, False)}


def test_in_strict_order_max_deliveries_1_never_dead_letters_a_held_message() -> None:
    messages = [m(1, "k", b"K1"), m(2, "k", b"K2"), m(3, "j", b"J1")]
    d = recovered(STRICT, messages, dispatched=1, reserved=3, acked=((3, 3),))
    # K1 was sent: at max_deliveries = 1 the restart ends it; K2 never was.
    assert [x.message.payload for x in d.dead] == [b"K1"]
    assert seen(d) == {2: (1, False)}


def test_in_strict_order_an_earlier_scheduled_message_does_not_hold_its_key() -> None:
    # K2 may have been sent while K1 was not due: it is counted (maybe seen).
    messages = [m(1, "k", b"K1", deliver_at=50.0), m(2, "k", b"K2")]
    d = recovered(STRICT, messages, dispatched=0, reserved=2, max_deliveries=3)
    assert seen(d) == {2: (2, True)}


def test_at_or_below_dispatched_seq_a_later_message_of_a_key_still_counts() -> None:
    # dispatched_seq says K2 was sent (its key's first message acked, the ack not written).
    messages = [m(1, "k", b"K1"), m(2, "k", b"K2")]
    d = recovered(STRICT, messages, dispatched=2, reserved=2, max_deliveries=3)
    assert seen(d) == {1: (2, True)}
    d.ack("a", messages[0])
    assert seen(d)[2] == (2, True)


def test_in_partition_order_a_message_behind_a_retry_is_maybe_seen() -> None:
    # It may have been sent before the first was nacked: counted, never dead-lettered.
    messages = [m(1, "k", b"K1"), m(2, "k", b"K2")]
    records = (DeliveryRecord(1, 1, 1.0),)
    d = recovered(PARTITION, messages, dispatched=1, reserved=2, records=records)
    assert [x.message.payload for x in d.dead] == [b"K1"]
    assert seen(d) == {2: (1, True)}


def test_after_a_crash_skipped_scheduled_messages_are_first_deliveries_at_their_time() -> None:
    # A budget with no room for a note: every scheduled message is skipped (core/notes.py).
    d = Driver(QueueConfig("q", max_deliveries=1), PARTITION, buffer_bytes=1)
    d.bind("a")
    for _ in range(3):
        d.publish("s", deliver_at=50.0)
    d.ack("a", d.publish("n"))
    assert d.machine._parts[0].skipped == (1, 3, 50.0)
    assert d.dispatched[0] == 0
    again = restart(d, PARTITION, max_deliveries=1)  # a crash: nothing more is written
    again.bind("a")
    assert again.deliveries == []
    again.advance(50.0)
    assert seen(again) == {1: (1, False), 2: (1, False), 3: (1, False)}
    assert again.dead == []
