"""Real AMQP clients (pika, aio-pika, a raw socket) against AmqpListener on a MemorySink."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import pika
import pika.exceptions
import pytest
from pamqp import commands, frame, heartbeat

from core.actions import Deliver
from core.model import Message, QueueConfig
from protocols.amqp import AmqpListener
from protocols.amqp.codec import FrameReader, content_frames
from protocols.amqp.constants import PROTOCOL_HEADER, ReplyCode
from protocols.sink import Ack, Principal, Unbind
from tests.support.memory_sink import MemorySink

HOST = "127.0.0.1"


@pytest.fixture
async def sink() -> MemorySink:
    return MemorySink(max_message_size=10_000)


@pytest.fixture
async def port(sink: MemorySink) -> AsyncIterator[int]:
    listener = AmqpListener(sink, heartbeat=0)
    bound = await listener.start(HOST, 0, None)
    yield bound
    await listener.close()


def _pika(port: int, **kw: object) -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.ConnectionParameters(HOST, port, connection_attempts=1, **kw)
    )


async def test_pika_confirmed_publish_maps_headers_and_survives_refusals(
    sink: MemorySink, port: int
) -> None:
    def scenario() -> tuple[type[Exception], type[Exception]]:
        connection = _pika(port)
        channel = connection.channel()
        channel.confirm_delivery()
        channel.queue_declare("orders", arguments={"x-partitions": 4})
        props = pika.BasicProperties(
            headers={"JMSXGroupID": "Order-3459134", "region": "eu", "n": 7},
            message_id="msg-1",
            correlation_id="c-1",
            reply_to="replies",
            content_type="application/json",
            delivery_mode=2,
            priority=5,
            expiration="60000",
            app_id="billing",
            timestamp=1_700_000_000,
            type="order.created",
        )
        channel.basic_publish("", "orders", b'{"a": 1}', props)
        with pytest.raises(pika.exceptions.UnroutableError) as unroutable:
            channel.basic_publish("amq.topic", "no.such.route", b"x", mandatory=True)
        with pytest.raises(pika.exceptions.NackError) as nacked:
            channel.basic_publish("", "orders", b"x" * 20_000)
        channel.basic_publish("", "orders", b"after")
        connection.close()
        return unroutable.type, nacked.type

    await asyncio.to_thread(scenario)
    stored = await sink.wait_stored(2)
    first = stored[0].publication
    assert [s.publication.payload for s in stored] == [b'{"a": 1}', b"after"]
    assert first.queue == "orders" and first.dedup_id == "msg-1"
    assert first.properties["JMSXGroupID"] == "Order-3459134"
    assert (first.properties["region"], first.properties["n"]) == ("eu", 7)
    assert (first.properties["amqp.delivery_mode"], first.properties["amqp.priority"]) == (2, 5)
    assert (first.correlation_id, first.reply_to) == ("c-1", "replies")
    assert (first.content_type, first.ttl, first.app_id) == ("application/json", 60.0, "billing")
    assert first.properties["amqp.timestamp"] == 1_700_000_000
    assert first.properties["amqp.type"] == "order.created"
    assert sink.queues["orders"].partitions == 4


async def test_pika_consumer_gets_pushed_deliveries_and_its_acks_reach_the_sink(
    sink: MemorySink, port: int
) -> None:
    got: list[tuple[bytes, dict[str, Any]]] = []

    def scenario() -> None:
        connection = _pika(port)
        channel = connection.channel()
        channel.queue_declare("jobs")
        channel.basic_qos(prefetch_count=5)

        def on_message(ch: Any, method: Any, properties: Any, body: bytes) -> None:
            got.append((body, properties.headers))
            if len(got) == 3:
                ch.basic_ack(method.delivery_tag, multiple=True)
                ch.stop_consuming()

        channel.basic_consume("jobs", on_message, arguments={"x-group": "billing"})
        channel.start_consuming()
        connection.close()

    task = asyncio.create_task(asyncio.to_thread(scenario))
    flow_id, bound = await sink.wait_bound()
    assert (bound.request.group, bound.request.window) == ("billing", 5)
    messages = [
        Message(message_id=f"m{i}", queue="jobs", partition=2, seq=i, key="k", payload=b"%d" % i)
        for i in range(3)
    ]
    assert bound.output.deliver([Deliver(flow_id, m, 1, False) for m in messages]) == []
    await task
    assert [body for body, _ in got] == [b"0", b"1", b"2"]
    assert got[0][1]["x-partition"] == 2 and got[0][1]["JMSXGroupID"] == "k"
    assert (flow_id, Ack(("m0", "m1", "m2"))) in sink.settled
    assert sink.settled[-1] == (flow_id, Unbind())


async def test_aio_pika_confirms_hundreds_of_publishes_in_flight_in_order(
    sink: MemorySink, port: int
) -> None:
    connection = await aio_pika.connect(host=HOST, port=port)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue("bulk", arguments={"x-partitions": 8})
        confirms = [
            channel.default_exchange.publish(
                aio_pika.Message(b"%d" % i, headers={"QUEUE_PARTITION_KEY": f"k{i % 10}"}),
                routing_key="bulk",
            )
            for i in range(300)
        ]
        results = await asyncio.gather(*confirms)
    assert all(isinstance(r, commands.Basic.Ack) for r in results)
    assert [s.publication.payload for s in sink.stored] == [b"%d" % i for i in range(300)]


async def test_aio_pika_topic_exchange_binding_routes_to_the_queue(
    sink: MemorySink, port: int
) -> None:
    connection = await aio_pika.connect(host=HOST, port=port)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.declare_exchange("events", aio_pika.ExchangeType.TOPIC)
        queue = await channel.declare_queue("created")
        await queue.bind(exchange, "order.*")
        shared = await channel.get_exchange("amq.topic")
        await queue.bind(shared, "sensors.#")
        await exchange.publish(aio_pika.Message(b"o1"), routing_key="order.created")
        await shared.publish(aio_pika.Message(b"s1"), routing_key="sensors.room1.temp")
    assert [(s.queue, s.publication.topic) for s in sink.stored] == [
        ("created", "$amqp/events/order/created"),
        ("created", "sensors/room1/temp"),
    ]
    assert sink.queues["created"].subscriptions == ("$amqp/events/order/+", "sensors/#")


async def test_confirm_arrives_only_after_the_commit(sink: MemorySink, port: int) -> None:
    connection = await aio_pika.connect(host=HOST, port=port)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue("slow")
        sink.gate.clear()
        confirm = asyncio.ensure_future(
            channel.default_exchange.publish(aio_pika.Message(b"x"), routing_key="slow")
        )
        done, _ = await asyncio.wait([confirm], timeout=0.3)
        assert not done and sink.stored == []
        sink.gate.set()
        async with asyncio.timeout(5):
            await confirm
    assert len(sink.stored) == 1


async def test_bad_credentials_are_refused(port: int, sink: MemorySink) -> None:
    sink.users = {"alice": "secret"}
    with pytest.raises(aio_pika.exceptions.AMQPConnectionError):
        await aio_pika.connect(host=HOST, port=port, login="alice", password="wrong")
    connection = await aio_pika.connect(host=HOST, port=port, login="alice", password="secret")
    await connection.close()


def _recv_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


async def test_malformed_bytes_close_the_connection_and_the_server_still_serves(
    sink: MemorySink, port: int
) -> None:
    def raw() -> bytes:
        with socket.create_connection((HOST, port), timeout=5) as sock:
            sock.sendall(PROTOCOL_HEADER)
            sock.sendall(b"\x01\x00\x00\x00\x00\x00\x03abc\x00")  # bad frame-end octet
            return _recv_until_closed(sock)

    reader = FrameReader(1 << 20)
    reader.feed(PROTOCOL_HEADER + await asyncio.to_thread(raw))
    start, close = reader.next_frame(), reader.next_frame()
    assert start is not None and isinstance(start.payload, commands.Connection.Start)
    assert close is not None and isinstance(close.payload, commands.Connection.Close)
    assert close.payload.reply_code == ReplyCode.FRAME_ERROR

    def wrong_header() -> bytes:
        with socket.create_connection((HOST, port), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
            return _recv_until_closed(sock)

    assert await asyncio.to_thread(wrong_header) == PROTOCOL_HEADER
    connection = await aio_pika.connect(host=HOST, port=port)
    await connection.close()


async def test_listener_close_ends_open_connections(sink: MemorySink) -> None:
    listener = AmqpListener(sink, heartbeat=0)
    bound = await listener.start(HOST, 0, None)
    connection = await aio_pika.connect(host=HOST, port=bound)
    closed = asyncio.Event()
    connection.close_callbacks.add(lambda *args: closed.set())
    async with asyncio.timeout(5):
        await listener.close()
        await closed.wait()


class RawClient:
    """A hand-driven AMQP client for what the libraries do not expose."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.frames = FrameReader(1 << 20)
        self.frames.feed(PROTOCOL_HEADER)

    @classmethod
    async def open(cls, port: int, heartbeat: int) -> RawClient:
        client = cls(*await asyncio.open_connection(HOST, port))
        client.writer.write(PROTOCOL_HEADER)
        await client.expect(commands.Connection.Start)
        capabilities: Any = {"connection.blocked": True}
        client.send(commands.Connection.StartOk({"capabilities": capabilities}, "PLAIN", PLAIN))
        await client.expect(commands.Connection.Tune)
        client.send(commands.Connection.TuneOk(2047, 131072, heartbeat))
        client.send(commands.Connection.Open("/"))
        await client.expect(commands.Connection.OpenOk)
        return client

    def send(self, method: object) -> None:
        self.writer.write(frame.marshal(method, 0))  # type: ignore[arg-type]

    async def next_payload(self) -> object | None:
        """The next frame's payload; None once the server closed the socket."""
        while (item := self.frames.next_frame()) is None:
            data = await self.reader.read(65536)
            if not data:
                return None
            self.frames.feed(data)
        return item.payload

    async def expect(self, kind: type) -> object:
        async with asyncio.timeout(5):
            while not isinstance(payload := await self.next_payload(), kind):
                assert payload is not None, f"closed while waiting for {kind.__name__}"
        return payload

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()


