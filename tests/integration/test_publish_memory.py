"""What a publisher costs the gateway's memory: a refused publish frees its payload as soon
as it is answered, and the bytes of publishes waiting for their commit — payload,
properties and headers alike — are held to the connection's ``max_unconfirmed_bytes``.

The gateway runs in the test's process, so its memory is read with ``tracemalloc``. The
refusal tests run with the cycle collector off: a payload freed only by it stays until a
full collection, which a busy gateway makes rarely (QA saw 1 GB held 10 s after the
client left). The back-pressure tests hold the store's ``seq_lock`` so nothing commits:
the gateway must then stop reading the publisher, which is seen as the client unable to
hand the kernel all of its frames, and as little memory taken meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import socket
import threading
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pika.frame
import pika.spec
import pytest

from gateway.client import Client
from gateway.server import Gateway
from protocols.amqp.listener import AmqpListener
from protocols.mqtt import Connect, MqttProperties, PubAck
from protocols.mqtt import Publish as MqttPublish
from protocols.native.connection import ClientConnection
from protocols.native.events import Error, Hello, HelloOk, Publish, PublishOk
from protocols.native.listener import NativeListener
from tests.integration.conftest import native_url, start_gateway
from tests.support.mqtt_raw import RawMqtt
from tests.support.native_raw import expect
from tests.support.wait import eventually

MIB = 1024 * 1024
REFUSALS = 16
BUDGET = 64 * 1024
PROPERTY = 60_000  # bytes of one property (native) or header (AMQP); the payload is empty
FLOOD = 500  # 30 MB of properties: more than the kernel's socket buffers hold
# What a connection stopped at its budget may hold besides it: a read (256 KiB), the
# stream's buffer, a frame being decoded.
# Measured: under 1 MiB; reading the whole flood would be 30 MB.
SLACK = 4 * MIB


@contextlib.contextmanager
def _traced() -> Iterator[list[int]]:
    """Trace allocations with the cycle collector off; yields [memory at the start]."""
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        yield [tracemalloc.get_traced_memory()[0]]
    finally:
        tracemalloc.stop()
        gc.enable()


def _grown(start: list[int]) -> int:
    return tracemalloc.get_traced_memory()[0] - start[0]


def _native_login(port: int) -> tuple[socket.socket, ClientConnection]:
    sock = socket.create_connection(("127.0.0.1", port))
    conn = ClientConnection()
    sock.sendall(conn.send(Hello(client_name="pubmem")))
    expect(sock, conn, HelloOk)
    return sock, conn


def _refuse(sock: socket.socket, conn: ClientConnection, publish: Publish, count: int) -> set[str]:
    """Send ``publish`` ``count`` times, each after the last one's answer; the codes."""
    codes = set()
    for _ in range(count):
        sock.sendall(conn.send(dataclasses.replace(publish, request_id=conn.next_request_id())))
        error = expect(sock, conn, Error)
        assert isinstance(error, Error)
        codes.add(error.code)
    return codes


def _native_session(gw: Gateway) -> Any:
    """The listener's session of the raw client (the SDK's may still be closing)."""
    native = gw._listeners["native"]
    assert isinstance(native, NativeListener)
    [session] = [s for s in native._acceptor.connections if s.requests.producer == "native:pubmem"]
    return session


@pytest.mark.parametrize(
    ("queue", "code"),
    [
        ("small", "message-too-large"),  # refused by the broker, before the store
        ("nosuch", "queue-not-found"),
        ("shallow", "queue-full"),  # refused by the store's checks
    ],
)
async def test_a_refused_native_publish_frees_its_payload_without_the_cycle_collector(
    sqlite_url: str, queue: str, code: str
) -> None:
    gw = await start_gateway(sqlite_url)
    try:
        async with Client(native_url(gw)) as client:
            await client.declare_queue("small", partitions=1, max_message_size=64 * 1024)
            await client.declare_queue("shallow", partitions=1, max_depth_bytes=1024)
        sock, conn = await asyncio.to_thread(_native_login, gw.ports["native"])
        with sock:
            publish = Publish(request_id=0, queue=queue, key="k", payload=b"x" * MIB)
            # One refusal first: buffers that stay (the codec's, the stream's) are grown.
            await asyncio.to_thread(_refuse, sock, conn, publish, 1)
            with _traced() as start:
                codes = await asyncio.to_thread(_refuse, sock, conn, publish, REFUSALS)
                grown = _grown(start)
            session = _native_session(gw)
            held = session.requests.unconfirmed.held
        assert codes == {code}
        # Leaked, the 16 payloads would be 16 MiB.
        assert grown < 2 * MIB, f"{grown} bytes still held after {REFUSALS} refusals"
        assert held == 0
    finally:
        await gw.stop()


