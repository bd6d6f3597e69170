"""TLS beside plain: the TLS twins of every listener, client certificates as users, the
TLS version floor and the handshake's bounds, with paho-mqtt, pika, stomp.py, aiohttp and
the SDK."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import aiohttp
import pika.exceptions
import pytest

from core.errors import AuthenticationFailed, ConnectionLimitReached
from gateway.client import Client
from gateway.config import TLS_LISTENERS
from gateway.server import Gateway
from tests.integration.conftest import native_url, start_gateway
from tests.support.pki import Pki, make_pki
from tests.support.security import ADMIN, hashed_users
from tests.support.serve import unused_port
from tests.support.wait import eventually

TLS_PORTS = {f"{name}_port": 0 for name in TLS_LISTENERS}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), clients=("alice", "device-17", "mallory"))


def _mqtt(port: int, payload: bytes, *, pki: Pki | None = None, cert: str | None = None) -> int:
    """Publish one QoS 1 message with paho (MQTT 5); the CONNACK reason code."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    device = mqtt.Client(CallbackAPIVersion.VERSION2, f"dev-{payload.decode()}", protocol=5)
    if pki is not None:
        certfile, keyfile = pki.cert(cert) if cert else (None, None)
        device.tls_set(ca_certs=pki.ca, certfile=certfile, keyfile=keyfile)
    connected = threading.Event()
    reason: list[int] = []

    def on_connect(client: Any, userdata: Any, flags: Any, code: Any, props: Any) -> None:
        reason.append(int(code.value))
        connected.set()

    device.on_connect = on_connect
    device.connect("127.0.0.1", port)
    device.loop_start()
    try:
        assert connected.wait(10), "no CONNACK"
        if reason[0] == 0:
            device.publish("orders/eu", payload, qos=1).wait_for_publish(10)
        return reason[0]
    finally:
        device.disconnect()
        device.loop_stop()


def _amqp(
    port: int,
    payload: bytes,
    *,
    pki: Pki | None = None,
    cert: str | None = None,
    user_id: str | None = None,
) -> None:
    """Publish one confirmed message with pika; with a certificate, log in with EXTERNAL.
    ``user_id`` (default: the certificate's user) must be the connection's user."""
    import pika
    import pika.credentials

    params: dict[str, Any] = {}
    if pki is not None:
        params["ssl_options"] = pika.SSLOptions(pki.client_context(cert), "127.0.0.1")
    if cert is not None:
        params["credentials"] = pika.credentials.ExternalCredentials()
    amqp = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, **params))
    try:
        channel = amqp.channel()
        channel.confirm_delivery()
        properties = pika.BasicProperties(user_id=user_id or cert)
        channel.basic_publish("", "orders", payload, properties=properties)
    finally:
        amqp.close()


def _stomp(port: int, payload: bytes, *, pki: Pki | None = None, cert: str | None = None) -> None:
    """Send one message with stomp.py (STOMP 1.2) and wait for its receipt."""
    import stomp

    receipt = threading.Event()

    class Receipts(stomp.ConnectionListener):  # type: ignore[misc]
        def on_receipt(self, frame: object) -> None:
            receipt.set()

    conn = stomp.Connection12([("127.0.0.1", port)], heartbeats=(0, 0))
    if pki is not None:
        certfile, keyfile = pki.cert(cert) if cert else (None, None)
        conn.set_ssl(
            for_hosts=[("127.0.0.1", port)], ca_certs=pki.ca, cert_file=certfile, key_file=keyfile
        )
    conn.set_listener("receipts", Receipts())
    conn.connect(wait=True)
    try:
        conn.send("/queue/orders", payload, headers={"receipt": "r1"})
        assert receipt.wait(10), "no STOMP receipt"
    finally:
        conn.disconnect()


async def _drain(gateway: Gateway, count: int) -> set[bytes]:
    async with Client(native_url(gateway)) as client:
        consumer = await client.subscribe("orders", group="check")
        return {(await consumer.receive(timeout=10)).payload for _ in range(count)}