PLAIN = "\x00guest\x00guest"


async def test_heartbeats_are_sent_and_a_silent_peer_is_dropped(sink: MemorySink) -> None:
    listener = AmqpListener(sink, heartbeat=1)
    bound = await listener.start(HOST, 0, None)
    try:
        client = await RawClient.open(bound, heartbeat=1)
        await client.expect(heartbeat.Heartbeat)
        async with asyncio.timeout(6):
            while await client.next_payload() is not None:
                pass
        await client.close()
    finally:
        await listener.close()


async def test_backpressure_is_announced_with_connection_blocked(
    sink: MemorySink, port: int
) -> None:
    client = await RawClient.open(port, heartbeat=0)
    sink.blocked = True
    await client.expect(commands.Connection.Blocked)
    sink.blocked = False
    await client.expect(commands.Connection.Unblocked)
    await client.close()


async def test_listener_close_does_not_wait_forever_for_a_silent_client(
    sink: MemorySink,
) -> None:
    listener = AmqpListener(sink, heartbeat=0)
    bound = await listener.start(HOST, 0, None)
    client = await RawClient.open(bound, heartbeat=0)
    async with asyncio.timeout(10):
        await listener.close()
    await client.expect(commands.Connection.Close)
    await client.close()


async def test_failed_writes_and_full_queues_are_nacked_and_the_channel_survives(
    sink: MemorySink, port: int
) -> None:
    def scenario() -> None:
        connection = _pika(port)
        channel = connection.channel()
        channel.confirm_delivery()
        channel.queue_declare("small", arguments={"x-max-length": 1})
        channel.basic_publish("", "small", b"first")
        with pytest.raises(pika.exceptions.NackError):
            channel.basic_publish("", "small", b"over the limit")
        sink.fail_writes = True
        channel.queue_declare("other")
        with pytest.raises(pika.exceptions.NackError):
            channel.basic_publish("", "other", b"lost")
        sink.fail_writes = False
        channel.basic_publish("", "other", b"stored")
        connection.close()

    await asyncio.to_thread(scenario)
    assert [(s.queue, s.publication.payload) for s in sink.stored] == [
        ("small", b"first"),
        ("other", b"stored"),
    ]