def _amqp_login(port: int) -> socket.socket:
    """A raw AMQP connection with channel 1 in confirm mode (as pika's frames)."""
    sock = socket.create_connection(("127.0.0.1", port))
    spec = pika.spec

    def method(channel: int, m: object) -> bytes:
        return pika.frame.Method(channel, m).marshal()  # type: ignore[no-any-return]

    start_ok = spec.Connection.StartOk(
        client_properties={}, mechanism="PLAIN", response="\x00guest\x00guest", locale="en_US"
    )
    sock.sendall(b"AMQP\x00\x00\x09\x01" + method(0, start_ok))
    _amqp_until(sock, spec.Connection.Tune)
    sock.sendall(
        method(0, spec.Connection.TuneOk(channel_max=10, frame_max=131072, heartbeat=0))
        + method(0, spec.Connection.Open(virtual_host="/"))
        + method(1, spec.Channel.Open())
        + method(1, spec.Confirm.Select())
    )
    _amqp_until(sock, spec.Confirm.SelectOk)
    return sock


def _amqp_until(sock: socket.socket, kind: type, buffer: bytearray | None = None) -> object:
    """Read frames until a method of ``kind``; return it."""
    buf = buffer if buffer is not None else bytearray()
    while True:
        consumed, frame = pika.frame.decode_frame(bytes(buf))
        if frame is not None:
            del buf[:consumed]
            if isinstance(frame, pika.frame.Method) and isinstance(frame.method, kind):
                return frame.method
            continue
        data = sock.recv(65536)
        assert data, "gateway closed the connection"
        buf += data


def _amqp_refuse(sock: socket.socket, frames: bytes, count: int) -> int:
    """Send the publish ``frames`` ``count`` times, each after the last one's nack."""
    for _ in range(count):
        sock.sendall(frames)
        _amqp_until(sock, pika.spec.Basic.Nack)
    return count


async def test_a_refused_amqp_publish_frees_its_payload_without_the_cycle_collector(
    sqlite_url: str,
) -> None:
    gw = await start_gateway(sqlite_url)
    try:
        async with Client(native_url(gw)) as client:
            await client.declare_queue("orders", partitions=1)
        sock = await asyncio.to_thread(_amqp_login, gw.ports["amqp"])
        with sock:
            # An x-delay that is no delay: refused by the listener itself, nacked.
            properties = pika.spec.BasicProperties(headers={"x-delay": "soon"})
            payload = b"x" * MIB
            frames = pika.frame.Method(1, pika.spec.Basic.Publish(routing_key="orders")).marshal()
            frames += pika.frame.Header(1, len(payload), properties).marshal()
            for start in range(0, len(payload), 131064):
                frames += pika.frame.Body(1, payload[start : start + 131064]).marshal()
            await asyncio.to_thread(_amqp_refuse, sock, frames, 1)
            with _traced() as start:
                await asyncio.to_thread(_amqp_refuse, sock, frames, REFUSALS)
                grown = _grown(start)
        assert grown < 2 * MIB, f"{grown} bytes still held after {REFUSALS} refusals"
    finally:
        await gw.stop()


async def test_a_refused_mqtt_publish_frees_its_payload_without_the_cycle_collector(
    sqlite_url: str,
) -> None:
    gw = await start_gateway(sqlite_url)
    try:
        async with Client(native_url(gw)) as client:
            await client.declare_queue("orders", partitions=1, subscriptions=["orders/#"])
        mqtt = await RawMqtt.connected(gw.ports["mqtt"], Connect(client_id="pubmem"))
        # An x-delay that is no delay: refused by the listener itself, PUBACK with an error.
        soon = MqttProperties(user_properties=(("x-delay", "soon"),))
        payload = b"x" * MIB

        async def refuse(packet_id: int) -> None:
            await mqtt.send(
                MqttPublish("orders/in", payload, 1, packet_id=packet_id, properties=soon)
            )
            ack = await mqtt.receive()
            assert isinstance(ack, PubAck) and ack.reason_code != 0, ack

        try:
            await refuse(1)
            with _traced() as start:
                for packet_id in range(2, 2 + REFUSALS):
                    await refuse(packet_id)
                grown = _grown(start)
        finally:
            await RawMqtt.close_all()
        assert grown < 2 * MIB, f"{grown} bytes still held after {REFUSALS} refusals"
    finally:
        await gw.stop()