async def test_tls_ports_serve_every_protocol_while_the_plain_ports_still_work(
    sqlite_url: str, pki: Pki
) -> None:
    cert, key = pki.server
    gateway = await start_gateway(sqlite_url, tls_cert=cert, tls_key=key, **TLS_PORTS)
    ports = gateway.ports
    try:
        tls_url = f"keygate://127.0.0.1:{ports['native_tls']}"
        async with Client(tls_url, ssl_context=pki.client_context()) as client:
            await client.declare_queue("orders", partitions=1, subscriptions=["orders/#"])
            assert await client.publish("orders", b"sdk-tls")
        async with Client(native_url(gateway)) as plain:
            assert await plain.publish("orders", b"sdk-plain")
        assert await asyncio.to_thread(_mqtt, ports["mqtt_tls"], b"mqtt-tls", pki=pki) == 0
        assert await asyncio.to_thread(_mqtt, ports["mqtt"], b"mqtt-plain") == 0
        await asyncio.to_thread(_amqp, ports["amqp_tls"], b"amqp-tls", pki=pki)
        await asyncio.to_thread(_amqp, ports["amqp"], b"amqp-plain")
        await asyncio.to_thread(_stomp, ports["stomp_tls"], b"stomp-tls", pki=pki)
        await asyncio.to_thread(_stomp, ports["stomp"], b"stomp-plain")
        async with aiohttp.ClientSession() as http:
            https = f"https://127.0.0.1:{ports['http_tls']}"
            health = await http.get(f"{https}/healthz", ssl=pki.client_context())
            assert health.status == 200
            plain_http = await http.get(f"http://127.0.0.1:{ports['http']}/api/queues")
            assert plain_http.status == 200
        assert await _drain(gateway, 8) == {
            b"sdk-tls", b"sdk-plain", b"mqtt-tls", b"mqtt-plain",
            b"amqp-tls", b"amqp-plain", b"stomp-tls", b"stomp-plain",
        }  # fmt: skip
    finally:
        await gateway.stop()


async def test_tls_listeners_stay_off_without_a_certificate(sqlite_url: str) -> None:
    gateway = await start_gateway(sqlite_url, **TLS_PORTS)
    try:
        assert not set(gateway.ports) & set(TLS_LISTENERS)
        assert {"native", "mqtt", "amqp", "stomp", "http"} <= set(gateway.ports)
    finally:
        await gateway.stop()


async def test_tls_below_1_2_is_refused(sqlite_url: str, pki: Pki) -> None:
    cert, key = pki.server
    gateway = await start_gateway(sqlite_url, tls_cert=cert, tls_key=key, **TLS_PORTS)
    try:
        port = gateway.ports["native_tls"]
        old = pki.client_context()
        with warnings.catch_warnings():  # TLS 1.1 is deprecated: that is the point
            warnings.simplefilter("ignore", DeprecationWarning)
            old.minimum_version = ssl.TLSVersion.TLSv1
            old.maximum_version = ssl.TLSVersion.TLSv1_1
        old.set_ciphers("ALL:@SECLEVEL=0")  # so that this client would speak it
        with pytest.raises((ssl.SSLError, ConnectionError)):
            _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=old)
            writer.close()
        modern = pki.client_context()
        modern.maximum_version = ssl.TLSVersion.TLSv1_2
        _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=modern)
        assert writer.get_extra_info("ssl_object").version() == "TLSv1.2"
        writer.close()
    finally:
        await gateway.stop()


async def _mtls_gateway(sqlite_url: str, pki: Pki, **settings: Any) -> Gateway:
    cert, key = pki.server
    return await start_gateway(
        sqlite_url,
        users=hashed_users(alice="not-given-to-any-client"),
        permissions={"alice": ADMIN},
        tls_cert=cert,
        tls_key=key,
        tls_ca=pki.ca,
        **TLS_PORTS,
        **settings,
    )


