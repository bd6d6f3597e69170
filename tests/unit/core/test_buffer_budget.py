"""Buffers bounded in bytes: a group holds about ``buffer_bytes`` of unsent messages in
memory whatever its partition count, and a partition whose buffered messages all wait
reads on past them while the group has room."""

from __future__ import annotations

from core.model import GroupConfig, Message, QueueConfig
from core.partition import buffered_cost
from tests.unit.core.driver import Driver

GROUP = GroupConfig("q", "g")


def _buffered(d: Driver) -> int:
    return sum(p.buffered for p in d.machine.status().partitions)


def test_the_buffers_of_a_group_keep_to_its_byte_budget_whatever_the_partition_count() -> None:
    budget = 64 * 1024
    for partitions in (1, 16, 256):
        d = Driver(QueueConfig("q", partitions=partitions), GROUP, buffer_bytes=budget)
        published = [d.publish(f"k{i % 3}", i % partitions) for i in range(4000)]
        cost = buffered_cost(published[0])
        d.bind("a", window=50)
        d.answer_fetches()
        # Each partition may always take one message; beyond that, the budget holds.
        assert 0 < _buffered(d) * cost <= budget + partitions * cost
        for _ in range(len(published)):
            d.ack("a", *[x.message for x in d.unacked["a"].values()])
            d.answer_fetches()
            assert _buffered(d) * cost <= budget + partitions * cost
        assert all(d.settled(m.partition, m.seq) for m in published)
        # Per key and partition, in publish order.
        for partition in range(partitions):
            for key in ("k0", "k1", "k2"):
                sent = [m.seq for m in d.received("a") if (m.partition, m.key) == (partition, key)]
                assert sent == sorted(sent)


def test_a_partition_reads_on_past_a_parked_key_beyond_its_share() -> None:
    # Four partitions share 8 KiB: 2 KiB each, three messages; the parked key holds five.
    queue = QueueConfig("q", partitions=4, on_dead_letter="park_key")
    d = Driver(queue, GROUP, buffer_bytes=8192, auto_fetch=False)
    bad = d.publish("k", 0)
    held = [d.publish("k", 0) for _ in range(5)]
    other = d.publish("j", 0)
    d.bind("a", window=1)
    d.answer_fetches()
    assert d.received("a") == [bad]
    d.unacked["a"].clear()
    d.call(d.machine.reject, "a", [bad.message_id])
    d.answer_fetches()
    assert (0, "k") in d.parked
    assert d.received("a") == [bad, other]
    assert 5 * buffered_cost(held[0]) > 8192 // 4
    d.ack("a", other)
    d.call(d.machine.release_key, "k")
    for message in held:
        d.answer_fetches()
        d.ack("a", message)
    assert d.received("a") == [bad, other, *held]


def test_a_smaller_budget_applies_from_the_next_event() -> None:
    d = Driver(QueueConfig("q", partitions=2), GROUP)
    for i in range(200):
        d.publish(None, i % 2)
    d.bind("a", window=1)
    d.answer_fetches()
    assert _buffered(d) > 100
    d.machine.set_buffer_bytes(4096)
    message: Message = next(iter(d.unacked["a"].values())).message
    d.ack("a", message)
    d.answer_fetches()
    # What was buffered stays until sent; no more is read until it drains below the share.
    assert _buffered(d) < 200


def test_a_message_too_big_for_the_room_left_is_read_once_then_when_it_fits() -> None:
    """A stuck partition reads on past its waiting messages; when the next message is
    larger than the room left, reading it again at once cannot help: the machine once
    asked for it again and again, forever (a busy loop of reads in the gateway)."""
    queue = QueueConfig("q", partitions=4, on_dead_letter="park_key")
    d = Driver(queue, GROUP, buffer_bytes=8192, auto_fetch=False)
    bad = d.publish("k", 0)
    held = [d.publish("k", 0) for _ in range(5)]
    big = d.publish("j", 0, properties={"p": "x" * 3000})
    d.bind("a", window=1)
    d.answer_fetches()
    d.unacked["a"].clear()
    d.call(d.machine.reject, "a", [bad.message_id])
    answered = 0
    while d.pending_fetches and answered < 50:
        d.answer()
        answered += 1
    assert not d.pending_fetches, "the partition keeps reading a message it cannot take"
    assert big not in d.received("a")
    # Once the parked messages go, there is room, and it is read and delivered in order.
    d.call(d.machine.release_key, "k")
    for _ in range(len(held) + 1):
        d.answer_fetches()
        d.ack("a", *[x.message for x in d.unacked["a"].values()])
    d.answer_fetches()
    assert [m.seq for m in d.received("a")] == [bad.seq, *(m.seq for m in held), big.seq]
