"""A group is consumed by native flows or by a Spark job, never both at once (DESIGN.md §7):
the gateway refuses a bind while Spark holds the group, and Spark refuses a group with
native consumers. Checked through the same SQL lease the two sides really use."""

from __future__ import annotations

import asyncio
import time

import pytest

from core.errors import GroupLeased
from core.model import GroupConfig
from gateway.client import Client
from gateway.server import Gateway
from spark import lease
from spark.db import commit_through
from storage.engine import sync_engine
from tests.integration.conftest import native_url


def _spark_acquire(db_url: str, owner: str) -> None:
    engine = sync_engine(db_url)
    try:
        with engine.begin() as conn:
            lease.acquire(conn, "orders", "billing", owner, ttl=60.0, now=time.time())
    finally:
        engine.dispose()


def _spark_release(db_url: str, owner: str) -> None:
    engine = sync_engine(db_url)
    try:
        with engine.begin() as conn:
            lease.release(conn, "orders", "billing", owner)
    finally:
        engine.dispose()


async def test_a_group_held_by_spark_refuses_native_binds_and_vice_versa(
    gateway: Gateway, db_url: str
) -> None:
    assert gateway.broker is not None
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=2)
        await gateway.broker.create_group(GroupConfig("orders", "billing"))
        await asyncio.to_thread(_spark_acquire, db_url, "spark-job-1")
        with pytest.raises(GroupLeased):
            await client.subscribe("orders", group="billing")
        await asyncio.to_thread(_spark_release, db_url, "spark-job-1")
        consumer = await client.subscribe("orders", group="billing")
        with pytest.raises(GroupLeased, match="native"):
            await asyncio.to_thread(_spark_acquire, db_url, "spark-job-2")
        await consumer.close()


def _spark_commits(db_url: str, owner: str, end: dict[int, int]) -> None:
    """What a Spark job does with the group: take its lease, commit through ``end``, let
    it go (spark.lease, spark.db.commit_through)."""
    engine = sync_engine(db_url)
    try:
        with engine.begin() as conn:
            lease.acquire(conn, "orders", "billing", owner, ttl=60.0, now=time.time())
            commit_through(conn, "orders", "billing", end, time.time())
            lease.release(conn, "orders", "billing", owner)
    finally:
        engine.dispose()


async def test_native_consumers_resume_where_a_spark_job_committed(
    gateway: Gateway, db_url: str
) -> None:
    """DESIGN.md §7: Spark's commit advances the group in SQL, and the gateway sees it.
    The gateway kept the group it had loaded for an earlier native consumer in memory,
    and a native consumer after the Spark job got what Spark had committed once more."""
    assert gateway.broker is not None
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=1)
        for i in range(6):
            await client.publish("orders", b"%d" % i, key="k")
        first = await client.subscribe("orders", group="billing")
        for _ in range(2):
            await first.acknowledge(await first.receive(timeout=10))
        await first.close(shutdown=True)
        # The gateway gives the group up once no consumer is bound (housekeeping).
        await gateway.broker.groups.renew_leases()
        await asyncio.to_thread(_spark_commits, db_url, "spark-job", {0: 4})
        second = await client.subscribe("orders", group="billing")
        got = [await second.receive(timeout=10) for _ in range(2)]
        assert [m.payload for m in got] == [b"4", b"5"]
        await second.close()
