"""A consumer that stops reading its socket costs the gateway a bounded number of bytes,
whatever its window and the backlog (DESIGN.md §8, docs/operations.md "Limits"): once
more than ``consumer_write_buffer`` waits for its connection's socket, the group sends
its flow nothing more, as if its window were full, and the rest of the backlog stays in
the database. When it reads again it gets every message, in order per key.

One test per consuming protocol, each with a raw client whose receive buffer is small and
whose window (10,000) holds the whole backlog: 120 messages of 256 KiB, 30 MiB. What the
gateway holds for the flow is read from its group (the messages delivered and not acked,
each kept whole until it is settled); it may hold at most the write buffer, the group's
read-ahead handed over in each of the two steps before it heard, what the kernel's socket
buffers took and one message more.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Final

import pytest
from pamqp import body, commands, header

from core.model import AckMode
from core.partition import FlowStatus
from gateway.client import Client
from gateway.server import Gateway
from protocols.native.connection import ClientConnection
from protocols.native.events import (
    Ack,
    Bind,
    BindOk,
    Deliver,
    Event,
    Hello,
    HelloOk,
    PartitionsChanged,
)
from protocols.stomp import Frame
from tests.integration.conftest import native_url, start_gateway
from tests.support.amqp_raw import RawAmqp
from tests.support.stomp_raw import RawClient
from tests.support.wait import eventually

SIZE: Final = 256 * 1024
COUNT: Final = 120
KEYS: Final = 4
WRITE_BUFFER: Final = 256 * 1024
GROUP_BUFFER: Final = 1024 * 1024
RCVBUF: Final = 32 * 1024
WINDOW: Final = 10_000
STREAM_LIMIT: Final = 64 * 1024  # asyncio's StreamReader pauses reading above twice this


def _bound() -> int:
    wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    # The kernel doubles SO_RCVBUF; the client's stream buffers up to twice its limit.
    return WRITE_BUFFER + 2 * GROUP_BUFFER + wmem + 2 * RCVBUF + 2 * STREAM_LIMIT + SIZE


@pytest.fixture
async def slow_gateway(db_url: str) -> AsyncIterator[Gateway]:
    gw = await start_gateway(
        db_url, consumer_write_buffer=WRITE_BUFFER, group_buffer_bytes=GROUP_BUFFER
    )
    try:
        async with Client(native_url(gw)) as client:
            await client.declare_queue("slow", partitions=2)
            await asyncio.gather(
                *(
                    client.publish("slow", b"%06d" % i + b"x" * (SIZE - 6), key=f"k{i % KEYS}")
                    for i in range(COUNT)
                )
            )
        yield gw
    finally:
        await gw.stop()


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection with a small receive buffer, as a client that reads slowly has."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock, limit=STREAM_LIMIT)


def _flow(gateway: Gateway) -> FlowStatus | None:
    assert gateway.broker is not None
    flows = [f for r in gateway.broker.runtimes("slow") for f in r.status().flows]
    return flows[0] if flows else None


async def _held_at_most_the_bound(gateway: Gateway) -> None:
    """Wait until the flow is held back (or, without the limit, its window took the whole
    backlog), then check what the gateway holds for it."""

    def settled() -> bool:
        flow = _flow(gateway)
        return flow is not None and (getattr(flow, "behind", False) or flow.pending == COUNT)

    await eventually(settled, timeout=30)
    for runtime in gateway.broker.runtimes("slow") if gateway.broker else ():
        await runtime.flush()
    flow = _flow(gateway)
    assert flow is not None
    held = flow.pending * SIZE
    assert held <= _bound(), f"{flow.pending} x 256 KiB held for a consumer that reads nothing"
    assert flow.pending < COUNT


def _check_order(indices: list[tuple[str | None, int]]) -> None:
    assert sorted(i for _, i in indices) == list(range(COUNT))  # all, each once
    for key in {k for k, _ in indices}:
        of_key = [i for k, i in indices if k == key]
        assert of_key == sorted(of_key), key


async def test_native_consumer_that_stops_reading_is_held_to_its_write_buffer(
    slow_gateway: Gateway,
) -> None:
    reader, writer = await _connect(slow_gateway.ports["native"])
    conn = ClientConnection()

    async def event() -> Event:
        while (got := conn.next_event()) is None:
            data = await asyncio.wait_for(reader.read(1 << 20), 10)
            assert data, "gateway closed the connection"
            conn.receive_data(data)
        return got

    writer.write(conn.send(Hello(client_name="slow")))
    assert isinstance(await event(), HelloOk)
    bind = Bind(
        request_id=conn.next_request_id(),
        queue="slow",
        group="g",
        window=WINDOW,
        ack_mode=AckMode.CLIENT,
    )
    writer.write(conn.send(bind))
    assert isinstance(await event(), BindOk)
    await _held_at_most_the_bound(slow_gateway)

    got: list[tuple[str | None, int]] = []
    while len(got) < COUNT:
        deliver = await event()
        if isinstance(deliver, PartitionsChanged):
            continue
        assert isinstance(deliver, Deliver), deliver
        got.append((deliver.key, int(deliver.payload[:6])))
        ack = Ack(flow_id=deliver.flow_id, message_ids=(deliver.message_id,))
        writer.write(conn.send(ack))
    _check_order(got)
    writer.close()


async def test_stomp_consumer_that_stops_reading_is_held_to_its_write_buffer(
    slow_gateway: Gateway,
) -> None:
    client = RawClient(*await _connect(slow_gateway.ports["stomp"]))
    await client.connect()
    await client.send(
        "SUBSCRIBE",
        ("id", "s"),
        ("destination", "/queue/slow"),
        ("ack", "client-individual"),
        ("x-group", "g"),
        ("activemq.prefetchSize", str(WINDOW)),
    )
    await _held_at_most_the_bound(slow_gateway)

    got: list[tuple[str | None, int]] = []
    while len(got) < COUNT:
        frame = await client.frame()
        assert isinstance(frame, Frame) and frame.command == "MESSAGE", frame
        got.append((frame.header("JMSXGroupID"), int(frame.body[:6])))
        await client.send("ACK", ("id", frame.header("ack") or ""))
    _check_order(got)
    client.writer.close()


async def test_amqp_consumer_that_stops_reading_is_held_to_its_write_buffer(
    slow_gateway: Gateway,
) -> None:
    client = await RawAmqp.opened(*await _connect(slow_gateway.ports["amqp"]))
    client.send(1, commands.Basic.Qos(prefetch_count=WINDOW))
    await client.expect(commands.Basic.QosOk)
    client.send(1, commands.Basic.Consume(queue="slow", consumer_tag="c"))
    await client.expect(commands.Basic.ConsumeOk)
    await _held_at_most_the_bound(slow_gateway)

    got: list[tuple[str | None, int]] = []
    frame: Callable[[], Awaitable[object]] = client.next_frame
    while len(got) < COUNT:
        deliver = await frame()
        assert isinstance(deliver, commands.Basic.Deliver), deliver
        content = await frame()
        assert isinstance(content, header.ContentHeader)
        payload = b""
        while len(payload) < content.body_size:
            part = await frame()
            assert isinstance(part, body.ContentBody)
            payload += part.value
        headers = content.properties.headers or {}
        key = headers.get("JMSXGroupID")
        got.append((key if isinstance(key, str) else None, int(payload[:6])))
        client.send(1, commands.Basic.Ack(delivery_tag=deliver.delivery_tag))
    _check_order(got)
    client.writer.close()
