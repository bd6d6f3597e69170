"""STOMP consumers through the real gateway, driven by a raw socket where a client must
pipeline frames or read exactly what the gateway wrote (docs/protocols/stomp.md,
"Consuming"): subscriptions that end while the connection is busy, ack ids, cumulative
ACKs and ACK/NACK inside transactions.
"""

from __future__ import annotations

import asyncio
import logging
import queue as queue_module
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import stomp

from core.model import Publication
from gateway.client import Client
from gateway.server import Gateway
from protocols.sink import Principal, Receipt
from protocols.stomp import Frame, Version
from tests.integration.conftest import native_url
from tests.integration.sqlcheck import declare
from tests.support.stomp_raw import RawClient, raw
from tests.support.wait import eventually

WAIT = 10.0


async def _publish(gateway: Gateway, queue: str, count: int) -> list[str]:
    """``count`` messages ``m0``, ``m1``...; their ids, in order."""
    async with Client(native_url(gateway)) as client:
        return [await client.publish(queue, b"m%d" % i) for i in range(count)]


def _in_flight(gateway: Gateway, queue: str, group: str = "default") -> int:
    (runtime,) = [rt for rt in gateway.broker.runtimes(queue) if rt.group.name == group]
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
    """Send a frame asking a receipt and wait for it (no MESSAGE may come meanwhile)."""
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


async def test_an_ack_id_names_one_delivery_when_two_subscriptions_got_the_message(
    gateway: Gateway,
) -> None:
    await declare(gateway, "twice", partitions=1)
    async with raw(gateway.ports["stomp"]) as client:
        await client.connect()
        for group in ("a", "b"):
            await _call(
                client,
                "SUBSCRIBE",
                ("destination", "/queue/twice"),
                ("id", group),
                ("ack", "client-individual"),
                ("x-group", group),
            )
        await _publish(gateway, "twice", 1)
        got = {m.header("subscription"): m for m in await _messages(client, 2)}
        assert got["a"].header("ack") != got["b"].header("ack")
        await _call(client, "ACK", ("id", got["b"].header("ack") or ""))
        await eventually(lambda: _in_flight(gateway, "twice", "b") == 0)
        assert _in_flight(gateway, "twice", "a") == 1
        await _call(client, "ACK", ("id", got["a"].header("ack") or ""))
        await eventually(lambda: _in_flight(gateway, "twice", "a") == 0)


async def test_stomp_1_1_acks_by_message_id_and_subscription(gateway: Gateway) -> None:
    await declare(gateway, "named", partitions=1)
    async with raw(gateway.ports["stomp"]) as client:
        client.codec.version = Version.V1_1
        await client.send("CONNECT", ("accept-version", "1.1"), ("host", "h"))
        assert (await _next(client, "CONNECTED")).header("version") == "1.1"
        for group in ("a", "b"):
            await _call(
                client,
                "SUBSCRIBE",
                ("destination", "/queue/named"),
                ("id", group),
                ("ack", "client-individual"),
                ("x-group", group),
            )
        (message_id,) = await _publish(gateway, "named", 1)
        await _messages(client, 2)
        await _call(client, "ACK", ("message-id", message_id), ("subscription", "b"))
        await eventually(lambda: _in_flight(gateway, "named", "b") == 0)
        assert _in_flight(gateway, "named", "a") == 1


async def test_a_cumulative_ack_leaves_a_redelivery_sent_after_the_acked_message(
    gateway: Gateway,
) -> None:
    """STOMP 1.2: ``ack:client`` acknowledges the message and those sent to the
    subscription *before* it; m0's redelivery came after m2, so ACK m2 leaves it."""
    await declare(gateway, "cumulative", partitions=1, backoff_initial=0.0)
    await _publish(gateway, "cumulative", 3)
    async with _consumer(gateway, "cumulative", "client") as client:
        m0, _, m2 = await _messages(client, 3)
        await _call(client, "NACK", ("id", m0.header("ack") or ""))
        (again,) = await _messages(client, 1)
        assert (again.body, again.header("redelivered")) == (b"m0", "true")
        await _call(client, "ACK", ("id", m2.header("ack") or ""))
        assert _in_flight(gateway, "cumulative") == 1
        await _call(client, "NACK", ("id", again.header("ack") or ""))
        (third,) = await _messages(client, 1)
        assert (third.body, third.header("x-delivery-count")) == (b"m0", "3")


