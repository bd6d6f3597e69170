"""The ``keygate`` Spark data source and consume_batch against a real local SparkSession.

One SparkSession (local[2]) serves the whole test session: starting one costs ~10 s.
Every test runs on SQLite and, when KEYGATE_TEST_POSTGRES_URL answers, on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

pytest.importorskip("pyspark")

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.functions import udf

import spark
from core.errors import GroupLeased, InvalidArgument
from core.keys import partition_for
from core.model import (
    DEAD_LETTER_REASON,
    DELIVERY_COUNT,
    ORIGINAL_GROUP,
    ORIGINAL_QUEUE,
    ORIGINAL_SEQ,
    GroupConfig,
    Message,
    QueueConfig,
)
from spark.db import write_engine
from spark.options import parse_options
from spark.source import KeygateStreamReader
from storage import open_store
from storage.schema import kg_deliveries, kg_flows, kg_group_offsets, kg_groups, kg_messages
from tests.support.wait import eventually

pytestmark = pytest.mark.spark

# Spread over the 3 partitions of the test queues: partitions 2, 1, 0, 2, 1, 0, 2.
KEYS = ["key-0", "key-1", "key-13", "key-3", "key-2", "key-22", "key-7"]


@pytest.fixture(scope="session")
def session() -> Iterator[SparkSession]:
    # Executors must run this interpreter (the venv with keygate importable).
    os.environ["PYSPARK_PYTHON"] = sys.executable
    built = (
        SparkSession.builder.master("local[2]")
        .appName("keygate-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    built.sparkContext.setLogLevel("ERROR")
    spark.register(built)
    yield built
    built.stop()


def seed(url: str, queue: str, count: int, *, partitions: int = 3, **settings: Any) -> None:
    """Create ``queue`` (if needed) and append ``count`` keyed messages through the store."""

    async def run() -> None:
        store = await open_store(url)
        try:
            config = QueueConfig(name=queue, partitions=partitions, **settings)
            await store.create_queue(config, exist_ok=True)
            messages = []
            for i in range(count):
                key = KEYS[i % len(KEYS)]
                messages.append(
                    Message(
                        message_id=uuid.uuid4().hex,
                        queue=queue,
                        partition=partition_for(key, partitions),
                        seq=0,
                        key=key,
                        payload=f"payload-{i}".encode(),
                        properties={"n": i, "ok": True, "raw": b"\x01\x02", "s": "text"},
                        topic="orders/eu",
                        publish_time=time.time(),
                    )
                )
            await store.append(messages, now=time.time())
        finally:
            await store.close()

    asyncio.run(run())


def read(session: SparkSession, url: str, queue: str, group: str, **options: str) -> DataFrame:
    reader = session.read.format("keygate").option("url", url).option("queue", queue)
    return reader.option("group", group).options(**options).load()


def offsets(url: str, queue: str, group: str) -> dict[int, int]:
    o = kg_group_offsets
    engine = write_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(o.c.partition, o.c.committed_seq).where(
                    o.c.queue == queue, o.c.group_name == group
                )
            )
            return {row.partition: row.committed_seq for row in rows}
    finally:
        engine.dispose()


def options_map(url: str) -> dict[str, str]:
    return {"url": url, "queue": "orders", "group": "etl"}


def execute(url: str, statement: sa.Executable) -> list[sa.Row[Any]]:
    engine = write_engine(url)
    try:
        with engine.begin() as conn:
            result = conn.execute(statement)
            return list(result) if result.returns_rows else []
    finally:
        engine.dispose()


def test_batch_read_returns_every_message_once_in_seq_order_per_partition(
    session: SparkSession, db_url: str
) -> None:
    seed(db_url, "orders", 60)
    df = read(session, db_url, "orders", "analytics", minPartitions="5")
    assert df.rdd.getNumPartitions() >= 5
    rows = df.collect()
    assert len(rows) == 60
    assert len({row.message_id for row in rows}) == 60
    by_partition: dict[int, list[int]] = {}
    for row in rows:
        by_partition.setdefault(row.partition, []).append(row.seq)
        assert row.partition == partition_for(row.key, 3)
        assert row.delivery_count == 1
        assert row.properties == {
            "n": row.payload.decode().split("-")[1],
            "ok": "true",
            "raw": "AQI=",
            "s": "text",
        }
    for seqs in by_partition.values():
        assert seqs == list(range(1, len(seqs) + 1))
    # A plain read commits nothing: the group is created at its start, nothing more.
    assert offsets(db_url, "orders", "analytics") == {0: 0, 1: 0, 2: 0}


def test_batch_read_honours_starting_and_ending_offsets(session: SparkSession, db_url: str) -> None:
    seed(db_url, "orders", 30)
    df = read(
        session, db_url, "orders", "g", startingOffsets='{"0": 2}', endingOffsets='{"0": 4, "1": 0}'
    )
    seqs = sorted((row.partition, row.seq) for row in df.select("partition", "seq").collect())
    heads = {
        p: n
        for p, n in read(session, db_url, "orders", "all").groupBy("partition").count().collect()
    }
    assert [s for p, s in seqs if p == 0] == [3, 4]
    assert not [s for p, s in seqs if p == 1]
    assert [s for p, s in seqs if p == 2] == list(range(1, heads[2] + 1))


def read_stream(session: SparkSession, url: str, queue: str, group: str) -> DataFrame:
    reader = session.readStream.format("keygate").option("url", url).option("queue", queue)
    return reader.option("group", group).load()


def run_stream(
    session: SparkSession, url: str, queue: str, group: str, out: Path, **options: str
) -> list[int]:
    """One availableNow run into Parquet; returns the input rows of each micro-batch."""
    stream = (
        session.readStream.format("keygate")
        .option("url", url)
        .option("queue", queue)
        .option("group", group)
        .options(**options)
        .load()
    )
    query = (
        stream.writeStream.format("parquet")
        .option("checkpointLocation", str(out / "checkpoint"))
        .trigger(availableNow=True)
        .start(str(out / "data"))
    )
    query.awaitTermination(120)
    assert not query.isActive
    assert query.exception() is None
    return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]


def test_stream_restarted_from_checkpoint_neither_loses_nor_duplicates(
    session: SparkSession, db_url: str, tmp_path: Path
) -> None:
    seed(db_url, "orders", 40)
    # A short lease: the restart waits for the first run's lease to lapse.
    run_stream(session, db_url, "orders", "etl", tmp_path, leaseTimeout="2")
    seed(db_url, "orders", 25)
    run_stream(session, db_url, "orders", "etl", tmp_path, leaseTimeout="2")
    rows = session.read.parquet(str(tmp_path / "data")).select("partition", "seq").collect()
    assert len(rows) == 65
    assert len({(row.partition, row.seq) for row in rows}) == 65
    # Spark commits a batch when it plans the next one: the restart committed the first run.
    committed = offsets(db_url, "orders", "etl")
    assert sum(committed.values()) >= 40


def test_a_stopped_streams_group_is_free_within_seconds(
    session: SparkSession, db_url: str, tmp_path: Path
) -> None:
    seed(db_url, "orders", 7)
    query = (
        read_stream(session, db_url, "orders", "etl")
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    query.processAllAvailable()
    holder = sa.select(kg_groups.c.lease_kind, kg_groups.c.lease_owner).where(
        kg_groups.c.group_name == "etl"
    )
    assert execute(db_url, holder)[0].lease_kind == "spark"
    query.stop()  # leaseTimeout is 60 s: only the listener can free it this soon
    asyncio.run(eventually(lambda: execute(db_url, holder)[0].lease_owner is None, timeout=10))
    # Another job takes the group at once (GroupLeased otherwise). The stream's last batch
    # is committed only when the next is planned, so it is read again here.
    result = spark.consume_batch(session, db_url, "orders", "etl", lambda df: None)
    assert result.acked == result.read <= 7


def test_max_offsets_per_trigger_bounds_every_micro_batch(
    session: SparkSession, db_url: str, tmp_path: Path
) -> None:
    seed(db_url, "orders", 35)
    batches = run_stream(session, db_url, "orders", "slow", tmp_path, maxOffsetsPerTrigger="10")
    assert sum(batches) == 35
    assert max(batches) <= 10
    assert len(batches) >= 4


def test_consume_batch_redelivers_failures_then_dead_letters_them(
    session: SparkSession, db_url: str
) -> None:
    seed(db_url, "orders", 28, max_deliveries=2, backoff_initial=0.0)
    poison = "key-3"

    def fail_poison(df: DataFrame) -> list[str]:
        return [row.message_id for row in df.where(df.key == poison).collect()]

    first = spark.consume_batch(session, db_url, "orders", "billing", fail_poison)
    assert (first.read, first.acked, first.nacked, first.dead_lettered) == (28, 24, 4, 0)

    seen: list[Any] = []

    def record(df: DataFrame) -> list[str]:
        seen.extend(df.collect())
        return fail_poison(df)

    second = spark.consume_batch(session, db_url, "orders", "billing", record)
    assert (second.read, second.nacked, second.dead_lettered) == (4, 0, 4)
    assert {row.key for row in seen} == {poison}
    assert {row.delivery_count for row in seen} == {2}

    dead = read(session, db_url, "orders.dlq", "inspect").collect()
    assert len(dead) == 4
    assert sorted(int(row.properties[ORIGINAL_SEQ]) for row in dead) == sorted(
        row.seq for row in seen
    )
    for row in dead:
        assert row.properties[DEAD_LETTER_REASON] == "max-deliveries"
        assert row.properties[ORIGINAL_QUEUE] == "orders"
        assert row.properties[ORIGINAL_GROUP] == "billing"
        assert row.properties[DELIVERY_COUNT] == "2"
    third = spark.consume_batch(session, db_url, "orders", "billing", record)
    assert third.read == 0
    assert execute(db_url, sa.select(kg_deliveries)) == []


def test_a_failed_message_comes_back_only_after_the_queues_backoff(
    session: SparkSession, db_url: str
) -> None:
    seed(db_url, "orders", 12, backoff_initial=30.0)
    failing = "key-1"

    def fail_key(df: DataFrame) -> list[str]:
        return [row.message_id for row in df.where(df.key == failing).collect()]

    before = time.time()
    first = spark.consume_batch(session, db_url, "orders", "billing", fail_key)
    assert first.nacked > 1
    due = [row.redeliver_at for row in execute(db_url, sa.select(kg_deliveries))]
    assert len(due) == first.nacked
    assert all(before + 30.0 <= at <= time.time() + 30.0 for at in due)  # the backoff
    seen: list[Any] = []

    def record(df: DataFrame) -> None:
        seen.extend(df.collect())

    early = spark.consume_batch(session, db_url, "orders", "billing", record)
    assert (early.read, seen) == (0, [])  # not due: left out, and still pending
    offsets = execute(db_url, sa.select(kg_group_offsets.c.committed_seq))
    assert sum(row.committed_seq for row in offsets) < 12
    execute(db_url, sa.update(kg_deliveries).values(redeliver_at=time.time() - 1))  # now due
    late = spark.consume_batch(session, db_url, "orders", "billing", record)
    assert late.read == first.nacked
    assert {row.key for row in seen} == {failing}
    assert {row.delivery_count for row in seen} == {2}


def test_consume_batch_commits_nothing_when_fn_raises(session: SparkSession, db_url: str) -> None:
    seed(db_url, "orders", 10)

    def broken(df: DataFrame) -> None:
        df.count()
        raise RuntimeError("job failed")

    with pytest.raises(RuntimeError, match="job failed"):  # on every row: a broken job
        spark.consume_batch(session, db_url, "orders", "billing", broken)
    assert offsets(db_url, "orders", "billing") == {0: 0, 1: 0, 2: 0}
    assert execute(db_url, sa.select(kg_deliveries)) == []
    # The lease is released even so: the next batch runs and sees everything.
    result = spark.consume_batch(session, db_url, "orders", "billing", lambda df: None)
    assert result.acked == 10


def test_a_poison_row_is_isolated_the_rest_commit_and_it_reaches_the_dlq(
    session: SparkSession, db_url: str
) -> None:
    seed(db_url, "orders", 10, max_deliveries=2, backoff_initial=0.0)
    poison = "payload-6"

    def size(payload: bytearray) -> int:
        if bytes(payload).decode() == poison:
            raise ValueError("cannot parse")
        return len(payload)

    parse = udf(size, returnType="int", useArrow=False)

    processed: list[str] = []

    def job(df: DataFrame) -> None:
        rows = df.select("message_id", parse(df.payload).alias("size")).collect()
        processed.extend(row.message_id for row in rows)

    first = spark.consume_batch(session, db_url, "orders", "billing", job)
    assert (first.read, first.acked, first.nacked, first.dead_lettered) == (10, 9, 1, 0)
    assert len(set(processed)) == 9
    assert [row.delivery_count for row in execute(db_url, sa.select(kg_deliveries))] == [1]

    second = spark.consume_batch(session, db_url, "orders", "billing", job)
    assert (second.read, second.acked, second.nacked, second.dead_lettered) == (1, 0, 0, 1)
    assert sum(offsets(db_url, "orders", "billing").values()) == 10
    (dead,) = read(session, db_url, "orders.dlq", "inspect").collect()
    assert dead.payload.decode() == poison
    assert dead.properties[DEAD_LETTER_REASON] == "exception:ValueError"
    assert dead.properties[DELIVERY_COUNT] == "2"


def test_isolation_off_raises_at_once_and_counts_nothing(
    session: SparkSession, db_url: str
) -> None:
    seed(db_url, "orders", 6)
    runs: list[int] = []

    def broken(df: DataFrame) -> None:
        runs.append(df.count())
        raise RuntimeError("job failed")

    with pytest.raises(RuntimeError, match="job failed"):
        spark.consume_batch(session, db_url, "orders", "billing", broken, isolation_runs=0)
    assert runs == [6]
    assert execute(db_url, sa.select(kg_deliveries)) == []


def test_consume_batch_respects_max_messages_and_rejects_unknown_ids(
    session: SparkSession, db_url: str
) -> None:
    seed(db_url, "orders", 20)
    first = spark.consume_batch(session, db_url, "orders", "g", lambda df: None, max_messages=8)
    assert first.read == 8
    with pytest.raises(InvalidArgument, match="not in this batch"):
        spark.consume_batch(session, db_url, "orders", "g", lambda df: ["no-such-id"])
    assert sum(offsets(db_url, "orders", "g").values()) == 8


def test_group_lease_refuses_second_job_and_native_holders(
    session: SparkSession, db_url: str
) -> None:
    seed(db_url, "orders", 5)
    options = parse_options(options_map(db_url))
    stream = KeygateStreamReader(options)
    try:
        assert stream.initialOffset() == {"0": 0, "1": 0, "2": 0}
        with pytest.raises(GroupLeased, match="spark"):
            spark.consume_batch(session, db_url, "orders", "etl", lambda df: None)
        # A second stream waits for a lease that lapses within its own lease timeout only.
        impatient = parse_options({**options_map(db_url), "leaseTimeout": "1"})
        second = KeygateStreamReader(impatient)
        with pytest.raises(GroupLeased, match="spark"):
            second.initialOffset()
        second.stop()
    finally:
        stream.stop()
    execute(
        db_url,
        sa.insert(kg_flows).values(
            flow_id="f1",
            queue="orders",
            group_name="etl",
            client="sdk",
            state="running",
            window_size=10,
            ack_mode="client",
            pending=0,
            bound_at=0.0,
            last_seen=0.0,
        ),
    )
    with pytest.raises(GroupLeased, match="native"):
        spark.consume_batch(session, db_url, "orders", "etl", lambda df: None)
    with pytest.raises(Exception, match=r"GroupLeased|native flow"):
        read(session, db_url, "orders", "etl").collect()


def test_stream_commit_is_idempotent_monotonic_and_folds_acked_ranges(db_url: str) -> None:
    seed(db_url, "orders", 30, partitions=1)
    stream = KeygateStreamReader(parse_options(options_map(db_url)))
    assert stream.initialOffset() == {"0": 0}
    o = kg_group_offsets
    execute(
        db_url,
        sa.update(o)
        .where(o.c.group_name == "etl")
        .values(acked_above=[[6, 8], [12, 12]], acked_count=4),
    )
    try:
        stream.commit({"0": 5})
        stream.commit({"0": 5})
        stream.commit({"0": 3})
        row = execute(db_url, sa.select(o.c.committed_seq, o.c.acked_above, o.c.acked_count))[0]
        assert (row.committed_seq, row.acked_above, row.acked_count) == (8, [[12, 12]], 1)
        stream.commit({"0": 20})
        row = execute(db_url, sa.select(o.c.committed_seq, o.c.acked_above, o.c.dispatched_seq))[0]
        assert (row.committed_seq, row.acked_above, row.dispatched_seq) == (20, [], 20)
    finally:
        stream.stop()


def test_committed_progress_is_visible_in_partition_status(
    session: SparkSession, db_url: str
) -> None:
    seed(db_url, "orders", 21)
    spark.consume_batch(session, db_url, "orders", "billing", lambda df: None, max_messages=9)
    status = execute(
        db_url,
        sa.text(
            "SELECT partition, committed_seq, head_seq, lag FROM kg_partition_status "
            "WHERE queue = 'orders' AND group_name = 'billing' ORDER BY partition"
        ),
    )
    assert sum(row.committed_seq for row in status) == 9
    assert sum(row.lag for row in status) == 12
    assert all(row.lag == row.head_seq - row.committed_seq for row in status)


def test_group_tag_filter_hides_other_messages_and_consuming_settles_them(
    session: SparkSession, db_url: str
) -> None:
    seed(db_url, "orders", 21)

    async def create_group() -> None:
        store = await open_store(db_url)
        try:
            await store.create_group(GroupConfig(queue="orders", name="fours", tags={"n": "4"}))
        finally:
            await store.close()

    asyncio.run(create_group())
    rows = read(session, db_url, "orders", "fours", includeProperties="false").collect()
    assert [row.payload for row in rows] == [b"payload-4"]
    assert rows[0].properties is None
    shown: list[Any] = []
    result = spark.consume_batch(
        session, db_url, "orders", "fours", lambda df: shown.extend(df.collect())
    )
    assert [row.payload for row in shown] == [b"payload-4"]
    assert (result.read, result.acked) == (21, 21)
    assert sum(offsets(db_url, "orders", "fours").values()) == 21


def seed_scheduled_and_expired(url: str) -> tuple[int, int]:
    """Six messages in one partition: seq 2 scheduled an hour ahead, seq 4 expired."""
    seed(url, "orders", 6, partitions=1, dead_letter_expired=True)
    later, gone = 2, 4
    m = kg_messages
    execute(url, sa.update(m).where(m.c.seq == later).values(deliver_at=time.time() + 3600))
    execute(url, sa.update(m).where(m.c.seq == gone).values(expire_at=time.time() - 1))
    return later, gone


def test_a_stream_reads_scheduled_and_expired_messages_as_stored_as_documented(
    session: SparkSession, db_url: str, tmp_path: Path
) -> None:
    seed_scheduled_and_expired(db_url)
    run_stream(session, db_url, "orders", "etl", tmp_path)
    rows = session.read.parquet(str(tmp_path / "data")).collect()
    assert sorted(row.seq for row in rows) == [1, 2, 3, 4, 5, 6]  # docs/spark.md: raw


def test_consume_batch_holds_scheduled_messages_and_settles_expired_ones(
    session: SparkSession, db_url: str
) -> None:
    later, gone = seed_scheduled_and_expired(db_url)
    seen: list[Any] = []
    result = spark.consume_batch(
        session, db_url, "orders", "billing", lambda df: seen.extend(df.collect())
    )
    assert sorted(row.seq for row in seen) == [1, 3, 5, 6]
    assert result.dead_lettered == 1  # the expired one, as the queue asks
    (letter,) = read(session, db_url, "orders.dlq", "inspect").collect()
    assert letter.properties[DEAD_LETTER_REASON] == "expired"
    assert int(letter.properties[ORIGINAL_SEQ]) == gone
    o = kg_group_offsets
    (offset,) = execute(
        db_url,
        sa.select(o.c.committed_seq).where(o.c.queue == "orders", o.c.group_name == "billing"),
    )
    assert offset.committed_seq == later - 1  # the scheduled one is still pending
