"""The MQTT publish pipeline (protocols/mqtt/pipeline.py) through the listener: the
publishes of one read stored with one commit, acks in arrival order after it, refusals
inside a batch and before storage, QoS 2 between QoS 0/1 batches, the byte budget, and a
task that fails."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from core.model import QueueConfig
from protocols._limits import ConnectionLimits
from protocols.mqtt import (
    MQTT_3_1_1,
    Connect,
    Disconnect,
    MqttListener,
    MqttProperties,
    PubAck,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    Will,
)
from protocols.sink import Principal
from tests.support.memory_sink import BatchSink, MemorySink
from tests.support.mqtt_raw import RawMqtt as Raw
from tests.support.wait import eventually

ADMIN = Principal("admin", "test")
TEXT = MqttProperties(payload_format_indicator=1)


@pytest.fixture
async def sink() -> BatchSink:
    memory = BatchSink()
    await memory.declare_queue(ADMIN, QueueConfig("orders", subscriptions=("orders/#",)))
    small = QueueConfig("small", subscriptions=("small/#",), max_message_size=4)
    await memory.declare_queue(ADMIN, small)
    return memory


Serve = Callable[..., Awaitable[tuple[MqttListener, int]]]


@pytest.fixture
async def serve(sink: BatchSink) -> AsyncIterator[Serve]:
    """Start a listener on ``sink`` (keyword arguments for ``MqttListener``)."""
    listeners: list[MqttListener] = []

    async def start(**options: Any) -> tuple[MqttListener, int]:
        listener = MqttListener(sink, max_packet_size=64 * 1024, **options)
        listeners.append(listener)
        return listener, await listener.start("127.0.0.1", 0, None)

    yield start
    await Raw.close_all()
    for listener in listeners:
        await listener.close()


def _payloads(sink: MemorySink) -> list[bytes]:
    return [s.publication.payload for s in sink.stored]


async def test_the_publishes_of_one_read_share_one_commit_and_are_acked_in_order_after_it(
    serve: Serve, sink: BatchSink
) -> None:
    _, port = await serve()
    client = await Raw.connected(port, Connect("batch"))
    sink.gate.clear()
    await client.send_together(
        *(Publish("orders/a", b"%d" % i, 1, packet_id=i) for i in range(1, 6))
    )
    await eventually(lambda: sink.batches == [5])
    assert sink.stored == []
    sink.gate.set()
    assert await client.receive() == PubAck(1)
    assert len(sink.stored) == 5  # the first ack left after the whole batch was committed
    assert [await client.receive() for _ in range(4)] == [PubAck(i) for i in range(2, 6)]
    assert _payloads(sink) == [b"1", b"2", b"3", b"4", b"5"]


async def test_a_refused_publish_inside_a_batch_gets_its_reason_and_is_counted_once(
    serve: Serve, sink: BatchSink
) -> None:
    listener, port = await serve()
    client = await Raw.connected(port, Connect("mixed"))
    await client.send_together(
        Publish("orders/a", b"1", 1, packet_id=1),
        Publish("small/b", b"too large", 1, packet_id=2),
        Publish("orders/c", b"3", 1, packet_id=3),
        Publish("small/d", b"too large", 0),
    )
    replies = [await client.receive() for _ in range(3)]
    assert [(r.packet_id, r.reason_code) for r in replies if isinstance(r, PubAck)] == [
        (1, ReasonCode.SUCCESS),
        (2, ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR),
        (3, ReasonCode.SUCCESS),
    ]
    assert sink.batches == [4]  # one call: each publication stored or refused alone
    assert _payloads(sink) == [b"1", b"3"]
    stats = listener.stats
    assert (stats.publishes, stats.rejected, stats.qos0_dropped) == (2, 2, 1)


async def test_a_publish_refused_before_storage_waits_for_the_commit_of_those_before_it(
    serve: Serve, sink: BatchSink
) -> None:
    listener, port = await serve()
    client = await Raw.connected(port, Connect("refused"))
    sink.gate.clear()
    await client.send_together(
        Publish("orders/a", b"1", 1, packet_id=1),
        Publish("orders/a", b"\xff", 1, packet_id=2, properties=TEXT),
        Publish("orders/a", b"3", 1, packet_id=3),
    )
    await eventually(lambda: sink.batches == [1])
    assert listener.stats.rejected == 0  # the refusal waits behind the commit in flight
    sink.gate.set()
    replies = [await client.receive() for _ in range(3)]
    assert [(r.packet_id, r.reason_code) for r in replies if isinstance(r, PubAck)] == [
        (1, ReasonCode.SUCCESS),
        (2, ReasonCode.PAYLOAD_FORMAT_INVALID),
        (3, ReasonCode.SUCCESS),
    ]
    assert sink.batches == [1, 1]  # the refusal, alone, stored nothing
    assert (listener.stats.publishes, listener.stats.rejected) == (2, 1)


async def test_on_311_a_refusal_inside_a_batch_acks_those_before_it_and_closes(
    serve: Serve, sink: BatchSink
) -> None:
    listener, port = await serve()
    client = await Raw.connected(port, Connect("mixed3", MQTT_3_1_1))
    await client.send_together(
        Publish("orders/a", b"1", 1, packet_id=1),
        Publish("small/b", b"too large", 1, packet_id=2),
        Publish("orders/c", b"3", 1, packet_id=3),
    )
    assert await client.receive() == PubAck(1)
    assert await client.receive() is None  # no PUBACK for 2, nor for 3 after it
    stats = listener.stats
    assert (stats.rejected, stats.unconfirmed_closes) == (1, 1)


async def test_qos2_between_qos1_publishes_is_stored_alone_and_in_order(
    serve: Serve, sink: BatchSink
) -> None:
    _, port = await serve()
    client = await Raw.connected(port, Connect("q2mix"))
    await client.send_together(
        Publish("orders/a", b"1", 1, packet_id=1),
        Publish("orders/a", b"2", 1, packet_id=2),
        Publish("orders/a", b"3", 2, packet_id=3),
        Publish("orders/a", b"4", 1, packet_id=4),
        Publish("orders/a", b"5", 0),
    )
    replies = [await client.receive() for _ in range(4)]
    assert replies == [PubAck(1), PubAck(2), PubRec(3), PubAck(4)]
    assert sink.batches == [2, 1, 2]
    assert _payloads(sink) == [b"1", b"2", b"3", b"4", b"5"]
    assert sink.mqtt_sessions["q2mix"] == {3}  # committed with its message


async def test_a_full_byte_budget_stops_reading_until_commits_free_it(
    serve: Serve, sink: BatchSink
) -> None:
    budget_bytes = 16 * 1024
    listener, port = await serve(limits=ConnectionLimits(max_unconfirmed_bytes=budget_bytes))
    client = await Raw.connected(port, Connect("flood"))
    sink.gate.clear()
    body = b"x" * 4094
    await client.send_together(
        *(Publish("orders/b", b"%02d" % i + body, 1, packet_id=i) for i in range(1, 21))
    )
    (connection,) = listener._acceptor.connections
    assert connection.pipeline is not None
    budget = connection.pipeline.budget
    await eventually(lambda: budget.held + len(body) > budget.limit)  # the next one waits
    assert budget.held <= budget.limit
    assert sink.stored == []
    sink.gate.set()
    assert [await client.receive() for _ in range(20)] == [PubAck(i) for i in range(1, 21)]
    assert [p[:2] for p in _payloads(sink)] == [b"%02d" % i for i in range(1, 21)]
    assert 0 < budget.peak <= budget_bytes


async def test_a_task_failing_with_a_bug_ends_its_connection_as_a_lost_one(
    serve: Serve, sink: BatchSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(client_id: str, packet_ids: frozenset[int]) -> None:
        raise RuntimeError("a bug in the release path")

    monkeypatch.setattr(sink, "mqtt_released", broken)
    _, port = await serve()
    client = await Raw.connected(port, Connect("buggy", will=Will("orders/wills", b"gone")))
    await client.send(Publish("orders/a", b"x", 2, packet_id=1))
    assert await client.receive() == PubRec(1)
    await client.send(PubRel(1))
    assert await client.receive() == Disconnect(ReasonCode.UNSPECIFIED_ERROR)
    assert await client.receive() is None
    assert [s.publication.payload for s in await sink.wait_stored(2)] == [b"x", b"gone"]
    again = await Raw.connected(port, Connect("buggy"))  # the client id was let go
    await again.send(Publish("orders/a", b"y", 1, packet_id=2))
    assert await again.receive() == PubAck(2)
