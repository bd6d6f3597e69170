"""What docs/native-protocol.md promises a client written from it alone, checked against a
running gateway frame by frame (the points where a third-party client found the server
and the document apart)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from core.errors import AlreadyExists, InvalidArgument
from core.keys import partition_for
from core.model import AckMode, GroupMode
from gateway.client import Client
from gateway.server import Gateway
from protocols.native.events import (
    Bind,
    BindOk,
    Close,
    DeclareQueue,
    Deliver,
    Error,
    Event,
    Hello,
    PartitionsChanged,
    Ping,
    Pong,
    Publish,
    QueueOk,
)
from tests.integration.conftest import native_url, start_gateway
from tests.support.native_raw import RawClient, connect, raw_client
from tests.support.security import hashed_users
from tests.support.settings_cases import LARGEST, OUT_OF_RANGE, WRONG_TYPES


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


@pytest.mark.parametrize(("name", "value", "kind"), WRONG_TYPES)
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


async def test_the_sdk_declare_queue_refuses_an_integer_out_of_range_on_either_database(
    gateway: Gateway,
) -> None:
    # max_message_size 2**63-1 was a 503 storage-error on PostgreSQL (an INTEGER column).
    async with Client(native_url(gateway)) as client:
        for name, value, bounds in OUT_OF_RANGE:
            with pytest.raises(InvalidArgument, match=f"^{name} must be {bounds}$"):
                await client.declare_queue("ranged", **{name: value})
        assert "ranged" not in {q.name for q in gateway.broker.queues()}
        queue = await client.declare_queue("ranged", **LARGEST)
        assert {name: getattr(queue, name) for name in LARGEST} == LARGEST


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


async def _bind(client: RawClient, queue: str, group: str, mode: GroupMode | None) -> BindOk:
    reply = await client.request(
        Bind(
            request_id=client.conn.next_request_id(),
            queue=queue,
            group=group,
            window=0,
            ack_mode=AckMode.CLIENT,
            mode=mode,
        )
    )
    assert isinstance(reply, BindOk), reply
    return reply


async def _publish(client: RawClient, queue: str, payload: bytes) -> None:
    rid = client.conn.next_request_id()
    client.send(Publish(request_id=rid, queue=queue, payload=payload, key="k"))


async def _until_deliver(client: RawClient) -> list[Event]:
    """The events up to and including the next DELIVER."""
    events: list[Event] = []
    while not (events and isinstance(events[-1], Deliver)):
        event = await client.receive()
        assert event is not None
        events.append(event)
    return events


@pytest.mark.parametrize(
    ("partitions", "mode", "expected"),
    [
        (4, None, {0, 1, 2, 3}),  # partitioned
        (4, GroupMode.SHARED, {0, 1, 2, 3}),
        (0, None, {0}),  # shared, the default of a non-partitioned queue (a DLQ's)
        (0, GroupMode.EXCLUSIVE, {0}),
    ],
)
async def test_bind_ok_names_the_partitions_a_flow_is_served_from_and_is_not_repeated(
    gateway: Gateway, raw: RawClient, partitions: int, mode: GroupMode | None, expected: set[int]
) -> None:
    reply = await raw.request(_declare(raw, "modes", partitions=partitions))
    assert isinstance(reply, QueueOk)
    bound = await _bind(raw, "modes", "g", mode)
    assert bound.partitions == expected
    await _publish(raw, "modes", b"after the bind")
    events = await _until_deliver(raw)
    # No PARTITIONS_CHANGED repeats what BIND_OK said (§4: only changes are pushed).
    assert not [e for e in events if isinstance(e, PartitionsChanged)], events


async def test_a_shared_flow_reports_every_partition_and_a_second_one_too(
    gateway: Gateway, raw: RawClient
) -> None:
    assert isinstance(await raw.request(_declare(raw, "shared", partitions=3)), QueueOk)
    first = await _bind(raw, "shared", "g", GroupMode.SHARED)
    second = await _bind(raw, "shared", "g", GroupMode.SHARED)
    assert first.partitions == second.partitions == {0, 1, 2}


async def test_a_rebalance_is_pushed_once_to_the_flow_that_lost_partitions(
    gateway: Gateway, raw: RawClient
) -> None:
    assert isinstance(await raw.request(_declare(raw, "moving", partitions=4)), QueueOk)
    first = await _bind(raw, "moving", "g", None)
    other = await raw_client(gateway.ports["native"], hello=Hello(request_id=1, client_name="b"))
    try:
        second = await _bind(other, "moving", "g", None)
        changed = await raw.receive()
        assert isinstance(changed, PartitionsChanged), changed
        assert changed.flow_id == first.flow_id
        assert changed.partitions == {0, 1, 2, 3} - second.partitions
        assert len(second.partitions) == 2
        # The step that sent that change sent the newcomer's too, had there been one: its
        # connection's next frame answers a PING sent now.
        await _alive(other)
    finally:
        other.close()


async def test_a_redeclare_checks_the_settings_it_names_and_keeps_the_rest(
    gateway: Gateway,
) -> None:
    """docs/native-protocol.md, DECLARE_QUEUE: with exist_ok, an existing queue whose
    settings differ from the ones given is already-exists. A redeclare naming other
    values was answered with the queue as stored, and one naming nothing was refused
    for its partition count ("exists with 2 partitions")."""
    async with Client(native_url(gateway)) as client:
        await client.declare_queue("orders", partitions=2, max_deliveries=5, key_from="topic:1")
        same = await client.declare_queue("orders")  # names nothing: the queue as stored
        assert (same.partitions, same.max_deliveries) == (2, 5)
        assert (await client.declare_queue("orders", max_deliveries=5)).key_from == "topic:1"
        for settings in ({"max_deliveries": 6}, {"key_from": "topic:2"}, {"partitions": 3}):
            with pytest.raises(AlreadyExists) as refused:
                await client.declare_queue("orders", **settings)
            name = next(iter(settings))
            assert f"exists with {name}=" in str(refused.value)
        assert (await client.declare_queue("orders")).max_deliveries == 5  # unchanged
