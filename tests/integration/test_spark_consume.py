"""consume_batch against a real local SparkSession: failures, poison rows, backoff.

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
from pyspark.sql.functions import udf

import spark
from core.errors import InvalidArgument, LeaseLost
from core.model import (
    DEAD_LETTER_REASON,
    DELIVERY_COUNT,
    ORIGINAL_GROUP,
    ORIGINAL_QUEUE,
    ORIGINAL_SEQ,
)
from spark.db import ensure_group, write_engine
from storage.schema import kg_deliveries, kg_group_offsets
from tests.support.spark import (  # noqa: F401
    bind_natively,
    execute,
    offsets,
    read,
    seed,
    spark_session,
)

pytestmark = pytest.mark.spark


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


def test_messages_acked_before_the_batch_are_neither_shown_nor_counted(
    session: SparkSession, db_url: str
) -> None:
    seed(db_url, "orders", 8, partitions=1)
    engine = write_engine(db_url)
    with engine.begin() as conn:
        ensure_group(conn, "orders", "billing", time.time())
    engine.dispose()
    o = kg_group_offsets  # a native consumer acked 2, 3 and 5 individually
    execute(db_url, sa.update(o).values(acked_above=[[2, 3], [5, 5]], acked_count=3))
    seen: list[int] = []
    result = spark.consume_batch(
        session, db_url, "orders", "billing", lambda df: seen.extend(r.seq for r in df.collect())
    )
    assert sorted(seen) == [1, 4, 6, 7, 8]
    assert (result.read, result.acked, result.committed) == (5, 5, {0: 8})


def test_a_batch_that_lost_its_lease_to_native_consumers_settles_nothing(
    session: SparkSession, db_url: str
) -> None:
    seed(db_url, "orders", 14)
    failing = "key-1"

    def outlive_the_lease(df: DataFrame) -> list[str]:
        bad = [row.message_id for row in df.where(df.key == failing).collect()]
        # fn runs past lease_timeout: a native consumer takes the group meanwhile, consumes
        # all of it and leaves (the gateway releases its lease).
        asyncio.run(bind_natively(db_url, "orders", "billing", receive=14))
        return bad

    with pytest.raises(LeaseLost, match=r"lost its lease.*nothing was settled"):
        spark.consume_batch(
            session, db_url, "orders", "billing", outlive_the_lease, lease_timeout=1
        )
    assert sum(offsets(db_url, "orders", "billing").values()) == 14  # the native acks
    assert execute(db_url, sa.select(kg_deliveries)) == []  # no nack recorded by Spark


def test_the_readmes_spark_example_runs_as_written(
    session: SparkSession, db_url: str, tmp_path: Path
) -> None:
    """QA ran the README's snippet: its ``fn`` returned a count, which consume_batch
    refuses (fn returns None or the failed ids)."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    snippet = readme.split("Spark (the `keygate` source")[1].split("```python\n")[1]
    snippet = snippet.split("```")[0].replace("sqlite:///keygate.db", db_url)
    # Spark resolves a relative path against the JVM's directory, not Python's.
    snippet = snippet.replace('"orders.parquet"', repr(str(tmp_path / "orders.parquet")))
    seed(db_url, "orders", 12)
    scope: dict[str, Any] = {"session": session}
    exec(compile(snippet, "README.md", "exec"), scope)
    assert scope["df"].count() == 12
    assert session.read.parquet(str(tmp_path / "orders.parquet")).count() == 12
    assert spark.consume_batch(session, db_url, "orders", "billing", lambda df: None).read == 0
