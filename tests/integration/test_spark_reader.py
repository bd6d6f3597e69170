"""The executor-side reader without a SparkSession: what it yields for a range, across
several of its 10,000-row batches, on SQLite (ADBC) and PostgreSQL (psycopg)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("pyspark")

import pyarrow as pa
import sqlalchemy as sa

from core.model import QueueConfig
from spark.db import write_engine
from spark.plan import ReadRange
from spark.reader import ARROW_SCHEMA, BATCH_ROWS, read_range
from storage import open_store
from storage.schema import kg_deliveries
from tests.conftest import MessageFactory

# More rows without key or topic than one batch holds: ADBC types a column from its first
# batch, and a batch of NULLs must not make the next batch's strings a type error.
NULL_FIRST = BATCH_ROWS + 500
TOTAL = NULL_FIRST + 1_500


def _key(i: int) -> str | None:
    return None if i < NULL_FIRST or i % 4 == 0 else f"k{i % 3}"


def _topic(i: int) -> str | None:
    return None if i < NULL_FIRST or i % 5 == 0 else f"t/{i % 2}"


async def _seed(url: str, make_message: MessageFactory) -> None:
    store = await open_store(url)
    try:
        await store.create_queue(QueueConfig(name="wide", partitions=1))
        for first in range(0, TOTAL, 2_000):
            batch = [
                make_message(
                    "wide",
                    0,
                    i.to_bytes(4, "big"),
                    key=_key(i),
                    topic=_topic(i),
                    properties={"n": i, "odd": i % 2 == 1, "big": 1e300, "half": 0.5},
                    publish_time=1_700_000_000.0 + i / 1000,
                )
                for i in range(first, min(TOTAL, first + 2_000))
            ]
            await store.append(batch, now=1_700_000_000.0)
    finally:
        await store.close()


def test_a_range_wider_than_a_batch_keeps_nulls_properties_and_delivery_counts(
    db_url: str, make_message: MessageFactory
) -> None:
    asyncio.run(_seed(db_url, make_message))
    redelivered = {7: 3, NULL_FIRST + 11: 2}
    engine = write_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.insert(kg_deliveries),
                [
                    {"queue": "wide", "group_name": g, "partition": 0, "seq": s}
                    | {"delivery_count": n}
                    for s, n in redelivered.items()
                    for g in ("g", "other")
                ],
            )
    finally:
        engine.dispose()
    r = ReadRange(
        url=db_url,
        queue="wide",
        group="g",
        partition=0,
        lo=0,
        hi=TOTAL,
        skip=((100, 199),),
        dispatched=50,
        include_properties=True,
    )

    batches = list(read_range(r))

    assert len(batches) > 1
    table = pa.Table.from_batches(batches, schema=ARROW_SCHEMA)
    shown = [i for i in range(TOTAL) if not 100 <= i + 1 <= 199]
    assert table.column("seq").to_pylist() == [i + 1 for i in shown]
    assert table.column("key").to_pylist() == [_key(i) for i in shown]
    assert table.column("topic").to_pylist() == [_topic(i) for i in shown]
    assert table.column("payload").to_pylist() == [i.to_bytes(4, "big") for i in shown]
    properties = table.column("properties").to_pylist()
    floats = {"big": "1e+300", "half": "0.5"}  # 1e300 once came back as a 301-digit int
    assert [dict(p) for p in properties[:2]] == [
        {"n": "0", "odd": "false"} | floats,
        {"n": "1", "odd": "true"} | floats,
    ]
    seqs, shown_counts = table.column("seq"), table.column("delivery_count")
    counts = dict(zip(seqs.to_pylist(), shown_counts.to_pylist(), strict=True))
    assert counts[7] == 4 and counts[NULL_FIRST + 11] == 3  # recorded deliveries + 1
    assert counts[50] == 2 and counts[51] == 1  # at or below dispatched: delivered once
