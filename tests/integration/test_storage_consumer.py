"""Consumer state in SqlStore: dispatch records, offsets, crash recovery, dead letters,
retention, flows, assignments, the inspection views and leases (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from core.actions import (
    AssignmentChanged,
    DeadLetter,
    DeliveryRecord,
    FlowChanged,
    OffsetUpdate,
    PartitionSnapshot,
    RecordDispatch,
)
from core.errors import GroupLeased, GroupNotFound, QueueNotFound, StorageError
from core.model import (
    DEAD_LETTER_REASON,
    DELIVERY_COUNT,
    FIRST_DELIVERY_TIME,
    ORIGINAL_GROUP,
    ORIGINAL_PARTITION,
    ORIGINAL_QUEUE,
    ORIGINAL_SEQ,
    DeadLetterReason,
    FlowState,
    GroupConfig,
    Message,
    PartitionState,
    QueueConfig,
)
from storage import SqlStore, open_store
from storage import retention as storage_retention
from storage.retention import RETENTION_CHUNK, RIDE_CHUNK, Rider
from storage.schema import kg_partitions
from storage.statements import advance_dispatched
from tests.support.wait import eventually

NOW = 1_700_000_000.0
MessageFactory = Callable[..., Message]


async def _queue_with_messages(
    store: SqlStore, make_message: MessageFactory, count: int, **settings: Any
) -> list[Message]:
    await store.create_queue(QueueConfig("orders", partitions=4, **settings))
    await store.create_group(GroupConfig("orders", "billing"))
    return await store.append([make_message("orders", 3) for _ in range(count)], now=NOW)


async def _rows(store: SqlStore, query: str, **params: Any) -> list[dict[str, Any]]:
    async with store.engine.connect() as conn:
        result = await conn.execute(sa.text(query), params)
        return [dict(row) for row in result.mappings()]


async def test_dispatch_records_and_offsets_are_recovered_after_a_crash(
    db_url: str, make_message: MessageFactory
) -> None:
    crashed = await open_store(db_url)
    await _queue_with_messages(crashed, make_message, 10)
    await crashed.record_dispatch("orders", "billing", [RecordDispatch(3, 8)])
    await crashed.record_dispatch(
        "orders", "billing", [RecordDispatch(3, 6, redeliveries=((3, 2, NOW), (4, 5, NOW + 1)))]
    )
    await crashed.write_offsets("orders", "billing", [OffsetUpdate(3, 2, ((4, 4), (6, 6)))])
    # Acks of seqs 7 and 8 were still in the broker's flush buffer: the gateway dies here.
    recovered = await open_store(db_url)
    try:
        snapshot = await recovered.load_group("orders", "billing")
        assert snapshot.partitions[3] == PartitionSnapshot(
            committed_seq=2,
            acked_above=((4, 4), (6, 6)),
            dispatched_seq=8,
            deliveries=(DeliveryRecord(3, 2, NOW),),
        )
        assert snapshot.partitions[0] == PartitionSnapshot()
    finally:
        await recovered.close()
        await crashed.close()


async def test_a_dispatch_reservation_survives_a_crash_and_ends_at_the_head_at_start(
    db_url: str, make_message: MessageFactory
) -> None:
    crashed = await open_store(db_url)
    await _queue_with_messages(crashed, make_message, 10)
    await crashed.record_dispatch("orders", "billing", [RecordDispatch(3, 2, reserved_seq=40)])
    # The ack flush carries the position sent since, without a record of its own.
    await crashed.write_offsets("orders", "billing", [OffsetUpdate(3, 1, (), 5, 40)])
    recovered = await open_store(db_url)
    try:
        mid_crash = (await recovered.load_group("orders", "billing")).partitions[3]
        assert (mid_crash.dispatched_seq, mid_crash.reserved_seq) == (5, 40)
        await recovered.forget_consumers("next-run")
        at_start = (await recovered.load_group("orders", "billing")).partitions[3]
        assert (at_start.dispatched_seq, at_start.reserved_seq) == (5, 10)
    finally:
        await recovered.close()
        await crashed.close()


async def test_an_ack_flush_shrinks_the_reservation_but_never_the_dispatched_seq(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await _queue_with_messages(store, make_message, 10)
    await store.record_dispatch("orders", "billing", [RecordDispatch(3, 6, reserved_seq=30)])
    await store.write_offsets("orders", "billing", [OffsetUpdate(3, 1, (), 4, 6)])
    snapshot = (await store.load_group("orders", "billing")).partitions[3]
    assert (snapshot.dispatched_seq, snapshot.reserved_seq) == (6, 6)


async def test_settling_forgets_delivery_records(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await _queue_with_messages(store, make_message, 10)
    redeliveries = tuple((seq, 2, NOW) for seq in range(1, 9))
    await store.record_dispatch("orders", "billing", [RecordDispatch(3, 8, redeliveries)])
    await store.write_offsets("orders", "billing", [OffsetUpdate(3, 3, ((5, 6),))])
    snapshot = await store.load_group("orders", "billing")
    assert [d.seq for d in snapshot.partitions[3].deliveries] == [4, 7, 8]
    with pytest.raises(GroupNotFound):
        await store.load_group("orders", "nobody")


async def test_dispatch_records_of_one_transaction_each_move_their_own_partition_up(
    store: SqlStore, make_message: MessageFactory
) -> None:
    """Records group-committed together are one statement (advance_dispatched): every
    (queue, group, partition) named moves to the highest position recorded for it, never
    back, and nothing else moves."""
    await _queue_with_messages(store, make_message, 10)
    await store.create_group(GroupConfig("orders", "audit"))
    await store.record_dispatch("orders", "billing", [RecordDispatch(0, 6, reserved_seq=9)])
    together = [
        ("orders", "billing", 0, 4, 12),
        ("orders", "billing", 0, 5, 7),
        ("orders", "billing", 3, 2, 2),
        ("orders", "audit", 3, 8, 20),
    ]
    await store.write(functools.partial(advance_dispatched, advances=together, now=NOW))
    positions = {
        (group, p): (s.dispatched_seq, s.reserved_seq)
        for group in ("billing", "audit")
        for p, s in (await store.load_group("orders", group)).partitions.items()
        if s.dispatched_seq or s.reserved_seq
    }
    assert positions == {
        ("billing", 0): (6, 12),
        ("billing", 3): (2, 2),
        ("audit", 3): (8, 20),
    }


async def test_one_flush_writes_every_partition_it_names_and_nothing_else(
    store: SqlStore, make_message: MessageFactory
) -> None:
    """An offset flush is one statement however many partitions it carries: each row
    lands on its own partition of its own group; dispatched_seq never moves back, a
    reservation is written as given, and records of other partitions and groups stay."""
    await _queue_with_messages(store, make_message, 10)
    await store.create_group(GroupConfig("orders", "audit"))
    kept = tuple((seq, 2, NOW) for seq in range(1, 9))
    for group in ("billing", "audit"):
        await store.record_dispatch("orders", group, [RecordDispatch(3, 8, kept, 9)])
    await store.write_offsets(
        "orders",
        "billing",
        [
            OffsetUpdate(0, 0, (), 0, 4),
            OffsetUpdate(2, 0, (), 0, 0),
            OffsetUpdate(3, 2, ((4, 4), (6, 7)), 5, 6),  # dispatched 5 < 8: kept at 8
        ],
    )
    billing = (await store.load_group("orders", "billing")).partitions
    assert billing[0] == PartitionSnapshot(0, (), 0, 4)
    assert billing[1] == billing[2] == PartitionSnapshot()
    assert billing[3].committed_seq == 2 and billing[3].acked_above == ((4, 4), (6, 7))
    assert (billing[3].dispatched_seq, billing[3].reserved_seq) == (8, 6)
    assert [d.seq for d in billing[3].deliveries] == [3, 5, 8]
    audit = (await store.load_group("orders", "audit")).partitions[3]
    assert audit.committed_seq == 0 and [d.seq for d in audit.deliveries] == list(range(1, 9))


async def test_dead_letter_appends_a_copy_and_settles_in_one_transaction(
    store: SqlStore, make_message: MessageFactory
) -> None:
    [message, *_] = await _queue_with_messages(store, make_message, 3)
    heard: list[Message] = []
    store.add_commit_listener(heard.extend)
    letter = DeadLetter(message, DeadLetterReason.MAX_DELIVERIES, 16, NOW - 60)
    await store.dead_letter("orders", "billing", [letter], [OffsetUpdate(3, 1)], now=NOW)
    [copy] = await store.read("orders.dlq", 0, 0, 10)
    assert heard == [copy]
    assert copy.payload == message.payload and copy.seq == 1
    assert {k: v for k, v in copy.properties.items() if k.startswith("x-")} == {
        DEAD_LETTER_REASON: "max-deliveries",
        ORIGINAL_QUEUE: "orders",
        ORIGINAL_GROUP: "billing",
        ORIGINAL_PARTITION: 3,
        ORIGINAL_SEQ: 1,
        DELIVERY_COUNT: 16,
        FIRST_DELIVERY_TIME: NOW - 60,
    }
    assert (await store.load_group("orders", "billing")).partitions[3].committed_seq == 1
    # A head that went back makes the copy's INSERT hit seq 1 again: the offset written in
    # the same transaction must not be written either.
    async with store.engine.begin() as conn:
        p = kg_partitions
        await conn.execute(sa.update(p).where(p.c.queue == "orders.dlq").values(head_seq=0))
    with pytest.raises(StorageError):
        await store.dead_letter("orders", "billing", [letter], [OffsetUpdate(3, 2)], now=NOW)
    assert (await store.load_group("orders", "billing")).partitions[3].committed_seq == 1
    assert await store.depth("orders.dlq") == (1, copy.size)  # payload and properties


async def test_dead_letters_without_a_dlq_are_settled_and_dropped(
    store: SqlStore, make_message: MessageFactory
) -> None:
    [message] = await _queue_with_messages(store, make_message, 1, dead_letter_queue="")
    letter = DeadLetter(message, DeadLetterReason.REJECTED, 1, None)
    await store.dead_letter("orders", "billing", [letter], [OffsetUpdate(3, 1)], now=NOW)
    assert (await store.load_group("orders", "billing")).partitions[3].committed_seq == 1
    assert [q.name for q in await store.list_queues()] == ["orders"]


async def test_retention_deletes_what_every_group_settled(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await _queue_with_messages(store, make_message, 6)
    await store.create_group(GroupConfig("orders", "audit"))
    await store.write_offsets("orders", "billing", [OffsetUpdate(3, 5)])
    await store.write_offsets("orders", "audit", [OffsetUpdate(3, 2, ((4, 6),))])
    assert await store.retention(now=NOW) == 2
    assert [m.seq for m in await store.read("orders", 3, 0, 10)] == [3, 4, 5, 6]
    assert await store.depth("orders") == (4, 4 * len(b"payload"))
    assert await store.retention(now=NOW) == 0


async def test_one_retention_chunk_deletes_each_partition_of_each_queue_up_to_its_own_point(
    store: SqlStore, make_message: MessageFactory
) -> None:
    for queue in ("orders", "invoices"):
        await store.create_queue(QueueConfig(queue, partitions=3))
        await store.create_group(GroupConfig(queue, "billing"))
        await store.append([make_message(queue, i % 3) for i in range(18)], now=NOW)
    await store.write_offsets("orders", "billing", [OffsetUpdate(0, 2), OffsetUpdate(1, 5)])
    await store.write_offsets("invoices", "billing", [OffsetUpdate(2, 6)])
    assert await store.retention(now=NOW) == 13
    left = {
        (queue, p): [m.seq for m in await store.read(queue, p, 0, 10)]
        for queue in ("orders", "invoices")
        for p in range(3)
    }
    assert left == {
        ("orders", 0): [3, 4, 5, 6],
        ("orders", 1): [6],
        ("orders", 2): [1, 2, 3, 4, 5, 6],
        ("invoices", 0): [1, 2, 3, 4, 5, 6],
        ("invoices", 1): [1, 2, 3, 4, 5, 6],
        ("invoices", 2): [],
    }
    assert await store.depth("orders") == (11, 11 * len(b"payload"))
    assert await store.depth("invoices") == (12, 12 * len(b"payload"))


async def test_retention_of_a_large_backlog_runs_in_chunks_and_deletes_it_all(
    store: SqlStore, make_message: MessageFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage_retention, "RETENTION_CHUNK", 7)
    await _queue_with_messages(store, make_message, 50)
    await store.write_offsets("orders", "billing", [OffsetUpdate(3, 45)])
    assert await store.retention(now=NOW) == 45
    assert [m.seq for m in await store.read("orders", 3, 0, 100)] == [46, 47, 48, 49, 50]
    assert await store.depth("orders") == (5, 5 * len(b"payload"))
    await store.write_offsets("orders", "billing", [OffsetUpdate(3, 50)])
    assert await store.retention(now=NOW) == 5
    assert await store.depth("orders") == (0, 0)


async def _settled_backlog(store: SqlStore, make_message: MessageFactory) -> None:
    """16 partitions of 20 messages, all settled by the one group."""
    await store.create_queue(QueueConfig("orders", partitions=16))
    await store.create_group(GroupConfig("orders", "billing"))
    await store.append([make_message("orders", i % 16) for i in range(320)], now=NOW)
    await store.write_offsets("orders", "billing", [OffsetUpdate(p, 20) for p in range(16)])


async def test_paced_retention_deletes_the_oldest_of_every_partition_a_chunk_at_a_time(
    store: SqlStore, make_message: MessageFactory
) -> None:
    """Publishes share the writer with retention: a paced run deletes a chunk, the oldest
    messages of every partition, then pauses, rather than taking the writer for the whole
    backlog at once. (On SQLite, with no publish to ride in, the chunk goes alone.)"""
    chunk = RETENTION_CHUNK if store.riders is None else RIDE_CHUNK
    await _settled_backlog(store, make_message)
    # Pauses of over 30 s: the test sees one chunk, however slow the machine.
    run = asyncio.create_task(store.retention(now=NOW, spread=300.0))
    try:

        async def started() -> bool:
            return (await store.depth("orders"))[0] < 320

        await eventually(started)
        assert await store.depth("orders") == (320 - chunk, (320 - chunk) * len(b"payload"))
        first = [(await store.read("orders", p, 0, 1))[0].seq for p in range(16)]
        assert first == [chunk // 16 + 1] * 16
        assert not run.done()
        # The writer is free between chunks: a publish meanwhile commits at once.
        await store.append([make_message("orders", 0)], now=NOW)
    finally:
        run.cancel()
    assert await store.retention(now=NOW) == 320 - chunk


async def test_on_sqlite_a_paced_chunk_rides_in_the_next_append_transaction(
    store: SqlStore, make_message: MessageFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deletes cost publishes a little SQL in a commit they make anyway, instead of a
    wait behind a transaction of their own."""
    if store.riders is None:
        pytest.skip("PostgreSQL appends are one pipelined round trip: chunks go alone")
    monkeypatch.setattr(storage_retention, "RIDE_WAIT", 60.0)  # only a ride can delete
    await _settled_backlog(store, make_message)
    # Pauses of over 30 s: the test sees one chunk, however slow the machine.
    run = asyncio.create_task(store.retention(now=NOW, spread=300.0))
    try:
        await eventually(lambda: len(store.riders or ()) == 1)
        assert await store.depth("orders") == (320, 320 * len(b"payload"))
        (stored,) = await store.append([make_message("orders", 5)], now=NOW)
        assert stored.seq == 21
        # Committed with the append: the two oldest of every partition are gone.
        assert len(store.riders) == 0
        assert [(await store.read("orders", p, 0, 1))[0].seq for p in (0, 15)] == [3, 3]

        async def counted() -> bool:
            return await store.depth("orders") == (289, 289 * len(b"payload"))

        await eventually(counted)
    finally:
        run.cancel()


