"""The per-key poison policy (queue setting on_dead_letter) with real SDK consumers, on
SQLite and PostgreSQL: a failing key stops or follows its dead letter while other keys
keep flowing; a parked key survives a restart and resumes in order once released."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from core.errors import QueueNotFound
from gateway.cli import main
from gateway.client import Client, Consumer
from gateway.inspect import inspect_queue
from gateway.server import Gateway
from storage.store import SqlStore
from tests.integration.conftest import native_url, start_gateway
from tests.support.consume import take
from tests.support.wait import eventually


async def _setup(client: Client, policy: str) -> Consumer:
    """orders (one partition, one delivery each) holds a1 b1 a2 b2 a3; a1 is rejected."""
    await client.declare_queue("orders", partitions=1, max_deliveries=1, on_dead_letter=policy)
    for name in ("a1", "b1", "a2", "b2", "a3"):
        await client.publish("orders", name.encode(), key=name[0])
    consumer = await client.subscribe("orders", group="g", window=1)
    first = await consumer.receive(timeout=10)
    assert first.payload == b"a1"
    await consumer.reject(first)
    return consumer


async def _payloads(consumer: Consumer, count: int) -> list[bytes]:
    return [m.payload for m in await take(consumer, count)]


async def _dead_letters(client: Client, count: int) -> list[tuple[bytes, Any]]:
    dlq = await client.subscribe("orders.dlq", group="inspect")
    return [(m.payload, m.properties["x-dead-letter-reason"]) for m in await take(dlq, count)]


async def _release(gateway: Gateway, key: str, **body: Any) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{gateway.ports['http']}/api/queues/orders/groups/g/keys/{key}/release"
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        return response.status, await response.json()


async def _metrics(gateway: Gateway) -> str:
    url = f"http://127.0.0.1:{gateway.ports['http']}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return await response.text()


async def test_continue_lets_the_rest_of_the_key_flow(gateway: Gateway) -> None:
    async with Client(native_url(gateway)) as client:
        consumer = await _setup(client, "continue")
        assert await _payloads(consumer, 4) == [b"b1", b"a2", b"b2", b"a3"]


async def test_a_parked_key_waits_while_other_keys_flow_and_resumes_in_order_on_release(
    gateway: Gateway,
) -> None:
    assert gateway.broker is not None
    store = gateway.store
    async with Client(native_url(gateway)) as client:
        consumer = await _setup(client, "park_key")
        assert await _payloads(consumer, 2) == [b"b1", b"b2"]
        await client.publish("orders", b"b3", key="b")
        # a2 is stored before b3: had key a not been parked, it would come first.
        assert await _payloads(consumer, 1) == [b"b3"]
        rows = await store.parked_keys("orders", "g")
        assert [(r["partition"], r["key"], r["reason"]) for r in rows] == [(0, "a", "rejected")]
        assert 'keygate_group_parked_keys{group="g",queue="orders"} 1.0' in await _metrics(gateway)
        assert await _release(gateway, "a") == (
            200,
            {"queue": "orders", "group": "g", "key": "a", "partitions": [0], "skip": False},
        )
        assert await _payloads(consumer, 2) == [b"a2", b"a3"]
        assert await store.parked_keys("orders", "g") == []
        status, body = await _release(gateway, "a")
        assert (status, body["error"]) == (404, "key-not-parked")
        assert await _dead_letters(client, 1) == [(b"a1", "rejected")]


async def test_a_parked_key_stays_parked_across_a_restart(db_url: str) -> None:
    gateway = await start_gateway(db_url)
    try:
        async with Client(native_url(gateway)) as client:
            consumer = await _setup(client, "park_key")
            assert await _payloads(consumer, 2) == [b"b1", b"b2"]
            await consumer.close(shutdown=True)
    finally:
        await gateway.stop()
    gateway = await start_gateway(db_url)
    try:
        async with Client(native_url(gateway)) as client:
            consumer = await client.subscribe("orders", group="g", window=1)
            await client.publish("orders", b"b3", key="b")
            assert await _payloads(consumer, 1) == [b"b3"]
            assert (await _release(gateway, "a"))[0] == 200
            assert await _payloads(consumer, 2) == [b"a2", b"a3"]
    finally:
        await gateway.stop()


async def test_release_with_skip_from_the_cli_dead_letters_the_held_messages(
    gateway: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    async with Client(native_url(gateway)) as client:
        consumer = await _setup(client, "park_key")
        assert await _payloads(consumer, 2) == [b"b1", b"b2"]
        url = f"--url=http://127.0.0.1:{gateway.ports['http']}"
        code = await asyncio.to_thread(main, ["key", "release", "orders", "g", "a", "--skip", url])
        assert code == 0
        assert json.loads(capsys.readouterr().out)["partitions"] == [0]
        await client.publish("orders", b"a4", key="a")
        assert await _payloads(consumer, 1) == [b"a4"]
        assert await _dead_letters(client, 3) == [
            (b"a1", "rejected"),
            (b"a2", "key-dead-lettered"),
            (b"a3", "key-dead-lettered"),
        ]


async def test_dead_letter_key_moves_the_rest_of_the_key_in_order(gateway: Gateway) -> None:
    assert gateway.broker is not None
    store = gateway.store
    async with Client(native_url(gateway)) as client:
        consumer = await _setup(client, "dead_letter_key")
        assert await _payloads(consumer, 2) == [b"b1", b"b2"]

        async def letters() -> bool:
            return (await store.depth("orders.dlq"))[0] == 3

        await eventually(letters)
        await client.publish("orders", b"a4", key="a")
        assert await _payloads(consumer, 1) == [b"a4"]
        assert await _dead_letters(client, 3) == [
            (b"a1", "rejected"),
            (b"a2", "key-dead-lettered"),
            (b"a3", "key-dead-lettered"),
        ]


async def test_kg_key_status_shows_parked_redelivered_and_waiting_keys(gateway: Gateway) -> None:
    assert gateway.store is not None
    engine = gateway.store.engine
    async with Client(native_url(gateway)) as client:
        await client.declare_queue(
            "orders", partitions=1, max_deliveries=3, backoff_initial=0.0, on_dead_letter="park_key"
        )
        for name in ("a1", "d1", "c1", "b1"):
            await client.publish("orders", name.encode(), key=name[0])
        consumer = await client.subscribe("orders", group="g", window=1)
        await consumer.reject(await consumer.receive(timeout=10))
        d1 = await consumer.receive(timeout=10)
        await consumer.negative_acknowledge(d1, delay=600.0)  # waits: a row from the flush
        c1 = await consumer.receive(timeout=10)
        await consumer.negative_acknowledge(c1)
        again = await consumer.receive(timeout=10)
        assert (again.payload, again.delivery_count) == (b"c1", 2)

        async def rows() -> list[tuple[Any, ...]] | None:
            query = sa.text(
                "SELECT key, reason, detail, attempts, messages FROM kg_key_status "
                "WHERE queue = 'orders' AND group_name = 'g' ORDER BY key"
            )
            async with engine.connect() as conn:
                found = [tuple(r) for r in await conn.execute(query)]
            return found if len(found) == 3 else None

        assert await eventually(rows) == [
            ("a", "parked", "rejected", None, None),
            ("c", "retry", None, 2, 1),
            ("d", "retry", None, 1, 1),
        ]
        # The admin API (console, `keygate inspect`) shows the same keys for the group.
        (group,) = (await inspect_queue(gateway.broker, gateway.store, "orders"))["groups"]
        shown = [(k["key"], k["reason"], k["attempts"]) for k in group["keys"]]
        assert shown == [("a", "parked", None), ("c", "retry", 2), ("d", "retry", 1)]


async def test_dead_letter_key_moves_stored_messages_the_group_has_not_read_yet(
    db_url: str,
) -> None:
    """With a load buffer of 4, most of key a is still only in storage when its head is
    dead-lettered: all of it reaches the DLQ in publish order, in that one transaction."""
    gateway = await start_gateway(db_url, buffer_size=4)
    try:
        assert gateway.broker is not None
        store = gateway.store
        async with Client(native_url(gateway)) as client:
            await client.declare_queue(
                "orders", partitions=1, max_deliveries=1, on_dead_letter="dead_letter_key"
            )
            audit = await client.subscribe("orders", group="audit", start="earliest")
            names = ["a1", "b1"] + [f"a{i}" for i in range(2, 13)] + ["b2", "b3"]
            for name in names:
                await client.publish("orders", name.encode(), key=name[0])
            consumer = await client.subscribe("orders", group="g", window=1, start="earliest")
            first = await consumer.receive(timeout=10)
            assert first.payload == b"a1"
            await consumer.reject(first)

            depth = await eventually(lambda: _dlq_depth(store))
            assert depth == 12  # never a part of the key: one transaction
            assert await _payloads(consumer, 3) == [b"b1", b"b2", b"b3"]
            await client.publish("orders", b"a13", key="a")
            assert await _payloads(consumer, 1) == [b"a13"]
            assert await _dead_letters(client, 12) == [(b"a1", "rejected")] + [
                (f"a{i}".encode(), "key-dead-lettered") for i in range(2, 13)
            ]
            # The other group of the queue still gets every message, in order.
            assert await _payloads(audit, len(names) + 1) == [n.encode() for n in names] + [b"a13"]
    finally:
        await gateway.stop()


async def _dlq_depth(store: SqlStore) -> int:
    try:
        return (await store.depth("orders.dlq"))[0]
    except QueueNotFound:
        return 0


async def test_kg_key_status_shows_a_key_held_by_strict_order(gateway: Gateway) -> None:
    assert gateway.store is not None
    engine = gateway.store.engine
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=1)
        for name in ("a1", "b1", "a2", "b2"):
            await client.publish("orders", name.encode(), key=name[0])
        consumer = await client.subscribe("orders", group="g", window=2, key_order="strict")
        a1 = await consumer.receive(timeout=10)
        b1 = await consumer.receive(timeout=10)
        assert (a1.payload, b1.payload) == (b"a1", b"b1")
        # b1 acked above the unacked a1; b2 follows it; a2 waits behind a1.
        await consumer.acknowledge(b1)
        b2 = await consumer.receive(timeout=10)
        assert b2.payload == b"b2"

        async def rows() -> list[tuple[Any, ...]] | None:
            query = sa.text(
                "SELECT key, reason, detail, message_id, attempts, messages, blocked_since "
                "FROM kg_key_status WHERE queue = 'orders' AND group_name = 'g'"
            )
            async with engine.connect() as conn:
                found = [tuple(r) for r in await conn.execute(query)]
            return found if len(found) == 1 else None  # b waits too until b1's ack is flushed

        [(key, reason, detail, message_id, attempts, messages, since)] = await eventually(rows)
        assert (key, reason, detail, message_id, attempts, messages) == (
            "a",
            "strict",
            None,
            a1.message_id,
            1,
            None,
        )
        assert a1.publish_time <= since <= time.time()
        await consumer.acknowledge(a1)
        assert await _payloads(consumer, 1) == [b"a2"]
        await eventually(lambda: _no_rows(engine))


async def _no_rows(engine: AsyncEngine) -> bool:
    async with engine.connect() as conn:
        return not list(await conn.execute(sa.text("SELECT * FROM kg_key_status")))