async def test_queue_operations_answer_with_counts_and_not_found(
    sink: MemorySink, port: int
) -> None:
    def scenario() -> tuple[int, int, int, int, int]:
        connection = _pika(port)
        channel = connection.channel()
        channel.confirm_delivery()
        declared = channel.queue_declare("work")
        for i in range(3):
            channel.basic_publish("", "work", b"%d" % i)
        redeclared = channel.queue_declare("work", passive=True)
        purged = channel.queue_purge("work")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as missing:
            channel.queue_declare("absent", passive=True)
        channel = connection.channel()
        channel.basic_publish("", "work", b"again")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as not_empty:
            channel.queue_delete("work", if_empty=True)
        channel = connection.channel()
        deleted = channel.queue_delete("work")
        connection.close()
        assert declared.method.queue == "work"
        assert int(not_empty.value.reply_code) == ReplyCode.PRECONDITION_FAILED
        return (
            redeclared.method.message_count,
            purged.method.message_count,
            int(missing.value.reply_code),
            deleted.method.message_count,
            len(sink.queues),
        )

    assert await asyncio.to_thread(scenario) == (3, 3, ReplyCode.NOT_FOUND, 1, 0)


async def test_server_named_queue_gets_a_valid_keygate_name(sink: MemorySink, port: int) -> None:
    connection = await aio_pika.connect(host=HOST, port=port)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue("", arguments={"x-partitions": 2})
    assert queue.name.startswith("amq.gen-")
    assert sink.queues[queue.name].partitions == 2


