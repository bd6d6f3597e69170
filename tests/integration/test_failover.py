"""Active/standby failover with real ``keygate serve`` processes on one PostgreSQL schema.

The frozen-active scenario of issue 17: the active gateway is frozen (SIGSTOP) while a
client queues publishes on its socket; the standby takes over; a consumer on it drains;
then the old gateway is thawed. Every publish confirmed by either gateway must be
delivered by the new one, and the old one must exit non-zero (its writes are fenced).
"""

from __future__ import annotations

import asyncio
import os
import signal
from contextlib import ExitStack
from pathlib import Path

import pytest

from gateway.client import Client, Consumer
from tests.support.serve import serve

pytestmark = pytest.mark.postgres

LEASE_TTL = "2"
QUEUED = 50


async def _publish(client: Client, payload: bytes) -> bytes | None:
    """The payload if the gateway confirmed it, None if it refused or the link broke."""
    try:
        async with asyncio.timeout(60):
            await client.publish("orders", payload, key=f"k{payload[-1] % 5}")
    except Exception:
        return None
    return payload


async def _drain(consumer: Consumer, delivered: set[bytes], until: set[bytes]) -> None:
    """Receive and ack into ``delivered`` until it holds every payload of ``until``."""
    while not until <= delivered:
        message = await consumer.receive(timeout=30)
        delivered.add(message.payload)
        await consumer.acknowledge(message)


@pytest.mark.parametrize("attempt", range(2))
async def test_a_frozen_active_gateway_confirms_nothing_after_the_takeover_and_exits(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attempt: int
) -> None:
    monkeypatch.setenv("KEYGATE_LEASE_TTL", LEASE_TTL)
    with ExitStack() as stack:
        proc_a, ports_a, log_a = stack.enter_context(serve(postgres_url, tmp_path, name="a"))
        async with Client(f"keygate://127.0.0.1:{ports_a['native']}") as publisher:
            await publisher.declare_queue("orders", partitions=4)
            before = [await _publish(publisher, b"before-%d" % i) for i in range(10)]
            assert all(before)

            os.kill(proc_a.pid, signal.SIGSTOP)
            try:
                queued = [
                    asyncio.create_task(_publish(publisher, b"queued-%d" % i))
                    for i in range(QUEUED)
                ]
                # B waits for A's lease to lapse, takes over and opens its ports.
                _, ports_b, _ = await asyncio.to_thread(
                    stack.enter_context, serve(postgres_url, tmp_path, name="b")
                )
                async with Client(f"keygate://127.0.0.1:{ports_b['native']}") as reader:
                    consumer = await reader.subscribe("orders", group="g", start="earliest")
                    delivered: set[bytes] = set()
                    await _drain(consumer, delivered, {p for p in before if p})
            finally:
                os.kill(proc_a.pid, signal.SIGCONT)

            confirmed = {p for p in await asyncio.gather(*queued) if p}
            assert await asyncio.to_thread(proc_a.wait, 30) != 0, log_a.read_text()
            assert "stopping at once" in log_a.read_text()
            async with Client(f"keygate://127.0.0.1:{ports_b['native']}") as reader:
                consumer = await reader.subscribe("orders", group="g")
                await _drain(consumer, delivered, confirmed)