async def test_a_chunk_whose_delete_fails_does_not_fail_the_publish_it_rides_with(
    store: SqlStore, make_message: MessageFactory
) -> None:
    if store.riders is None:
        pytest.skip("PostgreSQL appends are one pipelined round trip: chunks go alone")
    await store.create_queue(QueueConfig("orders", partitions=8))
    await store.append([make_message("orders", 7)], now=NOW)
    async with store.engine.begin() as conn:  # the database refuses to delete from 7
        await conn.execute(
            sa.text(
                'CREATE TRIGGER keep_seven BEFORE DELETE ON kg_messages WHEN old."partition" = 7'
                " BEGIN SELECT RAISE(ABORT, 'kept'); END"
            )
        )
    broken = Rider([("orders", 7, 0, 1)], asyncio.get_running_loop().create_future())
    store.riders.wait(broken)
    (stored,) = await store.append([make_message("orders")], now=NOW)
    assert stored.seq == 1
    assert [m.seq for m in await store.read("orders", 0, 0, 10)] == [1]
    with pytest.raises(StorageError):
        broken.done.result()  # its run writes it alone, and fails there on its own
    assert len(store.riders) == 0
    assert [m.seq for m in await store.read("orders", 7, 0, 10)] == [1]


async def test_retention_finds_each_partitions_span_through_the_key_index(
    store: SqlStore,
) -> None:
    """A chunk's spans are one JSON document joined to kg_messages: each span must be a
    seek in the key index, not a scan of the table (it runs on the writer's path)."""
    spans = '[{"queue": "orders", "partition": 3, "after": 0, "upto": 9}]'
    async with store.transaction() as conn:
        if conn.dialect.name == "postgresql":
            await conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
            explain, index = "EXPLAIN", "pkey"
        else:
            explain, index = "EXPLAIN QUERY PLAN", "partition=? AND seq>? AND seq<?"
        delete = storage_retention._DELETE[conn.dialect.name]
        statement = str(delete).replace(":spans", f"'{spans}'")
        plan = await conn.exec_driver_sql(f"{explain} {statement}")
        text = "\n".join(str(row[-1]) for row in plan)
    assert index in text, text
    assert "SCAN kg_messages" not in text and "Seq Scan on kg_messages" not in text, text


