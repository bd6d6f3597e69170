"""Seed a demo queue straight through the store, without a running gateway.

Used by the examples and benchmarks/spark_read.py. Messages are keyed (``customer-N``),
hashed to partitions as the gateway would, and appended in chunks through
``storage.open_store`` (which also migrates the database).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from typing import Final

import sqlalchemy as sa

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
