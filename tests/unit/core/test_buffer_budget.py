"""Buffers bounded in bytes: a group holds about ``buffer_bytes`` of unsent messages in
memory whatever its partition count, and a partition whose buffered messages all wait
reads on past them while the group has room."""

from __future__ import annotations

from core.actions import LARGE_MESSAGE, Fetch, fetched
from core.model import GroupConfig, Message, QueueConfig
from core.partition import buffered_cost
from core.pump import TURN
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
    big = d.publish("j", 0, properties={"p": "x" * 7000})
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


def _publish(d: Driver, partition: int) -> Message:
    """A message of about 1 KiB."""
    return d.publish(None, partition, properties={"p": "x" * 1000})


def _backlog(partitions: int, budget: int, count: int) -> tuple[Driver, list[Message]]:
    """A group with ``count`` messages of about 1 KiB stored, spread over the partitions;
    Fetches are answered by the test."""
    d = Driver(
        QueueConfig("q", partitions=partitions), GROUP, buffer_bytes=budget, auto_fetch=False
    )
    return d, [_publish(d, i % partitions) for i in range(count)]


def _drain(d: Driver, flow: str, partitions: int, budget: int) -> list[Fetch]:
    """Answer the oldest Fetch, one at a time, acking what ``flow`` holds between answers,
    until no read is asked for; the Fetches answered, in order. Throughout, the group keeps
    to its budget (each partition may always take one message)."""
    read: list[Fetch] = []
    cost = max(buffered_cost(m) for stored in d.store.values() for m in stored)
    while d.pending_fetches or d.unacked[flow]:
        assert _buffered(d) * cost <= budget + partitions * cost
        if d.unacked[flow]:
            d.ack(flow, *[x.message for x in d.unacked[flow].values()])
        if d.pending_fetches:
            read.append(next(iter(d.pending_fetches.values())))
            d.answer()
    return read


def test_with_many_partitions_a_read_is_a_turn_of_messages_not_a_sliver_of_the_budget() -> None:
    # 64 partitions share 256 KiB: 4 KiB each, two or three messages of 1 KiB. A page is
    # a turn's worth (TURN messages) instead, and the reads take turns within the budget.
    partitions, budget = 64, 256 * 1024
    d, published = _backlog(partitions, budget, 12_800)
    d.bind("a", window=500)
    read = _drain(d, "a", partitions, budget)
    assert all(d.settled(m.partition, m.seq) for m in published)
    # (Each partition's first read, before the group has seen a message, takes one.)
    pages = [f.limit for f in read if f.after_seq]
    assert min(pages) >= TURN // 2, "pages shrink with the partition count"


def test_partitions_that_find_no_room_read_in_the_order_they_asked() -> None:
    # Room for about three pages at a time: every partition gets its next page before
    # any gets the one after (none waits behind lower-numbered partitions for ever).
    partitions, budget = 8, 320 * 1024
    d, _ = _backlog(partitions, budget, partitions * 640)
    d.bind("a", window=64)
    counts = dict.fromkeys(range(partitions), 0)
    for fetch in _drain(d, "a", partitions, budget):
        counts[fetch.partition] += 1
        ahead = counts[fetch.partition] - min(counts.values())
        assert ahead <= 2, f"partition {fetch.partition} read ahead of its turn"
    assert max(counts.values()) - min(counts.values()) <= 1


def test_a_flow_that_stops_acking_holds_no_more_than_its_partitions_share_of_the_budget() -> None:
    # "a" takes its partitions' pages and never acks: what it holds stays within its two
    # partitions' shares of the budget, and "b" keeps reading its own partitions in pages
    # (it once got a message per read while "a" held the whole budget).
    partitions, budget = 4, 64 * 1024
    d, published = _backlog(partitions, budget, 800)
    d.bind("a", window=1)
    d.bind("b", window=10)
    theirs = {p for p, (_, flow) in d.assignment.items() if flow == "b"}
    assert theirs and len(theirs) < partitions
    # While "a" holds its part and "b" reads its own, the group holds up to twice its
    # budget (docs/operations.md "Limits").
    reads = [f for f in _drain(d, "b", partitions, 2 * budget) if f.partition in theirs]
    wanted = {(m.partition, m.seq) for m in published if m.partition in theirs}
    assert {(m.partition, m.seq) for m in d.received("b")} == wanted
    assert len(reads) <= len(wanted) // 10, f"{len(reads)} reads for {len(wanted)} messages"
    held = sum(p.buffered for p in d.machine.status().partitions if p.partition not in theirs)
    assert held * buffered_cost(published[0]) <= budget // 2 + TURN * buffered_cost(published[0])


