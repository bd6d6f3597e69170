"""Seed a demo queue straight through the store, without a running gateway.

Used by the examples and benchmarks/spark_read.py. Messages are keyed (``customer-N``),
hashed to partitions as the gateway would, and appended in chunks through
``storage.open_store`` (which also migrates the database).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from typing import Final

import sqlalchemy as sa
from pyspark.sql import SparkSession

import spark
from core.keys import partition_for
from core.model import Message, QueueConfig
from spark.db import write_engine
from storage import open_store
from storage.schema import kg_messages

APPEND_CHUNK: Final = 5_000


def message_count(url: str, queue: str) -> int:
    """Messages stored in ``queue`` (0 when the database has no keygate schema yet)."""
    engine = write_engine(url)
    try:
        with engine.connect() as conn:
            query = sa.select(sa.func.count()).where(kg_messages.c.queue == queue)
            return int(conn.execute(query).scalar_one())
    except (sa.exc.OperationalError, sa.exc.ProgrammingError):
        return 0
    finally:
        engine.dispose()


def seed(
    url: str,
    queue: str,
    count: int,
    *,
    partitions: int = 4,
    keys: int = 20,
    payload_size: int = 0,
) -> None:
    """Create ``queue`` if needed and append ``count`` messages (blocks until stored)."""

    async def run() -> None:
        store = await open_store(url)
        try:
            config = QueueConfig(name=queue, partitions=partitions)
            await store.create_queue(config, exist_ok=True)
            filler = os.urandom(payload_size)
            for first in range(0, count, APPEND_CHUNK):
                batch = []
                for i in range(first, min(count, first + APPEND_CHUNK)):
                    key = f"customer-{i % keys}"
                    amount = (i * 7919) % 1000
                    batch.append(
                        Message(
                            message_id=uuid.uuid4().hex,
                            queue=queue,
                            partition=partition_for(key, partitions),
                            seq=0,
                            key=key,
                            payload=filler or f'{{"amount": {amount}}}'.encode(),
                            properties={"amount": amount, "region": ("eu", "us")[i % 2]},
                            topic=f"orders/{('eu', 'us')[i % 2]}",
                            publish_time=time.time(),
                        )
                    )
                await store.append(batch, now=time.time())
        finally:
            await store.close()

    asyncio.run(run())


def use_this_python() -> None:
    """Make Spark's Python workers run this interpreter (where keygate is importable)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def arguments(doc: str | None, group: str) -> argparse.ArgumentParser:
    """The options both examples take: the database, the queue and the group."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--url", default="sqlite:///keygate-demo.db")
    parser.add_argument("--queue", default="demo-orders")
    parser.add_argument("--group", default=group)
    return parser


def local_session(app: str, url: str, queue: str) -> SparkSession:
    """Seed the demo queue when it is empty, then start a local[2] session with the keygate
    source registered."""
    if message_count(url, queue) == 0:
        seed(url, queue, 1_000)
    use_this_python()
    session = (
        SparkSession.builder.master("local[2]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .getOrCreate()
    )
    spark.register(session)
    return session
