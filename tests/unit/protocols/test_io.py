"""The listeners' shared socket side. The publish step: one transaction, each publication
stored or refused alone; where a refusal stops the protocol, one by one only when a
publication spoils the batch, nothing after the refusal. The outbox: push order, auto-acks
settled once the kernel took their bytes, frames above the high-water mark held as
remakes, and a flow held back while its connection is behind."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from core.errors import MessageTooLarge, StorageError, Unavailable
from core.model import Publication, QueueConfig
from protocols._io import FlowGate, Outbox, publish_in_order
from protocols.sink import Principal
from tests.support.memory_sink import MemorySink
from tests.support.wait import eventually

ME = Principal(None, "test")


async def _sink() -> MemorySink:
    sink = MemorySink()
    await sink.declare_queue(ME, QueueConfig("q", max_message_size=100))
    return sink


def _pubs(count: int, too_large: int | None = None) -> list[Publication]:
    return [
        Publication(b"x" * 200 if i == too_large else b"%d" % i, queue="q") for i in range(count)
    ]


async def test_an_accepted_batch_is_stored_whole() -> None:
    sink = await _sink()
    assert await publish_in_order(sink, ME, _pubs(2), stop_at_refusal=False) == [None, None]
    assert [s.publication.payload for s in sink.stored] == [b"0", b"1"]


async def test_a_refused_publication_fails_alone_or_stops_the_rest() -> None:
    sink = await _sink()
    outcomes = await publish_in_order(sink, ME, _pubs(4, too_large=2), stop_at_refusal=False)
    assert outcomes[:2] == [None, None] and outcomes[3] is None
    assert isinstance(outcomes[2], MessageTooLarge)
    assert [s.publication.payload for s in sink.stored] == [b"0", b"1", b"3"]
    stopping = await _sink()
    outcomes = await publish_in_order(stopping, ME, _pubs(4, too_large=2), stop_at_refusal=True)
    assert outcomes[:2] == [None, None] and isinstance(outcomes[2], MessageTooLarge)
    assert len(outcomes) == 3  # the fourth was not tried
    assert [s.publication.payload for s in stopping.stored] == [b"0", b"1"]


async def test_a_storage_failure_fails_the_whole_batch_without_retrying() -> None:
    sink = await _sink()
    sink.fail_writes = True
    outcomes = await publish_in_order(sink, ME, _pubs(2), stop_at_refusal=False)
    assert len(outcomes) == 2 and all(isinstance(o, StorageError) for o in outcomes)
    assert sink.stored == []


async def test_a_bug_in_the_sink_answers_each_publication_as_unavailable() -> None:
    class Broken(MemorySink):
        def publish_each(self, *_: object) -> Any:
            raise RuntimeError("a bug")

    sink = Broken()
    await sink.declare_queue(ME, QueueConfig("q"))
    outcomes = await publish_in_order(sink, ME, _pubs(2), stop_at_refusal=False)
    assert [type(o) for o in outcomes] == [Unavailable, Unavailable]


class _Pipe:
    """An outbox on one end of a socket pair whose other end the test reads (or not)."""

    def __init__(self, settled: list[tuple[str, tuple[str, ...]]], high: int) -> None:
        self.settled = settled
        self.high = high

    async def __aenter__(self) -> tuple[Outbox, socket.socket]:
        ours, self.peer = socket.socketpair()
        for sock in (ours, self.peer):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        self.peer.setblocking(False)
        _, self.writer = await asyncio.open_connection(sock=ours)

        def settle(flow_id: str, message_ids: tuple[str, ...]) -> None:
            self.settled.append((flow_id, message_ids))

        self.outbox = Outbox(self.writer, settle_written=settle, high=self.high)
        self.task = asyncio.create_task(self.outbox.run())
        return self.outbox, self.peer

    async def __aexit__(self, *exc: object) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.writer.transport.abort()
        self.peer.close()


async def _read(peer: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    data = b""
    async with asyncio.timeout(10):
        while len(data) < size:
            data += await loop.sock_recv(peer, size - len(data))
    return data


async def test_frames_leave_in_push_order_and_auto_acks_settle_once_the_kernel_took_them() -> None:
    settled: list[tuple[str, tuple[str, ...]]] = []
    async with _Pipe(settled, high=1024 * 1024) as (outbox, peer):
        outbox.push(b"reply;")
        outbox.push(b"a" * 10, ("flow", ("m1",)))
        await outbox.put(b";done")
        assert await _read(peer, 21) == b"reply;" + b"a" * 10 + b";done"
        await eventually(lambda: settled == [("flow", ("m1",))])
        # More than the socket buffers hold, never read: the last delivery stays unsettled.
        big = b"b" * (4 * 1024 * 1024)
        outbox.push(big, ("flow", ("m2",)))
        await asyncio.sleep(0.1)
        assert settled == [("flow", ("m1",))]
        assert await _read(peer, len(big)) == big
        await eventually(lambda: settled[-1] == ("flow", ("m2",)))


async def test_frames_pushed_above_high_are_held_as_remakes_in_order_with_later_ones() -> None:
    settled: list[tuple[str, tuple[str, ...]]] = []
    made: list[int] = []

    def remake(n: int) -> bytes:
        made.append(n)
        return b"%05d" % n

    async with _Pipe(settled, high=4096) as (outbox, peer):
        outbox.push(b"x" * 200_000)  # fills the socket and the transport: nothing is read
        await asyncio.sleep(0.05)
        before = outbox.pending
        for n in range(1000):
            outbox.push(b"%05d" % n, ("flow", (str(n),)), remake=lambda n=n: remake(n))
        outbox.push(b"!")  # no remake: held as bytes, behind the held frames
        assert outbox.pending == before  # not one more byte is kept
        room = asyncio.create_task(outbox.room())
        await asyncio.sleep(0.05)
        assert not room.done()  # a reader waits while frames are held
        expected = b"x" * 200_000 + b"".join(b"%05d" % n for n in range(1000)) + b"!"
        assert await _read(peer, len(expected)) == expected
        await asyncio.wait_for(room, 5)
        assert made and made == sorted(made)  # held frames were made again, in order
        await eventually(
            lambda: [i for _, ids in settled for i in ids] == [str(n) for n in range(1000)]
        )


async def test_a_frame_pushed_as_only_its_remake_is_made_once_when_it_is_queued() -> None:
    made: list[int] = []

    def make(n: int) -> bytes:
        made.append(n)
        return b"%05d" % n

    async with _Pipe([], high=4096) as (outbox, peer):
        outbox.push(None, remake=lambda: make(0))  # room: made at once
        assert made == [0] and not outbox.holding
        outbox.push(b"x" * 200_000)  # fills the socket and the transport: nothing is read
        await asyncio.sleep(0.05)
        assert outbox.holding
        for n in range(1, 100):
            outbox.push(None, remake=lambda n=n: make(n))
        assert made == [0]  # held, not made
        expected = b"00000" + b"x" * 200_000 + b"".join(b"%05d" % n for n in range(1, 100))
        assert await _read(peer, len(expected)) == expected
        assert made == list(range(100))  # each made once, in order


async def test_a_flow_is_held_back_while_its_outbox_holds_what_came_before_and_let_go_after() -> (
    None
):
    told: list[bool] = []
    async with _Pipe([], high=4096) as (outbox, peer):
        gate = FlowGate(outbox, told.append)
        for data in (b"a" * 1000, b"x" * 200_000):
            gate.check()  # each time before pushing
            outbox.push(data)
        assert told == []  # a burst into an outbox that kept up is not "behind"
        await asyncio.sleep(0.05)
        gate.check()  # nothing was read: more than the mark still waits
        outbox.push(b"y")
        assert told == [True]
        gate.check()
        outbox.push(b"z")
        assert told == [True]  # told once
        assert await _read(peer, 201_002) == b"a" * 1000 + b"x" * 200_000 + b"yz"
        await eventually(lambda: told == [True, False])
        gate.check()
        assert told == [True, False]


def test_a_push_after_the_transport_closed_ends_the_writer_as_a_lost_connection() -> None:
    """On uvloop (the gateway's loop where installed) a write to a closed transport raises
    RuntimeError ("the handler is closed"), which the writer task logged as a bug with its
    traceback, once per publisher that reset with confirms queued."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        pipe = _Pipe([], high=1024 * 1024)
        async with pipe as (outbox, _):
            pipe.writer.transport.abort()
            outbox.push(b"confirm")
            await eventually(lambda: outbox.broken)
            assert not pipe.task.done() or pipe.task.exception() is None

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


async def test_sent_returns_once_what_was_queued_is_written_or_gives_up_at_its_timeout() -> None:
    async with _Pipe([], high=1024 * 1024) as (outbox, peer):
        outbox.push(b"confirms")
        await outbox.sent(10)
        assert outbox.pending == 0
        assert await _read(peer, 8) == b"confirms"
        # More than the socket buffers hold, never read: sent gives up at its timeout.
        outbox.push(b"b" * (4 * 1024 * 1024))
        await outbox.sent(0.1)
        assert outbox.pending > 0