def test_a_page_on_its_way_keeps_to_a_budget_made_smaller_meanwhile() -> None:
    # A second group loads while the first one's reads are under way: the gateway's
    # budget is split again, and what those reads bring is cut to the new budget.
    partitions, budget = 4, 64 * 1024
    d, published = _backlog(partitions, budget, 400)
    d.bind("a", window=1)
    assert d.pending_fetches
    d.machine.set_buffer_bytes(budget // 4)
    while d.pending_fetches:
        d.answer()
    cost = buffered_cost(published[0])
    assert _buffered(d) * cost <= budget // 4 + partitions * cost


def test_a_group_reads_one_message_a_partition_until_it_knows_how_large_they_are() -> None:
    # Its first reads used to assume 1 KiB messages: 170 of 256 KiB per partition, 170 MiB
    # read for a budget of 1 MiB (the rest dropped, to be read again).
    budget = 1024 * 1024
    d = Driver(QueueConfig("q", partitions=4), GROUP, buffer_bytes=budget, auto_fetch=False)
    published = [d.publish(f"k{i}", i % 4, payload=b"x" * 256 * 1024) for i in range(200)]
    cost = buffered_cost(published[0])
    d.bind("a", window=10_000)
    while d.pending_fetches:
        reading = sum(f.limit for f in d.pending_fetches.values())
        assert reading * cost <= budget + 4 * cost
        d.answer(len(d.pending_fetches))
        d.ack("a", *[x.message for x in d.unacked["a"].values()])
    assert all(d.settled(m.partition, m.seq) for m in published)


def test_a_backlog_of_large_messages_after_small_ones_is_read_within_what_a_read_reserved() -> None:
    """A group that has seen 1 KiB messages sizes its pages for them; a backlog of 4 MiB
    messages behind them was read whole (60 of them, 240 MiB, for a 2 MiB budget: the
    gateway's peak RSS went 118 -> 360 MB). A page now ends with the large message that
    takes it past what its read reserved, so what a read brings stays within that
    plus one message and the small ones a page may hold; every message is still delivered,
    in order."""
    budget = 2 * 1024 * 1024
    d = Driver(QueueConfig("q"), GROUP, buffer_bytes=budget, auto_fetch=False)
    small = [d.publish("k", 0, payload=b"s" * 1024) for _ in range(3000)]
    d.bind("a", window=2000)
    while d.pending_fetches:
        d.answer()
    assert len(d.unacked["a"]) == 2000  # the window is full, the rest is buffered
    large = [d.publish("k", 0, payload=b"L" * 4 * 1024 * 1024) for _ in range(60)]
    later = [d.publish("k", 0, payload=b"s" * 1024) for _ in range(10)]
    largest_read = 0
    while d.pending_fetches or d.unacked["a"]:
        d.ack("a", *[x.message for x in d.unacked["a"].values()])
        for fetch in list(d.pending_fetches.values()):
            rows = [m for m in d.store[0] if m.seq > fetch.after_seq]
            page = fetched(rows, fetch.limit, fetch.max_bytes)
            read = sum(m.size for m in page)
            biggest = max((m.size for m in page), default=0)
            assert read <= fetch.max_bytes + fetch.limit * LARGE_MESSAGE + biggest
            largest_read = max(largest_read, read)
            d.answer()
    assert largest_read < 3 * buffered_cost(large[0])
    assert [m.seq for m in d.received("a")] == [m.seq for m in [*small, *large, *later]]
