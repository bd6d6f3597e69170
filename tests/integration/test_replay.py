"""Replay: a queue that keeps settled messages, and a group moved back (or forward) with
``keygate group reset`` through the admin API — on SQLite and PostgreSQL."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import aiohttp

from gateway.client import Client, Consumer
from gateway.server import Gateway
from tests.integration.conftest import native_url
from tests.support.consume import take


async def _reset(gateway: Gateway, to: str, *, force: bool = False) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{gateway.ports['http']}/api/queues/orders/groups/g/reset"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json={"to": to, "force": force}) as response,
    ):
        return response.status, await response.json()


async def _take(consumer: Consumer, count: int) -> list[str]:
    return [m.payload.decode() for m in await take(consumer, count)]


async def _publish(client: Client, first: int, last: int) -> None:
    for n in range(first, last):
        await client.publish("orders", f"m{n}".encode(), key="k")


async def test_a_group_reset_to_earliest_replays_what_retention_kept(gateway: Gateway) -> None:
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=2, retention=3600)
        await _publish(client, 0, 5)
        consumer = await client.subscribe("orders", group="g")
        assert await _take(consumer, 5) == [f"m{n}" for n in range(5)]
        status, body = await _reset(gateway, "earliest")
        assert (status, body["error"]) == (409, "conflict")  # a consumer is bound
        await consumer.close(shutdown=True)
        status, body = await _reset(gateway, "earliest")
        assert status == 200, body
        again = await client.subscribe("orders", group="g")
        assert await _take(again, 5) == [f"m{n}" for n in range(5)]


async def test_a_forced_reset_rebinds_the_bound_consumer_at_the_new_position(
    gateway: Gateway,
) -> None:
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=2, retention=3600)
        await _publish(client, 0, 3)
        consumer = await client.subscribe("orders", group="g")
        assert await _take(consumer, 3) == ["m0", "m1", "m2"]
        status, _ = await _reset(gateway, "earliest", force=True)
        assert status == 200
        assert await _take(consumer, 3) == ["m0", "m1", "m2"]  # the same consumer, replayed
        await _publish(client, 3, 4)
        assert await _take(consumer, 1) == ["m3"]


async def test_a_reset_to_a_time_or_to_latest_skips_what_came_before(gateway: Gateway) -> None:
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=1, retention=3600)
        await (await client.subscribe("orders", group="g")).close(shutdown=True)
        await _publish(client, 0, 3)
        middle = datetime.fromtimestamp(time.time(), UTC).isoformat()
        await _publish(client, 3, 6)
        status, body = await _reset(gateway, f"time:{middle}")
        assert (status, body["committed"]) == (200, {"0": 3})
        consumer = await client.subscribe("orders", group="g")
        assert await _take(consumer, 3) == ["m3", "m4", "m5"]
        await consumer.close(shutdown=True)
        assert (await _reset(gateway, "seq:0=2"))[1]["committed"] == {"0": 1}
        assert (await _reset(gateway, "latest"))[1]["committed"] == {"0": 6}
        status, body = await _reset(gateway, "seq:5=1")
        assert (status, body["error"]) == (400, "invalid-argument")
        consumer = await client.subscribe("orders", group="g")
        await _publish(client, 6, 7)
        assert await _take(consumer, 1) == ["m6"]
