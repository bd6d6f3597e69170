"""Group-commit append throughput of SqlStore beside the raw driver, in one run.

Workload: 1 KiB payloads, 1,000 keys, 16 partitions, 64 concurrent appenders, each
publishing one message per call with ``--inflight`` publishes outstanding (a publisher's
confirm window; batching comes from group commit alone, and a batch can never hold more
messages than there are outstanding calls). The raw
figure is the driver's own executemany (aiosqlite / asyncpg) into a table with the same
DDL as kg_messages, in batches of 1,000 rows, one transaction per batch, same SQLite
pragmas; its timing includes turning messages into parameter tuples (properties to JSON),
the least any writer must do. Both run on uvloop when it is installed, as the gateway
does. Not a test: run it by hand.

    .venv/bin/python benchmarks/store_append.py [--messages 50000] [--inflight 16]
        [--postgres URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import aiosqlite
import asyncpg  # type: ignore[import-untyped]
import psycopg
import sqlalchemy as sa
from psycopg import sql
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url

from core.keys import partition_for
from core.model import Message, QueueConfig
from storage import open_store
from storage.codec import encode_properties, message_row
from storage.schema import kg_messages

PARTITIONS: Final = 16
KEYS: Final = 1000
APPENDERS: Final = 64
PAYLOAD: Final = os.urandom(1024)
RAW_BATCH: Final = 1000
QUEUE: Final = "bench"


def _messages(count: int) -> list[Message]:
    now = time.time()
    return [
        Message(
            message_id=uuid.uuid4().hex,
            queue=QUEUE,
            partition=partition_for(f"key-{i % KEYS}", PARTITIONS),
            seq=0,
            key=f"key-{i % KEYS}",
            payload=PAYLOAD,
            properties={"JMSXGroupID": f"key-{i % KEYS}", "n": i},
            topic="bench/topic",
            publish_time=now,
            producer="bench",
        )
        for i in range(count)
    ]


async def bench_store(url: str, messages: Sequence[Message], inflight: int) -> tuple[float, int]:
    """Messages per second through SqlStore.append, and the number of commits."""
    store = await open_store(url)
    try:
        await store.create_queue(QueueConfig(QUEUE, partitions=PARTITIONS))
        callers = APPENDERS * inflight
        share = len(messages) // callers

        async def appender(mine: Sequence[Message]) -> None:
            for message in mine:
                await store.append([message], now=message.publish_time)

        commits = store.appender.commits
        start = time.perf_counter()
        await asyncio.gather(
            *(appender(messages[i * share : (i + 1) * share]) for i in range(callers))
        )
        elapsed = time.perf_counter() - start
        return share * callers / elapsed, store.appender.commits - commits
    finally:
        await store.close()


def _raw_rows(messages: Sequence[Message], seq_base: int) -> list[tuple[Any, ...]]:
    rows = []
    for seq, message in enumerate(messages, start=seq_base):
        row = message_row(message)
        row["seq"] = seq
        row["properties"] = json.dumps(encode_properties(message.properties))
        rows.append(tuple(row[c.name] for c in kg_messages.columns))
    return rows


def _raw_table(dialect: sa.Dialect) -> tuple[str, str]:
    table = kg_messages.to_metadata(sa.MetaData(), name="bench_raw")
    create = str(sa.schema.CreateTable(table).compile(dialect=dialect))
    insert = str(sa.insert(table).compile(dialect=dialect, column_keys=list(table.c.keys())))
    return create, insert


async def bench_raw_sqlite(path: Path, messages: Sequence[Message]) -> float:
    create, insert = _raw_table(sqlite.dialect())
    async with aiosqlite.connect(path, isolation_level=None) as conn:
        for pragma in ("journal_mode=WAL", "synchronous=FULL"):
            await conn.execute("PRAGMA " + pragma)
        await conn.execute(create)
        start = time.perf_counter()
        for i in range(0, len(messages), RAW_BATCH):
            await conn.execute("BEGIN IMMEDIATE")
            await conn.executemany(insert, _raw_rows(messages[i : i + RAW_BATCH], i + 1))
            await conn.execute("COMMIT")
        return len(messages) / (time.perf_counter() - start)


async def bench_raw_postgres(url: str, schema: str, messages: Sequence[Message]) -> float:
    create, insert = _raw_table(postgresql.asyncpg.dialect())  # type: ignore[no-untyped-call]
    conn = await asyncpg.connect(url, server_settings={"search_path": schema})
    try:
        await conn.execute(create)
        start = time.perf_counter()
        for i in range(0, len(messages), RAW_BATCH):
            rows = _raw_rows(messages[i : i + RAW_BATCH], i + 1)
            async with conn.transaction():
                await conn.executemany(insert, rows)
        return len(messages) / (time.perf_counter() - start)
    finally:
        await conn.close()


def _report(name: str, store_rate: float, commits: int, count: int, raw_rate: float) -> None:
    print(
        f"{name:<10} store {store_rate:>9,.0f} msg/s  ({count / max(commits, 1):.0f} msg/commit)"
        f"  raw executemany {raw_rate:>9,.0f} msg/s  ratio {store_rate / raw_rate:.0%}"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--inflight", type=int, default=16)
    parser.add_argument("--postgres", default=os.environ.get("KEYGATE_TEST_POSTGRES_URL"))
    args = parser.parse_args()
    messages = _messages(args.messages)
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]
    print(
        f"{loop}: {args.messages} messages of {len(PAYLOAD)} B, {KEYS} keys, "
        f"{PARTITIONS} partitions, {APPENDERS} concurrent appenders x {args.inflight} in flight"
    )
    with tempfile.TemporaryDirectory() as tmp:
        store_url = f"sqlite:///{tmp}/store.db"
        store_rate, commits = await bench_store(store_url, messages, args.inflight)
        raw_rate = await bench_raw_sqlite(Path(tmp) / "raw.db", messages)
        _report("sqlite", store_rate, commits, len(messages), raw_rate)
    if args.postgres:
        base = make_url(args.postgres).set(drivername="postgresql")
        libpq = base.render_as_string(hide_password=False)
        schema = "kg_bench_" + uuid.uuid4().hex[:12]
        with psycopg.connect(libpq, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        try:
            url = base.update_query_dict({"search_path": schema})
            store_rate, commits = await bench_store(
                url.render_as_string(hide_password=False), messages, args.inflight
            )
            raw_rate = await bench_raw_postgres(libpq, schema, messages)
            _report("postgresql", store_rate, commits, len(messages), raw_rate)
        finally:
            with psycopg.connect(libpq, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


if __name__ == "__main__":
    try:
        import uvloop
    except ImportError:
        asyncio.run(main())
    else:
        uvloop.run(main())
