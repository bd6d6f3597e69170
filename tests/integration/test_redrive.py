"""Dead-letter redrive through the admin API and ``keygate dlq redrive``, on SQLite and
PostgreSQL: letters go back to their original queue with their key and properties, in
order per key, and reach the group that dead-lettered them again."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from gateway.cli import main
from gateway.client import Client
from gateway.server import Gateway
from tests.integration.conftest import native_url
from tests.support.consume import take
from tests.support.wait import eventually


async def _redrive(gateway: Gateway, **body: Any) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{gateway.ports['http']}/api/queues/orders.dlq/redrive"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.json()


async def _dead_letter_everything(client: Client, count: int) -> None:
    await client.declare_queue("orders", partitions=2, max_deliveries=1)
    for n in range(count):
        await client.publish(
            "orders", f"{'ab'[n % 2]}{n}".encode(), key="ab"[n % 2], properties={"n": n}
        )
    consumer = await client.subscribe("orders", group="g")
    for _ in range(count):
        await consumer.reject(await consumer.receive(timeout=10))
    await consumer.close(shutdown=True)


async def _dead_lettered(gateway: Gateway, count: int) -> None:
    """Dead letters are written by the group's executor after the reject: wait for them."""
    assert gateway.broker is not None
    store = gateway.store

    async def stored() -> bool:
        return (await store.depth("orders.dlq"))[0] == count

    await eventually(stored)


async def test_redrive_returns_letters_to_their_queue_in_order_with_their_key(
    gateway: Gateway,
) -> None:
    async with Client(native_url(gateway)) as client:
        await _dead_letter_everything(client, 6)
        await _dead_lettered(gateway, 6)
        status, body = await _redrive(gateway)
        assert (status, body) == (200, {"moved": 6, "skipped": 0})
        consumer = await client.subscribe("orders", group="g")
        back = await take(consumer, 6)
        for key in "ab":
            mine = [m for m in back if m.key == key]
            assert [m.properties["n"] for m in mine] == sorted(m.properties["n"] for m in mine)
        assert all(m.properties["x-redrive-count"] == 1 for m in back)
        assert not any("x-dead-letter-reason" in m.properties for m in back)
        assert not any(m.redelivered for m in back)
        status, body = await _redrive(gateway)
        assert body == {"moved": 0, "skipped": 0}


async def test_redrive_of_one_key_with_a_limit_and_a_target(gateway: Gateway) -> None:
    async with Client(native_url(gateway)) as client:
        await _dead_letter_everything(client, 6)
        await _dead_lettered(gateway, 6)
        await client.declare_queue("retry", partitions=1)
        status, body = await _redrive(gateway, key="a", limit=2, to="retry")
        assert (status, body) == (200, {"moved": 2, "skipped": 0})
        consumer = await client.subscribe("retry", group="r")
        assert [m.payload for m in await take(consumer, 2)] == [b"a0", b"a2"]
        dlq = await client.subscribe("orders.dlq", group="inspect")
        left = await take(dlq, 4)
        assert sorted(m.payload for m in left) == [b"a4", b"b1", b"b3", b"b5"]
        status, body = await _redrive(gateway)
        assert (status, body["error"]) == (409, "conflict")  # a consumer is bound to the DLQ


async def test_keygate_dlq_redrive_moves_letters_and_reports_counts(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    async with Client(native_url(gateway)) as client:
        await _dead_letter_everything(client, 4)
    await _dead_lettered(gateway, 4)
    url = f"--url=http://127.0.0.1:{gateway.ports['http']}"
    code = await asyncio.to_thread(main, ["dlq", "redrive", "orders.dlq", "--where", "key=b", url])
    assert code == 0
    assert json.loads(capsys.readouterr().out) == {"moved": 2, "left_in_place": 0}


async def test_letters_moved_out_of_a_dlq_no_longer_count_as_its_groups_lag(
    gateway: Gateway,
) -> None:
    """A DLQ group took letters and left without settling them; once a redrive moved them
    out, its in-flight and lag are 0 (sql.md: lag = messages not yet settled by the group;
    a message that is gone is not waiting for it), as after a purge."""
    async with Client(native_url(gateway)) as client:
        await _dead_letter_everything(client, 4)
        await _dead_lettered(gateway, 4)
        dlq = await client.subscribe("orders.dlq", group="inspect")
        for _ in range(4):
            await dlq.receive(timeout=10)
        await dlq.close(shutdown=True)  # none settled
    assert gateway.store is not None
    rows = await gateway.store.partition_status("orders.dlq")
    assert sum(row["in_flight"] for row in rows) == 4
    status, body = await _redrive(gateway, key="a")
    assert (status, body) == (200, {"moved": 2, "skipped": 0})
    rows = await gateway.store.partition_status("orders.dlq")
    assert (sum(row["in_flight"] for row in rows), sum(row["lag"] for row in rows)) == (2, 2)
    await _redrive(gateway)
    rows = await gateway.store.partition_status("orders.dlq")
    assert [(row["in_flight"], row["lag"]) for row in rows] == [(0, 0)] * len(rows)
