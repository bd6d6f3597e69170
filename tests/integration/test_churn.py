"""Consumer churn under load, through the real gateway on SQLite and PostgreSQL.

While keyed messages are published, consumers of one group join, leave gracefully and
crash (socket dropped) at random — seeded, so a failure replays. At the end every message
was processed (at-least-once: duplicates allowed) and, per key, the first processing of
each message happened in publish order: DESIGN.md §4's per-key order across failure.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections import defaultdict

import pytest

from gateway.client import Client, ClientClosed, ConsumerClosed
from gateway.server import Gateway
from tests.integration.conftest import native_url
from tests.support.wait import eventually

KEYS = 40
PER_KEY = 60
# CI runs two seeds; KEYGATE_CHURN_SEEDS=3,4,5,... runs more for a deeper soak.
SEEDS = [int(seed) for seed in os.environ.get("KEYGATE_CHURN_SEEDS", "1,2").split(",")]


class World:
    def __init__(self, gateway: Gateway, seed: int) -> None:
        self.url = native_url(gateway)
        self.rng = random.Random(seed)
        self.processed: dict[str, list[int]] = defaultdict(list)
        self.members: list[tuple[Client, asyncio.Task[None]]] = []
        self.published = asyncio.Event()

    def unique(self) -> int:
        return sum(len(set(values)) for values in self.processed.values())

    async def join(self, name: str) -> None:
        client = await Client(self.url, client_name=name).connect()
        consumer = await client.subscribe("orders", group="g", window=self.rng.choice([1, 5, 20]))

        async def work() -> None:
            try:
                while True:
                    msg = await consumer.receive(timeout=30)
                    key, n = msg.payload.decode().split(":")
                    self.processed[key].append(int(n))
                    await consumer.acknowledge(msg)
            except (ConsumerClosed, ClientClosed, ConnectionError, TimeoutError):
                return

        self.members.append((client, asyncio.create_task(work())))

    async def leave(self, *, crash: bool) -> None:
        client, task = self.members.pop(self.rng.randrange(len(self.members)))
        if crash:
            client.abort()
        else:
            await client.close()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _publish(url: str) -> None:
    async with Client(url) as producer:
        for n in range(PER_KEY):
            await asyncio.gather(
                *(
                    producer.publish("orders", f"k{k}:{n}".encode(), key=f"k{k}")
                    for k in range(KEYS)
                )
            )


@pytest.mark.parametrize("seed", SEEDS)
async def test_per_key_order_and_no_loss_through_consumer_churn(
    gateway: Gateway, seed: int
) -> None:
    async with Client(native_url(gateway)) as admin:
        await admin.declare_queue("orders", partitions=8, rebalance_delay=0.3, max_handoff_time=0.3)
    world = World(gateway, seed)
    await world.join("c0")
    publisher = asyncio.create_task(_publish(world.url))
    names = iter(range(1, 1000))
    while not publisher.done():
        await asyncio.sleep(world.rng.uniform(0.05, 0.3))
        roll = world.rng.random()
        if roll < 0.4 or len(world.members) < 2:
            await world.join(f"c{next(names)}")
        elif roll < 0.7:
            await world.leave(crash=True)
        elif len(world.members) > 1:
            await world.leave(crash=False)
    await publisher
    await eventually(lambda: world.unique() == KEYS * PER_KEY, timeout=60)
    for key, values in world.processed.items():
        first_seen = list(dict.fromkeys(values))
        assert first_seen == list(range(PER_KEY)), f"{key}: {first_seen[:20]}"
    for client, task in world.members:
        await client.close()
        task.cancel()
