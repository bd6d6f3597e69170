"""Fairness in the commit path: a connection with one publish queued rides the next
commit or the one after, however much other connections have queued (storage.batcher
takes turns between sources), and the writes the gateway's safety depends on (its lease)
go ahead of the writes waiting (docs/performance.md, "Fairness")."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator, Hashable
from typing import Any

import pytest
import sqlalchemy as sa

from gateway import server
from gateway.client import Client
from gateway.server import Gateway
from protocols.native.encoding import encode
from protocols.native.events import Hello, Publish
from storage.appends import AppendCall
from storage.schema import kg_gateway_lease
from storage.store import SqlStore, open_store
from tests.integration.conftest import native_url, start_gateway
from tests.support.wait import eventually

# Batches smaller than the default (1,000), so that a few MiB of publishes are a backlog
# of many commits, yet as the default larger than a lot: a connection's lot is what one
# read brought (protocols.native.listener.READ_SIZE, 256 KiB: ~250 of these publishes).
MAX_BATCH = 300
FLOODERS = 4
PER_FLOODER = 3000
# The backlog, in batches, that must be queued when the canary publishes.
BACKLOG_BATCHES = 20


@pytest.fixture
async def small_batch_gateway(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Gateway]:
    monkeypatch.setattr(server, "open_store", functools.partial(open_store, max_batch=MAX_BATCH))
    gw = await start_gateway(db_url)
    try:
        yield gw
    finally:
        await gw.stop()


async def _flood(port: int, ready: asyncio.Event) -> None:
    """A native connection that sends PER_FLOODER 1 KiB publishes without waiting for any
    confirm (reading them all the while), then stays open until cancelled."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    body = b"F" * 1024
    frames = [encode(Hello(client_name="flood"))]
    frames += [
        encode(Publish(request_id=i + 2, queue="flood", key=f"k{i % 64}", payload=body))
        for i in range(PER_FLOODER)
    ]
    ready.set()
    writer.write(b"".join(frames))
    try:
        while await reader.read(65536):
            pass
    finally:
        writer.close()


async def test_a_publish_is_confirmed_within_a_few_commits_behind_a_flood(
    small_batch_gateway: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway = small_batch_gateway
    store = gateway.store
    assert store is not None
    async with Client(native_url(gateway), client_name="canary") as canary:
        await canary.declare_queue("flood", partitions=4)
        await canary.declare_queue("canary", partitions=1)
        await canary.publish("canary", b"warm-up")
        floods = []
        for _ in range(FLOODERS):
            ready = asyncio.Event()
            floods.append(asyncio.create_task(_flood(gateway.ports["native"], ready)))
            await ready.wait()
        try:
            await eventually(
                lambda: store.appends_pending >= BACKLOG_BATCHES * MAX_BATCH, interval=0.001
            )
            commits: list[int] = []  # when the canary's lot was queued, and committed
            enqueue = store.appender.enqueue

            def spy(calls: list[AppendCall], weight: int = 1, *, source: Hashable = None) -> Any:
                future = enqueue(calls, weight, source=source)
                if calls[0].messages[0].queue == "canary":
                    commits.append(store.appender.commits)
                    future.add_done_callback(lambda _: commits.append(store.appender.commits))
                return future

            monkeypatch.setattr(store.appender, "enqueue", spy)
            await canary.publish("canary", b"canary")
            # Counted in commits from the moment the canary's lot was queued, not in wall
            # time (what the flood's commits take depends on the machine): it waits for
            # the batch committing then (and, under load, possibly one formed before it
            # arrived), and rides the next one — not the BACKLOG_BATCHES queued ahead of it
            # (it waited 29-30 commits before the batches took turns).
            queued, committed = commits
            assert committed - queued <= 3, f"the canary waited {committed - queued} commits"
            assert store.appends_pending > MAX_BATCH, "the flood's backlog was gone too soon"
        finally:
            for flood in floods:
                flood.cancel()
            for flood in floods:
                with contextlib.suppress(asyncio.CancelledError):
                    await flood


async def test_the_gateway_lease_is_renewed_ahead_of_the_writes_waiting(store: SqlStore) -> None:
    epoch = await store.acquire_gateway_lease("gw", "me", ttl=30)
    started, release = threading.Event(), threading.Event()
    seen: list[float] = []

    def busy(conn: sa.Connection) -> None:
        started.set()
        release.wait(10)

    def look(conn: sa.Connection) -> None:
        seen.append(conn.execute(sa.select(kg_gateway_lease.c.expires_at)).scalar_one())

    first = asyncio.ensure_future(store.write(busy))
    await asyncio.to_thread(started.wait, 10)
    waiting = asyncio.ensure_future(store.write(look))
    await asyncio.sleep(0.05)  # queued: for SQLite's write lock, or for the writer thread
    renewal = asyncio.ensure_future(store.acquire_gateway_lease("gw", "me", ttl=3600, epoch=epoch))
    await asyncio.sleep(0.05)
    release.set()
    assert await renewal == epoch
    await asyncio.gather(first, waiting)
    # The write queued first ran after the renewal: it saw the new expiry.
    ((expires_at,),) = [seen]
    assert expires_at > time.time() + 1000  # not the first expiry, 30 s from then
