"""A consumer that binds and never reads its socket costs bounded gateway memory, and when it
dies the group loses nothing that was not written to its socket.

The gateway runs as a real ``keygate serve`` process so its resident memory can be read
from /proc. The stalled consumer is a raw socket speaking the native protocol: HELLO, an
auto-ack BIND with the default window, then silence. The backlog is 100,000 x 1 KiB on
SQLite and half that on PostgreSQL, to keep the test near a minute on a small CI machine;
KEYGATE_STALL_MESSAGES=200000 runs issue 18's full 200,000 (passes the same bound: the
memory held depends on the window, not on the backlog).

What is measured is the stalled consumer's own cost. Its group's read-ahead is a limit of
its own (``group_buffer_bytes``, 2 MiB), held whether or not anyone reads, so a first
consumer takes one message and leaves before the baseline is read: the group is loaded,
a page buffered in every partition, when the stalled one binds.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import struct
from collections.abc import Awaitable
from pathlib import Path

import aiohttp

from core.model import AckMode
from core.pump import TURN
from gateway.client import Client
from gateway.inspect import inspect_queue
from gateway.server import Gateway
from protocols.native.connection import ClientConnection
from protocols.native.events import Bind, BindOk, Hello, HelloOk
from tests.integration.conftest import native_url
from tests.support.native_raw import expect
from tests.support.serve import serve
from tests.support.wait import eventually

PAYLOAD = b"x" * 1024
WINDOW = 10_000  # the default max_window (gateway/config.py)
WRITE_BUFFER = 1024 * 1024  # the default consumer_write_buffer
PARTITIONS = 4
# docs/operations.md "Limits": a stalled consumer costs at most consumer_write_buffer plus
# its window of in-flight messages at (message size + 2 KiB of bookkeeping) each (far less
# since its connection's backlog holds it back: tests/integration/test_slow_reader.py).
BOUND = WRITE_BUFFER + WINDOW * (len(PAYLOAD) + 2048)


def _rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None
    return int(match.group(1)) * 1024


def _kernel_buffers() -> int:
    """The most a loopback connection's two socket buffers can hold (send + receive)."""
    wmem = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    rmem = int(Path("/proc/sys/net/ipv4/tcp_rmem").read_text().split()[2])
    return wmem + rmem


def _stalled_consumer(port: int, queue: str, group: str) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    sock.connect(("127.0.0.1", port))
    conn = ClientConnection()
    sock.sendall(conn.send(Hello(client_name="stalled")))
    expect(sock, conn, HelloOk)
    bind = Bind(
        request_id=conn.next_request_id(),
        queue=queue,
        group=group,
        window=0,  # the queue's window, clamped to max_window
        ack_mode=AckMode.AUTO,
    )
    sock.sendall(conn.send(bind))
    expect(sock, conn, BindOk)
    return sock  # and never read again


async def _http(port: int, path: str) -> str:
    async with aiohttp.ClientSession() as http:
        got = await http.get(f"http://127.0.0.1:{port}{path}")
        assert got.status == 200
        return await got.text()


async def _flows(port: int, queue: str) -> list[dict[str, object]]:
    async with aiohttp.ClientSession() as http:
        data = await (await http.get(f"http://127.0.0.1:{port}/api/queues/{queue}/inspect")).json()
    return [flow for group in data["groups"] for flow in group["flows"]]


async def _publish(url: str, producer: int, count: int) -> None:
    """One of four producers, each with batches of 1000 publishes in flight."""
    async with Client(url, client_name=f"producer-{producer}") as client:
        for start in range(0, count, 1000):
            batch = range(start, min(count, start + 1000))
            await asyncio.gather(
                *(client.publish("bulk", PAYLOAD, key=f"k{producer}-{n % 16}") for n in batch)
            )


