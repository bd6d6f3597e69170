"""The STOMP listener end to end: stomp.py 1.0/1.1/1.2 clients and raw sockets.

stomp.py is blocking, so its calls run in a worker thread (``asyncio.to_thread``) while
the listener serves on the test's event loop; threading events carry receipts and errors
back. No sleeps: every wait is an event or a read with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import stomp
import stomp.exception

from core.model import Publication, QueueConfig
from protocols.sink import Principal, Receipt
from protocols.stomp import Frame, StompListener
from tests.support.memory_sink import MemorySink
from tests.support.stomp_raw import raw

VERSIONS = [stomp.Connection10, stomp.Connection11, stomp.Connection12]
ADMIN = Principal("admin", "test")
WAIT = 10.0


@dataclass
class CountingSink(MemorySink):
    """Records the size of every publish_many call (publish goes through it too)."""

    calls: list[int] = field(default_factory=list)
    called: asyncio.Event = field(default_factory=asyncio.Event)

    async def publish_many(
        self, principal: Principal, publications: Sequence[Publication]
    ) -> list[Receipt]:
        self.calls.append(len(publications))
        self.called.set()
        return await super().publish_many(principal, publications)


class Recorder(stomp.ConnectionListener):  # type: ignore[misc]
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.receipts: list[str] = []
        self.errors: list[Any] = []
        self.disconnected = threading.Event()

    def on_receipt(self, frame: Any) -> None:
        with self.cond:
            self.receipts.append(frame.headers["receipt-id"])
            self.cond.notify_all()

    def on_error(self, frame: Any) -> None:
        with self.cond:
            self.errors.append(frame)
            self.cond.notify_all()

    def on_disconnected(self) -> None:
        self.disconnected.set()

    def wait_receipt(self, receipt: str, timeout: float = WAIT) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: receipt in self.receipts, timeout)

    def wait_error(self, timeout: float = WAIT) -> Any:
        with self.cond:
            assert self.cond.wait_for(lambda: self.errors, timeout), "no ERROR frame"
            return self.errors[0]


@pytest.fixture
async def sink() -> CountingSink:
    s = CountingSink()
    for name in ("orders", "audit"):
        await s.declare_queue(ADMIN, QueueConfig(name, partitions=4))
    await s.declare_queue(ADMIN, QueueConfig("small", max_message_size=10))
    await s.declare_queue(ADMIN, QueueConfig("tiny", max_depth_messages=1))
    await s.declare_queue(ADMIN, QueueConfig("events", subscriptions=("sensors/#",)))
    return s


@pytest.fixture
async def port(sink: CountingSink) -> AsyncIterator[int]:
    listener = StompListener(sink, max_frame_size=64 * 1024)
    bound = await listener.start("127.0.0.1", 0, None)
    yield bound
    await listener.close()


def connect(
    cls: Any, port: int, login: str | None = None, passcode: str | None = None
) -> tuple[Any, Recorder]:
    conn = cls([("127.0.0.1", port)], reconnect_attempts_max=1)
    recorder = Recorder()
    conn.set_listener("recorder", recorder)
    conn.connect(login, passcode, wait=True)
    return conn, recorder


def close(conn: Any) -> None:
    # After an ERROR the listener closes the socket: stomp.py may still think it is
    # connected for a moment, and its DISCONNECT then fails on the closed socket.
    with contextlib.suppress(OSError, stomp.exception.NotConnectedException):
        if conn.is_connected():
            conn.disconnect()


@pytest.mark.parametrize("cls", VERSIONS)
async def test_headers_become_properties_and_receipt_follows_the_store(
    cls: Any, sink: CountingSink, port: int
) -> None:
    def client() -> bool:
        conn, rec = connect(cls, port)
        try:
            conn.send(
                "/queue/orders",
                "payload",
                content_type="text/plain",
                headers={
                    "JMSXGroupID": "Order-3459134",
                    "QUEUE_PARTITION_KEY": "pk",
                    "color": "red:blue\\x",
                    "correlation-id": "c-1",
                },
                receipt="r1",
            )
            return rec.wait_receipt("r1")
        finally:
            close(conn)

    assert await asyncio.to_thread(client)
    (stored,) = sink.stored
    pub = stored.publication
    assert stored.queue == "orders"
    assert pub.payload == b"payload"
    assert pub.properties == {
        "JMSXGroupID": "Order-3459134",
        "QUEUE_PARTITION_KEY": "pk",
        "color": "red:blue\\x",
    }
    assert pub.correlation_id == "c-1"
    assert pub.content_type == "text/plain"
    assert pub.producer is not None and pub.producer.startswith("stomp:")


@pytest.mark.parametrize("cls", VERSIONS)
async def test_receipt_is_sent_only_after_commit(cls: Any, sink: CountingSink, port: int) -> None:
    conn, rec = await asyncio.to_thread(connect, cls, port)
    try:
        sink.gate.clear()
        await asyncio.to_thread(conn.send, "/queue/orders", "x", receipt="r1")
        assert not await asyncio.to_thread(rec.wait_receipt, "r1", 0.3)
        assert sink.stored == []
        sink.gate.set()
        assert await asyncio.to_thread(rec.wait_receipt, "r1")
        assert len(sink.stored) == 1
    finally:
        await asyncio.to_thread(close, conn)


@pytest.mark.parametrize("cls", VERSIONS)
async def test_pipelined_sends_are_stored_in_order(cls: Any, sink: CountingSink, port: int) -> None:
    def client() -> bool:
        conn, rec = connect(cls, port)
        try:
            for i in range(200):
                conn.send("/topic/sensors.t1", str(i), JMSXGroupID="k")
            conn.send("/queue/orders", "last", receipt="end")
            return rec.wait_receipt("end")
        finally:
            close(conn)

    assert await asyncio.to_thread(client)
    assert [s.publication.payload for s in sink.stored if s.queue == "events"] == [
        str(i).encode() for i in range(200)
    ]
    assert sink.stored[0].publication.topic == "sensors/t1"


@pytest.mark.parametrize("cls", VERSIONS)
async def test_nul_bodies_round_trip(cls: Any, sink: CountingSink, port: int) -> None:
    body = b"\x00a\x00\xff\x00" * 100

    def client() -> bool:
        conn, rec = connect(cls, port)
        try:
            conn.send("/queue/orders", body, receipt="r")
            return rec.wait_receipt("r")
        finally:
            close(conn)

    assert await asyncio.to_thread(client)
    assert sink.stored[0].publication.payload == body


@pytest.mark.parametrize("cls", VERSIONS)
async def test_commit_stores_the_transaction_in_one_publish_many(
    cls: Any, sink: CountingSink, port: int
) -> None:
    def client() -> bool:
        conn, rec = connect(cls, port)
        try:
            tx = conn.begin()
            for i in range(3):
                conn.send("/queue/orders", f"m{i}", transaction=tx)
            conn.commit(tx, receipt="c")
            return rec.wait_receipt("c")
        finally:
            close(conn)

    assert await asyncio.to_thread(client)
    assert sink.calls == [3]
    assert [s.publication.payload for s in sink.stored] == [b"m0", b"m1", b"m2"]


@pytest.mark.parametrize("cls", VERSIONS)
async def test_abort_stores_nothing(cls: Any, sink: CountingSink, port: int) -> None:
    def client() -> bool:
        conn, rec = connect(cls, port)
        try:
            tx = conn.begin()
            conn.send("/queue/orders", "dropped", transaction=tx)
            conn.abort(tx, receipt="a")
            conn.send("/queue/audit", "kept", receipt="k")
            return rec.wait_receipt("a") and rec.wait_receipt("k")
        finally:
            close(conn)

    assert await asyncio.to_thread(client)
    assert [s.publication.payload for s in sink.stored] == [b"kept"]


async def test_a_failing_commit_stores_none_of_the_transaction(
    sink: CountingSink, port: int
) -> None:
    def client() -> Any:
        conn, rec = connect(stomp.Connection12, port)
        try:
            tx = conn.begin()
            conn.send("/queue/orders", "a", transaction=tx)
            conn.send("/queue/missing", "b", transaction=tx)
            conn.commit(tx, receipt="c")
            return rec.wait_error()
        finally:
            close(conn)

    error = await asyncio.to_thread(client)
    assert error.headers["message"] == "unknown destination"
    assert error.headers["receipt-id"] == "c"
    assert sink.stored == []


@pytest.mark.parametrize("cls", VERSIONS)
@pytest.mark.parametrize(
    ("destination", "message"),
    [
        ("/queue/missing", "unknown destination"),
        ("/topic/nobody.listens", "unknown destination"),
        ("/exchange/amq.topic", "unknown destination"),
    ],
)
async def test_bad_destinations_get_an_error_with_the_receipt_id(
    cls: Any, sink: CountingSink, port: int, destination: str, message: str
) -> None:
    def client() -> tuple[Any, bool]:
        conn, rec = connect(cls, port)
        try:
            conn.send(destination, "x", receipt="r9")
            error = rec.wait_error()
            return error, rec.disconnected.wait(WAIT)
        finally:
            close(conn)

    error, disconnected = await asyncio.to_thread(client)
    assert error.headers["message"] == message
    assert error.headers["receipt-id"] == "r9"
    assert disconnected
    assert sink.stored == []


@pytest.mark.parametrize("cls", VERSIONS)
async def test_subscribe_to_an_unknown_queue_is_an_error(cls: Any, port: int) -> None:
    def client() -> Any:
        conn, rec = connect(cls, port)
        try:
            conn.subscribe("/queue/no-such-queue", id="1")
            return rec.wait_error()
        finally:
            close(conn)

    error = await asyncio.to_thread(client)
    assert error.headers["message"] == "unknown destination"
    assert "no-such-queue" in error.body


@pytest.mark.parametrize("cls", VERSIONS)
async def test_bad_credentials_are_refused(cls: Any, sink: CountingSink, port: int) -> None:
    sink.users = {"alice": "secret"}

    def client(passcode: str) -> tuple[bool, list[Any]]:
        try:
            conn, rec = connect(cls, port, "alice", passcode)
        except stomp.exception.ConnectFailedException:
            return False, []
        close(conn)
        return True, rec.errors

    assert await asyncio.to_thread(client, "secret") == (True, [])
    ok, _ = await asyncio.to_thread(client, "wrong")
    assert not ok


async def test_bad_credentials_get_an_error_frame(sink: CountingSink, port: int) -> None:
    sink.users = {"alice": "secret"}
    async with raw(port) as client:
        await client.send(
            "CONNECT", ("accept-version", "1.2"), ("login", "alice"), ("passcode", "nope")
        )
        error = await client.frame()
        assert error is not None and error.command == "ERROR"
        assert error.header("message") == "authentication failed"
        assert await client.frame() is None


# --- raw sockets ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "garbage",
    [
        b"HELLO WORLD\n\n\x00",
        b"CONNECT\naccept-version:1.2\n\n\x00SEND\nno colon here\n\n\x00",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\n\n\x00",
        b"CONNECT\naccept-version:1.2\n\n\x00SEND\ndestination:/queue/orders\nk:a\\qb\n\n\x00",
    ],
)
async def test_malformed_bytes_get_an_error_and_close_and_the_server_still_serves(
    sink: CountingSink, port: int, garbage: bytes
) -> None:
    async with raw(port) as client:
        await client.send_raw(garbage)
        frames = []
        while (frame := await client.frame()) is not None:
            frames.append(frame)
        assert frames[-1].command == "ERROR"
        assert frames[-1].header("content-type") == "text/plain"
    async with raw(port) as client:
        await client.connect()
        await client.send("SEND", ("destination", "/queue/orders"), ("receipt", "ok"))
        reply = await client.frame()
        assert reply is not None and reply.header("receipt-id") == "ok"


async def test_frame_over_max_frame_size_is_refused(port: int) -> None:
    async with raw(port) as client:
        await client.connect()
        await client.send("SEND", ("destination", "/queue/orders"), body=b"x" * 70_000)
        error = await client.frame()
        assert error is not None and error.header("message") == "frame too large"
        assert await client.frame() is None


@pytest.mark.parametrize(
    ("setup", "destination", "message"),
    [
        (None, "/queue/small", "message too large"),
        (None, "/queue/tiny", "queue full"),
        ("fail", "/queue/orders", "storage failure"),
    ],
)
async def test_sink_rejections_become_error_frames(
    sink: CountingSink, port: int, setup: str | None, destination: str, message: str
) -> None:
    sink.fail_writes = setup == "fail"
    async with raw(port) as client:
        await client.connect()
        # One SEND at a time: the in-memory sink checks depth per call, not per batch.
        frames: list[Frame] = []
        for i in range(2):
            body = b"x" * (11 if "small" in destination else 1)
            await client.send("SEND", ("destination", destination), ("receipt", f"r{i}"), body=body)
            frame = await client.frame()
            assert frame is not None
            frames.append(frame)
            if frame.command == "ERROR":
                break
        assert await client.frame() is None
    assert frames[-1].command == "ERROR"
    assert frames[-1].header("message") == message
    assert [f.command for f in frames].count("ERROR") == 1


async def test_a_rejected_send_in_a_pipeline_keeps_those_before_it(
    sink: CountingSink, port: int
) -> None:
    async with raw(port) as client:
        await client.connect()
        # One write: the three SENDs are read together and usually stored as one batch,
        # which the unknown queue spoils; those before it must still be stored.
        await client.send_raw(
            b"".join(
                client.codec.send(
                    Frame("SEND", (("destination", f"/queue/{queue}"), ("receipt", receipt)))
                )
                for receipt, queue in (("a", "orders"), ("b", "missing"), ("c", "orders"))
            )
        )
        first = await client.frame()
        error = await client.frame()
        assert first is not None and first.header("receipt-id") == "a"
        assert error is not None and error.command == "ERROR"
        assert error.header("receipt-id") == "b"
        assert await client.frame() is None
    assert [s.queue for s in sink.stored] == ["orders"]


async def test_disconnect_receipt_waits_for_every_earlier_commit(
    sink: CountingSink, port: int
) -> None:
    async with raw(port) as client:
        await client.connect()
        sink.gate.clear()
        for i in range(3):
            await client.send("SEND", ("destination", "/queue/orders"), body=b"%d" % i)
        await client.send("DISCONNECT", ("receipt", "bye"))
        with pytest.raises(TimeoutError):
            await client.frame(wait=0.3)
        sink.gate.set()
        reply = await client.frame()
        assert reply is not None and reply.header("receipt-id") == "bye"
        assert len(sink.stored) == 3
        assert await client.frame() is None


async def test_server_sends_heartbeats_and_drops_a_silent_client(sink: CountingSink) -> None:
    listener = StompListener(sink, heartbeat=(50, 50))
    port = await listener.start("127.0.0.1", 0, None)
    try:
        async with raw(port) as client:
            reply = await client.connect(("heart-beat", "50,50"))
            assert reply.header("heart-beat") == "50,50"
            # We never send: the server beats at us, then gives up on us.
            assert await client.frame(wait=WAIT) is None
            assert client.heartbeats >= 1
    finally:
        await listener.close()


async def test_heartbeats_from_the_client_keep_the_connection(sink: CountingSink) -> None:
    listener = StompListener(sink, heartbeat=(0, 50))
    port = await listener.start("127.0.0.1", 0, None)
    try:
        async with raw(port) as client:
            await client.connect(("heart-beat", "50,0"))
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 0.5
            while loop.time() < deadline:
                await client.send_raw(b"\n")
                with pytest.raises(TimeoutError):
                    await client.frame(wait=0.04)
            await client.send("SEND", ("destination", "/queue/orders"), ("receipt", "alive"))
            reply = await client.frame()
            assert reply is not None and reply.header("receipt-id") == "alive"
    finally:
        await listener.close()


async def test_close_ends_every_connection(sink: CountingSink) -> None:
    listener = StompListener(sink)
    port = await listener.start("127.0.0.1", 0, None)
    async with raw(port) as first, raw(port) as second:
        await first.connect()
        await second.send_raw(b"CONN")
        await listener.close()
        assert await first.frame() is None
        assert await second.frame() is None


async def test_close_finishes_what_was_received_before_closing(sink: CountingSink) -> None:
    listener = StompListener(sink)
    port = await listener.start("127.0.0.1", 0, None)
    async with raw(port) as client:
        await client.connect()
        sink.gate.clear()
        await client.send("SEND", ("destination", "/queue/orders"), ("receipt", "r"))
        # The SEND reached the sink and waits for its commit.
        await asyncio.wait_for(sink.called.wait(), WAIT)
        closing = asyncio.create_task(listener.close())
        sink.gate.set()
        reply = await client.frame()
        assert reply is not None and reply.header("receipt-id") == "r"
        assert await client.frame() is None
        await closing
    assert len(sink.stored) == 1


async def test_a_reader_that_fails_unexpectedly_still_closes_the_connection(
    port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Any) -> None:
        raise ValueError("a bug in the codec")

    monkeypatch.setattr("protocols.stomp.connection.ServerConnection.next_event", broken)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"CONNECT\naccept-version:1.2\n\n\0")
        async with asyncio.timeout(5):
            while await reader.read(65536):
                pass
    finally:
        writer.close()
