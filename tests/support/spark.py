"""Shared by the Spark integration tests: one local[2] SparkSession for the test
session (starting one costs ~10 s), seeding through the store, SQL helpers, and a native
consumer that takes a group once Spark lets it go."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from pyspark.sql import DataFrame, SparkSession

import spark
from core.errors import GroupLeased
from core.keys import partition_for
from core.model import Message, QueueConfig
from gateway.client import Client
from spark.db import write_engine
from storage import open_store
from storage.schema import kg_group_offsets
from tests.integration.conftest import native_url, start_gateway
from tests.support.consume import take
from tests.support.wait import eventually

# Spread over the 3 partitions of the test queues: partitions 2, 1, 0, 2, 1, 0, 2.
KEYS = ["key-0", "key-1", "key-13", "key-3", "key-2", "key-22", "key-7"]


@pytest.fixture(scope="session", name="session")
def spark_session() -> Iterator[SparkSession]:
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


def execute(url: str, statement: sa.Executable) -> list[sa.Row[Any]]:
    engine = write_engine(url)
    try:
        with engine.begin() as conn:
            result = conn.execute(statement)
            return list(result) if result.returns_rows else []
    finally:
        engine.dispose()


async def bind_natively(
    url: str, queue: str, group: str, *, receive: int = 0, timeout: float = 10
) -> None:
    """A native SDK consumer binds ``group`` within ``timeout`` seconds (GroupLeased until
    then), receives and acknowledges ``receive`` messages, and leaves."""
    gateway = await start_gateway(url)
    try:
        async with Client(native_url(gateway)) as client:

            async def bound() -> Any:
                try:
                    return await client.subscribe(queue, group=group)
                except GroupLeased:
                    return None

            consumer = await eventually(bound, timeout=timeout)
            await take(consumer, receive)
            await consumer.close()
    finally:
        await gateway.stop()


__all__ = ["KEYS", "bind_natively", "execute", "offsets", "read", "seed", "spark_session"]
