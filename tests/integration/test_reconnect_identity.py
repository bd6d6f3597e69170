"""A reconnect inside the rebalance delay keeps the partitions (DESIGN.md §4 Rebalance),
for SDK clients created without a name, through a real TCP cut (tests/support/proxy.py):
every connection reset on both sides, new connections refused for a while. On SQLite and
PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterable

from gateway.client import Client, Consumer
from gateway.inspect import inspect_queue
from gateway.server import Gateway
from tests.integration.conftest import native_url
from tests.support.proxy import TcpProxy
from tests.support.wait import eventually

DELAY = 10.0
KEYS = [f"k{i}" for i in range(12)]


async def _partitions(gateway: Gateway) -> dict[int, tuple[str, str | None]]:
    """Per partition of group g of queue orders: (state, owner client), as stored."""
    assert gateway.broker is not None
    (entry,) = (await inspect_queue(gateway.broker, gateway.store, "orders"))["groups"]
    return {p["partition"]: (p["state"], p["owner_client"]) for p in entry["partitions"]}


async def _owned(gateway: Gateway, partitions: Iterable[int], client: str) -> bool:
    states = await _partitions(gateway)
    return all(states[p] == ("ready", client) for p in partitions)


async def _unbound(gateway: Gateway, partitions: Iterable[int]) -> bool:
    states = await _partitions(gateway)
    return all(states[p][0] == "unbound" for p in partitions)


class _Collector:
    """Receives and acks in the background; keeps (key, n) in the order received."""

    def __init__(self, consumers: Iterable[Consumer]) -> None:
        self.seen: dict[str, tuple[str, int]] = {}
        self.order: dict[str, list[int]] = defaultdict(list)
        self._tasks = [asyncio.create_task(self._run(c)) for c in consumers]

    async def _run(self, consumer: Consumer) -> None:
        async for msg in consumer:
            key, n = msg.payload.decode().split(":")
            if msg.message_id not in self.seen:
                self.seen[msg.message_id] = (key, int(n))
                self.order[key].append(int(n))
            await consumer.acknowledge(msg)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _publish(gateway: Gateway, rounds: range) -> None:
    async with Client(native_url(gateway)) as producer:
        for n in rounds:
            await asyncio.gather(
                *(producer.publish("orders", f"{k}:{n}".encode(), key=k) for k in KEYS)
            )


async def _cut_and_restore(proxy: TcpProxy, gateway: Gateway, held: frozenset[int]) -> float:
    """Cut the network; once the gateway holds ``held`` unbound (reserved) and the client
    has been refused at least once, let it through again. Returns when the cut began."""
    started = time.monotonic()
    proxy.cut()
    await eventually(lambda: _unbound(gateway, held), timeout=5, interval=0.01)
    await eventually(lambda: proxy.refused >= 1, timeout=10)
    proxy.restore()
    return started


async def _declare(gateway: Gateway) -> None:
    async with Client(native_url(gateway)) as admin:
        await admin.declare_queue("orders", partitions=6, rebalance_delay=DELAY)


async def test_an_unnamed_client_cut_off_inside_the_rebalance_delay_gets_its_partitions_back(
    gateway: Gateway,
) -> None:
    await _declare(gateway)
    async with TcpProxy(gateway.ports["native"]) as proxy:
        a_client = await Client(proxy.url).connect()
        b_client = await Client(native_url(gateway)).connect()
        a = await a_client.subscribe("orders", group="g", window=5)
        b = await b_client.subscribe("orders", group="g", window=5)
        await eventually(lambda: len(a.partitions) == 3 and len(b.partitions) == 3)
        before_a, before_b = a.partitions, b.partitions
        collector = _Collector([a, b])
        await _publish(gateway, range(10))
        await eventually(lambda: len(collector.seen) >= 40)

        started = await _cut_and_restore(proxy, gateway, before_a)
        await eventually(lambda: a_client.session.reconnects == 1, timeout=10)
        await eventually(lambda: _owned(gateway, before_a, a_client.client_name), timeout=5)
        assert time.monotonic() - started < DELAY / 2  # back long before the delay ends
        assert a.partitions == before_a
        assert b.partitions == before_b
        assert await _owned(gateway, before_b, b_client.client_name)

        await _publish(gateway, range(10, 20))
        await eventually(lambda: len(collector.seen) == 20 * len(KEYS), timeout=15)
        await collector.stop()
        assert a.partitions == before_a and b.partitions == before_b  # nothing moved since
        assert all(collector.order[k] == list(range(20)) for k in KEYS)
        await a_client.close()
        await b_client.close()


async def test_two_consumers_of_one_client_cut_together_each_get_their_own_partitions_back(
    gateway: Gateway,
) -> None:
    await _declare(gateway)
    async with TcpProxy(gateway.ports["native"]) as proxy:
        a_client = await Client(proxy.url).connect()
        b_client = await Client(native_url(gateway)).connect()
        a1 = await a_client.subscribe("orders", group="g", window=5)
        a2 = await a_client.subscribe("orders", group="g", window=5)
        b = await b_client.subscribe("orders", group="g", window=5)
        consumers = (a1, a2, b)
        await eventually(lambda: all(len(c.partitions) == 2 for c in consumers))
        before = [c.partitions for c in consumers]
        collector = _Collector(consumers)

        await _cut_and_restore(proxy, gateway, before[0] | before[1])
        await eventually(lambda: a_client.session.reconnects == 1, timeout=10)
        await eventually(lambda: _owned(gateway, before[0] | before[1], a_client.client_name))
        assert [c.partitions for c in consumers] == before
        assert a1.flow_id != a2.flow_id

        await _publish(gateway, range(10))
        await eventually(lambda: len(collector.seen) == 10 * len(KEYS), timeout=15)
        await collector.stop()
        assert [c.partitions for c in consumers] == before
        assert all(collector.order[k] == list(range(10)) for k in KEYS)
        await a_client.close()
        await b_client.close()


async def test_a_fresh_client_after_a_restart_is_a_newcomer(gateway: Gateway) -> None:
    await _declare(gateway)
    async with TcpProxy(gateway.ports["native"]) as proxy:
        a_client = await Client(proxy.url).connect()
        b_client = await Client(native_url(gateway)).connect()
        a = await a_client.subscribe("orders", group="g", window=5)
        b = await b_client.subscribe("orders", group="g", window=5)
        await eventually(lambda: len(a.partitions) == 3 and len(b.partitions) == 3)
        before_a, before_b = a.partitions, b.partitions
        proxy.cut()
        a_client.abort()  # the process died with the network
        await eventually(lambda: _unbound(gateway, before_a), timeout=5, interval=0.01)
        proxy.restore()

        restarted = await Client(proxy.url).connect()
        assert restarted.client_name != a_client.client_name
        c = await restarted.subscribe("orders", group="g", window=5)
        # A newcomer: it shares the free partitions with B (a rebalance), while A's stay
        # reserved for A until the delay expires.
        await eventually(lambda: len(c.partitions) == 1 and len(b.partitions) == 2)
        assert c.partitions | b.partitions == before_b
        assert await _unbound(gateway, before_a)
        await restarted.close()
        await b_client.close()
