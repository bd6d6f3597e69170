"""SqlStore administration and publishing, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Sequence

import pytest
import sqlalchemy as sa

from core.errors import (
    AlreadyExists,
    GroupNotFound,
    InvalidArgument,
    MessageTooLarge,
    QueueFull,
    QueueNotFound,
    StorageError,
)
from core.model import GroupConfig, Message, QueueConfig, StartPosition
from storage import SqlStore, open_store
from storage.base import COPY_ROWS, StoreBase
from storage.retention import expired_messages
from storage.schema import kg_partitions

MessageFactory = Callable[..., Message]

NOW = 1_700_000_000.0


async def test_create_queue_also_creates_its_dead_letter_queue(store: SqlStore) -> None:
    config = QueueConfig("orders", partitions=4, subscriptions=("shop/+/orders",))
    assert await store.create_queue(config) == config
    assert await store.get_queue("orders") == config
    dlq = await store.get_queue("orders.dlq")
    assert (dlq.partitions, dlq.dlq_name) == (0, None)
    assert [q.name for q in await store.list_queues()] == ["orders", "orders.dlq"]


async def test_create_queue_twice_needs_exist_ok_and_same_partitions(store: SqlStore) -> None:
    await store.create_queue(QueueConfig("orders", partitions=4))
    with pytest.raises(AlreadyExists):
        await store.create_queue(QueueConfig("orders", partitions=4))
    stored = await store.create_queue(QueueConfig("orders", partitions=4, window=5), exist_ok=True)
    assert stored.window == QueueConfig("x").window
    with pytest.raises(AlreadyExists):
        await store.create_queue(QueueConfig("orders", partitions=8), exist_ok=True)


async def test_subscriptions_are_stored_sorted_and_unique(store: SqlStore) -> None:
    stored = await store.create_queue(QueueConfig("orders", subscriptions=("b/#", "a/+", "b/#")))
    assert stored.subscriptions == ("a/+", "b/#") == (await store.get_queue("orders")).subscriptions


async def test_create_queue_rejects_a_bad_subscription_pattern(store: SqlStore) -> None:
    with pytest.raises(InvalidArgument):
        await store.create_queue(QueueConfig("orders", subscriptions=("a/#/b",)))
    with pytest.raises(QueueNotFound):
        await store.get_queue("orders")


async def test_alter_queue_changes_settings_but_not_partitions(store: SqlStore) -> None:
    await store.create_queue(QueueConfig("orders", partitions=2))
    altered = await store.alter_queue("orders", max_deliveries=3, key_from="topic:1")
    assert (altered.max_deliveries, altered.key_from) == (3, "topic:1")
    assert await store.get_queue("orders") == altered
    with pytest.raises(InvalidArgument):
        await store.alter_queue("orders", partitions=3)
    with pytest.raises(InvalidArgument):
        await store.alter_queue("orders", no_such_setting=1)
    with pytest.raises(InvalidArgument):
        await store.alter_queue("orders", window=0)
    with pytest.raises(QueueNotFound):
        await store.alter_queue("missing", window=3)


async def test_subscriptions_are_added_and_removed(store: SqlStore) -> None:
    await store.create_queue(QueueConfig("orders"))
    await store.add_subscription("orders", "shop/#")
    await store.add_subscription("orders", "a/+/b")
    await store.add_subscription("orders", "shop/#")
    assert (await store.get_queue("orders")).subscriptions == ("a/+/b", "shop/#")
    await store.remove_subscription("orders", "shop/#")
    assert (await store.get_queue("orders")).subscriptions == ("a/+/b",)
    with pytest.raises(InvalidArgument):
        await store.add_subscription("orders", "a+/b")


async def test_append_assigns_increasing_seqs_per_partition(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await store.create_queue(QueueConfig("orders", partitions=2))
    stored = await store.append(
        [make_message("orders", p, key=f"k{i}") for i, p in enumerate([0, 1, 0, 0, 1])], now=NOW
    )
    assert [(m.partition, m.seq) for m in stored] == [(0, 1), (1, 1), (0, 2), (0, 3), (1, 2)]
    assert await store.head_seqs("orders") == {0: 3, 1: 2}
    # A message's size counts its key as well as its payload.
    assert await store.depth("orders") == (5, sum(m.size for m in stored))
    assert [m.seq for m in await store.read("orders", 0, 1, 10)] == [2, 3]
    assert [m.seq for m in await store.read("orders", 0, 0, 2)] == [1, 2]


async def test_a_message_round_trips_every_field(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await store.create_queue(QueueConfig("orders"))
    sent = make_message(
        "orders",
        payload=b"\x00\xffbinary",
        key="Order-1",
        properties={"s": "x", "i": 7, "f": 1.5, "t": True, "b": b"\x00\x01", "d": "{}"},
        topic="shop/1/orders",
        deliver_at=NOW + 5,
        expire_at=NOW + 60,
        producer="mqtt:c1",
        dedup_id="d1",
        content_type="application/json",
        correlation_id="c",
        reply_to="replies",
    )
    [stored] = await store.append([sent], now=NOW)
    [read] = await store.read("orders", 0, 0, 10)
    assert read == stored == dataclasses.replace(sent, seq=1)
    assert read.properties["b"] == b"\x00\x01" and read.properties["t"] is True


async def test_seqs_continue_after_reopen_even_when_every_message_was_deleted(
    db_url: str, make_message: MessageFactory
) -> None:
    store = await open_store(db_url)
    await store.create_queue(QueueConfig("orders"))
    await store.append([make_message("orders"), make_message("orders")], now=NOW)
    assert await store.purge_queue("orders") == 2
    await store.close()
    store = await open_store(db_url)
    try:
        [stored] = await store.append([make_message("orders")], now=NOW)
        assert stored.seq == 3
        assert await store.depth("orders") == (1, len(b"payload"))
    finally:
        await store.close()


async def test_a_too_large_message_fails_only_its_own_call(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await store.create_queue(QueueConfig("orders", max_message_size=10))
    big = store.append([make_message("orders"), make_message("orders", payload=b"x" * 11)], now=NOW)
    small = store.append([make_message("orders")], now=NOW)
    results = await asyncio.gather(big, small, return_exceptions=True)
    assert isinstance(results[0], MessageTooLarge)
    assert [m.seq for m in await store.read("orders", 0, 0, 10)] == [1]


async def test_max_depth_rejects_publishes_beyond_it(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await store.create_queue(QueueConfig("orders", max_depth_messages=3, max_depth_bytes=1000))
    await store.append([make_message("orders") for _ in range(2)], now=NOW)
    with pytest.raises(QueueFull):
        await store.append([make_message("orders") for _ in range(2)], now=NOW)
    await store.append([make_message("orders")], now=NOW)
    with pytest.raises(QueueFull):
        await store.append([make_message("orders")], now=NOW)
    await store.create_queue(QueueConfig("bytes", max_depth_bytes=10))
    with pytest.raises(QueueFull):
        await store.append([make_message("bytes", payload=b"x" * 11)], now=NOW)
    assert await store.depth("orders") == (3, 3 * len(b"payload"))


async def test_append_to_an_unknown_queue_raises_queue_not_found(
    store: SqlStore, make_message: MessageFactory
) -> None:
    with pytest.raises(QueueNotFound):
        await store.append([make_message("nowhere")], now=NOW)


async def test_a_duplicate_within_the_dedup_window_returns_the_original(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await store.create_queue(QueueConfig("orders", dedup_window=60))
    first = make_message("orders", producer="p", dedup_id="d", payload=b"one")
    [original] = await store.append([first], now=NOW)
    again = make_message("orders", producer="p", dedup_id="d", payload=b"two")
    assert await store.append([again], now=NOW + 30) == [original]
    [twice, other] = await store.append(
        [again, make_message("orders", producer="p", dedup_id="e")], now=NOW + 31
    )
    assert twice == original and other.seq == 2
    assert await store.retention(now=NOW + 61) == 0
    [late] = await store.append([again], now=NOW + 61)
    assert (late.seq, late.payload) == (3, b"two")


async def test_duplicates_inside_one_batch_are_stored_once(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await store.create_queue(QueueConfig("orders", dedup_window=60))
    one = make_message("orders", producer="p", dedup_id="d")
    results = await asyncio.gather(
        *(
            store.append([make_message("orders", producer="p", dedup_id="d")], now=NOW)
            for _ in "ab"
        ),
        store.append([one], now=NOW),
    )
    assert len({r[0].message_id for r in results}) == 1
    assert await store.depth("orders") == (1, results[0][0].size)


async def test_a_queue_with_default_settings_stores_every_repeated_dedup_id(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await store.create_queue(QueueConfig("orders"))
    messages = [make_message("orders", producer="p", dedup_id="order-42") for _ in "ab"]
    stored = await store.append(messages, now=NOW)
    assert [m.seq for m in stored] == [1, 2]
    assert await store.depth("orders") == (2, sum(m.size for m in stored))


async def test_the_same_producer_and_dedup_id_of_two_users_are_two_messages(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await store.create_queue(QueueConfig("orders", dedup_window=60))
    alice, bob, anonymous = (
        make_message("orders", producer="p", dedup_id="d", publisher=user)
        for user in ("alice", "bob", None)
    )
    assert [m.seq for m in await store.append([alice, bob, anonymous], now=NOW)] == [1, 2, 3]
    # Names that a naive "user/producer" join would make equal stay apart.
    joined = [
        make_message("orders", producer=producer, dedup_id="d", publisher=user)
        for user, producer in (("a/b", "c"), ("a", "b/c"))
    ]
    assert [m.seq for m in await store.append(joined, now=NOW)] == [4, 5]
    [again] = await store.append(
        [make_message("orders", producer="p", dedup_id="d", publisher="alice")], now=NOW + 1
    )
    assert (again.message_id, again.seq) == (alice.message_id, 1)


async def test_concurrent_appends_share_few_transactions_and_keep_order(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await store.create_queue(QueueConfig("orders", partitions=4))
    batches: list[list[Message]] = []
    resolved_before_listener: list[bool] = []
    calls = [
        store.append([make_message("orders", i % 4, payload=str(i).encode())], now=NOW)
        for i in range(64)
    ]
    tasks = [asyncio.ensure_future(c) for c in calls]

    def listener(messages: Sequence[Message]) -> None:
        batches.append(list(messages))
        resolved_before_listener.append(any(t.done() for t in tasks))

    store.add_commit_listener(listener)
    commits_before = store.appender.commits
    results = await asyncio.gather(*tasks)
    assert store.appender.commits - commits_before <= 4
    assert resolved_before_listener == [False] * len(batches)
    heard = [m for batch in batches for m in batch]
    assert sorted(heard, key=lambda m: m.message_id) == sorted(
        (r[0] for r in results), key=lambda m: m.message_id
    )
    for partition in range(4):
        mine = [r[0] for i, r in enumerate(results) if i % 4 == partition]
        assert [m.seq for m in mine] == list(range(1, 17))
        assert [m.seq for m in heard if m.partition == partition] == list(range(1, 17))


async def test_a_failed_transaction_fails_every_call_and_stores_nothing(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await store.create_queue(QueueConfig("orders"))
    await store.append([make_message("orders")], now=NOW)
    # A head that went back (a corrupted database) makes the INSERT hit seq 1 again.
    async with store.engine.begin() as conn:
        await conn.execute(sa.update(kg_partitions).values(head_seq=0))
    results = await asyncio.gather(
        store.append([make_message("orders")], now=NOW),
        store.append([make_message("orders")], now=NOW),
        return_exceptions=True,
    )
    assert all(isinstance(r, StorageError) for r in results)
    assert await store.head_seqs("orders") == {0: 1}
    assert await store.depth("orders") == (1, len(b"payload"))
    assert len(await store.read("orders", 0, 0, 10)) == 1


@pytest.mark.parametrize("count", [1, COPY_ROWS], ids=["one", "copy-sized"])
async def test_seqs_follow_rows_another_writer_appended(
    store: SqlStore, make_message: MessageFactory, count: int
) -> None:
    await store.create_queue(QueueConfig("orders"))
    await store.append([make_message("orders")], now=NOW)
    # A Spark job dead-lettering into a queue appends and advances head_seq itself.
    async with store.engine.begin() as conn:
        await conn.execute(sa.update(kg_partitions).values(head_seq=5))
    stored = await store.append([make_message("orders") for _ in range(count)], now=NOW)
    assert [m.seq for m in stored] == list(range(6, 6 + count))
    assert await store.head_seqs("orders") == {0: 5 + count}
    assert len(await store.read("orders", 0, 0, 1000)) == 1 + count


async def test_groups_are_created_listed_and_deleted(store: SqlStore) -> None:
    await store.create_queue(QueueConfig("orders", partitions=2))
    config = GroupConfig("orders", "billing", tags={"region": "eu"}, ack_timeout=30)
    stored, snapshot = await store.create_group(config)
    assert stored == config and sorted(snapshot.partitions) == [0, 1]
    assert (await store.create_group(GroupConfig("orders", "billing", ack_timeout=1)))[0] == config
    with pytest.raises(AlreadyExists):
        await store.create_group(config, exist_ok=False)
    assert await store.get_group("orders", "billing") == config
    assert await store.list_groups("orders") == [config]
    assert await store.list_groups("other") == []
    await store.delete_group("orders", "billing")
    with pytest.raises(GroupNotFound):
        await store.get_group("orders", "billing")
    with pytest.raises(QueueNotFound):
        await store.create_group(GroupConfig("missing", "g"))


async def test_group_start_positions(store: SqlStore, make_message: MessageFactory) -> None:
    await store.create_queue(QueueConfig("orders", partitions=2))
    await store.append([make_message("orders", 0) for _ in range(3)], now=NOW)
    _, latest = await store.create_group(GroupConfig("orders", "l", start=StartPosition.LATEST))
    _, earliest = await store.create_group(GroupConfig("orders", "e"))
    assert {p: s.committed_seq for p, s in latest.partitions.items()} == {0: 3, 1: 0}
    assert {p: s.committed_seq for p, s in earliest.partitions.items()} == {0: 0, 1: 0}


async def test_delete_queue_removes_messages_and_groups_but_keeps_the_dlq(
    store: SqlStore, make_message: MessageFactory
) -> None:
    await store.create_queue(QueueConfig("orders"))
    await store.create_group(GroupConfig("orders", "billing"))
    await store.append([make_message("orders") for _ in range(3)], now=NOW)
    assert await store.delete_queue("orders") == 3
    with pytest.raises(QueueNotFound):
        await store.get_queue("orders")
    assert await store.list_groups() == []
    assert (await store.get_queue("orders.dlq")).name == "orders.dlq"
    with pytest.raises(QueueNotFound):
        await store.delete_queue("orders")


async def test_pointing_a_queue_at_a_new_dead_letter_queue_creates_it(store: SqlStore) -> None:
    await store.create_queue(QueueConfig("orders", dead_letter_queue=""))
    assert [q.name for q in await store.list_queues()] == ["orders"]
    await store.alter_queue("orders", dead_letter_queue="failed")
    assert (await store.get_queue("failed")).dlq_name is None
    with pytest.raises(QueueNotFound):
        await store.add_subscription("nowhere", "a/b")


@pytest.mark.parametrize("size", [1, COPY_ROWS], ids=["single", "copy-sized"])
async def test_a_call_the_database_refuses_fails_alone_and_its_batch_mates_are_stored(
    store: SqlStore, make_message: MessageFactory, db_url: str, size: int
) -> None:
    await store.create_queue(QueueConfig("orders", partitions=4))
    # Rows that ingress validation would have refused, handed to the store directly: a
    # value JSON cannot hold fails on both databases, a NUL in a key only on PostgreSQL.
    bad = [make_message("orders", properties={"odd": {1, 2}})]
    if db_url.startswith("postgresql"):
        bad.append(make_message("orders", key="a\0b"))
    good = [
        [make_message("orders", i % 4, payload=b"good-%d-%d" % (n, i)) for i in range(size)]
        for n in range(40 if size == 1 else 2)
    ]
    half = len(good) // 2
    calls = [*good[:half], *([m] for m in bad), *good[half:]]
    results = await asyncio.gather(
        *(store.append(call, now=NOW) for call in calls), return_exceptions=True
    )
    refused = [isinstance(r, BaseException) for r in results]
    assert refused == [False] * half + [True] * len(bad) + [False] * (len(good) - half)
    for error in results:
        if isinstance(error, BaseException):
            assert isinstance(error, StorageError) and error.message == "storage error"
    stored = [m for p in range(4) for m in await store.read("orders", p, 0, 1000)]
    assert sorted(m.payload for m in stored) == sorted(m.payload for c in good for m in c)


FLOATS = (1e300, -1e20, 1e16, 9999999999999998.0, 2.0, 1.5, 5e-324, math.inf, -math.inf)


# -- appends as large as COPY takes on PostgreSQL (storage.base.COPY_ROWS) -------------------


def _spy_on_inserts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """(rows, whether by COPY) of every kg_messages insert from now on."""
    inserts: list[tuple[int, bool]] = []
    original = StoreBase.insert_messages

    def spy(self: StoreBase, conn: sa.Connection, messages: Sequence[Message], **kw: bool) -> None:
        inserts.append((len(messages), kw.get("copy", False)))
        original(self, conn, messages, **kw)

    monkeypatch.setattr(StoreBase, "insert_messages", spy)
    return inserts


async def test_a_batch_as_large_as_copy_takes_round_trips_every_field(
    store: SqlStore, make_message: MessageFactory, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tabs, newlines, backslashes, NUL bytes and non-ASCII text are what COPY's text
    format must escape; every field comes back as it went in."""
    inserts = _spy_on_inserts(monkeypatch)
    await store.create_queue(QueueConfig("orders", partitions=2))
    sent = [
        make_message(
            "orders",
            i % 2,
            payload=bytes([i % 256]) * 100 + b"\x00\\\n\t\r",
            key=f"Schlüssel-{i}\t\\N",
            properties={"s": "a\tb\nc\\d", "f": FLOATS[i % len(FLOATS)], "b": b"\x00\n"},
            topic=None if i % 3 else "shop/\\N",
            deliver_at=NOW + i if i % 2 else None,
            dedup_id=f"d{i}",
            reply_to="\\.",
        )
        for i in range(COPY_ROWS + 5)
    ]
    expected = [dataclasses.replace(m) for m in sent]  # the store stamps seqs on its own
    stored = await store.append(sent, now=NOW)
    read = [m for p in (0, 1) for m in await store.read("orders", p, 0, 1000)]
    assert sorted(read, key=lambda m: m.message_id) == sorted(stored, key=lambda m: m.message_id)
    assert [dataclasses.replace(m, seq=0) for m in stored] == expected
    assert inserts == [(len(sent), db_url.startswith("postgresql"))]