def _flood(sock: socket.socket, data: bytes, sent: threading.Event) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)
        sent.set()


async def _held_back(
    gw: Gateway, sock: socket.socket, data: bytes, stalled: object
) -> tuple[bool, int, threading.Thread]:
    """Send ``data`` from a thread while nothing commits; once ``stalled()`` (the
    connection's budget is full) or everything was sent: whether it was, and the memory
    the gateway took meanwhile. The thread is still sending when the gateway held back."""
    sent = threading.Event()
    with _traced() as start:
        sender = threading.Thread(target=_flood, args=(sock, data, sent), daemon=True)
        sender.start()
        await eventually(lambda: sent.is_set() or stalled(), timeout=20)  # type: ignore[operator]
        # Anything the gateway still reads once stalled would show as memory here.
        await asyncio.sleep(0.2)
        grown = _grown(start)
    return sent.is_set(), grown, sender


async def test_native_publishes_of_large_properties_are_held_to_the_byte_budget(
    sqlite_url: str,
) -> None:
    gw = await start_gateway(sqlite_url, max_unconfirmed_bytes=BUDGET)
    try:
        async with Client(native_url(gw)) as client:
            await client.declare_queue("props", partitions=2)
        sock, conn = await asyncio.to_thread(_native_login, gw.ports["native"])
        with sock:
            frames = b"".join(
                conn.send(
                    Publish(
                        request_id=conn.next_request_id(),
                        queue="props",
                        key=f"k{i % 5}",
                        payload=b"",
                        properties={"p": "x" * PROPERTY},
                    )
                )
                for i in range(FLOOD)
            )
            session = _native_session(gw)
            budget = session.requests.unconfirmed
            async with gw.store.seq_lock:  # nothing commits
                all_sent, grown, sender = await _held_back(
                    gw, sock, frames, lambda: budget.held + PROPERTY > BUDGET
                )
            answers = await asyncio.to_thread(_native_answers, sock, conn, FLOOD)
            sender.join(10)
        assert not all_sent, "the gateway read the whole flood while nothing committed"
        assert grown < SLACK, f"the gateway took {grown} bytes while nothing committed"
        assert answers == FLOOD
        assert 0 < budget.peak <= BUDGET + PROPERTY + 1024
    finally:
        await gw.stop()


async def test_native_publishes_of_nothing_are_held_to_the_byte_budget(sqlite_url: str) -> None:
    """An empty PUBLISH is 30 bytes on the wire but a few objects in the gateway: each
    counts as at least what those cost, or a budget of bytes would let tens of
    thousands wait."""
    budget_bytes = 256 * 1024
    count = 20_000
    gw = await start_gateway(sqlite_url, max_unconfirmed_bytes=budget_bytes)
    try:
        async with Client(native_url(gw)) as client:
            await client.declare_queue("empty", partitions=2)
        sock, conn = await asyncio.to_thread(_native_login, gw.ports["native"])
        with sock:
            frames = b"".join(
                conn.send(Publish(request_id=conn.next_request_id(), queue="empty", payload=b""))
                for _ in range(count)
            )
            session = _native_session(gw)
            budget = session.requests.unconfirmed
            async with gw.store.seq_lock:  # nothing commits
                _, grown, sender = await _held_back(
                    gw, sock, frames, lambda: budget.held + 1024 > budget_bytes
                )
            answers = await asyncio.to_thread(_native_answers, sock, conn, count)
            sender.join(10)
        assert grown < SLACK, f"the gateway took {grown} bytes while nothing committed"
        assert answers == count
    finally:
        await gw.stop()


def _native_answers(sock: socket.socket, conn: ClientConnection, count: int) -> int:
    for _ in range(count):
        expect(sock, conn, PublishOk)
    return count


