"""GroupRuntime carries out a real GroupMachine's actions in the order DESIGN.md §4 needs,
against the in-memory twin of the store (the layer below) that records its writes."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from core import actions
from core.errors import KeygateError, Unavailable
from core.group import GroupMachine
from core.model import AckMode, DeadLetterReason, GroupConfig, Message, QueueConfig
from gateway import runtime as runtime_module
from gateway.runtime import GroupRuntime
from tests.support.recording_store import UNREADABLE, RecordingStore
from tests.support.wait import eventually

# Payload the Output below treats as a message that cannot be encoded for the consumer.
UNENCODABLE = b"unencodable"


@dataclass
class Output:
    store: RecordingStore
    got: list[actions.Deliver] = field(default_factory=list)

    def deliver(self, deliveries: Sequence[actions.Deliver]) -> list[actions.Deliver]:
        self.store.log.append("deliver")
        failed = [d for d in deliveries if d.message.payload == UNENCODABLE]
        self.got.extend(d for d in deliveries if d not in failed)
        return failed

    def partitions_changed(self, partitions: frozenset[int]) -> None:
        pass

    def terminate(self, error: KeygateError) -> None:
        pass


class Hooks:
    def __init__(self) -> None:
        self.counted: list[tuple[str, object]] = []

    def delivered(self, queue: str, group: str, deliveries: Sequence[actions.Deliver]) -> None:
        pass

    def dead_lettered(self, queue: str, group: str, count: int) -> None:
        self.counted.append(("dead_lettered", count))

    def dropped(self, queue: str, group: str, reason: str) -> None:
        self.counted.append(("dropped", reason))


async def _runtime(store: RecordingStore, **queue_settings: Any) -> GroupRuntime:
    """A started runtime of group "g" of queue "q", told of each commit as the broker is."""
    queue = await store.create_queue(QueueConfig("q", **queue_settings), exist_ok=True)
    group, _ = await store.create_group(GroupConfig("q", "g"))
    machine = GroupMachine(queue, group, now=0.0)
    rt = GroupRuntime(store, machine, queue, group, Hooks(), clock=lambda: 0.0)
    store.add_commit_listener(rt.append)
    rt.start()
    return rt


async def _append(store: RecordingStore, *seqs: int, payload: bytes = b"x") -> None:
    """Store messages "m<seq>" (the store assigns the same seqs) in partition 0 of "q"."""
    batch = [Message(f"m{seq}", "q", 0, 0, "k", payload) for seq in seqs]
    assert [m.seq for m in await store.append(batch, now=0.0)] == list(seqs)


async def test_dispatch_is_recorded_before_the_first_delivery_is_handed_out() -> None:
    store = RecordingStore()
    rt = await _runtime(store)
    out = Output(store)
    rt.bind("f", "c", 10, AckMode.CLIENT, None, out)
    await _append(store, 1, 2)
    await eventually(lambda: len(out.got) == 2)
    assert store.log.index("dispatch") < store.log.index("deliver")
    await rt.close()


async def test_a_failed_write_is_retried_and_delivery_waits_for_it() -> None:
    store = RecordingStore()
    rt = await _runtime(store)
    out = Output(store)
    rt.bind("f", "c", 10, AckMode.CLIENT, None, out)
    await rt.flush()
    store.fail = 2
    await _append(store, 1)
    await eventually(lambda: len(out.got) == 1)
    assert store.fail == 0  # both failures were retried before the message went out
    await rt.close()


async def test_a_dead_letter_is_written_with_the_pending_offsets_in_one_call() -> None:
    store = RecordingStore()
    rt = await _runtime(store, max_deliveries=1)
    out = Output(store)
    rt.bind("f", "c", 10, AckMode.CLIENT, None, out)
    await _append(store, 1, 2)
    await eventually(lambda: len(out.got) == 2)
    rt.ack("f", ["m2"])
    rt.nack("f", ["m1"], None)
    await rt.flush()
    assert "dead_letter+1offsets" in store.log
    await rt.close()


async def test_a_letter_of_a_queue_without_a_dead_letter_queue_counts_as_dropped() -> None:
    """A reject on a queue whose dead_letter_queue is '' (every DLQ's own setting) drops
    the message: it was counted as dead-lettered though no dead-letter queue holds it."""
    store = RecordingStore()
    rt = await _runtime(store, dead_letter_queue="")
    hooks = rt._hooks
    assert isinstance(hooks, Hooks)
    out = Output(store)
    rt.bind("f", "c", 10, AckMode.CLIENT, None, out)
    await _append(store, 1)
    await eventually(lambda: len(out.got) == 1)
    rt.reject("f", ["m1"])
    await rt.flush()
    assert hooks.counted == [("dropped", "rejected")]
    await rt.close()


async def test_close_gives_up_on_a_database_that_does_not_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runtime_module, "_CLOSE_TIMEOUT", 0.2)
    store = RecordingStore()
    rt = await _runtime(store)
    rt.bind("f", "c", 10, AckMode.CLIENT, None, Output(store))
    await rt.flush()
    store.hang = True
    await _append(store, 1)
    await asyncio.wait_for(rt.close(), 5)


async def test_a_message_the_output_cannot_encode_is_dead_lettered_and_the_next_is_delivered() -> (
    None
):
    store = RecordingStore()
    rt = await _runtime(store)
    out = Output(store)
    rt.bind("f", "c", 10, AckMode.CLIENT, None, out)
    await _append(store, 1, payload=UNENCODABLE)
    await _append(store, 2, 3)
    await eventually(lambda: [d.message.seq for d in out.got] == [2, 3])
    await eventually(lambda: [letter.message.seq for letter in store.letters] == [1])
    assert store.letters[0].reason is DeadLetterReason.UNDELIVERABLE
    await rt.close()


async def test_a_message_its_protocol_could_not_write_later_is_dead_lettered_as_undeliverable() -> (
    None
):
    """A protocol may find a frame it cannot write only when it writes it (a native
    consumer whose socket is behind): ``undeliverable`` then does what returning it from
    ``deliver`` does."""
    store = RecordingStore()
    rt = await _runtime(store)
    out = Output(store)
    rt.bind("f", "c", 1, AckMode.CLIENT, None, out)
    await _append(store, 1, 2)
    await eventually(lambda: [d.message.seq for d in out.got] == [1])
    rt.undeliverable("f", [out.got[0].message.message_id])
    await eventually(lambda: [d.message.seq for d in out.got] == [1, 2])  # the window freed
    await eventually(lambda: [letter.message.seq for letter in store.letters] == [1])
    assert store.letters[0].reason is DeadLetterReason.UNDELIVERABLE
    await rt.close()


async def test_an_unreadable_stored_message_is_dead_lettered_and_its_partition_moves_on() -> None:
    store = RecordingStore()
    await store.create_queue(QueueConfig("q"))
    await _append(store, 1)
    await _append(store, 2, payload=UNREADABLE)
    await _append(store, 3)
    rt = await _runtime(store)
    out = Output(store)
    rt.bind("f", "c", 10, AckMode.CLIENT, None, out)
    rt.append([])  # as after a restart: the backlog is read through Fetch
    await eventually(lambda: [d.message.seq for d in out.got] == [1, 3])
    assert [(letter.message.seq, letter.reason) for letter in store.letters] == [
        (2, DeadLetterReason.UNDELIVERABLE)
    ]
    await rt.close()


async def test_an_output_that_raises_is_ended_and_unbound_and_the_other_flows_are_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A bug in one consumer's protocol must not cost the other consumers their deliveries
    of the same step, nor leave its messages in flight: its flow is unbound (what it held
    goes back for redelivery) and its output ended, as a lost connection would be."""
    store = RecordingStore()
    rt = await _runtime(store, partitions=2, rebalance_delay=0.0)
    broken, healthy = Output(store), Output(store)
    ended: list[KeygateError] = []

    def deliver_failing(deliveries: Sequence[actions.Deliver]) -> list[actions.Deliver]:
        raise RuntimeError("a bug")

    broken.deliver = deliver_failing  # type: ignore[method-assign]
    broken.terminate = ended.append  # type: ignore[method-assign]
    rt.bind("broken", "c1", 10, AckMode.CLIENT, None, broken)
    rt.bind("healthy", "c2", 10, AckMode.CLIENT, None, healthy)
    await eventually(lambda: [len(f.partitions) for f in rt.status().flows] == [1, 1])
    await store.append([Message(f"m{p}", "q", p, 0, "k", b"x") for p in (0, 1)], now=0.0)
    await eventually(lambda: sorted(d.message.partition for d in healthy.got) == [0, 1])
    assert sum(d.redelivered for d in healthy.got) == 1  # the one the broken flow held
    assert [e.code for e in ended] == [Unavailable.code]
    assert "q/g: the output of flow broken failed" in caplog.text
    await rt.close()