async def test_publishes_stalled_behind_a_commit_keep_their_order_across_channels(
    sink: MemorySink, port: int
) -> None:
    connection = await aio_pika.connect(host=HOST, port=port)
    async with connection:
        first = await connection.channel(publisher_confirms=True)
        second = await connection.channel(publisher_confirms=True)
        await first.declare_queue("ordered")
        sink.gate.clear()
        confirms = [
            (first if i % 2 else second).default_exchange.publish(
                aio_pika.Message(b"%d" % i, headers={"JMSXGroupID": "same"}),
                routing_key="ordered",
            )
            for i in range(200)
        ]
        pending = asyncio.gather(*confirms)
        done, _ = await asyncio.wait([pending], timeout=0.2)
        assert not done
        sink.gate.set()
        async with asyncio.timeout(10):
            await pending
    assert [s.publication.payload for s in sink.stored] == [b"%d" % i for i in range(200)]


class _ConnectionEnded(logging.Handler):
    """Sets an event when the listener logs that a connection ended."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "ended" in record.getMessage():
            self.seen.set()


async def test_publishes_of_a_client_that_vanishes_are_still_stored(
    sink: MemorySink, port: int
) -> None:
    ended = _ConnectionEnded()
    amqp_logger = logging.getLogger("keygate.amqp")
    amqp_logger.addHandler(ended)
    amqp_logger.setLevel(logging.INFO)
    try:
        await _publish_then_vanish(sink, port, ended.seen)
    finally:
        amqp_logger.removeHandler(ended)
        amqp_logger.setLevel(logging.NOTSET)


async def _publish_then_vanish(sink: MemorySink, port: int, ended: asyncio.Event) -> None:
    await sink.declare_queue(Principal(None, "amqp"), QueueConfig("left"))
    client = await RawClient.open(port, heartbeat=0)
    client.writer.write(frame.marshal(commands.Channel.Open(), 1))
    await client.expect(commands.Channel.OpenOk)
    sink.gate.clear()
    for i in range(50):
        publish = commands.Basic.Publish(exchange="", routing_key="left")
        body = b"%d" % i
        client.writer.write(
            frame.marshal(publish, 1) + content_frames(1, commands.Basic.Properties(), body, 131072)
        )
    # Channel.Flow is answered by the reader itself: once Flow-Ok arrives, every publish
    # before it has been read, and they are all waiting on the stalled commit.
    client.writer.write(frame.marshal(commands.Channel.Flow(active=True), 1))
    await client.expect(commands.Channel.FlowOk)
    assert sink.stored == []
    # SO_LINGER 0: closing resets the connection (RST), the way a crashed client's does.
    sock = client.writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.writer.transport.abort()
    # Release the commit only once the server has seen the reset.
    async with asyncio.timeout(5):
        await ended.wait()
    sink.gate.set()
    stored = await sink.wait_stored(50)
    assert [s.publication.payload for s in stored] == [b"%d" % i for i in range(50)]