async def test_ack_in_a_transaction_applies_at_commit_and_abort_leaves_the_message_unacked(
    gateway: Gateway,
) -> None:
    await declare(gateway, "tx", partitions=1)
    await _publish(gateway, "tx", 2)
    async with _consumer(gateway, "tx", "client-individual") as client:
        m0, m1 = await _messages(client, 2)
        await _call(client, "BEGIN", ("transaction", "t1"))
        await _call(client, "ACK", ("id", m0.header("ack") or ""), ("transaction", "t1"))
        await _call(client, "ABORT", ("transaction", "t1"))
        assert _in_flight(gateway, "tx") == 2
        await _call(client, "BEGIN", ("transaction", "t2"))
        await _call(client, "ACK", ("id", m0.header("ack") or ""), ("transaction", "t2"))
        await _call(client, "ACK", ("id", m1.header("ack") or ""), ("transaction", "t2"))
        assert _in_flight(gateway, "tx") == 2
        await _call(client, "COMMIT", ("transaction", "t2"))
        assert _in_flight(gateway, "tx") == 0


async def test_an_ack_naming_an_unknown_transaction_is_an_error(gateway: Gateway) -> None:
    await declare(gateway, "notx", partitions=1)
    await _publish(gateway, "notx", 1)
    async with _consumer(gateway, "notx", "client-individual") as client:
        (m0,) = await _messages(client, 1)
        await client.send("ACK", ("id", m0.header("ack") or ""), ("transaction", "nope"))
        error = await _next(client, "ERROR")
        assert error.header("message") == "invalid frame"
        assert b"unknown transaction" in error.body


async def test_a_dead_letter_s_consumer_sees_the_original_delivery_count(gateway: Gateway) -> None:
    """A property the message carries reaches the consumer unchanged: a dead letter's
    x-delivery-count is its original queue's (DESIGN.md §4), the gateway's own per-delivery
    value goes under x-keygate-delivery-count (as over AMQP)."""
    await declare(gateway, "poison", partitions=1, max_deliveries=2, backoff_initial=0.05)
    async with Client(native_url(gateway)) as client:
        await client.publish("poison", b"bad", key="a", properties={"x-seq": "mine"})
    async with _consumer(gateway, "poison", "client-individual") as consumer:
        for count in ("1", "2"):
            [message] = await _messages(consumer, 1)
            assert message.header("x-delivery-count") == count
            assert (message.header("x-seq"), message.header("x-keygate-seq")) == ("mine", "1")
            await _call(consumer, "NACK", ("id", message.header("ack") or ""))
    async with _consumer(gateway, "poison.dlq", "client-individual") as dlq:
        [letter] = await _messages(dlq, 1)
    assert letter.body == b"bad"
    assert letter.header("x-delivery-count") == "2"  # max_deliveries
    assert letter.header("x-keygate-delivery-count") == "1"
    assert letter.header("x-original-queue") == "poison"


def _stomp_send(gateway: Gateway, queue: str, headers: dict[str, str]) -> None:
    """One SEND by stomp.py, returning once its RECEIPT arrived."""
    conn = stomp.Connection12([("127.0.0.1", gateway.ports["stomp"])])
    receipts: queue_module.Queue[str] = queue_module.Queue()
    listener = stomp.ConnectionListener()
    listener.on_receipt = lambda frame: receipts.put(frame.headers["receipt-id"])
    conn.set_listener("receipts", listener)
    conn.connect(wait=True)
    try:
        conn.send(f"/queue/{queue}", "body", headers={**headers, "receipt": "sent"})
        assert receipts.get(timeout=WAIT) == "sent"
    finally:
        conn.disconnect()


async def test_published_headers_arrive_unchanged_except_the_frame_headers_stomp_gives_the_server(
    gateway: Gateway,
) -> None:
    """A published JMSXGroupID is not the key (QUEUE_PARTITION_KEY won) and arrives as
    published; a published ``redelivered`` wins over keygate's, which goes under
    x-keygate-redelivered; ``ack`` and ``subscription`` are the server's in a MESSAGE
    (STOMP 1.2), so the published ones cannot reach a STOMP consumer (nor whatever the
    subscription's ack mode)."""
    await declare(gateway, "mixed", partitions=2)
    published = {
        "QUEUE_PARTITION_KEY": "A",
        "JMSXGroupID": "B",
        "redelivered": "mine",
        "ack": "mine",
        "subscription": "mine",
        "colour": "blue",
    }
    await asyncio.to_thread(_stomp_send, gateway, "mixed", published)
    for ack in ("client-individual", "auto"):
        async with _consumer(gateway, "mixed", ack, **{"x-group": ack}) as consumer:
            [message] = await _messages(consumer, 1)
        names = [name for name, _ in message.headers]
        assert len(names) == len(set(names)), message.headers  # one value per header
        headers = message.header_map()
        assert (headers["JMSXGroupID"], headers["QUEUE_PARTITION_KEY"]) == ("B", "A")
        assert (headers["redelivered"], headers["x-keygate-redelivered"]) == ("mine", "false")
        assert headers["colour"] == "blue"
        assert headers["subscription"] == "s"
        assert headers.get("ack") == (None if ack == "auto" else f"1:{headers['message-id']}")