def _amqp_confirmed(sock: socket.socket, count: int) -> int:
    """Read basic.acks until ``count`` delivery tags are confirmed."""
    buf = bytearray()
    while True:
        ack = _amqp_until(sock, pika.spec.Basic.Ack, buf)
        assert isinstance(ack, pika.spec.Basic.Ack)
        if ack.delivery_tag >= count:
            return count


async def test_amqp_publishes_of_large_headers_are_held_to_the_byte_budget(
    sqlite_url: str,
) -> None:
    gw = await start_gateway(sqlite_url, max_unconfirmed_bytes=BUDGET)
    try:
        async with Client(native_url(gw)) as client:
            await client.declare_queue("props", partitions=2)
        sock = await asyncio.to_thread(_amqp_login, gw.ports["amqp"])
        with sock:
            properties = pika.spec.BasicProperties(headers={"p": "x" * PROPERTY})
            publish = pika.frame.Method(1, pika.spec.Basic.Publish(routing_key="props")).marshal()
            frames = (publish + pika.frame.Header(1, 0, properties).marshal()) * FLOOD
            amqp = gw._listeners["amqp"]
            assert isinstance(amqp, AmqpListener)
            [connection] = amqp._acceptor.connections
            queue = connection.session.queue  # type: ignore[attr-defined]
            async with gw.store.seq_lock:  # nothing commits
                all_sent, grown, sender = await _held_back(
                    gw, sock, frames, lambda: queue._bytes + PROPERTY > BUDGET
                )
            confirmed = await asyncio.to_thread(_amqp_confirmed, sock, FLOOD)
            sender.join(10)
        assert not all_sent, "the gateway read the whole flood while nothing committed"
        assert grown < SLACK, f"the gateway took {grown} bytes while nothing committed"
        assert confirmed == FLOOD
    finally:
        await gw.stop()


async def test_amqp_publishes_being_stored_count_against_the_byte_budget(
    sqlite_url: str,
) -> None:
    """The batch the connection's worker is storing counts against the budget until it is
    stored: it left the queue's count when taken, so as much again (up to 4 MiB, one
    batch) was read beside it. Here the worker first waits for a purge while the budget
    fills, then takes all of it as one batch, which waits to be stored in turn."""
    budget, body, flood = 2 * MIB, 100_000, 300  # 30 MB: more than the socket buffers
    gw = await start_gateway(sqlite_url, max_unconfirmed_bytes=budget)
    try:
        async with Client(native_url(gw)) as client:
            await client.declare_queue("bodies", partitions=2)
            await client.declare_queue("other")
        sock = await asyncio.to_thread(_amqp_login, gw.ports["amqp"])
        with sock:
            purge = pika.frame.Method(1, pika.spec.Queue.Purge(queue="other")).marshal()
            publish = pika.frame.Method(1, pika.spec.Basic.Publish(routing_key="bodies")).marshal()
            content = pika.frame.Header(1, body, pika.spec.BasicProperties()).marshal()
            message = publish + content + pika.frame.Body(1, b"x" * body).marshal()
            frames = purge + message * flood
            amqp = gw._listeners["amqp"]
            assert isinstance(amqp, AmqpListener)
            [connection] = amqp._acceptor.connections
            queue = connection.session.queue  # type: ignore[attr-defined]
            lock, appender = gw.store.seq_lock, gw.store.appender
            sent = threading.Event()
            with _traced() as start:
                await lock.acquire()  # neither the purge nor any publish is stored
                sender = threading.Thread(target=_flood, args=(sock, frames, sent), daemon=True)
                sender.start()
                await eventually(lambda: queue.full, timeout=20)
                lock.release()  # the purge goes, then the lock is the test's again (FIFO)
                await lock.acquire()
                await eventually(lambda: appender.backlog > 0, timeout=20)  # the batch
                await eventually(lambda: queue.full, timeout=20)
                await asyncio.sleep(0.2)  # anything still read would show here
                grown, all_sent = _grown(start), sent.is_set()
                lock.release()
            confirmed = await asyncio.to_thread(_amqp_confirmed, sock, flood)
            sender.join(10)
        assert not all_sent, "the gateway read the whole flood while nothing committed"
        # Measured: the budget and 1.2 MB (a read, the stream's buffer, a frame being
        # decoded); with the batch beside it, a budget more (5.3 MB).
        assert grown < budget + SLACK // 2, f"the gateway took {grown} bytes"
        assert confirmed == flood
    finally:
        await gw.stop()
