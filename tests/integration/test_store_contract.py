"""The contract MemoryStore (the twin the unit tests of the layers above use) shares with
SqlStore: every test runs against both, the SQL one on SQLite and on PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.actions import (
    DeadLetter,
    DeadLetterKey,
    DeliveryRecord,
    GroupSnapshot,
    KeyParked,
    KeyReleased,
    OffsetUpdate,
    ParkedKey,
    PartitionSnapshot,
    RecordDispatch,
    RetryScheduled,
)
from core.errors import (
    AlreadyExists,
    GroupNotFound,
    InvalidArgument,
    KeygateError,
    MessageTooLarge,
    QueueFull,
    QueueNotFound,
)
from core.model import (
    DEAD_LETTER_REASON,
    ORIGINAL_SEQ,
    DeadLetterReason,
    GroupConfig,
    Message,
    QueueConfig,
    ResetKind,
    ResetPosition,
    StartPosition,
)
from storage import SqlStore, open_store
from storage.interfaces import AdminStore, GroupStore, PublishStore
from storage.memory import MemoryStore
from tests.support.fuzz import fuzz_settings

MessageFactory = Callable[..., Message]

NOW = 1_700_000_000.0
# A page's max_bytes that no test's messages come near.
ROOMY = 1 << 40


class Store(PublishStore, GroupStore, AdminStore, Protocol):
    """What both stores provide."""


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def twin(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    """MemoryStore, then SqlStore on SQLite and on PostgreSQL."""
    if request.param == "memory":
        yield MemoryStore()
        return
    opened = await open_store(request.getfixturevalue(f"{request.param}_url"))
    try:
        yield opened
    finally:
        await opened.close()


def _positions(messages: Sequence[Message]) -> list[tuple[str, int, int]]:
    return [(m.queue, m.partition, m.seq) for m in messages]


async def test_seqs_start_at_one_per_partition_in_append_order(
    twin: Store, make_message: MessageFactory
) -> None:
    await twin.create_queue(QueueConfig("orders", partitions=2))
    first = await twin.append(
        [make_message("orders", 0), make_message("orders", 1), make_message("orders", 0)], now=NOW
    )
    second = await twin.append([make_message("orders", 1)], now=NOW)
    assert _positions(first) == [("orders", 0, 1), ("orders", 1, 1), ("orders", 0, 2)]
    assert _positions(second) == [("orders", 1, 2)]
    assert await twin.head_seqs("orders") == {0: 2, 1: 2}
    assert await twin.read("orders", 0, 0, 10) == [first[0], first[2]]
    assert await twin.read("orders", 0, 1, 10) == [first[2]]
    total = sum(m.size for m in [*first, *second])
    assert await twin.depth("orders") == (4, total)


@pytest.mark.parametrize(
    ("settings", "partition", "error"),
    [
        ({"max_message_size": 10}, 0, MessageTooLarge),
        ({"max_depth_messages": 2}, 0, QueueFull),
        ({"max_depth_bytes": 12}, 0, QueueFull),
        ({}, 5, InvalidArgument),
    ],
)
async def test_an_append_that_breaks_a_limit_stores_none_of_its_messages(
    twin: Store,
    make_message: MessageFactory,
    settings: dict[str, Any],
    partition: int,
    error: type[Exception],
) -> None:
    await twin.create_queue(QueueConfig("orders", **settings))
    small = make_message("orders", 0, b"a")
    await twin.append([small], now=NOW)
    with pytest.raises(error):
        await twin.append(
            [make_message("orders", 0, b"b"), make_message("orders", partition, b"c" * 11)], now=NOW
        )
    assert await twin.depth("orders") == (1, small.size)
    assert await twin.head_seqs("orders") == {0: 1}
    assert [m.seq for m in await twin.append([make_message("orders")], now=NOW)] == [2]


async def test_append_each_stores_or_refuses_each_unit_alone_in_the_order_of_the_calls(
    twin: Store, make_message: MessageFactory
) -> None:
    """Two calls made back to back, before either committed (two lots of one connection):
    each unit is stored or refused alone, and the second call's units come after the
    first's, whatever the first one refused."""
    await twin.create_queue(QueueConfig("orders", max_depth_messages=4, max_message_size=10))
    await twin.create_queue(QueueConfig("audit"))
    a1, a2, b1 = (make_message("orders", payload=p) for p in (b"a1", b"a2", b"b1"))
    too_large = make_message("orders", payload=b"x" * 11)
    both = [make_message("orders", payload=b"b2"), make_message("audit", payload=b"b2")]
    full = [make_message("orders", payload=b"b3"), make_message("audit", payload=b"b3")]
    first = twin.append_each([[a1], [too_large], [a2]], now=NOW)
    second = twin.append_each([[b1], both, full], now=NOW)
    one, two = await first, await second
    assert isinstance(one[1], MessageTooLarge) and isinstance(two[2], QueueFull)
    stored = [unit for unit in [*one, *two] if not isinstance(unit, KeygateError)]
    assert [[m.payload for m in unit] for unit in stored] == [
        [b"a1"],
        [b"a2"],
        [b"b1"],
        [b"b2"] * 2,
    ]
    orders = await twin.read("orders", 0, 0, 10)
    assert [(m.payload, m.seq) for m in orders] == [(b"a1", 1), (b"a2", 2), (b"b1", 3), (b"b2", 4)]
    assert [m.payload for m in await twin.read("audit", 0, 0, 10)] == [b"b2"]  # b3: none of it
    assert await twin.append_each([], now=NOW) == []


