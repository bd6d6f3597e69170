"""Bad input on every port at once: each listener answers with its protocol's error or a
closed connection, the gateway keeps serving every protocol, and nothing confirmed is lost."""

from __future__ import annotations

import asyncio
import base64
import logging
import random

import pytest

from gateway.client import Client
from gateway.server import Gateway
from tests.integration.conftest import native_url

JUNK_SEEDS = range(8)


async def _throw_junk(port: int, seed: int) -> None:
    junk = random.Random(seed).randbytes(4096)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(junk)
        await writer.drain()
        # The listener answers (an error frame, CONNACK refusal, HTTP 400...) and/or closes.
        async with asyncio.timeout(10):
            while await reader.read(65536):
                pass
    except (ConnectionError, TimeoutError):
        pass
    finally:
        writer.close()


async def test_junk_on_every_port_leaves_the_gateway_serving_and_data_intact(
    gateway: Gateway,
) -> None:
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=4)
        confirmed = [await client.publish("orders", b"%d" % i, key=f"k{i}") for i in range(20)]
    ports = [gateway.ports[name] for name in ("native", "mqtt", "amqp", "stomp", "http")]
    await asyncio.gather(*(_throw_junk(port, seed) for port in ports for seed in JUNK_SEEDS))
    async with Client(native_url(gateway)) as client:
        confirmed.append(await client.publish("orders", b"after", key="k"))
        consumer = await client.subscribe("orders", group="g")
        got = {(await consumer.receive(timeout=5)).message_id for _ in confirmed}
    assert got == set(confirmed)


async def _stomp_refusal(port: int, frame: bytes) -> tuple[bytes, float]:
    """Send ``frame`` on a fresh connection; return what came back and how long the
    gateway took to close the connection."""
    started = asyncio.get_running_loop().time()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(frame)
        await writer.drain()
        answer = b""
        async with asyncio.timeout(10):
            while chunk := await reader.read(65536):
                answer += chunk
        return answer, asyncio.get_running_loop().time() - started
    finally:
        writer.close()


async def test_stomp_numbers_too_long_to_parse_get_an_error_and_a_closed_connection(
    gateway: Gateway,
) -> None:
    port = gateway.ports["stomp"]
    connect = b"CONNECT\naccept-version:1.2\nhost:/\n"
    frames = [
        connect + b"heart-beat:" + b"9" * 400 + b",0\n\n\x00",
        connect + b"content-length:" + b"1" * 5000 + b"\n\n\x00",
        connect + b"\n\x00SEND\ndestination:/queue/orders\nexpires:" + b"7" * 5000 + b"\n\nx\x00",
    ]
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders")
        for frame in frames:
            answer, took = await _stomp_refusal(port, frame)
            assert answer.startswith(b"CONNECTED") or answer.startswith(b"ERROR"), answer[:80]
            assert b"ERROR\n" in answer and b"invalid" in answer, answer[:200]
            assert took < 10  # closed by the gateway, not by our timeout
        # Every other client keeps working.
        confirmed = await client.publish("orders", b"after", key="k")
        consumer = await client.subscribe("orders", group="g")
        assert (await consumer.receive(timeout=5)).message_id == confirmed


async def test_an_http_request_too_large_to_parse_is_one_log_line_without_its_bytes(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp logged an oversized header at ERROR with a traceback quoting its start:
    for an ``Authorization`` header, the start of the client's Basic credentials."""
    secret = base64.b64encode(b"alice:" + b"hunter2-" * 2000).decode()
    caplog.set_level(logging.INFO)
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.ports["http"])
    try:
        writer.write(f"GET /api/status HTTP/1.1\r\nAuthorization: Basic {secret}\r\n\r\n".encode())
        await writer.drain()
        async with asyncio.timeout(10):
            answer = await reader.read()
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.0 400") or answer.startswith(b"HTTP/1.1 400"), answer[:80]
    logged = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert [r.getMessage() for r in logged] == ["http 127.0.0.1: bad request: LineTooLong (400)"]
    assert all(r.levelno == logging.INFO and not r.exc_info for r in logged)
    assert secret[6:30] not in caplog.text
    async with Client(native_url(gateway)) as client:  # the gateway serves on
        await client.declare_queue("orders")
