"""The native server's answers as docs/native-protocol.md states them, over a real socket
and an in-memory sink: HELLO refusals (§3), settling a flow id the connection does not
know (§4), CREDIT's bounds (§5) and CLOSE after pipelined PUBLISHes (§2)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from core.errors import QueueNotFound
from core.model import QueueConfig
from protocols.native.events import (
    Ack,
    AckCumulative,
    Bind,
    Close,
    Credit,
    Error,
    Event,
    FlowClosed,
    Hello,
    Nack,
    NackOutcome,
    Ok,
    Ping,
    Pong,
    Publish,
    PublishOk,
    Unbind,
)
from protocols.native.listener import NativeListener
from protocols.sink import Principal
from tests.support.memory_sink import MemorySink
from tests.support.native_raw import RawClient, connect, raw_client

ME = Principal(None, "test")


@asynccontextmanager
async def _serving(sink: MemorySink) -> AsyncIterator[int]:
    await sink.declare_queue(ME, QueueConfig("q"))
    listener = NativeListener(sink)  # type: ignore[arg-type]
    port = await listener.start("127.0.0.1", 0, None)
    try:
        yield port
    finally:
        await listener.close()


async def _rest(client: RawClient) -> list[Event]:
    """Every event until the gateway closes the connection."""
    events = []
    while (event := await client.receive()) is not None:
        events.append(event)
    return events


@pytest.mark.parametrize(
    ("hello", "code"),
    [
        (Hello(request_id=7, username="alice", password="wrong"), "authentication-failed"),
        (Hello(request_id=7, version=0, username="alice", password="pw"), "unsupported-version"),
        (Hello(request_id=7, client_name="n" * 501, username="alice", password="pw"),
         "invalid-argument"),
    ],
)  # fmt: skip
async def test_a_refused_hello_gets_an_error_with_its_id_then_close(
    hello: Hello, code: str
) -> None:
    async with _serving(MemorySink(users={"alice": "pw"})) as port:
        client = await connect(port)
        try:
            client.send(hello)
            error, close = await _rest(client)
        finally:
            client.close()
        assert isinstance(error, Error) and (error.request_id, error.code) == (7, code)
        assert isinstance(close, Close)


def _settles(flow_id: str) -> list[Callable[[int], Event]]:
    """Every request that names a flow, for request id ``rid``."""
    return [
        lambda rid: Ack(request_id=rid, flow_id=flow_id, message_ids=("m",)),
        lambda rid: AckCumulative(request_id=rid, flow_id=flow_id, partition=0, seq=1),
        lambda rid: Nack(request_id=rid, flow_id=flow_id, message_ids=("m",)),
        lambda rid: Nack(
            request_id=rid, flow_id=flow_id, message_ids=("m",), outcome=NackOutcome.REJECT
        ),
        lambda rid: Credit(request_id=rid, flow_id=flow_id, window=5),
        lambda rid: Nack(
            request_id=rid, flow_id=flow_id, message_ids=(), outcome=NackOutcome.SHUTDOWN
        ),
        lambda rid: Unbind(request_id=rid, flow_id=flow_id),
    ]


async def test_settling_a_flow_the_connection_never_bound_is_an_error_with_the_request_id() -> None:
    async with _serving(MemorySink()) as port:
        client = await raw_client(port)
        try:
            for make in _settles("never-bound"):
                rid = client.conn.next_request_id()
                reply = await client.request(make(rid))
                assert isinstance(reply, Error), reply
                assert (reply.request_id, reply.code) == (rid, "not-found")
                assert "never-bound" in reply.text
            # With id 0 nothing is answered, and the connection goes on.
            client.send(Ack(flow_id="never-bound", message_ids=("m",)))
            client.send(Credit(flow_id="never-bound", window=5))
            assert await client.request(Ping(request_id=99)) == Pong(request_id=99)
        finally:
            client.close()


@pytest.mark.parametrize("ending", ["unbind", "nack-shutdown", "flow-closed"])
async def test_late_settles_of_a_flow_that_ended_on_this_connection_are_answered_ok(
    ending: str,
) -> None:
    sink = MemorySink()
    async with _serving(sink) as port:
        client = await raw_client(port)
        try:
            flow_id = await client.bind("q")
            rid = client.conn.next_request_id()
            if ending == "unbind":
                assert await client.request(Unbind(request_id=rid, flow_id=flow_id)) == Ok(
                    request_id=rid
                )
            elif ending == "nack-shutdown":
                shutdown = Nack(
                    request_id=rid, flow_id=flow_id, message_ids=(), outcome=NackOutcome.SHUTDOWN
                )
                assert await client.request(shutdown) == Ok(request_id=rid)
            else:
                sink.flows[flow_id].output.terminate(QueueNotFound("q"))
                assert isinstance(await client.receive(), FlowClosed)
            for make in _settles(flow_id):
                rid = client.conn.next_request_id()
                assert await client.request(make(rid)) == Ok(request_id=rid)
        finally:
            client.close()


async def test_close_after_pipelined_publishes_answers_them_all_then_closes() -> None:
    sink = MemorySink()
    async with _serving(sink) as port:
        client = await raw_client(port)
        try:
            sink.gate.clear()  # commits stall: the CLOSE arrives before any confirm
            publishes = [
                Publish(request_id=client.conn.next_request_id(), queue="q", payload=b"%d" % i)
                for i in range(50)
            ]
            frames = [client.conn.send(p) for p in publishes] + [client.conn.send(Close())]
            client.writer.write(b"".join(frames))
            await asyncio.sleep(0.05)
            sink.gate.set()
            events = await _rest(client)
        finally:
            client.close()
    assert [type(e) for e in events] == [PublishOk] * 50 + [Close]
    assert [e.request_id for e in events[:-1]] == [p.request_id for p in publishes]
    assert len(sink.stored) == 50


@pytest.mark.parametrize(
    ("request_kind", "zero_means"), [("credit", "0 pauses the flow"), ("bind", "0 = the queue")]
)
async def test_a_window_out_of_range_is_refused_with_a_text_that_allows_zero(
    request_kind: str, zero_means: str
) -> None:
    async with _serving(MemorySink()) as port:
        client = await raw_client(port)
        try:
            flow_id = await client.bind("q")
            rid = client.conn.next_request_id()
            too_large = 2**31
            if request_kind == "credit":
                request: Event = Credit(request_id=rid, flow_id=flow_id, window=too_large)
            else:
                request = Bind(request_id=rid, queue="q", group="g", window=too_large)
            reply = await client.request(request)
            assert isinstance(reply, Error) and reply.code == "invalid-argument", reply
            assert reply.text.startswith("window must be between 0 and 2147483647"), reply.text
            assert zero_means in reply.text
            # 0 itself is taken.
            rid = client.conn.next_request_id()
            credit = Credit(request_id=rid, flow_id=flow_id, window=0)
            assert await client.request(credit) == Ok(request_id=rid)
        finally:
            client.close()
