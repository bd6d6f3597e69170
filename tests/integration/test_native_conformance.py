"""What docs/native-protocol.md promises a client written from it alone, checked against a
running gateway frame by frame (the points where a third-party client found the server
and the document apart)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from core.errors import InvalidArgument
from core.keys import partition_for
from gateway.client import Client
from gateway.server import Gateway
from protocols.native.events import Close, DeclareQueue, Error, Event, Hello, Ping, Pong, QueueOk
from tests.integration.conftest import native_url, start_gateway
from tests.support.native_raw import RawClient, connect, raw_client
from tests.support.security import hashed_users


@pytest.fixture
async def raw(gateway: Gateway) -> AsyncIterator[RawClient]:
    client = await raw_client(gateway.ports["native"])
    try:
        yield client
    finally:
        client.close()


def _declare(client: RawClient, name: str, **settings: object) -> DeclareQueue:
    return DeclareQueue(
        request_id=client.conn.next_request_id(),
        name=name,
        settings=settings,  # type: ignore[arg-type]
    )


async def _alive(client: RawClient) -> None:
    rid = client.conn.next_request_id()
    assert await client.request(Ping(request_id=rid)) == Pong(request_id=rid)


@pytest.mark.parametrize(
    ("name", "value", "kind"),
    [
        ("partitions", 2.0, "int"),
        ("partitions", True, "int"),
        ("partitions", b"\x02", "int"),
        ("max_deliveries", 3.0, "int"),
        ("window", 10.0, "int"),
        ("max_message_size", 100.0, "int"),
        ("max_depth_messages", 5.0, "int"),
        ("dead_letter_expired", 1, "bool"),
        ("rebalance_delay", "x", "float"),
    ],
)
async def test_declare_queue_refuses_a_setting_of_the_wrong_type_and_the_connection_stays(
    gateway: Gateway, raw: RawClient, name: str, value: object, kind: str
) -> None:
    request = _declare(raw, "typed", **{name: value})
    reply = await raw.request(request)
    assert isinstance(reply, Error), reply
    assert (reply.request_id, reply.code) == (request.request_id, "invalid-argument")
    assert reply.text.startswith(f"{name} must be of type {kind}")
    await _alive(raw)
    assert "typed" not in {q.name for q in gateway.broker.queues()}


async def test_the_sdk_declare_queue_refuses_a_wrong_type_as_the_wire_does(
    gateway: Gateway,
) -> None:
    async with Client(native_url(gateway)) as client:
        with pytest.raises(InvalidArgument, match=r"^partitions must be of type int"):
            await client.declare_queue("typed", partitions=2.0)
        assert (await client.declare_queue("typed", partitions=2)).partitions == 2


async def test_queue_ok_encodes_each_setting_with_its_documented_type(raw: RawClient) -> None:
    reply = await raw.request(_declare(raw, "typed", rebalance_delay=5, ttl=30, partitions=2))
    assert isinstance(reply, QueueOk), reply
    floats = {"rebalance_delay", "max_handoff_time", "ttl", "dedup_window", "retention"}
    floats |= {"backoff_initial", "backoff_max", "backoff_multiplier"}
    ints = {"partitions", "max_deliveries", "window", "max_message_size"}
    strings = {"dead_letter_queue", "on_dead_letter"}
    assert {k for k, v in reply.settings.items() if type(v) is float} == floats
    assert {k for k, v in reply.settings.items() if type(v) is int} == ints
    assert {k for k, v in reply.settings.items() if type(v) is str} == strings
    assert reply.settings["dead_letter_expired"] is False


@pytest.mark.parametrize(
    ("username", "password"), [("alice", "wrong"), ("nobody", "pw"), (None, None)]
)
async def test_a_refused_login_answers_the_hello_id_then_sends_close(
    sqlite_url: str, username: str | None, password: str | None
) -> None:
    gateway = await start_gateway(sqlite_url, users=hashed_users(alice="secret"))
    client = await connect(gateway.ports["native"])
    try:
        client.send(Hello(request_id=7, client_name="c", username=username, password=password))
        events: list[Event | None] = [await client.receive(), await client.receive()]
        assert await client.receive() is None  # then the gateway closes the socket
    finally:
        client.close()
        await gateway.stop()
    error, close = events
    assert isinstance(error, Error), error
    assert (error.request_id, error.code) == (7, "authentication-failed")
    assert isinstance(close, Close)


async def test_the_key_properties_win_over_the_publish_key_field(gateway: Gateway) -> None:
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("keyed", partitions=16)
        await client.publish(
            "keyed", b"1", key="alpha", properties={"QUEUE_PARTITION_KEY": "bravo"}
        )
        await client.publish("keyed", b"2", key="alpha", properties={"JMSXGroupID": "charlie"})
        await client.publish("keyed", b"3", key="alpha")
        consumer = await client.subscribe("keyed", group="g")
        async with asyncio.timeout(10):
            got = {
                m.payload: (m.key, m.partition) for m in [await consumer.receive() for _ in "123"]
            }
    assert got == {
        b"1": ("bravo", partition_for("bravo", 16)),
        b"2": ("charlie", partition_for("charlie", 16)),
        b"3": ("alpha", partition_for("alpha", 16)),
    }
