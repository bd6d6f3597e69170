"""Publishing through the admin HTTP API and ``keygate publish`` with ``delay``, ``ttl`` and
``dedup_id`` (docs/operations.md, "Publishing from the admin API")."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.server import Gateway
from tests.integration.conftest import native_url
from tests.integration.sqlcheck import Sql, declare, open_sql
from tests.support.delay import DELAY_MS, DELAYED, UNDELAYED, assert_delay_honoured
from tests.support.serve import KEYGATE


@pytest.fixture
async def sql(db_url: str) -> AsyncIterator[Sql]:
    async with open_sql(db_url) as opened:
        yield opened


_JSON = {"Content-Type": "application/json"}


def _base(gateway: Gateway) -> str:
    return f"http://127.0.0.1:{gateway.ports['http']}"


def _post(url: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 201


async def test_http_publish_with_delay_holds_the_message_back_while_a_later_one_flows(
    gateway: Gateway,
) -> None:
    await declare(gateway, "later", partitions=4)
    url = f"{_base(gateway)}/api/queues/later/messages"

    def publish_both() -> None:
        for (payload, key), delay in ((DELAYED, {"delay": DELAY_MS / 1000}), (UNDELAYED, {})):
            _post(url, {"payload": payload.decode(), "key": key, **delay})

    await assert_delay_honoured(native_url(gateway), "later", publish_both)


async def test_http_publish_stores_delay_ttl_and_dedup_id_and_refuses_bad_values(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "orders", dedup_window=300)
    url = f"{_base(gateway)}/api/queues/orders/messages"
    async with aiohttp.ClientSession() as http:
        body = {"payload": "a", "delay": 30, "ttl": 60, "dedup_id": "order-42"}
        for _ in range(2):
            assert (await http.post(url, json=body)).status == 201
        refused = []
        for bad in ({"delay": -1}, {"delay": "soon"}, {"ttl": 0}, {"dedup_id": 42}):
            response = await http.post(url, json={"payload": "b", **bad})
            refused.append((response.status, (await response.json())["message"]))
    (row,) = await sql.messages("orders")  # the second publish of order-42 was a duplicate
    assert row.deliver_at is not None and row.expire_at is not None
    assert row.deliver_at - row.publish_time == pytest.approx(30)
    assert row.expire_at - row.publish_time == pytest.approx(60)
    assert row.dedup_id == "order-42"
    assert refused == [
        (400, "delay must be at least 0"),
        (400, "delay must be a number or null"),
        (400, "ttl must be greater than 0"),
        (400, "dedup_id must be a string or null"),
    ]


def _keygate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KEYGATE, *args], capture_output=True, text=True, timeout=60)


async def test_keygate_publish_passes_delay_ttl_and_dedup_id(gateway: Gateway, sql: Sql) -> None:
    await declare(gateway, "orders", dedup_window=300)
    url = f"--url={_base(gateway)}"
    flags = ["--delay", "30", "--ttl", "60", "--dedup-id", "order-7"]
    sent = [await asyncio.to_thread(_keygate, "publish", "orders", "a", *flags, url)]
    sent.append(await asyncio.to_thread(_keygate, "publish", "orders", "a", *flags, url))
    assert [s.returncode for s in sent] == [0, 0], [s.stderr for s in sent]
    refused = await asyncio.to_thread(_keygate, "publish", "orders", "b", "--delay", "-1", url)
    assert refused.returncode == 1
    assert "delay must be at least 0" in refused.stderr
    (row,) = await sql.messages("orders")
    assert row.deliver_at is not None and row.expire_at is not None
    assert row.deliver_at - row.publish_time == pytest.approx(30)
    assert row.expire_at - row.publish_time == pytest.approx(60)
    assert row.dedup_id == "order-7"


async def test_http_publish_refuses_a_payload_that_is_not_text_and_fields_it_does_not_know(
    gateway: Gateway, sql: Sql
) -> None:
    await declare(gateway, "orders")
    url = f"{_base(gateway)}/api/queues/orders/messages"
    bodies: list[dict[str, Any]] = [
        {"payload": {"order": 1, "ok": True}},
        {"payload": None},
        {"payload": True},
        {"payload": [1, 2]},
        {"payload": 1.5},
        {"payload": "x", "payload_b64": "eA=="},
        {"payload": "x", "correlation_id": "c", "colour": "red"},
    ]
    async with aiohttp.ClientSession() as http:
        refused = []
        for body in bodies:
            async with http.post(url, json=body) as response:
                refused.append((response.status, (await response.json())["message"]))
    assert refused == [
        *[(400, "payload must be a string")] * 5,
        (400, "give payload or payload_b64, not both"),
        (400, "unknown fields: colour, correlation_id"),
    ]
    assert await sql.messages("orders") == []


async def test_http_publish_takes_a_largest_message_and_refuses_a_larger_body_with_413(
    gateway: Gateway, sql: Sql
) -> None:
    """A 5 MiB message (the default maximum) fits base64-encoded; a body over 8 MiB is
    refused before it is parsed (64 MiB bodies from a few clients stopped the gateway)."""
    await declare(gateway, "orders")
    url = f"{_base(gateway)}/api/queues/orders/messages"
    largest = base64.b64encode(b"x" * (5 * 1024 * 1024 - 64)).decode()
    async with aiohttp.ClientSession() as http:
        body = io.BytesIO(json.dumps({"payload_b64": largest}).encode())
        async with http.post(url, data=body, headers=_JSON) as response:
            assert response.status == 201, await response.text()
        body = io.BytesIO(json.dumps({"payload": "y" * (9 * 1024 * 1024)}).encode())
        async with http.post(url, data=body, headers=_JSON) as response:
            assert response.status == 413
            assert (await response.json())["error"] == "request-entity-too-large"
    assert len(await sql.messages("orders")) == 1
