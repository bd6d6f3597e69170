"""The admin HTTP port is bounded like the protocol ports: at most
``max_http_connections`` open connections (the one over it is answered 503 and closed at
once, and the open ones are a metric), a connection that has not sent a complete request
head within ``login_timeout`` of its accept, or of its previous response, is closed, and
so is one whose request body has not arrived within ``http_body_timeout``. Attackers on
the HTTP port cannot take the descriptors the other listeners need to accept logins."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.client import Client
from gateway.config import GatewayConfig
from gateway.http_server import HttpConnections
from gateway.server import Gateway
from gateway.standby import StandbyHealth
from protocols.mqtt import Connect
from tests.integration.conftest import native_url, start_gateway
from tests.support import stomp_raw
from tests.support.amqp_raw import RawAmqp
from tests.support.http_raw import Held, answered_then_closed, get, request
from tests.support.mqtt_raw import RawMqtt
from tests.support.pki import make_pki
from tests.support.wait import eventually

CAP = 3


@pytest.fixture
async def capped(sqlite_url: str) -> AsyncIterator[Gateway]:
    """A gateway whose HTTP port takes three connections and whose protocol ports take
    four (one per protocol)."""
    gw = await start_gateway(sqlite_url, max_http_connections=CAP, max_connections=4)
    try:
        yield gw
    finally:
        await gw.stop()


async def _refused(port: int) -> bytes:
    """Open a connection and return what the server wrote before closing it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await answered_then_closed(reader, wait=5)
    finally:
        writer.close()


async def _fill(port: int, count: int) -> list[Held]:
    return [await Held.open(port) for _ in range(count)]


async def _status_ok(port: int) -> bool:
    try:
        status, _ = await get(port, "/api/status")
    except (ConnectionError, ValueError, IndexError):
        return False
    return status == 200


async def test_the_http_connection_over_the_cap_is_refused_and_one_is_accepted_once_another_closes(
    capped: Gateway,
) -> None:
    port = capped.ports["http"]
    held = await _fill(port, CAP)
    try:
        answer = await _refused(port)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        error = json.loads(answer.partition(b"\r\n\r\n")[2])
        assert error["error"] == "connection-limit"
        assert "max_http_connections" in error["message"]
        await held.pop().close()
        # The gateway sees the close when it reads the EOF: poll, with a deadline.
        await eventually(lambda: _status_ok(port), timeout=5)
        status, metrics = await get(port, "/metrics")
        assert status == 200
        assert b'keygate_listener_refused_connections_total{listener="http"} 1.0' in metrics
    finally:
        for connection in held:
            await connection.close()


async def test_the_http_and_https_ports_share_the_cap(sqlite_url: str, tmp_path: Path) -> None:
    """The cap bounds descriptors, so it is one count for both admin ports; a TLS
    connection is counted once its handshake is done and refused over TLS."""
    pki = make_pki(tmp_path / "pki")
    cert, key = pki.server
    gw = await start_gateway(sqlite_url, max_http_connections=1, tls_cert=cert, tls_key=key)
    try:
        held = await Held.open(gw.ports["http"])
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", gw.ports["http_tls"], ssl=pki.client_context()
            )
            try:
                assert (await answered_then_closed(reader, wait=5)).startswith(b"HTTP/1.1 503")
            finally:
                writer.close()
        finally:
            await held.close()
        await eventually(lambda: _status_ok(gw.ports["http"]), timeout=5)
    finally:
        await gw.stop()


async def test_every_protocol_listener_accepts_logins_while_the_http_port_is_at_its_cap(
    capped: Gateway,
) -> None:
    """HTTP connections are not counted against ``max_connections``: four logins, one per
    protocol, fill it exactly while the HTTP port is full and refusing."""
    port = capped.ports["http"]
    held = await _fill(port, CAP)
    try:
        for _ in range(5):
            assert (await _refused(port)).startswith(b"HTTP/1.1 503")
        async with Client(native_url(capped)) as client:
            await client.declare_queue("orders")
            await RawMqtt.connected(capped.ports["mqtt"], Connect("during"))
            amqp = await RawAmqp.confirming(capped.ports["amqp"])
            try:
                async with stomp_raw.raw(capped.ports["stomp"]) as stomp:
                    await stomp.connect()
                confirmed = await client.publish("orders", b"during", key="k")
                consumer = await client.subscribe("orders", group="g")
                assert (await consumer.receive(timeout=5)).message_id == confirmed
            finally:
                amqp.writer.close()
                await RawMqtt.close_all()
    finally:
        for connection in held:
            await connection.close()


@pytest.fixture
async def strict(sqlite_url: str) -> AsyncIterator[Gateway]:
    """A gateway that gives a peer one second to log in, or to send a request head."""
    gw = await start_gateway(sqlite_url, login_timeout=1.0)
    try:
        yield gw
    finally:
        await gw.stop()


CLOSE_WITHIN = 1.9


