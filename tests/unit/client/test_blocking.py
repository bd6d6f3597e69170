"""The blocking SDK twin, against the fake gateway running in its own loop thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from core.errors import QueueNotFound
from gateway.client import BlockingClient
from protocols.native import Ack, Unbind
from tests.unit.client.fake_gateway import FakeGateway


@pytest.fixture
def gateway() -> Iterator[tuple[FakeGateway, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> FakeGateway:
        fake = FakeGateway()
        fake.queues["orders"] = 2
        await fake.start()
        return fake

    fake = asyncio.run_coroutine_threadsafe(start(), loop).result()
    yield fake, loop
    asyncio.run_coroutine_threadsafe(fake.stop(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


def test_blocking_client_publishes_receives_acks_and_closes(
    gateway: tuple[FakeGateway, asyncio.AbstractEventLoop],
) -> None:
    fake, loop = gateway
    with BlockingClient(fake.url, heartbeat=0) as client:
        assert client.publish("orders", b"x", key="k") == "id-1"
        with pytest.raises(QueueNotFound):
            client.publish("nope", b"x")
        consumer = client.subscribe("orders", "g", window=5)
        assert consumer.partitions == {0, 1}
        [flow] = fake.flow_ids
        loop.call_soon_threadsafe(fake.deliver, flow, 1)
        message = consumer.receive(timeout=5)
        assert message.seq == 1
        consumer.acknowledge(message)
        consumer.close()
        assert list(consumer) == []
    kinds = [type(e) for e in fake.received if isinstance(e, Ack | Unbind)]
    assert kinds == [Ack, Unbind]


def test_blocking_receive_times_out(gateway: tuple[FakeGateway, asyncio.AbstractEventLoop]) -> None:
    fake, _ = gateway
    with BlockingClient(fake.url, heartbeat=0) as client:
        consumer = client.subscribe("orders", "g")
        with pytest.raises(TimeoutError):
            consumer.receive(timeout=0.01)