async def test_an_append_to_a_missing_queue_stores_nothing(
    twin: Store, make_message: MessageFactory
) -> None:
    await twin.create_queue(QueueConfig("orders"))
    with pytest.raises(QueueNotFound):
        await twin.append([make_message("orders"), make_message("nowhere")], now=NOW)
    assert await twin.depth("orders") == (0, 0)
    with pytest.raises(QueueNotFound):
        twin.queue("nowhere")


async def test_a_dedup_id_seen_within_the_window_returns_the_original(
    twin: Store, make_message: MessageFactory
) -> None:
    await twin.create_queue(QueueConfig("orders", dedup_window=60))
    await twin.create_queue(QueueConfig("plain", dedup_window=0))

    def publish(queue: str, **fields: object) -> Message:
        return make_message(queue, producer="p", dedup_id="d1", publisher="alice", **fields)

    [original] = await twin.append([publish("orders")], now=NOW)
    again = await twin.append([publish("orders"), publish("orders")], now=NOW + 59)
    assert [(m.message_id, m.seq) for m in again] == [(original.message_id, 1)] * 2
    other_user = make_message("orders", producer="p", dedup_id="d1", publisher="bob")
    assert [m.seq for m in await twin.append([other_user], now=NOW)] == [2]
    assert [m.seq for m in await twin.append([publish("orders")], now=NOW + 61)] == [3]
    plain = await twin.append([publish("plain"), publish("plain")], now=NOW)
    assert [m.seq for m in plain] == [1, 2]
    assert await twin.depth("orders") == (3, 3 * original.size)


async def test_commit_listeners_see_each_commits_new_messages_in_order(
    twin: Store, make_message: MessageFactory
) -> None:
    await twin.create_queue(QueueConfig("orders", partitions=2, dedup_window=60))
    seen: list[list[tuple[str, int, int]]] = []
    twin.add_commit_listener(lambda batch: seen.append(_positions(batch)))
    await twin.append([make_message("orders", 1), make_message("orders", 0)], now=NOW)
    duplicate = make_message("orders", producer="p", dedup_id="d")
    await twin.append([duplicate], now=NOW)
    await twin.append([duplicate], now=NOW)
    assert seen == [[("orders", 1, 1), ("orders", 0, 1)], [("orders", 0, 2)]]


