"""Scheduled messages that are not due are held as notes, out of the buffer, so that they
never stop the rest of their partition (core/delivery.py, docs/operations.md "Limits")."""

from __future__ import annotations

from core.actions import Fetch
from core.model import GroupConfig, QueueConfig
from core.partition import NOTE_COST
from tests.unit.core.driver import Driver

HOUR = 3600.0


def make(**kw: object) -> Driver:
    return Driver(QueueConfig("q", partitions=1), GroupConfig("q", "g"), **kw)  # type: ignore[arg-type]


def test_more_scheduled_messages_than_a_buffer_holds_do_not_stop_later_keys() -> None:
    # QA: 1,001 messages an hour ahead in one partition stopped every later message.
    d = make(buffer_size=1000)
    scheduled = [d.publish(f"s{i}", deliver_at=HOUR) for i in range(1500)]
    d.bind("a", window=5000)
    now = [d.publish(f"k{i}") for i in range(20)]
    assert d.seqs("a") == [m.seq for m in now]
    part = d.machine._parts[0]
    assert len(part.buffer) == 0 and len(part.notes) == 1500
    # Storage's low-water mark stays below what is noted and was never sent.
    assert d.dispatched[0] < scheduled[0].seq
    d.advance(HOUR)
    assert d.seqs("a")[20:] == [m.seq for m in scheduled]
    assert not part.notes and d.machine._noted == 0


def test_noted_messages_come_back_by_seq_within_the_groups_budget() -> None:
    d = make(buffer_bytes=20 * 1024)
    for i in range(30):
        d.publish(f"s{i}", deliver_at=10.0, payload=b"x" * 1000)
    d.bind("a", window=1)  # each read back waits for room
    reads: list[Fetch] = []
    for _ in range(40):
        actions = d.advance(10.0 if not reads else 0.0)
        reads += [a for a in actions if isinstance(a, Fetch) and a.seqs]
        d.ack("a", *d.received("a")[-1:])
    assert len(d.seqs("a")) == 30
    assert d.seqs("a") == sorted(d.seqs("a"))
    assert all(sum(1512 for _ in r.seqs) <= 20 * 1024 for r in reads)


def test_beyond_the_notes_budget_scheduled_messages_are_skipped_and_read_again_when_due() -> None:
    d = make(buffer_bytes=10 * NOTE_COST)
    d.bind("a")
    for i in range(15):
        d.publish(str(i % 10), deliver_at=HOUR)
    d.publish("now")
    part = d.machine._parts[0]
    assert list(part.notes) == list(range(1, 10))  # a key's bytes each beside NOTE_COST
    assert part.skipped == (10, 15, HOUR) and not part.buffer
    assert d.seqs("a") == [16]
    assert d.dispatched[0] < 1
    d.advance(HOUR)
    assert d.seqs("a") == [16, *range(1, 16)]
    assert part.skipped is None and part.rescan is None and not part.notes


def test_a_skipped_range_read_again_notes_what_is_not_due_yet() -> None:
    d = make(buffer_bytes=2 * NOTE_COST + 2)
    d.bind("a", window=100)
    for i in range(1, 7):
        d.publish("k", deliver_at=100.0 * i)
    part = d.machine._parts[0]
    assert list(part.notes) == [1, 2] and part.skipped == (3, 6, 300.0)
    d.advance(200.0)
    assert d.seqs("a") == [1, 2]
    d.advance(100.0)  # 3 comes due: the range is read again, 4 and 5 noted, 6 skipped
    assert d.seqs("a") == [1, 2, 3]
    assert list(part.notes) == [4, 5] and part.skipped == (6, 6, 600.0)
    for _ in range(3):
        d.advance(100.0)
    assert d.seqs("a") == [1, 2, 3, 4, 5, 6]


def test_a_noted_message_that_expires_before_it_is_due_is_dropped_then() -> None:
    d = make()
    d.publish("s", deliver_at=HOUR, expire_at=60.0)
    d.bind("a")
    assert d.machine.next_deadline() == 60.0
    d.advance(60.0)
    assert [x.reason for x in d.dropped] == ["expired"] and d.settled(0, 1)
    assert not d.machine._parts[0].notes


def test_a_noted_message_no_longer_stored_is_settled_when_it_comes_due() -> None:
    d = make()
    d.publish("s", deliver_at=HOUR)
    d.publish("k")
    d.bind("a")
    d.ack("a", *d.received("a"))
    d.store[0].pop(0)  # purged meanwhile
    d.advance(HOUR)
    assert d.seqs("a") == [2] and d.settled(0, 1)