async def _held_back(port: int) -> bool:
    """The flow is held back: its connection is behind (or, without that limit, its
    window is full). An inspection answered with an error (a storage timeout under load) is
    asked again."""
    async with aiohttp.ClientSession() as http:
        got = await http.get(f"http://127.0.0.1:{port}/api/queues/bulk/inspect")
        if got.status != 200:
            return False
        data = await got.json()
    flows = [flow for group in data["groups"] for flow in group["flows"]]
    return bool(flows) and (bool(flows[0].get("behind")) or flows[0]["pending"] == WINDOW)


async def _unbound(port: int) -> bool:
    return not await _flows(port, "bulk")


async def _metric(port: int, name: str, queue: str, group: str) -> int:
    metrics = await _http(port, "/metrics")
    pattern = rf'{name}{{group="{group}",queue="{queue}"}} ([0-9.e+]+)'
    match = re.search(pattern, metrics)
    return 0 if match is None else int(float(match.group(1)))


async def _acked(port: int, queue: str, group: str) -> int:
    return await _metric(port, "keygate_acked_total", queue, group)


async def _buffers_full(port: int) -> bool:
    """Every partition of group g holds a page of unsent messages (a turn's worth at
    least), but for the one the first consumer took."""
    backlog = await _metric(port, "keygate_group_backlog", "bulk", "g")
    return backlog >= PARTITIONS * TURN - 1


async def _load_group(url: str, http_port: int) -> None:
    """Load group g with its read-ahead: a consumer takes one message and leaves without
    acking it (it goes back for redelivery)."""
    async with Client(url, client_name="first") as client:
        consumer = await client.subscribe("bulk", group="g", window=1)
        await consumer.receive()
    await eventually(lambda: _buffers_full(http_port))


async def test_a_stalled_auto_ack_consumer_costs_bounded_memory_and_loses_nothing_unwritten(
    db_url: str, tmp_path: Path
) -> None:
    total = int(os.environ.get("KEYGATE_STALL_MESSAGES", "100000"))
    total = total if db_url.startswith("sqlite") else total // 2
    with serve(db_url, tmp_path) as (proc, ports, _log):
        url = f"keygate://127.0.0.1:{ports['native']}"
        async with Client(url) as admin:
            await admin.declare_queue("bulk", partitions=PARTITIONS)
        await asyncio.gather(*(_publish(url, part, total // 4) for part in range(4)))
        await _load_group(url, ports["http"])
        before = _rss(proc.pid)
        stalled = _stalled_consumer(ports["native"], "bulk", "g")
        try:
            # Its connection falls behind (nothing it was sent is acked until written),
            # and the group sends it nothing more.
            await eventually(lambda: _held_back(ports["http"]), timeout=30)
            growth = _rss(proc.pid) - before
            assert growth < BOUND, f"gateway grew by {growth} bytes (bound {BOUND})"
        finally:
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            stalled.close()  # reset: whatever sat in its socket buffers is gone
        await eventually(lambda: _unbound(ports["http"]))
        written = await _acked(ports["http"], "bulk", "g")
        # Only what fitted in the two socket buffers was written (and counted as acked).
        assert written * len(PAYLOAD) <= _kernel_buffers()

        received: set[str] = set()
        async with Client(url) as client:
            consumer = await client.subscribe("bulk", group="g", window=2000)
            async with asyncio.timeout(40):
                while len(received) < total - written:
                    message = await consumer.receive()
                    received.add(message.message_id)
                    await consumer.acknowledge(message)
            await consumer.close()
        assert len(received) == total - written


async def _is(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


async def test_a_window_above_max_window_is_clamped_on_bind_and_credit(gateway: Gateway) -> None:
    async def window() -> int:
        assert gateway.broker is not None
        (group,) = (await inspect_queue(gateway.broker, gateway.store, "orders"))["groups"]
        (flow,) = group["flows"]
        return int(flow["window"])

    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=2)
        consumer = await client.subscribe("orders", group="g", window=1_000_000)
        assert await window() == WINDOW
        await consumer.set_window(20)  # CREDIT has no answer: poll the flow
        await eventually(lambda: _is(window(), 20))
        await consumer.set_window(50_000)
        await eventually(lambda: _is(window(), WINDOW))
        await consumer.close()
