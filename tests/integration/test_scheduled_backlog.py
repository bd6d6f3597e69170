"""QA: 1,000 or more messages scheduled far ahead in one partition stopped every later
message of the partition until they came due. They are held as notes, out of the group's
buffer, and read back by seq when due; beyond the notes budget they are skipped and their
range read again when the first comes due (core/notes.py); on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.client import Client
from gateway.server import Gateway
from tests.integration.conftest import native_url, start_gateway
from tests.support.consume import take

SCHEDULED = 1_100  # past the group's buffer_size (1,000)


@pytest.mark.parametrize("bind_first", [False, True])
async def test_messages_scheduled_an_hour_ahead_do_not_stop_the_other_keys(
    gateway: Gateway, bind_first: bool
) -> None:
    client = await Client(native_url(gateway)).connect()
    await client.declare_queue("later", partitions=1)
    consumer = await client.subscribe("later", group="g", window=50) if bind_first else None
    hour = time.time() + 3600
    await asyncio.gather(
        *(
            client.publish("later", b"scheduled", key=f"s{i}", deliver_at=hour)
            for i in range(SCHEDULED)
        )
    )
    if consumer is None:
        consumer = await client.subscribe("later", group="g", window=50)
    await asyncio.gather(*(client.publish("later", b"now %d" % i, key=f"k{i}") for i in range(20)))
    got = await take(consumer, 20, timeout=5)
    assert sorted(m.payload for m in got) == sorted(b"now %d" % i for i in range(20))
    with pytest.raises(TimeoutError):  # the scheduled ones wait for their hour
        await consumer.receive(timeout=0.3)
    assert gateway.broker is not None
    (runtime,) = gateway.broker.runtimes("later")
    assert runtime.status().partitions[0].buffered == 0
    await client.close()


async def test_scheduled_messages_beyond_the_notes_budget_come_when_due(db_url: str) -> None:
    # 32 KiB: notes for about a hundred; the rest are skipped and read again when due.
    gateway = await start_gateway(db_url, group_buffer_bytes=32 * 1024)
    try:
        client = await Client(native_url(gateway)).connect()
        await client.declare_queue("later", partitions=1)
        consumer = await client.subscribe("later", group="g", window=50)
        soon, hour = time.time() + 6, time.time() + 3600
        await asyncio.gather(
            *(
                client.publish("later", b"soon" if i % 3 else b"hour", key=f"s{i}", deliver_at=at)
                for i in range(1_200)
                for at in [soon if i % 3 else hour]
            )
        )
        await asyncio.gather(*(client.publish("later", b"now", key=f"k{i}") for i in range(20)))
        assert [m.payload for m in await take(consumer, 20, timeout=5)] == [b"now"] * 20
        due = await take(consumer, 800, timeout=15)
        assert time.time() >= soon - 0.05
        assert [m.payload for m in due] == [b"soon"] * 800
        with pytest.raises(TimeoutError):  # the others wait for their hour
            await consumer.receive(timeout=0.3)
        await client.close()
    finally:
        await gateway.stop()