async def test_read_for_delivery_reads_each_page_from_its_seq_up_to_its_limit(
    twin: Store, make_message: MessageFactory
) -> None:
    await twin.create_queue(QueueConfig("orders", partitions=3))
    stored = await twin.append([make_message("orders", p % 2) for p in range(8)], now=NOW)
    pages = await twin.read_for_delivery(
        "orders", [(0, 1, 2, ROOMY), (1, 0, 10, ROOMY), (2, 0, 5, ROOMY)]
    )
    assert {p: _positions(found) for p, (found, _) in pages.items()} == {
        0: [("orders", 0, 2), ("orders", 0, 3)],
        1: [("orders", 1, s) for s in (1, 2, 3, 4)],
        2: [],
    }
    assert all(unreadable == frozenset() for _, unreadable in pages.values())
    assert pages[1][0] == [m for m in stored if m.partition == 1]


async def test_a_page_ends_with_the_large_message_that_takes_it_past_its_max_bytes(
    twin: Store, make_message: MessageFactory
) -> None:
    """core.actions.fetched, as every store answers it: up to the limit, ending with the
    large message (over LARGE_MESSAGE bytes) that takes the page's large ones past
    max_bytes."""
    await twin.create_queue(QueueConfig("orders", partitions=2))
    small, large = b"s" * 100, b"L" * 10_000
    payloads = [small, small, small, large, small, large, large, small]
    await twin.append([make_message("orders", 0, payload=p) for p in payloads], now=NOW)
    await twin.append([make_message("orders", 1, payload=p) for p in (large * 2, small)], now=NOW)
    pages = [(0, 0, 100, 15_000), (1, 0, 100, 1_000)]
    found = await twin.read_for_delivery("orders", pages)
    # Partition 0: the second large message makes 20 kB of large ones; partition 1: its
    # first message alone is past max_bytes.
    assert [m.seq for m in found[0][0]] == [1, 2, 3, 4, 5, 6]
    assert [m.seq for m in found[1][0]] == [1]
    found = await twin.read_for_delivery("orders", [(0, 5, 100, 15_000), (1, 0, 1, ROOMY)])
    assert [m.seq for m in found[0][0]] == [6, 7]
    assert [m.seq for m in found[1][0]] == [1]
    everything = await twin.read_for_delivery("orders", [(0, 0, 100, ROOMY)])
    assert [m.payload for m in everything[0][0]] == payloads


async def test_a_read_of_many_pages_answers_each_as_a_read_of_its_partition_would(
    twin: Store, make_message: MessageFactory
) -> None:
    """More pages than one SQLite statement takes (READ_PAGES), some past their partition's
    end, some empty partitions: each page holds what reading its partition alone holds."""
    partitions = 100
    await twin.create_queue(QueueConfig("orders", partitions=partitions))
    await twin.append(
        [make_message("orders", p % 61, payload=bytes([p % 256])) for p in range(300)], now=NOW
    )
    pages = [(p, p % 3, 1 + p % 5, ROOMY) for p in range(partitions)]
    found = await twin.read_for_delivery("orders", pages)
    assert sorted(found) == list(range(partitions))
    for partition, after_seq, limit, _ in pages:
        alone = await twin.read("orders", partition, after_seq, limit)
        assert found[partition] == (alone, frozenset())
    stored = [sum(1 for i in range(300) if i % 61 == p) for p in range(partitions)]
    expected = {p: min(limit, max(0, stored[p] - after)) for p, after, limit, _ in pages}
    assert {p: len(messages) for p, (messages, _) in found.items()} == expected


async def test_read_seqs_reads_the_given_seqs_of_each_partition_that_are_still_stored(
    twin: Store, make_message: MessageFactory
) -> None:
    """Noted scheduled messages come due (core.actions.Fetch ``seqs``): exactly those
    asked, in seq order, none of another partition; a seq no longer stored is absent."""
    await twin.create_queue(QueueConfig("orders", partitions=3))
    stored = await twin.append(
        [make_message("orders", p % 2, payload=bytes([p])) for p in range(10)], now=NOW
    )
    # However many seqs (one statement, whatever the database's parameter limits).
    many = list(range(1, 40_001))
    found = await twin.read_seqs("orders", [(0, [5, 2, 4, 99]), (1, [1]), (2, many)])
    assert {p: _positions(messages) for p, (messages, _) in found.items()} == {
        0: [("orders", 0, 2), ("orders", 0, 4), ("orders", 0, 5)],
        1: [("orders", 1, 1)],
        2: [],
    }
    assert found[1][0] == [stored[1]]
    assert all(unreadable == frozenset() for _, unreadable in found.values())


