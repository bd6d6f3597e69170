"""STOMP consumers through the real gateway, driven by a raw socket where a client must
pipeline frames or read exactly what the gateway wrote (docs/protocols/stomp.md,
"Consuming"): subscriptions that end while the connection is busy, ack ids, cumulative
ACKs and ACK/NACK inside transactions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from core.model import Publication
from gateway.client import Client
from gateway.server import Gateway
from protocols.sink import Principal, Receipt
from protocols.stomp import Frame
from tests.integration.conftest import native_url
from tests.integration.sqlcheck import declare
from tests.support.stomp_raw import RawClient, raw
from tests.support.wait import eventually

WAIT = 10.0


async def _publish(gateway: Gateway, queue: str, count: int) -> list[str]:
    """``count`` messages ``m0``, ``m1``...; their ids, in order."""
    async with Client(native_url(gateway)) as client:
        return [await client.publish(queue, b"m%d" % i) for i in range(count)]


def _in_flight(gateway: Gateway, queue: str) -> int:
    (runtime,) = gateway.broker.runtimes(queue)
    return sum(p.in_flight for p in runtime.status().partitions)


@asynccontextmanager
async def _consumer(
    gateway: Gateway, queue: str, ack: str, **headers: str
) -> AsyncIterator[RawClient]:
    """A connected STOMP 1.2 client subscribed to ``queue`` as ``s``."""
    async with raw(gateway.ports["stomp"]) as client:
        await client.connect()
        await _call(
            client,
            "SUBSCRIBE",
            ("destination", f"/queue/{queue}"),
            ("id", "s"),
            ("ack", ack),
            *headers.items(),
        )
        yield client


async def _call(client: RawClient, command: str, *headers: tuple[str, str]) -> None:
    """Send a frame asking a receipt; return once it came (MESSAGEs meanwhile are kept)."""
    await client.send(command, *headers, ("receipt", command))
    frame = await _next(client, "RECEIPT", "ERROR")
    assert frame.command == "RECEIPT", frame


async def _next(client: RawClient, *commands: str) -> Frame:
    frame = await client.frame()
    assert frame is not None, "connection closed"
    assert frame.command in commands, frame
    return frame


async def _messages(client: RawClient, count: int) -> list[Frame]:
    return [await _next(client, "MESSAGE") for _ in range(count)]


async def test_deliveries_racing_an_unsubscribe_go_back_and_reach_the_next_consumer(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    """UNSUBSCRIBE read while the connection's worker is still storing an earlier SEND:
    deliveries to the subscription in that gap are not written, and its unbind returns
    them for redelivery (they used to fail the group's whole delivery step)."""
    await declare(gateway, "watched", partitions=1, rebalance_delay=0.0)
    await declare(gateway, "other", partitions=1)
    entered, release = asyncio.Event(), asyncio.Event()
    publish = gateway.broker.publish

    async def stalled(principal: Principal, publication: Publication) -> Receipt:
        if publication.queue == "other":
            entered.set()
            await release.wait()
        return await publish(principal, publication)

    gateway.broker.publish = stalled  # type: ignore[method-assign]
    stomp = gateway._listeners["stomp"]
    async with _consumer(gateway, "watched", "client-individual") as victim:
        await victim.send_raw(
            victim.codec.send(Frame("SEND", (("destination", "/queue/other"),), b"x"))
            + victim.codec.send(Frame("UNSUBSCRIBE", (("id", "s"), ("receipt", "gone"))))
        )
        await asyncio.wait_for(entered.wait(), WAIT)
        await eventually(
            lambda: all(len(c.conn.subscriptions) == 0 for c in stomp._acceptor.connections)
        )
        await _publish(gateway, "watched", 5)
        await eventually(lambda: _in_flight(gateway, "watched") == 5)  # handed to the victim
        release.set()
        assert (await _next(victim, "RECEIPT")).header("receipt-id") == "gone"
    async with _consumer(gateway, "watched", "client-individual") as next_one:
        got = await _messages(next_one, 5)
    assert [m.body for m in got] == [b"m%d" % i for i in range(5)]
    assert {m.header("redelivered") for m in got} == {"true"}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
