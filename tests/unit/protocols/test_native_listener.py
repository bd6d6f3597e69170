"""The native listener over a real socket and an in-memory sink: a crashed task ends its
connection like a lost one, a slow reader holds its deliveries as messages and has only
what the kernel took acked, and closing lets received publishes be confirmed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from core.actions import Deliver as Delivery
from core.model import AckMode, Message, QueueConfig
from protocols.native import connection as native_connection
from protocols.native import requests as native_requests
from protocols.native.events import Ack as NativeAck
from protocols.native.events import (
    Close,
    Deliver,
    Error,
    Publish,
    PublishOk,
)
from protocols.native.listener import NativeListener
from protocols.sink import Ack, Principal, Settle, Unbind, Undeliverable
from tests.support.memory_sink import BatchSink, MemorySink
from tests.support.native_raw import raw_client
from tests.support.wait import eventually

ME = Principal(None, "test")
COUNT = 10_000


@asynccontextmanager
async def _serving(sink: MemorySink, **options: int) -> AsyncIterator[tuple[NativeListener, int]]:
    await sink.declare_queue(ME, QueueConfig("q", window=10_000))
    listener = NativeListener(sink, **options)  # type: ignore[arg-type]
    port = await listener.start("127.0.0.1", 0, None)
    try:
        yield listener, port
    finally:
        await listener.close()


class _BuggySink(MemorySink):
    def settle(self, principal: Principal, flow_id: str, event: Settle) -> None:
        if isinstance(event, Ack):
            raise ValueError("a bug")
        super().settle(principal, flow_id, event)


async def test_a_crashed_task_ends_the_connection_with_an_error_and_unbinds_its_flows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sink = _BuggySink()
    async with _serving(sink) as (_, port):
        client = await raw_client(port)
        flow_id = await client.bind("q")
        with caplog.at_level(logging.ERROR, logger="keygate.io"):
            client.send(
                NativeAck(request_id=client.conn.next_request_id(), flow_id=flow_id, message_ids=())
            )
            error = await client.receive()
        assert isinstance(error, Error) and error.request_id == 0 and error.code == "error"
        assert await client.receive() is None  # closed
        assert "task reader failed" in caplog.text and "ValueError: a bug" in caplog.text
        await eventually(lambda: (flow_id, Unbind()) in sink.settled)
        client.writer.close()


def _deliveries(flow_id: str, count: int, size: int) -> list[Delivery]:
    return [
        Delivery(flow_id, Message(f"m{n}", "q", 0, n, None, b"%06d" % n + b"x" * size), 1, False)
        for n in range(count)
    ]


async def test_a_slow_auto_ack_reader_gets_every_delivery_in_order_acked_once_written() -> None:
    sink = MemorySink()
    async with _serving(sink, write_buffer=64 * 1024) as (_, port):
        client = await raw_client(port, receive_buffer=16 * 1024)
        flow_id = await client.bind("q", AckMode.AUTO)
        # 10 MB: more than the socket buffers hold (the kernel's send buffer grows to 4 MB).
        deliveries = _deliveries(flow_id, COUNT, 1000)
        assert sink.flows[flow_id].output.deliver(deliveries) == []
        await asyncio.sleep(0.2)

        def acked() -> list[str]:
            return [i for f, e in sink.settled if isinstance(e, Ack) for i in e.message_ids]

        assert len(acked()) < COUNT  # only what the kernel took
        for n in range(COUNT):
            event = await client.receive()
            assert isinstance(event, Deliver) and event.message_id == f"m{n}"
        await eventually(lambda: acked() == [f"m{n}" for n in range(COUNT)])
        client.send(Close())
        assert isinstance(await client.receive(), Close)  # the gateway's answer
        assert await client.receive() is None  # then it closed the socket
        client.writer.close()


async def test_a_delivery_the_wire_cannot_carry_is_returned_and_the_rest_of_its_run_sent() -> None:
    """A run is written in pieces; a frame that cannot be encoded (a key longer than a
    string field holds) comes back to the group for dead-lettering, alone."""
    sink = MemorySink()
    async with _serving(sink) as (_, port):
        client = await raw_client(port)
        flow_id = await client.bind("q")
        run = _deliveries(flow_id, 200, 1000)
        bad = Delivery(flow_id, Message("bad", "q", 0, 1000, "k" * 70_000, b"x"), 1, False)
        run.insert(100, bad)
        assert sink.flows[flow_id].output.deliver(run) == [bad]
        for n in range(200):
            event = await client.receive()
            assert isinstance(event, Deliver) and event.message_id == f"m{n}"
        client.writer.close()


async def test_a_reader_that_is_behind_has_each_delivery_encoded_once_and_bad_ones_settled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Client-ack deliveries pushed while the socket is behind are held unencoded and
    written once, when there is room (not encoded to check them, then again); one the
    wire cannot carry is then found, left out, and settled as undeliverable."""
    encoded: list[str] = []

    def counting(module: object) -> None:
        original = module.append_deliver  # type: ignore[attr-defined]

        def append_deliver(out: bytearray, flow_id: str, message: Message, *rest: object) -> None:
            encoded.append(message.message_id)
            original(out, flow_id, message, *rest)

        monkeypatch.setattr(module, "append_deliver", append_deliver)

    counting(native_connection)  # what the listener encodes at once
    counting(native_requests)  # what it encodes when the outbox writes a held piece
    sink = MemorySink()
    async with _serving(sink, write_buffer=64 * 1024) as (_, port):
        client = await raw_client(port, receive_buffer=16 * 1024)
        flow_id = await client.bind("q")
        first = _deliveries(flow_id, COUNT // 2, 1000)  # 5 MB: far more than the socket holds
        assert sink.flows[flow_id].output.deliver(first) == []
        bad = Delivery(flow_id, Message("bad", "q", 0, 10**6, "k" * 70_000, b"x"), 1, False)
        second = [bad, *_deliveries(flow_id, 10, 10)]
        assert sink.flows[flow_id].output.deliver(second) == []  # found when written
        for n in range(COUNT // 2):
            event = await client.receive()
            assert isinstance(event, Deliver) and event.message_id == f"m{n}"
        for n in range(10):
            event = await client.receive()
            assert isinstance(event, Deliver) and event.message_id == f"m{n}"
        await eventually(lambda: (flow_id, Undeliverable(("bad",))) in sink.settled)
        good = [d.message.message_id for d in first] + [f"m{n}" for n in range(10)]
        assert sorted(i for i in encoded if i != "bad") == sorted(good)  # each once
        client.writer.close()


async def test_closing_the_listener_confirms_publishes_already_received() -> None:
    sink = MemorySink()
    async with _serving(sink) as (listener, port):
        client = await raw_client(port)
        sink.gate.clear()  # commits stall
        client.send(Publish(request_id=client.conn.next_request_id(), queue="q", payload=b"x"))
        await asyncio.sleep(0.05)
        closing = asyncio.create_task(listener.close())
        await asyncio.sleep(0.05)
        assert not closing.done()
        sink.gate.set()
        assert isinstance(await client.receive(), PublishOk)
        assert await client.receive() is None
        await asyncio.wait_for(closing, 10)
        client.writer.close()


async def test_closing_while_a_client_keeps_sending_confirms_what_was_read_and_logs_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Bytes that arrive after the listener stopped reading are not read: no "feed_data
    after feed_eof" traceback from the transport, and every publish read is confirmed."""
    sink = MemorySink()
    async with _serving(sink) as (listener, port):
        client = await raw_client(port)
        confirmed = 0

        async def pump() -> None:
            with contextlib.suppress(ConnectionError):  # the gateway reset the socket
                while not reading.done():
                    for _ in range(20):
                        request_id = client.conn.next_request_id()
                        client.send(Publish(request_id=request_id, queue="q", payload=b"x"))
                    await asyncio.sleep(0)

        async def read() -> None:
            nonlocal confirmed
            while (event := await client.receive()) is not None:
                confirmed += isinstance(event, PublishOk)

        reading = asyncio.create_task(read())
        pumping = asyncio.create_task(pump())
        await eventually(lambda: confirmed > 100, interval=0.001)
        closing = asyncio.create_task(listener.close())
        await reading
        client.writer.close()
        await pumping
        await closing
    assert confirmed == len(sink.stored)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_the_publishes_of_one_read_share_one_commit_and_are_answered_in_order() -> None:
    """Five PUBLISHes in one write: one publish_each; the one too large for its queue is
    refused alone (ERROR with its request id) and the others get PUBLISH_OK, in order."""
    sink = BatchSink()
    await sink.declare_queue(ME, QueueConfig("small", max_message_size=4))
    async with _serving(sink) as (_, port):
        client = await raw_client(port)
        publishes = [
            Publish(request_id=client.conn.next_request_id(), queue=queue, payload=payload)
            for queue, payload in [
                ("q", b"1"),
                ("q", b"2"),
                ("small", b"too large"),
                ("q", b"4"),
                ("q", b"5"),
            ]
        ]
        client.writer.write(b"".join(client.conn.send(p) for p in publishes))  # one read
        replies = [await client.receive() for _ in publishes]
        assert [r.request_id for r in replies if isinstance(r, PublishOk | Error)] == [
            p.request_id for p in publishes
        ]
        assert [type(r) for r in replies] == [PublishOk, PublishOk, Error, PublishOk, PublishOk]
        assert sink.batches == [5]  # one lot; the refused one alone, not retried one by one
        assert [s.publication.payload for s in sink.stored] == [b"1", b"2", b"4", b"5"]
        client.writer.close()


async def test_the_next_read_is_handed_over_while_the_previous_one_commits_in_order() -> None:
    """Lots overlap: with commits stalled, a second read's PUBLISHes reach the sink before
    the first read's are confirmed; once commits resume, everything is stored and
    answered in the order sent."""
    sink = BatchSink()
    async with _serving(sink) as (_, port):
        client = await raw_client(port)
        sink.gate.clear()
        first = [
            Publish(request_id=client.conn.next_request_id(), queue="q", payload=b"%d" % i)
            for i in range(3)
        ]
        client.writer.write(b"".join(client.conn.send(p) for p in first))
        await eventually(lambda: sink.batches == [3])
        second = [
            Publish(request_id=client.conn.next_request_id(), queue="q", payload=b"%d" % i)
            for i in range(3, 5)
        ]
        client.writer.write(b"".join(client.conn.send(p) for p in second))
        await eventually(lambda: sink.batches == [3, 2])
        assert sink.stored == []  # neither lot committed yet
        sink.gate.set()
        replies = [await client.receive() for _ in range(5)]
        assert [(type(r), r.request_id) for r in replies if r is not None] == [
            (PublishOk, p.request_id) for p in [*first, *second]
        ]
        assert [s.publication.payload for s in sink.stored] == [b"%d" % i for i in range(5)]
        client.writer.close()


async def test_a_malformed_publish_is_refused_alone_and_the_connection_goes_on() -> None:
    """A PUBLISH naming both a queue and a topic gets ERROR with its request id; the
    PUBLISHes around it, in the same read, are stored."""
    sink = MemorySink()
    async with _serving(sink) as (_, port):
        client = await raw_client(port)
        publishes = [
            Publish(request_id=client.conn.next_request_id(), queue="q", payload=b"1"),
            Publish(request_id=client.conn.next_request_id(), queue="q", topic="t", payload=b"2"),
            Publish(request_id=client.conn.next_request_id(), queue="q", payload=b"3"),
        ]
        client.writer.write(b"".join(client.conn.send(p) for p in publishes))
        replies = {}
        for _ in publishes:
            reply = await client.receive()
            assert isinstance(reply, PublishOk | Error), reply
            replies[reply.request_id] = reply
        assert [type(replies[p.request_id]) for p in publishes] == [PublishOk, Error, PublishOk]
        assert replies[publishes[1].request_id].code == "invalid-argument"
        assert [s.publication.payload for s in sink.stored] == [b"1", b"3"]
        client.writer.close()