async def test_a_request_head_that_trickles_in_is_closed_at_the_login_timeout_from_the_accept(
    strict: Gateway,
) -> None:
    """A byte every 0.25 s keeps no read waiting long (slowloris), but the head is due one
    second after the accept, not after the last byte."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    reader, writer = await asyncio.open_connection("127.0.0.1", strict.ports["http"])
    closed = asyncio.create_task(answered_then_closed(reader, wait=CLOSE_WITHIN))
    try:
        half = b"GET /healthz HTTP/1.1\r\nHost: keygate\r\nX-Pad: " + b"a" * 40
        for byte in half:
            writer.write(bytes([byte]))
            done, _ = await asyncio.wait([closed], timeout=0.25)
            if done:
                break
        answer = await closed
    finally:
        writer.close()
    assert 0.9 <= loop.time() - started < CLOSE_WITHIN
    assert b"Traceback" not in answer


async def test_a_silent_http_connection_is_closed_at_the_login_timeout(strict: Gateway) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    await _refused(strict.ports["http"])
    assert 0.9 <= loop.time() - started < CLOSE_WITHIN


async def test_an_idle_keep_alive_connection_is_closed_after_the_timeout(strict: Gateway) -> None:
    held = await Held.open(strict.ports["http"])
    loop = asyncio.get_running_loop()
    answered = loop.time()
    try:
        assert await answered_then_closed(held.reader, wait=CLOSE_WITHIN) == b""
        assert 0.9 <= loop.time() - answered < CLOSE_WITHIN
    finally:
        await held.close()


async def test_a_keep_alive_connection_serves_requests_sent_in_time(strict: Gateway) -> None:
    """The timeout restarts after each response: three requests 0.6 s apart on one
    connection, 1.8 s in all, are all answered."""
    held = await Held.open(strict.ports["http"])
    try:
        for _ in range(3):
            await asyncio.sleep(0.6)  # a pause within the timeout is the point of the test
            held.writer.write(request("/healthz", keep_alive=True))
            head = await asyncio.wait_for(held.reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200"), head
            await held.reader.readuntil(b"}")
    finally:
        await held.close()


async def _standby_is_capped_and_closes_a_silent_socket() -> None:
    connections = HttpConnections(limit=1, header_timeout=1.0)
    standby = StandbyHealth(GatewayConfig(), "sqlite", connections)
    port = await standby.start("127.0.0.1", 0, None)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            # Silent: counted, then closed by the header timeout.
            await eventually(lambda: standby.connections.open == 1, timeout=5)
            assert (await _refused(port)).startswith(b"HTTP/1.1 503")
            loop = asyncio.get_running_loop()
            started = loop.time()
            await answered_then_closed(reader, wait=CLOSE_WITHIN)
            assert loop.time() - started < CLOSE_WITHIN
        finally:
            writer.close()
        await eventually(lambda: standby.connections.open == 0, timeout=5)
        status, body = await get(port, "/healthz")
        assert status == 503 and json.loads(body)["role"] == "standby"
    finally:
        await standby.close()


async def test_the_standby_http_server_has_the_same_cap_and_timeout() -> None:
    await _standby_is_capped_and_closes_a_silent_socket()


def test_the_cap_and_timeout_hold_on_uvloop() -> None:
    """``keygate serve`` runs on uvloop where it is installed, whose transports are not
    asyncio's classes."""
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(_standby_is_capped_and_closes_a_silent_socket())


def _post_head(length: int) -> bytes:
    return (
        "POST /api/queues HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Connection: close\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


async def test_a_request_body_that_stalls_or_trickles_is_cut_off_and_its_place_freed(
    sqlite_url: str,
) -> None:
    """A body announced and then not sent held its connection, and a place under the
    cap, for ever: the head had come in time and nothing bounded the rest."""
    gw = await start_gateway(sqlite_url, max_http_connections=2, http_body_timeout=1.0)
    port = gw.ports["http"]
    loop = asyncio.get_running_loop()
    opened: list[asyncio.StreamWriter] = []

    async def post(head: bytes) -> asyncio.StreamReader:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        opened.append(writer)
        writer.write(head)
        return reader

    try:
        started = loop.time()
        stalled = await post(_post_head(1_000_000) + b'{"name": ')
        trickling = await post(_post_head(1_000_000))
        assert (await _refused(port)).startswith(b"HTTP/1.1 503")  # both places held
        answers = [
            asyncio.create_task(answered_then_closed(r, wait=5)) for r in (stalled, trickling)
        ]
        while not answers[1].done():  # a byte every 0.2 s does not restart the deadline
            opened[1].write(b" ")
            await asyncio.wait(answers[1:], timeout=0.2)
        for answer in answers:
            head, _, body = (await answer).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), head
            error = json.loads(body)
            assert error["error"] == "request-timeout"
            assert "http_body_timeout" in error["message"]
        assert loop.time() - started < 1.9
        await eventually(lambda: _status_ok(port), timeout=5)
        # A body sent in time is read as before.
        body = b'{"name": "orders"}'
        created = await post(_post_head(len(body)) + body)
        head = (await answered_then_closed(created, wait=5)).partition(b"\r\n")[0]
        assert head.startswith(b"HTTP/1.1 201"), head
    finally:
        for writer in opened:
            writer.close()
        await gw.stop()


async def test_the_open_http_connections_are_a_metric(capped: Gateway) -> None:
    port = capped.ports["http"]
    held = await _fill(port, CAP - 1)
    try:
        status, metrics = await get(port, "/metrics")  # the third open connection
        assert status == 200
        assert b"keygate_open_http_connections 3.0" in metrics, metrics
    finally:
        for connection in held:
            await connection.close()
    await eventually(lambda: _status_ok(port), timeout=5)
    await eventually(lambda: _metric_shows(port, b"keygate_open_http_connections 1.0"), timeout=5)


async def _metric_shows(port: int, line: bytes) -> bool:
    return line in (await get(port, "/metrics"))[1]
