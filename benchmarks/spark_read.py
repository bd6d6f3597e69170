"""Spark read throughput of the ``keygate`` source beside a raw driver scan, in one run.

Workload: a backlog of ``--messages`` messages (default 1,000,000) with 1 KiB payloads,
20 keys, 8 partitions, seeded through the store. The Spark figure is a full read of every
column with ``local[2]`` into the ``noop`` sink (best of ``--runs``, after a warm-up read of
the first partition); the raw figure is one process scanning the same rows and columns
with the driver alone (sqlite3 / psycopg server-side cursor in binary format, as the
source reads, 10,000 rows per fetch), no decoding. SQLite always; PostgreSQL when
``--postgres`` (default: env KEYGATE_TEST_POSTGRES_URL) answers, in a throwaway schema.
Not a test: run it by hand.

    .venv/bin/python benchmarks/spark_read.py [--messages 1000000] [--runs 2]
        [--postgres URL]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import psycopg
from psycopg import sql
from pyspark.sql import SparkSession
from sqlalchemy.engine import make_url

import spark
from benchmarks.native import libpq_url, postgres_target
from spark.examples.demo import seed, use_this_python

QUEUE: Final = "bench"
PARTITIONS: Final = 8
FETCH: Final = 10_000
_COLUMNS: Final = "partition, seq, message_id, key, payload, properties, topic, publish_time"
_SCAN: Final = f"SELECT {_COLUMNS} FROM kg_messages WHERE queue = %s ORDER BY partition, seq"


def raw_sqlite(url: str) -> int:
    path = make_url(url).database
    assert path
    conn = sqlite3.connect(path)
    try:
        cursor = conn.execute(_SCAN.replace("%s", "?"), (QUEUE,))
        rows = 0
        while chunk := cursor.fetchmany(FETCH):
            rows += len(chunk)
        return rows
    finally:
        conn.close()


def raw_postgres(url: str) -> int:
    schema = make_url(url).query["search_path"]
    with psycopg.connect(libpq_url(url)) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(str(schema))))
        with conn.cursor(name="scan", binary=True) as cursor:
            cursor.execute(_SCAN, (QUEUE,))
            rows = 0
            while chunk := cursor.fetchmany(FETCH):
                rows += len(chunk)
            return rows


def spark_read(session: SparkSession, url: str, **options: str) -> None:
    reader = session.read.format("keygate").option("url", url).option("queue", QUEUE)
    df = reader.option("group", "bench").options(**options).load()
    df.write.format("noop").mode("overwrite").save()


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def measure(session: SparkSession, name: str, url: str, messages: int, runs: int) -> None:
    started = time.perf_counter()
    seed(url, QUEUE, messages, partitions=PARTITIONS, payload_size=1024)
    print(f"{name}: seeded {messages:,} messages in {time.perf_counter() - started:.1f} s")
    spark_read(session, url, endingOffsets='{"0": 1, "1": 0, "2": 0, "3": 0}')
    best = min(timed(lambda: spark_read(session, url)) for _ in range(runs))
    raw = raw_sqlite if name == "sqlite" else raw_postgres
    raw_time = min(timed(lambda: raw(url)) for _ in range(runs))
    print(f"{name}: spark local[2]  {messages / best:>12,.0f} rows/s ({best:.2f} s)")
    print(f"{name}: raw driver scan {messages / raw_time:>12,.0f} rows/s ({raw_time:.2f} s)")


def postgres_reachable(url: str | None) -> str | None:
    if not url:
        return None
    try:
        with psycopg.connect(libpq_url(url), connect_timeout=3):
            return url
    except psycopg.Error as e:
        print(f"postgres: skipped ({e})")
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--postgres", default=os.environ.get("KEYGATE_TEST_POSTGRES_URL"))
    args = parser.parse_args()
    use_this_python()
    session = (
        SparkSession.builder.master("local[2]")
        .appName("keygate-spark-read-benchmark")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    spark.register(session)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            url = "sqlite:///" + str(Path(tmp) / "bench.db")
            measure(session, "sqlite", url, args.messages, args.runs)
        base = postgres_reachable(args.postgres)
        if base is not None:
            with postgres_target(base) as url:
                measure(session, "postgres", url, args.messages, args.runs)
    finally:
        session.stop()


if __name__ == "__main__":
    main()
