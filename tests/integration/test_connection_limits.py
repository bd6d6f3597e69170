"""The connection limit is one count across every listener: the connection over it is
refused with its protocol's own error (MQTT CONNACK 0x97 / 0x03, AMQP 530, STOMP ERROR,
native ``connection-limit``) and a connection is accepted again once another closes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import paho.mqtt.client as paho
import pika
import pytest
import stomp
from paho.mqtt.enums import CallbackAPIVersion

from core.errors import ConnectionLimitReached
from gateway.client import Client
from gateway.server import Gateway
from tests.integration.conftest import native_url, start_gateway
from tests.support.security import ADMIN, hashed_users


@pytest.fixture
async def gateway(db_url: str) -> AsyncIterator[Gateway]:
    """A gateway that allows two connections in all."""
    gw = await start_gateway(db_url, max_connections=2)
    try:
        yield gw
    finally:
        await gw.stop()


def _mqtt_connack(port: int, version: int) -> int:
    """The CONNACK return/reason code paho reports."""
    codes: list[int] = []
    client = paho.Client(CallbackAPIVersion.VERSION2, client_id="over", protocol=version)
    client.on_connect = lambda c, u, f, rc, p: codes.append(rc.value)
    client.connect("127.0.0.1", port)
    while not codes:
        if client.loop(timeout=0.1) != paho.MQTT_ERR_SUCCESS:
            break
    client.disconnect()
    return codes[0] if codes else -1


def _amqp_refusal(port: int) -> str:
    params = pika.ConnectionParameters("127.0.0.1", port, connection_attempts=1)
    try:
        pika.BlockingConnection(params).close()
    except pika.exceptions.AMQPConnectionError as e:
        # pika wraps a close during the handshake as ProbableAuthenticationError.
        return str(e)
    return "connected"


def _stomp_refusal(port: int) -> str:
    conn = stomp.Connection12([("127.0.0.1", port)], reconnect_attempts_max=1)
    errors: list[str] = []
    conn.set_listener("e", _ErrorRecorder(errors))
    try:
        conn.connect(wait=True)
    except stomp.exception.ConnectFailedException:
        pass
    finally:
        if conn.is_connected():
            conn.disconnect()
    return errors[0] if errors else "connected"


class _ErrorRecorder(stomp.ConnectionListener):  # type: ignore[misc]
    def __init__(self, errors: list[str]) -> None:
        self.errors = errors

    def on_error(self, frame: stomp.utils.Frame) -> None:
        self.errors.append(frame.body)


REFUSALS: dict[str, tuple[Callable[[int], object], str, Callable[[object], bool]]] = {
    "mqtt 5": (lambda p: _mqtt_connack(p, paho.MQTTv5), "mqtt", lambda r: r == 0x97),
    # paho reports the 3.1.1 return code 3 (server unavailable) as reason 0x88.
    "mqtt 3.1.1": (lambda p: _mqtt_connack(p, paho.MQTTv311), "mqtt", lambda r: r == 0x88),
    "amqp": (_amqp_refusal, "amqp", lambda r: "(530) 'connection limit" in str(r)),
    "stomp": (_stomp_refusal, "stomp", lambda r: "connection limit" in str(r)),
}


@pytest.mark.parametrize("protocol", REFUSALS.keys())
async def test_the_connection_over_the_limit_is_refused_with_the_protocols_error(
    gateway: Gateway, protocol: str
) -> None:
    attempt, listener, refused = REFUSALS[protocol]
    port = gateway.ports[listener]
    async with Client(native_url(gateway)) as first, Client(native_url(gateway)):
        await first.declare_queue("orders", partitions=2)
        answer = await asyncio.to_thread(attempt, port)
        assert refused(answer), answer
    # Both closed: the same client now gets in, and a native client still works.
    assert not refused(await asyncio.to_thread(attempt, port))
    async with Client(native_url(gateway)) as client:
        confirmed = await client.publish("orders", b"after", key="k")
        consumer = await client.subscribe("orders", group="g")
        assert (await consumer.receive(timeout=5)).message_id == confirmed


async def test_a_native_client_over_the_limit_gets_connection_limit_and_gets_in_later(
    gateway: Gateway,
) -> None:
    async with Client(native_url(gateway)), Client(native_url(gateway)):
        with pytest.raises(ConnectionLimitReached, match="connection limit"):
            async with Client(native_url(gateway), max_reconnect_attempts=0):
                pass
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders")


async def test_the_per_user_limit_refuses_a_third_connection_of_one_user(db_url: str) -> None:
    gw = await start_gateway(
        db_url,
        max_connections_per_user=2,
        users=hashed_users(alice="pw", bob="pw"),
        permissions={"bob": ADMIN},
    )
    try:
        url = native_url(gw)
        async with (
            Client(url, username="alice", password="pw"),
            Client(url, username="alice", password="pw"),
        ):
            with pytest.raises(ConnectionLimitReached, match="2 per user"):
                async with Client(url, username="alice", password="pw", max_reconnect_attempts=0):
                    pass
            async with Client(url, username="bob", password="pw") as bob:
                await bob.declare_queue("orders")
    finally:
        await gw.stop()
