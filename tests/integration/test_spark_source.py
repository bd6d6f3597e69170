"""The ``keygate`` Spark data source against a real local SparkSession (consume_batch's
failure handling is in test_spark_consume.py; the shared session in tests/support/spark.py).

Every test runs on SQLite and, when KEYGATE_TEST_POSTGRES_URL answers, on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

pytest.importorskip("pyspark")

from pyspark.sql import DataFrame, SparkSession

import spark
from core.errors import GroupLeased, LeaseLost
from core.keys import partition_for
from core.model import (
    DEAD_LETTER_REASON,
    ORIGINAL_SEQ,
    GroupConfig,
)
from spark.options import parse_options
from spark.source import KeygateStreamReader
from storage import open_store
from storage.schema import kg_flows, kg_group_offsets, kg_groups, kg_messages
from tests.support.spark import KEYS, bind_natively, execute, offsets, read, seed, spark_session  # noqa: F401

pytestmark = pytest.mark.spark


def options_map(url: str) -> dict[str, str]:
    return {"url": url, "queue": "orders", "group": "etl"}


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


def test_batch_read_of_an_empty_range_returns_no_rows(session: SparkSession, db_url: str) -> None:
    seed(db_url, "orders", 5)
    df = read(session, db_url, "orders", "g", endingOffsets='{"0": 0, "1": 0, "2": 0}')
    assert df.count() == 0


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
    asyncio.run(bind_natively(db_url, "orders", "etl"))


def test_max_offsets_per_trigger_bounds_every_micro_batch(
    session: SparkSession, db_url: str, tmp_path: Path
) -> None:
    seed(db_url, "orders", 35)
    batches = run_stream(session, db_url, "orders", "slow", tmp_path, maxOffsetsPerTrigger="10")
    assert sum(batches) == 35
    assert max(batches) <= 10
    assert len(batches) >= 4


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


def test_a_stream_that_lost_its_lease_commits_nothing(db_url: str) -> None:
    seed(db_url, "orders", 10, partitions=1)
    stream = KeygateStreamReader(parse_options({**options_map(db_url), "leaseTimeout": "1"}))
    try:
        assert stream.initialOffset() == {"0": 0}
        # A batch outlives the lease: a native consumer binds the group and leaves.
        asyncio.run(bind_natively(db_url, "orders", "etl"))
        with pytest.raises(LeaseLost, match="lost its lease"):
            stream.commit({"0": 10})
        assert offsets(db_url, "orders", "etl") == {0: 0}
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


def test_a_stream_reads_a_scheduled_message_when_due_and_never_an_expired_one(
    session: SparkSession, db_url: str, tmp_path: Path
) -> None:
    later, gone = seed_scheduled_and_expired(db_url)
    run_stream(session, db_url, "orders", "etl", tmp_path, leaseTimeout="2")
    rows = session.read.parquet(str(tmp_path / "data")).collect()
    # The partition waits at the scheduled message (docs/spark.md), so its key's later
    # messages do not overtake it.
    assert sorted(row.seq for row in rows) == [1]
    m = kg_messages
    execute(db_url, sa.update(m).where(m.c.seq == later).values(deliver_at=time.time() - 1))
    run_stream(session, db_url, "orders", "etl", tmp_path, leaseTimeout="2")
    rows = session.read.parquet(str(tmp_path / "data")).collect()
    assert sorted(row.seq for row in rows) == [1, 2, 3, 5, 6]
    assert gone not in {row.seq for row in rows}


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