async def test_a_paced_retention_run_ends_having_deleted_everything_settled(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await _queue_with_messages(store, make_message, 200)
    await store.write_offsets("orders", "billing", [OffsetUpdate(3, 200)])
    assert await store.retention(now=NOW, spread=0.2) == 200
    assert await store.depth("orders") == (0, 0)


async def test_a_queue_with_retention_keeps_settled_messages_for_the_period(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await store.create_queue(QueueConfig("orders", partitions=4, retention=60))
    await store.create_queue(QueueConfig("audit"))  # no retention period: deleted at once
    for queue in ("orders", "audit"):
        await store.create_group(GroupConfig(queue, "billing"))
    early = [make_message("orders", 3, publish_time=NOW) for _ in range(3)]
    late = [make_message("orders", 3, publish_time=NOW + 10) for _ in range(3)]
    other = [make_message("orders", 1, publish_time=NOW + 20) for _ in range(2)]
    await store.append([*early, *late, *other, make_message("audit")], now=NOW)
    await store.write_offsets("orders", "billing", [OffsetUpdate(3, 5), OffsetUpdate(1, 2)])
    await store.write_offsets("audit", "billing", [OffsetUpdate(0, 1)])
    assert await store.retention(now=NOW + 30) == 1  # orders: settled, but younger than 60 s
    assert await store.retention(now=NOW + 65) == 3  # seqs 1-3 of 3: settled and old enough
    assert await store.retention(now=NOW + 75) == 2  # seqs 4-5; 6 is not settled
    assert [m.seq for m in await store.read("orders", 3, 0, 10)] == [6]
    assert [m.seq for m in await store.read("orders", 1, 0, 10)] == [1, 2]
    assert await store.retention(now=NOW + 85) == 2  # partition 1's, 60 s after their publish


async def test_a_queue_without_groups_keeps_messages_until_they_expire(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await store.create_queue(QueueConfig("events"))
    await store.append(
        [make_message("events"), make_message("events", expire_at=NOW + 10)], now=NOW
    )
    expired: list[tuple[str, int, bool]] = []
    assert await store.retention(now=NOW + 5, on_expired=lambda *a: expired.append(a)) == 0
    assert expired == []
    assert await store.retention(now=NOW + 10, on_expired=lambda *a: expired.append(a)) == 1
    assert expired == [("events", 1, False)]  # dropped: the metrics count it
    assert [m.seq for m in await store.read("events", 0, 0, 10)] == [1]


async def test_a_queue_without_groups_dead_letters_what_expires_when_it_asks_for_it(
    store: SqlStore, make_message: MessageFactory
) -> None:
    """DESIGN.md §4: expired messages are dead-lettered if the queue asks for it — also
    before any group exists (the sweep used to delete them without a trace)."""
    await store.create_queue(QueueConfig("events", partitions=2, dead_letter_expired=True))
    await store.append(
        [
            make_message("events", 1, payload=b"late", expire_at=NOW + 10, properties={"n": 1}),
            make_message("events", 0, payload=b"kept"),
        ],
        now=NOW,
    )
    expired: list[tuple[str, int, bool]] = []
    assert await store.retention(now=NOW + 10, on_expired=lambda *a: expired.append(a)) == 1
    assert expired == [("events", 1, True)]
    [letter] = await store.read("events.dlq", 0, 0, 10)
    assert letter.payload == b"late"
    assert letter.properties["n"] == 1
    assert letter.properties[DEAD_LETTER_REASON] == "expired"
    assert letter.properties[ORIGINAL_QUEUE] == "events"
    assert letter.properties[ORIGINAL_PARTITION] == 1
    assert ORIGINAL_GROUP not in letter.properties  # there was none
    assert letter.expire_at is None
    assert await store.depth("events") == (1, (await store.read("events", 0, 0, 1))[0].size)
    assert (await store.depth("events.dlq"))[0] == 1


async def test_the_expiry_sweep_deletes_more_than_one_chunk(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await store.create_queue(QueueConfig("events", partitions=3))
    count = 2 * RETENTION_CHUNK + 7
    await store.append(
        [make_message("events", i % 3, expire_at=NOW + i % 5) for i in range(count)], now=NOW
    )
    assert await store.retention(now=NOW + 10) == count
    assert await store.depth("events") == (0, 0)


async def test_purge_moves_every_group_to_the_head(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await _queue_with_messages(store, make_message, 4)
    await store.record_dispatch("orders", "billing", [RecordDispatch(3, 4, ((2, 2, NOW),))])
    assert await store.purge_queue("orders") == 4
    assert (await store.load_group("orders", "billing")).partitions[3] == PartitionSnapshot(
        committed_seq=4, dispatched_seq=4, reserved_seq=4
    )
    assert await store.depth("orders") == (0, 0)


async def test_views_show_owner_lag_backlog_and_dead_letters(
    store: SqlStore, make_message: MessageFactory
) -> None:
    [first, *_] = await _queue_with_messages(store, make_message, 10)
    await store.write_flows(
        "orders", "billing", [FlowChanged("f1", "worker-1", FlowState.RUNNING, 100)], now=NOW
    )
    await store.write_assignments(
        "orders", "billing", [AssignmentChanged(3, PartitionState.READY, "f1")], now=NOW
    )
    await store.record_dispatch("orders", "billing", [RecordDispatch(3, 7)])
    await store.write_offsets("orders", "billing", [OffsetUpdate(3, 2, ((4, 5),))])
    letter = DeadLetter(first, DeadLetterReason.REJECTED, 1, NOW)
    await store.dead_letter("orders", "billing", [letter], [], now=NOW)
    await store.update_flow_pending({"f1": 3}, now=NOW + 1)
    [status] = await _rows(
        store,
        "SELECT s.owner_client, s.lag, s.backlog, s.in_flight, s.state, f.pending "
        "FROM kg_partition_status s LEFT JOIN kg_flows f ON f.flow_id = s.owner_flow "
        "WHERE s.queue = :q AND s.group_name = :g AND s.partition = :p",
        q="orders",
        g="billing",
        p=3,
    )
    assert status == {
        "owner_client": "worker-1",
        "lag": 6,
        "backlog": 3,
        "in_flight": 3,
        "state": "ready",
        "pending": 3,
    }
    [lag] = await _rows(store, "SELECT partitions, lag, in_flight FROM kg_group_lag")
    assert lag == {"partitions": 4, "lag": 6, "in_flight": 3}
    [stats] = await _rows(store, "SELECT * FROM kg_queue_stats WHERE queue = 'orders'")
    assert stats == {
        "queue": "orders",
        "partitions": 4,
        "depth": 10,
        "bytes": 10 * len(b"payload"),
        "in_flight": 3,
        "dead_letters": 1,
    }
    assert await store.queue_stats("orders") == {
        "depth": 10,
        "bytes": 10 * len(b"payload"),
        "in_flight": 3,
        "dead_letters": 1,
    }
    rows = await store.partition_status("orders")
    assert [(r["group_name"], r["partition"], r["lag"]) for r in rows] == [
        ("billing", 0, 0),
        ("billing", 1, 0),
        ("billing", 2, 0),
        ("billing", 3, 6),
    ]
    [group] = await store.group_lag("orders")
    assert (group["group_name"], group["lag"], group["backlog"]) == ("billing", 6, 3)
    with pytest.raises(QueueNotFound):
        await store.queue_stats("nowhere")


async def test_exited_flows_are_removed(store: SqlStore) -> None:
    await store.create_queue(QueueConfig("orders"))
    flow = FlowChanged("f1", "worker-1", FlowState.RUNNING, 10)
    await store.write_flows("orders", "g", [flow], now=NOW)
    await store.write_flows(
        "orders", "g", [FlowChanged("f1", "worker-1", FlowState.LEAVING, 20)], now=NOW + 1
    )
    [row] = await _rows(store, "SELECT state, window_size, bound_at, last_seen FROM kg_flows")
    assert row == {"state": "leaving", "window_size": 20, "bound_at": NOW, "last_seen": NOW + 1}
    await store.write_flows("orders", "g", [FlowChanged("f1", "w", FlowState.EXITED, 20)], now=NOW)
    assert await _rows(store, "SELECT * FROM kg_flows") == []


async def test_a_spark_lease_refuses_native_consumers_until_it_expires(store: SqlStore) -> None:
    await store.create_queue(QueueConfig("orders"))
    await store.create_group(GroupConfig("orders", "etl"))
    await store.acquire_group_lease("orders", "etl", "spark", "job-1", ttl=30, now=NOW)
    await store.acquire_group_lease("orders", "etl", "spark", "job-1", ttl=30, now=NOW + 20)
    with pytest.raises(GroupLeased):
        await store.acquire_group_lease("orders", "etl", "native", "gw", ttl=30, now=NOW + 49)
    await store.acquire_group_lease("orders", "etl", "native", "gw", ttl=30, now=NOW + 50)
    await store.release_group_lease("orders", "etl", "gw")
    await store.acquire_group_lease("orders", "etl", "spark", "job-2", ttl=30, now=NOW + 51)
    [row] = await _rows(store, "SELECT lease_owner, lease_kind FROM kg_group_lag")
    assert row == {"lease_owner": "job-2", "lease_kind": "spark"}
    with pytest.raises(GroupNotFound):
        await store.acquire_group_lease("orders", "nope", "spark", "job-1", ttl=30, now=NOW)


async def test_concurrent_dispatch_records_share_one_transaction(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await _queue_with_messages(store, make_message, 8)
    commits = store.dispatcher.commits
    await asyncio.gather(
        *(
            store.record_dispatch("orders", "billing", [RecordDispatch(3, seq)])
            for seq in range(1, 9)
        )
    )
    assert store.dispatcher.commits - commits == 1
    assert (await store.load_group("orders", "billing")).partitions[3].dispatched_seq == 8


async def test_close_writes_appends_already_submitted(
    db_url: str, make_message: MessageFactory
) -> None:
    store = await open_store(db_url)
    await store.create_queue(QueueConfig("orders"))
    # gather starts its tasks in order: the three appends are submitted before close runs.
    results = await asyncio.gather(
        *(store.append([make_message("orders")], now=NOW) for _ in range(3)), store.close()
    )
    assert [batch[0].seq for batch in results if batch is not None] == [1, 2, 3]
    reopened = await open_store(db_url)
    try:
        assert await reopened.depth("orders") == (3, 3 * len(b"payload"))
    finally:
        await reopened.close()