async def test_a_group_starts_at_the_oldest_message_or_at_the_head(
    twin: Store, make_message: MessageFactory
) -> None:
    await twin.create_queue(QueueConfig("orders", partitions=2))
    await twin.append([make_message("orders", 0), make_message("orders", 0)], now=NOW)
    _, earliest = await twin.create_group(GroupConfig("orders", "e"))
    _, latest = await twin.create_group(GroupConfig("orders", "l", start=StartPosition.LATEST))
    assert earliest == GroupSnapshot(partitions={0: PartitionSnapshot(), 1: PartitionSnapshot()})
    head = PartitionSnapshot(committed_seq=2, dispatched_seq=2)
    assert latest == GroupSnapshot(partitions={0: head, 1: PartitionSnapshot()})


async def test_offsets_dispatch_records_and_parked_keys_round_trip(
    twin: Store, make_message: MessageFactory
) -> None:
    await twin.create_queue(QueueConfig("orders"))
    await twin.append([make_message("orders") for _ in range(6)], now=NOW)
    await twin.create_group(GroupConfig("orders", "g"))
    await twin.record_dispatch(
        "orders", "g", [RecordDispatch(0, 5, ((2, 2, NOW), (4, 3, NOW)), reserved_seq=8)]
    )
    await twin.write_offsets(
        "orders",
        "g",
        [OffsetUpdate(0, 1, ((4, 4),), dispatched_seq=3, reserved_seq=6)],
        retries=[RetryScheduled(0, 3, 2, NOW, due=NOW + 5), RetryScheduled(0, 2, 1, NOW, NOW)],
    )
    parked = ParkedKey(0, "k", NOW, "m-1", "max-deliveries")
    await twin.write_key_changes(
        "orders", "g", [KeyParked(parked), KeyParked(ParkedKey(0, "j", NOW, "m", "r"))]
    )
    await twin.write_key_changes("orders", "g", [KeyReleased(0, "j")])
    snapshot = await twin.load_group("orders", "g")
    assert snapshot == GroupSnapshot(
        partitions={
            0: PartitionSnapshot(
                committed_seq=1,
                acked_above=((4, 4),),
                dispatched_seq=5,
                reserved_seq=6,
                deliveries=(DeliveryRecord(2, 2, NOW), DeliveryRecord(3, 2, NOW)),
            )
        },
        parked=(parked,),
    )


async def test_dead_letters_go_to_the_dlq_with_the_offsets_and_key_moves(
    twin: Store, make_message: MessageFactory
) -> None:
    await twin.create_queue(QueueConfig("orders"))
    stored = await twin.append([make_message("orders", key=k) for k in "abab"], now=NOW)
    await twin.create_group(GroupConfig("orders", "g"))
    seen: list[list[tuple[str, int, int]]] = []
    twin.add_commit_listener(lambda batch: seen.append(_positions(batch)))
    letter = DeadLetter(stored[0], DeadLetterReason.MAX_DELIVERIES, 3, NOW)
    moved = await twin.dead_letter(
        "orders",
        "g",
        [letter],
        [OffsetUpdate(0, 1)],
        now=NOW + 1,
        moves=[DeadLetterKey(0, "a", 1)],
    )
    assert moved == [[3]]
    assert seen == [[("orders.dlq", 0, 1), ("orders.dlq", 0, 2)]]
    copies = await twin.read("orders.dlq", 0, 0, 10)
    assert [(m.message_id, m.properties[ORIGINAL_SEQ]) for m in copies] == [
        (stored[0].message_id, 1),
        (stored[2].message_id, 3),
    ]
    assert copies[1].properties[DEAD_LETTER_REASON] == DeadLetterReason.KEY_DEAD_LETTERED.value
    snapshot = await twin.load_group("orders", "g")
    assert (snapshot.partitions[0].committed_seq, snapshot.partitions[0].acked_above) == (
        1,
        ((3, 3),),
    )
    assert await twin.depth("orders.dlq") == (2, sum(m.size for m in copies))