async def test_a_client_certificate_logs_in_as_its_user_on_every_protocol(
    sqlite_url: str, pki: Pki
) -> None:
    gateway = await _mtls_gateway(sqlite_url, pki)
    ports = gateway.ports
    try:
        tls_url = f"keygate://127.0.0.1:{ports['native_tls']}"
        async with Client(tls_url, ssl_context=pki.client_context("alice")) as client:
            await client.declare_queue("orders", partitions=1, subscriptions=["orders/#"])
            assert await client.publish("orders", b"sdk")
            code = await asyncio.to_thread(_mqtt, ports["mqtt_tls"], b"mqtt", pki=pki, cert="alice")
            assert code == 0
            await asyncio.to_thread(_amqp, ports["amqp_tls"], b"amqp", pki=pki, cert="alice")
            with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="user_id"):
                await asyncio.to_thread(
                    _amqp, ports["amqp_tls"], b"spoof", pki=pki, cert="alice", user_id="bob"
                )
            await asyncio.to_thread(_stomp, ports["stomp_tls"], b"stomp", pki=pki, cert="alice")
            async with aiohttp.ClientSession() as http:
                listed = await http.get(
                    f"https://127.0.0.1:{ports['http_tls']}/api/queues",
                    ssl=pki.client_context("alice"),
                )
                assert listed.status == 200
                assert "orders" in {q["name"] for q in await listed.json()}
            consumer = await client.subscribe("orders", group="g")
            got = {(await consumer.receive(timeout=10)).payload for _ in range(4)}
            assert got == {b"sdk", b"mqtt", b"amqp", b"stomp"}
    finally:
        await gateway.stop()


async def test_a_certificate_of_no_configured_user_or_no_certificate_logs_nobody_in(
    sqlite_url: str, pki: Pki
) -> None:
    gateway = await _mtls_gateway(sqlite_url, pki)
    ports = gateway.ports
    try:
        tls_url = f"keygate://127.0.0.1:{ports['native_tls']}"
        for context in (pki.client_context("mallory"), pki.client_context()):
            with pytest.raises(AuthenticationFailed):
                await Client(tls_url, ssl_context=context, max_reconnect_attempts=0).connect()
        assert await asyncio.to_thread(_mqtt, ports["mqtt_tls"], b"m", pki=pki, cert="mallory") in (
            0x86,
            0x87,
        )
        # The certificate names alice; it cannot be used to act as somebody else.
        with pytest.raises(AuthenticationFailed):
            await Client(
                tls_url, ssl_context=pki.client_context("alice"), username="bob", password="x"
            ).connect()
    finally:
        await gateway.stop()


async def test_certificate_users_maps_a_certificate_name_to_a_user(
    sqlite_url: str, pki: Pki
) -> None:
    gateway = await _mtls_gateway(sqlite_url, pki, certificate_users={"device-17": "alice"})
    try:
        tls_url = f"keygate://127.0.0.1:{gateway.ports['native_tls']}"
        async with Client(tls_url, ssl_context=pki.client_context("device-17")) as client:
            await client.declare_queue("orders", partitions=1)  # alice's admin right
    finally:
        await gateway.stop()


async def test_a_required_client_certificate_turns_away_clients_without_one(
    sqlite_url: str, pki: Pki, tmp_path: Path
) -> None:
    gateway = await _mtls_gateway(sqlite_url, pki, tls_require_client_cert=True)
    try:
        tls_url = f"keygate://127.0.0.1:{gateway.ports['native_tls']}"
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            client = Client(tls_url, ssl_context=pki.client_context(), max_reconnect_attempts=0)
            await client.connect()
            await client.close()
        async with Client(tls_url, ssl_context=pki.client_context("alice")) as client:
            await client.declare_queue("orders", partitions=1)
    finally:
        await gateway.stop()