async def test_float_properties_come_back_as_the_same_floats(
    store: SqlStore, make_message: MessageFactory
) -> None:
    """PostgreSQL's JSONB turned 1e300 into a 301-digit integer and refused inf and NaN."""
    await store.create_queue(QueueConfig("orders"))
    properties = {f"f{i}": value for i, value in enumerate(FLOATS)} | {"nan": math.nan}
    await store.append([make_message("orders", properties=properties)], now=NOW)
    [stored] = await store.read("orders", 0, 0, 1)
    back = dict(stored.properties)
    assert math.isnan(back.pop("nan"))  # type: ignore[arg-type]
    assert back == {f"f{i}": value for i, value in enumerate(FLOATS)}
    assert all(type(value) is float for value in back.values())


async def test_the_expiry_sweep_finds_expired_messages_through_an_index(store: SqlStore) -> None:
    """It runs every few seconds with the write lock held: a scan of kg_messages there
    stalled appends for seconds with millions of messages stored, and the gateway lost
    its lease."""
    query = expired_messages("orders", NOW)
    async with store.transaction() as conn:
        if conn.dialect.name == "postgresql":
            await conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
            compiled = query.compile(conn.sync_connection, compile_kwargs={"literal_binds": True})
            plan = await conn.exec_driver_sql(f"EXPLAIN {compiled}")
        else:
            compiled = query.compile(conn.sync_connection, compile_kwargs={"literal_binds": True})
            plan = await conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}")
        text = "\n".join(str(row[-1]) for row in plan)
    assert "ix_kg_messages_expire_at" in text, text


async def test_a_write_that_need_not_be_durable_skips_the_flush_on_sqlite_alone(
    store: SqlStore,
) -> None:
    """``durable=False`` (retention's deletes): SQLite's synchronous is NORMAL (1) for that
    transaction and FULL (2) after it; PostgreSQL's commits all wait for the WAL flush (a
    server restarted under the gateway must not undo deletes its caches counted)."""
    if store.engine.dialect.name == "postgresql":
        setting = "SHOW synchronous_commit"
        relaxed, strict = "on", "on"
    else:
        setting = "PRAGMA synchronous"
        relaxed, strict = 1, 2

    def read(conn: sa.Connection) -> object:
        return conn.exec_driver_sql(setting).scalar_one()

    assert await store.write(read, durable=False) == relaxed
    assert await store.write(read) == strict