async def test_queue_settings_and_subscriptions_change_but_not_the_partition_count(
    twin: Store,
) -> None:
    await twin.create_queue(QueueConfig("orders", partitions=2, dead_letter_queue=""))
    assert [q.name for q in await twin.list_queues()] == ["orders"]
    with pytest.raises(AlreadyExists):
        await twin.create_queue(QueueConfig("orders", partitions=2))
    with pytest.raises(AlreadyExists):
        await twin.create_queue(QueueConfig("orders", partitions=3), exist_ok=True)
    altered = await twin.alter_queue("orders", window=7, dead_letter_queue="dead")
    assert (altered.window, altered.dlq_name) == (7, "dead")
    assert await twin.get_queue("dead") == QueueConfig("dead", dead_letter_queue="")
    for bad in ({"partitions": 3}, {"nonsense": 1}):
        with pytest.raises(InvalidArgument):
            await twin.alter_queue("orders", **bad)
    await twin.add_subscription("orders", "b/#")
    await twin.add_subscription("orders", "a/+")
    await twin.add_subscription("orders", "b/#")
    await twin.remove_subscription("orders", "c")
    assert (await twin.get_queue("orders")).subscriptions == ("a/+", "b/#")
    await twin.remove_subscription("orders", "b/#")
    assert twin.queue("orders") == await twin.get_queue("orders")
    assert twin.queue("orders").subscriptions == ("a/+",)
    with pytest.raises(InvalidArgument):
        await twin.add_subscription("orders", "a/#/b")
    with pytest.raises(QueueNotFound):
        await twin.alter_queue("nowhere", window=1)


async def test_deleting_a_queue_deletes_its_messages_and_groups_but_keeps_its_dlq(
    twin: Store, make_message: MessageFactory
) -> None:
    await twin.create_queue(QueueConfig("orders", partitions=2))
    await twin.append([make_message("orders", p % 2) for p in range(3)], now=NOW)
    await twin.create_group(GroupConfig("orders", "g"))
    assert await twin.delete_queue("orders") == 3
    with pytest.raises(QueueNotFound):
        await twin.get_queue("orders")
    assert [q.name for q in await twin.list_queues()] == ["orders.dlq"]
    assert await twin.list_groups() == []
    await twin.create_queue(QueueConfig("orders", partitions=2))
    assert [m.seq for m in await twin.append([make_message("orders")], now=NOW)] == [1]
    with pytest.raises(QueueNotFound):
        await twin.delete_queue("orders.nothing")


async def test_a_purge_deletes_every_message_and_moves_every_group_to_the_head(
    twin: Store, make_message: MessageFactory
) -> None:
    await twin.create_queue(QueueConfig("orders", partitions=2))
    await twin.append([make_message("orders", p % 2) for p in range(5)], now=NOW)
    await twin.create_group(GroupConfig("orders", "g"))
    await twin.record_dispatch("orders", "g", [RecordDispatch(0, 2, ((1, 2, NOW),))])
    assert await twin.purge_queue("orders") == 5
    assert await twin.depth("orders") == (0, 0)
    snapshot = await twin.load_group("orders", "g")
    assert snapshot.partitions == {
        0: PartitionSnapshot(3, (), 3, 3),
        1: PartitionSnapshot(2, (), 2, 2),
    }
    assert [m.seq for m in await twin.append([make_message("orders")], now=NOW)] == [4]


