"""Limits a peer runs into: a number in a header that is too long, too large or not a
number is a clean protocol error and a closed connection within seconds, while other
clients keep publishing and consuming."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import paho.mqtt.client as paho
import pika
import pytest
import stomp
from paho.mqtt.enums import CallbackAPIVersion

from gateway.client import Client
from gateway.server import Gateway
from protocols.mqtt.wire import write_vbi
from protocols.native.listener import NativeListener
from tests.integration.conftest import native_url, start_gateway

CLOSE_WITHIN = 5.0


async def _answer_then_close(port: int, data: bytes) -> bytes:
    """Send ``data``; return everything the gateway answered before closing the socket."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        answer = b""
        async with asyncio.timeout(CLOSE_WITHIN):
            while chunk := await reader.read(65536):
                answer += chunk
        return answer
    finally:
        writer.close()


def _connect(*headers: str) -> bytes:
    lines = ["CONNECT", "accept-version:1.2", "host:/", *headers]
    return ("\n".join(lines) + "\n\n\0").encode()


MALFORMED_STOMP = {
    "content-length of 5,000 digits": _connect("content-length:" + "9" * 5000),
    "heart-beat of 400 digits": _connect("heart-beat:" + "9" * 400 + ",0"),
    "heart-beat over one day": _connect("heart-beat:0,86400001"),
    "content-length in superscript digits": _connect("content-length:²"),
    "expires of 500 digits": _connect()
    + b"SEND\ndestination:/queue/orders\nexpires:"
    + b"9" * 500
    + b"\n\nx\0",
}


@pytest.mark.parametrize("frames", MALFORMED_STOMP.values(), ids=MALFORMED_STOMP.keys())
async def test_a_stomp_number_that_is_no_number_is_an_error_and_a_closed_connection(
    gateway: Gateway, frames: bytes
) -> None:
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=2)
        before = await client.publish("orders", b"before", key="k")
        answer = await _answer_then_close(gateway.ports["stomp"], frames)
        after = await client.publish("orders", b"after", key="k")
        consumer = await client.subscribe("orders", group="g")
        got = [(await consumer.receive(timeout=5)).message_id for _ in range(2)]
    assert b"ERROR" in answer
    assert b"Traceback" not in answer
    assert got == [before, after]


def _publish_with_expiration(port: int, expiration: str) -> str:
    """The channel-closing reply code and text pika reports for one publish."""
    params = pika.ConnectionParameters("127.0.0.1", port, connection_attempts=1)
    with pika.BlockingConnection(params) as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        try:
            channel.basic_publish("", "orders", b"x", pika.BasicProperties(expiration=expiration))
        except pika.exceptions.ChannelClosedByBroker as e:
            return f"{e.reply_code} {e.reply_text}"
    return "published"


@pytest.mark.parametrize("expiration", ["²", "9" * 200, "-1"])
async def test_an_amqp_expiration_that_is_no_number_closes_the_channel_with_406(
    gateway: Gateway, expiration: str
) -> None:
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=2)
        outcome = await asyncio.to_thread(
            _publish_with_expiration, gateway.ports["amqp"], expiration
        )
        confirmed = await client.publish("orders", b"after", key="k")
        consumer = await client.subscribe("orders", group="g")
        got = await consumer.receive(timeout=5)
    assert outcome.startswith("406 ")
    assert got.message_id == confirmed


@pytest.fixture
async def strict_gateway(db_url: str) -> AsyncIterator[Gateway]:
    """A gateway that gives a peer one second to log in."""
    gw = await start_gateway(db_url, login_timeout=1.0)
    try:
        yield gw
    finally:
        await gw.stop()


LOGIN_PROTOCOLS = ("native", "mqtt", "amqp", "stomp")


async def _closed_after(port: int, data: bytes) -> tuple[bytes, float]:
    """Send ``data`` and nothing more; the answer and how long until the gateway closed."""
    started = asyncio.get_running_loop().time()
    answer = await _answer_then_close(port, data)
    return answer, asyncio.get_running_loop().time() - started


@pytest.mark.parametrize("protocol", LOGIN_PROTOCOLS)
async def test_a_peer_that_never_logs_in_is_closed_after_the_login_timeout(
    strict_gateway: Gateway, protocol: str
) -> None:
    # AMQP needs its protocol header to get as far as waiting for start-ok.
    opening = b"AMQP\x00\x00\x09\x01" if protocol == "amqp" else b""
    _, elapsed = await _closed_after(strict_gateway.ports[protocol], opening)
    assert 0.9 <= elapsed < CLOSE_WITHIN


def _login_start(announced: int, sent: int) -> dict[str, bytes]:
    """Per protocol, the start of a login frame that announces ``announced`` bytes, with
    ``sent`` bytes of its body (a STOMP frame announces no length: its login header runs
    ``sent`` bytes)."""
    mqtt_length = bytearray()
    write_vbi(mqtt_length, announced)
    return {
        "native": announced.to_bytes(4, "big") + b"\x01" * sent,
        "mqtt": b"\x10" + mqtt_length + b"\x00" * sent,
        "amqp": b"AMQP\x00\x00\x09\x01\x01\x00\x00" + announced.to_bytes(4, "big") + b"\0" * sent,
        "stomp": b"CONNECT\naccept-version:1.2\nlogin:" + b"a" * sent,
    }


# Each starts a login frame of 300 bytes, whose first bytes then trickle in.
TRICKLED_LOGIN = _login_start(300, 120)


