"""The SDK's address list: active/standby gateways in one service URL."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest

from core.errors import InvalidArgument
from gateway.client import Backoff, Client
from gateway.client.client import parse_url
from protocols.native import Bind
from tests.unit.client.fake_gateway import FakeGateway

FAST = Backoff(initial=0.01, maximum=0.05)


def _closed_port() -> int:
    """A loopback port nobody listens on (a standby keeps its ports closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


@pytest.fixture
async def pair() -> AsyncIterator[tuple[FakeGateway, FakeGateway]]:
    first, second = FakeGateway(), FakeGateway()
    for fake in (first, second):
        fake.queues["orders"] = 2
        await fake.start()
    yield first, second
    for fake in (first, second):
        await fake.stop()  # closing twice is harmless


def test_a_service_url_lists_several_gateways_in_order() -> None:
    assert parse_url("keygate://a:1,b,[::1]:3") == (
        (("a", 1), ("b", 55555), ("::1", 3)),
        False,
    )
    assert parse_url("keygates://gw:7") == ((("gw", 7),), True)
    for bad in ("keygate://a:1,,b:2", "keygate://a:port", "keygate://", "http://a:1"):
        with pytest.raises(InvalidArgument):
            parse_url(bad)


async def test_the_client_connects_to_the_first_address_that_answers() -> None:
    fake = FakeGateway()
    fake.queues["orders"] = 2
    await fake.start()
    try:
        url = f"keygate://127.0.0.1:{_closed_port()},127.0.0.1:{fake.port}"
        async with Client(url, backoff=FAST, heartbeat=0) as client:
            assert await client.publish("orders", b"x")
    finally:
        await fake.stop()


async def test_after_a_cut_the_client_moves_to_the_next_gateway_and_rebinds(
    pair: tuple[FakeGateway, FakeGateway],
) -> None:
    first, second = pair
    url = f"keygate://127.0.0.1:{first.port},127.0.0.1:{second.port}"
    async with Client(url, backoff=FAST, heartbeat=0) as client:
        consumer = await client.subscribe("orders", "billing", window=10)
        await first.stop()  # the active gateway dies; its ports stay closed
        await second.wait_for(lambda: bool(second.of_type(Bind)))
        assert second.of_type(Bind)[0].previous_partitions == frozenset({0, 1})
        assert await client.publish("orders", b"after")
        assert consumer.partitions == {0, 1}
        assert client.session.reconnects == 1


async def test_when_no_address_answers_the_connect_fails() -> None:
    url = f"keygate://127.0.0.1:{_closed_port()},127.0.0.1:{_closed_port()}"
    with pytest.raises(OSError):
        await Client(url, backoff=FAST, heartbeat=0).connect()