def _healthcheck(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "healthcheck"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_the_container_healthcheck_works_with_only_the_tls_admin_port_on(
    sqlite_url: str, pki: Pki
) -> None:
    cert, key = pki.server
    gateway = await start_gateway(
        sqlite_url, tls_cert=cert, tls_key=key, http_port="off", **TLS_PORTS
    )
    env = {
        "KEYGATE_HTTP_PORT": "off",
        "KEYGATE_HTTP_TLS_PORT": str(gateway.ports["http_tls"]),
        "KEYGATE_TLS_CERT": cert,
        "KEYGATE_TLS_KEY": key,
    }
    try:
        healthy = await asyncio.to_thread(_healthcheck, env)
        assert healthy.returncode == 0, healthy.stderr
    finally:
        await gateway.stop()
    down = await asyncio.to_thread(_healthcheck, env)
    assert down.returncode == 1 and "https port" in down.stderr


async def test_a_standby_with_a_certificate_answers_plain_http_on_its_plain_admin_port(
    sqlite_url: str, pki: Pki
) -> None:
    """The standby served TLS on the plain `http` port whenever a certificate was set, so
    a load balancer's plain health probe could not tell it was a standby."""
    cert, key = pki.server
    tls = {"tls_cert": cert, "tls_key": key, **TLS_PORTS}
    active = await start_gateway(sqlite_url, lease_ttl=1.0, **tls)
    port = unused_port()
    standby = asyncio.create_task(start_gateway(sqlite_url, lease_ttl=1.0, http_port=port, **tls))

    async def answers_standby() -> bool:
        try:
            url = f"http://127.0.0.1:{port}/healthz"
            async with aiohttp.ClientSession() as http, http.get(url) as response:
                return response.status == 503 and (await response.json())["role"] == "standby"
        except aiohttp.ClientError:
            return False

    try:
        await eventually(answers_standby, timeout=10)
    finally:
        await active.stop()
        await (await asyncio.wait_for(standby, 15)).stop()


async def test_without_a_certificate_the_tls_admin_port_is_never_bound(sqlite_url: str) -> None:
    """With plain HTTP off, the standby's admin port fell back to http_tls, which has a
    port (8443 by default) even with no certificate: a gateway whose TLS port was taken
    failed to start (two benchmark gateways at once did)."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        gateway = await start_gateway(sqlite_url, http_port="off", http_tls_port=port)
        await gateway.stop()
    finally:
        taken.close()


class _Silent:
    """A TCP connection that never sends its ClientHello."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.opened = asyncio.get_running_loop().time()

    @classmethod
    async def open(cls, port: int) -> _Silent:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def closed_within(self, seconds: float) -> None:
        """Closed by the gateway within ``seconds`` of its opening."""
        async with asyncio.timeout_at(self.opened + seconds):
            with contextlib.suppress(ConnectionError):
                assert await self.reader.read() == b""


async def test_tls_handshakes_count_as_connections_and_are_due_at_the_login_timeout(
    sqlite_url: str, pki: Pki
) -> None:
    """asyncio's own handshake gave a peer that never sends a ClientHello 60 s, and it
    was not counted against max_connections until it finished: a flood of them was
    free. Now a handshake is part of the login and counts from the accept: a real client
    still gets in beside them, or is refused with the protocol's error at the limit."""
    cert, key = pki.server
    gateway = await start_gateway(
        sqlite_url, tls_cert=cert, tls_key=key, login_timeout=1.0, max_connections=4, **TLS_PORTS
    )
    ports = gateway.ports
    url = f"keygate://127.0.0.1:{ports['native_tls']}"
    silent: list[_Silent] = []
    try:
        for name in ("native_tls", "mqtt_tls", "amqp_tls"):
            silent.append(await _Silent.open(ports[name]))
        async with Client(url, ssl_context=pki.client_context()) as client:  # the fourth
            await client.declare_queue("orders", partitions=1)
        silent.append(await _Silent.open(ports["stomp_tls"]))
        with pytest.raises(ConnectionLimitReached, match="4 connections"):
            await Client(url, ssl_context=pki.client_context(), max_reconnect_attempts=0).connect()
        for connection in silent:
            await connection.closed_within(1.9)
        async with Client(url, ssl_context=pki.client_context()) as client:
            assert await client.publish("orders", b"after the flood")
    finally:
        for connection in silent:
            connection.writer.close()
        await gateway.stop()