@pytest.mark.parametrize("protocol", LOGIN_PROTOCOLS)
async def test_a_login_that_trickles_in_is_closed_at_the_login_timeout_from_the_accept(
    strict_gateway: Gateway, protocol: str
) -> None:
    """A byte every 0.25 s keeps no read waiting long, but the login frame is due one
    second (the login timeout) after the accept, not after the last byte (STOMP
    counted it from the last read)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    reader, writer = await asyncio.open_connection("127.0.0.1", strict_gateway.ports[protocol])
    closed = asyncio.create_task(reader.read())  # b"" or an error frame, then EOF
    try:
        for byte in TRICKLED_LOGIN[protocol]:
            writer.write(bytes([byte]))
            done, _ = await asyncio.wait([closed], timeout=0.25)
            if done:
                break
        async with asyncio.timeout(CLOSE_WITHIN):
            while await closed:
                closed = asyncio.create_task(reader.read())
    except ConnectionError:
        pass  # reset by the gateway's close
    finally:
        writer.close()
    assert 0.9 <= loop.time() - started < 1.9


# Each announces a login frame of 100,000 bytes (over 64 KiB, under every protocol's
# frame limit after login) and sends its first bytes: refused before the rest (STOMP's,
# which announces no length, sends them all).
OVERSIZED_LOGIN = {**_login_start(100_000, 64), "stomp": _login_start(0, 100_000)["stomp"]}


@pytest.mark.parametrize("protocol", LOGIN_PROTOCOLS)
async def test_a_login_frame_over_64_kib_closes_the_connection(
    gateway: Gateway, protocol: str
) -> None:
    answer, elapsed = await _closed_after(gateway.ports[protocol], OVERSIZED_LOGIN[protocol])
    assert elapsed < CLOSE_WITHIN
    assert b"Traceback" not in answer
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=2)
        confirmed = await client.publish("orders", b"after", key="k")
        consumer = await client.subscribe("orders", group="g")
        assert (await consumer.receive(timeout=5)).message_id == confirmed


async def test_a_publisher_flooding_unconfirmed_publishes_is_held_to_the_byte_budget(
    db_url: str,
) -> None:
    budget = 64 * 1024
    gw = await start_gateway(db_url, max_unconfirmed_bytes=budget)
    try:
        async with Client(native_url(gw)) as client:
            await client.declare_queue("orders", partitions=4)
            payloads = [b"%05d" % i + b"x" * 4091 for i in range(600)]  # 2.4 MB in flight
            confirmed = await asyncio.gather(
                *(client.publish("orders", p, key=f"k{i % 7}") for i, p in enumerate(payloads))
            )
            consumer = await client.subscribe("orders", group="g", window=1000)
            got = {(await consumer.receive(timeout=10)).message_id for _ in confirmed}
        assert got == set(confirmed)
        native = gw._listeners["native"]
        assert isinstance(native, NativeListener)
        assert 0 < native.unconfirmed_peak <= budget
    finally:
        await gw.stop()


def _stomp_flood(port: int, count: int) -> str:
    """Send ``count`` SENDs with 8 KiB of headers each, a receipt on the last."""
    conn = stomp.Connection12([("127.0.0.1", port)], reconnect_attempts_max=1)
    receipts: list[str] = []
    conn.set_listener("r", _ReceiptRecorder(receipts))
    conn.connect(wait=True)
    try:
        for i in range(count):
            headers = {"JMSXGroupID": f"k{i % 5}", "x-pad": "p" * 8192}
            if i == count - 1:
                headers["receipt"] = "last"
            conn.send("/queue/orders", b"%d" % i, headers=headers)
        deadline = time.monotonic() + 30
        while not receipts and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        conn.disconnect()
    return receipts[0] if receipts else "no receipt"


class _ReceiptRecorder(stomp.ConnectionListener):  # type: ignore[misc]
    def __init__(self, receipts: list[str]) -> None:
        self.receipts = receipts

    def on_receipt(self, frame: stomp.utils.Frame) -> None:
        self.receipts.append(frame.headers["receipt-id"])


async def test_a_stomp_flood_of_large_headers_under_a_small_budget_is_all_stored(
    db_url: str,
) -> None:
    gw = await start_gateway(db_url, max_unconfirmed_bytes=64 * 1024)
    try:
        async with Client(native_url(gw)) as client:
            await client.declare_queue("orders", partitions=2)
            receipt = await asyncio.to_thread(_stomp_flood, gw.ports["stomp"], 300)
            consumer = await client.subscribe("orders", group="g", window=1000)
            got = {(await consumer.receive(timeout=10)).payload for _ in range(300)}
        assert receipt == "last"
        assert got == {b"%d" % i for i in range(300)}
    finally:
        await gw.stop()


def _mqtt_flood(port: int, count: int) -> int:
    """Publish ``count`` QoS 1 messages of 4 KiB without waiting; the PUBACKs received."""
    acked: list[int] = []
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="flood", protocol=paho.MQTTv5)
    client.on_publish = lambda c, u, mid, rc, p: acked.append(mid)
    client.max_inflight_messages_set(count)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        for i in range(count):
            client.publish("orders/in", b"%05d" % i + b"x" * 4091, qos=1)
        deadline = time.monotonic() + 30
        while len(acked) < count and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        client.disconnect()
        client.loop_stop()
    return len(acked)


async def test_an_mqtt_flood_of_qos1_publishes_under_a_small_budget_is_all_stored(
    db_url: str,
) -> None:
    gw = await start_gateway(db_url, max_unconfirmed_bytes=64 * 1024)
    try:
        async with Client(native_url(gw)) as client:
            await client.declare_queue("orders", partitions=2, subscriptions=["orders/#"])
            acked = await asyncio.to_thread(_mqtt_flood, gw.ports["mqtt"], 500)
            consumer = await client.subscribe("orders", group="g", window=1000)
            got = {(await consumer.receive(timeout=10)).payload[:5] for _ in range(500)}
        assert acked == 500
        assert got == {b"%05d" % i for i in range(500)}
    finally:
        await gw.stop()