async def test_a_group_reset_moves_it_to_a_position_and_forgets_its_acks(
    twin: Store, make_message: MessageFactory
) -> None:
    await twin.create_queue(QueueConfig("orders", partitions=2))
    for t in range(4):
        await twin.append([make_message("orders", 0, publish_time=NOW + t)], now=NOW)
    await twin.create_group(GroupConfig("orders", "g", start=StartPosition.LATEST))
    await twin.write_offsets("orders", "g", [OffsetUpdate(0, 4, (), 4, 4)])
    earliest = await twin.reset_group("orders", "g", ResetPosition(ResetKind.EARLIEST))
    assert earliest == {0: 0, 1: 0}
    at_time = await twin.reset_group("orders", "g", ResetPosition(ResetKind.TIME, time=NOW + 2))
    assert at_time == {0: 2, 1: 0}
    at_seq = await twin.reset_group("orders", "g", ResetPosition(ResetKind.SEQ, seqs={0: 9}))
    assert at_seq == {0: 4}
    assert await twin.reset_group("orders", "g", ResetPosition(ResetKind.LATEST)) == at_seq | {1: 0}
    assert (await twin.load_group("orders", "g")).partitions[0] == PartitionSnapshot(4, (), 4, 4)
    with pytest.raises(InvalidArgument):
        await twin.reset_group("orders", "g", ResetPosition(ResetKind.SEQ, seqs={2: 1}))
    with pytest.raises(GroupNotFound):
        await twin.reset_group("orders", "h", ResetPosition(ResetKind.LATEST))


async def test_groups_are_listed_by_queue_and_name_until_deleted(twin: Store) -> None:
    await twin.create_queue(QueueConfig("b"))
    await twin.create_queue(QueueConfig("a"))
    for queue, name in [("b", "x"), ("a", "y"), ("a", "x")]:
        await twin.create_group(GroupConfig(queue, name))
    with pytest.raises(AlreadyExists):
        await twin.create_group(GroupConfig("a", "x"), exist_ok=False)
    assert [(g.queue, g.name) for g in await twin.list_groups()] == [
        ("a", "x"),
        ("a", "y"),
        ("b", "x"),
    ]
    assert [g.name for g in await twin.list_groups("a")] == ["x", "y"]
    assert await twin.get_group("b", "x") == GroupConfig("b", "x")
    await twin.delete_group("a", "x")
    with pytest.raises(GroupNotFound):
        await twin.get_group("a", "x")
    with pytest.raises(GroupNotFound):
        await twin.delete_group("a", "x")
    with pytest.raises(QueueNotFound):
        await twin.create_group(GroupConfig("c", "x"))


# One append: (partition, dedup id or None, payload bytes) per message; partition 2 does
# not exist, 31 bytes are too many, and the queue holds at most 8 messages.
_CALLS = st.lists(
    st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from([None, "a", "b"]), st.integers(0, 31)),
        min_size=1,
        max_size=4,
    ),
    min_size=1,
    max_size=8,
)


@given(calls=_CALLS)
@fuzz_settings(15)
async def test_any_appends_end_the_same_in_memory_as_in_sql(
    store: SqlStore, calls: list[list[tuple[int, str | None, int]]]
) -> None:
    """Outcome by outcome (stored positions or the error), then what each store holds."""
    queue = QueueConfig(
        f"q{uuid.uuid4().hex}",
        partitions=2,
        max_message_size=30,
        max_depth_messages=8,
        dedup_window=5,
    )
    seen: list[list[object]] = []
    for twin in (store, MemoryStore()):
        await twin.create_queue(queue)
        outcomes: list[object] = []
        for i, call in enumerate(calls):
            batch = [
                Message(
                    f"{queue.name}-{i}-{j}",
                    queue.name,
                    p,
                    0,
                    None,
                    b"x" * size,
                    producer="p" if dedup else None,
                    dedup_id=dedup,
                )
                for j, (p, dedup, size) in enumerate(call)
            ]
            try:
                stored = await twin.append(batch, now=NOW + 2 * i)  # dedup ids expire
            except KeygateError as e:
                outcomes.append(type(e).__name__)
            else:
                outcomes.append([(m.message_id, m.partition, m.seq) for m in stored])
        outcomes.append(await twin.depth(queue.name))
        for p in (0, 1):
            outcomes.append(await twin.read(queue.name, p, 0, 100))
        seen.append(outcomes)
    assert seen[0] == seen[1]
