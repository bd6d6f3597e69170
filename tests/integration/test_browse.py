"""Browsing a queue through the admin API shows stored messages without consuming them."""

from __future__ import annotations

from typing import Any

import aiohttp

from gateway.client import Client
from gateway.server import Gateway
from tests.integration.conftest import native_url


async def _get(gateway: Gateway, path: str) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{gateway.ports['http']}{path}"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.json()


async def test_browse_shows_messages_in_partition_and_seq_order_without_consuming_them(
    gateway: Gateway,
) -> None:
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=2)
        for n in range(6):
            await client.publish("orders", f"m{n}".encode(), key=f"k{n % 3}")
        await client.publish("orders", b"\xff\x00", key="bin", properties={"raw": b"\x01"})
        consumer = await client.subscribe("orders", group="g", window=1)
        first = await consumer.receive(timeout=5)  # delivered, unacked: still stored
        status, rows = await _get(gateway, "/api/queues/orders/messages")
        assert status == 200 and len(rows) == 7
        assert [(r["partition"], r["seq"]) for r in rows] == sorted(
            (r["partition"], r["seq"]) for r in rows
        )
        assert first.message_id in {r["message_id"] for r in rows}
        (binary,) = [r for r in rows if r["key"] == "bin"]
        assert binary["payload"] is None and binary["payload_b64"] == "/wA="
        assert binary["properties"] == {"raw": {"$b64": "AQ=="}}
        p = binary["partition"]
        _, one = await _get(gateway, f"/api/queues/orders/messages?partition={p}&limit=1")
        assert [r["partition"] for r in one] == [p] and one[0]["seq"] == 1
        _, later = await _get(gateway, f"/api/queues/orders/messages?partition={p}&from_seq=2")
        assert [r["seq"] for r in later] == list(range(2, 2 + len(later)))
        _, again = await _get(gateway, "/api/queues/orders/messages")
        assert len(again) == 7  # browsing consumed nothing


async def test_browse_refuses_bad_parameters_and_unknown_queues(gateway: Gateway) -> None:
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=2)
    for query in ("limit=0", "limit=1001", "partition=-1", "from_seq=x"):
        status, body = await _get(gateway, f"/api/queues/orders/messages?{query}")
        assert (status, body["error"]) == (400, "invalid-argument"), query
    status, body = await _get(gateway, "/api/queues/nope/messages")
    assert (status, body["error"]) == (404, "queue-not-found")
