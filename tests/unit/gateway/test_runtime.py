"""GroupRuntime carries out a real GroupMachine's actions in the order DESIGN.md §4 needs,
against an in-memory stand-in for the store (the layer below)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from core import actions
from core.errors import KeygateError, StorageError
from core.group import GroupMachine
from core.model import AckMode, DeadLetterReason, GroupConfig, Message, QueueConfig
from gateway import runtime as runtime_module
from gateway.runtime import GroupRuntime
from tests.support.wait import eventually


@dataclass
class FakeStore:
    """Records the order of writes; ``fail`` makes the next N writes raise StorageError."""

    log: list[str] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    fail: int = 0
    hang: bool = False
    letters: list[actions.DeadLetter] = field(default_factory=list)

    async def _write(self, what: str) -> None:
        if self.hang:
            await asyncio.Event().wait()
        if self.fail:
            self.fail -= 1
            raise StorageError("database is down")
        self.log.append(what)

    async def record_dispatch(self, queue: str, group: str, records: Any) -> None:
        await self._write("dispatch")

    async def write_offsets(self, queue: str, group: str, updates: Any, **kw: Any) -> None:
        await self._write("offsets")

    async def write_key_changes(self, queue: str, group: str, keys: Any) -> None:
        await self._write("keys")

    async def write_assignments(self, queue: str, group: str, changes: Any, **kw: Any) -> None:
        await self._write("assignments")

    async def write_flows(self, queue: str, group: str, flows: Any, **kw: Any) -> None:
        await self._write("flows")

    async def read_for_delivery(
        self, queue: str, pages: Any
    ) -> dict[int, tuple[list[Message], frozenset[int]]]:
        out = {}
        for partition, after_seq, limit in pages:
            found = [m for m in self.messages if m.partition == partition and m.seq > after_seq]
            found = found[:limit]
            out[partition] = (found, frozenset(m.seq for m in found if m.payload == UNREADABLE))
        return out

    async def dead_letter(
        self, queue: str, group: str, letters: Any, offsets: Any, **kw: Any
    ) -> list[list[int]]:
        await self._write(f"dead_letter+{len(offsets)}offsets")
        self.letters.extend(letters)
        return [[] for _ in kw.get("moves", ())]


# Payloads the fakes treat as a row that cannot be read back / a message that cannot be
# encoded for the consumer's protocol.
UNREADABLE = b"unreadable"
UNENCODABLE = b"unencodable"


@dataclass
class Output:
    store: FakeStore
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
    def delivered(self, queue: str, group: str, deliveries: Sequence[actions.Deliver]) -> None:
        pass

    def dead_lettered(self, queue: str, group: str, count: int) -> None:
        pass

    def dropped(self, queue: str, group: str, reason: str) -> None:
        pass


def _runtime(store: FakeStore, **queue_settings: Any) -> GroupRuntime:
    queue = QueueConfig("q", **queue_settings)
    group = GroupConfig("q", "g")
    machine = GroupMachine(queue, group, now=0.0)
    rt = GroupRuntime(store, machine, queue, group, Hooks(), clock=lambda: 0.0)
    rt.start()
    return rt


def _append(rt: GroupRuntime, store: FakeStore, *seqs: int, payload: bytes = b"x") -> None:
    """What the broker does after a commit: the rows are in the store, then the runtime hears."""
    batch = [Message(f"m{seq}", "q", 0, seq, "k", payload) for seq in seqs]
    store.messages.extend(batch)
    rt.append(batch)


async def test_dispatch_is_recorded_before_the_first_delivery_is_handed_out() -> None:
    store = FakeStore()
    rt = _runtime(store)
    out = Output(store)
    rt.bind("f", "c", 10, AckMode.CLIENT, None, out)
    _append(rt, store, 1, 2)
    await eventually(lambda: len(out.got) == 2)
    assert store.log.index("dispatch") < store.log.index("deliver")
    await rt.close()


async def test_a_failed_write_is_retried_and_delivery_waits_for_it() -> None:
    store = FakeStore()
    rt = _runtime(store)
    out = Output(store)
    rt.bind("f", "c", 10, AckMode.CLIENT, None, out)
    await rt.flush()
    store.fail = 2
    _append(rt, store, 1)
    await eventually(lambda: len(out.got) == 1)
    assert store.fail == 0  # both failures were retried before the message went out
    await rt.close()


async def test_a_dead_letter_is_written_with_the_pending_offsets_in_one_call() -> None:
    store = FakeStore()
    rt = _runtime(store, max_deliveries=1)
    out = Output(store)
    rt.bind("f", "c", 10, AckMode.CLIENT, None, out)
    _append(rt, store, 1, 2)
    await eventually(lambda: len(out.got) == 2)
    rt.ack("f", ["m2"])
    rt.nack("f", ["m1"], None)
    await rt.flush()
    assert "dead_letter+1offsets" in store.log
    await rt.close()


async def test_close_gives_up_on_a_database_that_does_not_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runtime_module, "_CLOSE_TIMEOUT", 0.2)
    store = FakeStore()
    rt = _runtime(store)
    rt.bind("f", "c", 10, AckMode.CLIENT, None, Output(store))
    await rt.flush()
    store.hang = True
    _append(rt, store, 1)
    await asyncio.wait_for(rt.close(), 5)


async def test_a_message_the_output_cannot_encode_is_dead_lettered_and_the_next_is_delivered() -> (
    None
):
    store = FakeStore()
    rt = _runtime(store)
    out = Output(store)
    rt.bind("f", "c", 10, AckMode.CLIENT, None, out)
    _append(rt, store, 1, payload=UNENCODABLE)
    _append(rt, store, 2, 3)
    await eventually(lambda: [d.message.seq for d in out.got] == [2, 3])
    await eventually(lambda: [letter.message.seq for letter in store.letters] == [1])
    assert store.letters[0].reason is DeadLetterReason.UNDELIVERABLE
    await rt.close()


async def test_an_unreadable_stored_message_is_dead_lettered_and_its_partition_moves_on() -> None:
    store = FakeStore()
    store.messages = [
        Message("m1", "q", 0, 1, "k", b"x"),
        Message("m2", "q", 0, 2, "k", UNREADABLE),
        Message("m3", "q", 0, 3, "k", b"x"),
    ]
    rt = _runtime(store)
    out = Output(store)
    rt.bind("f", "c", 10, AckMode.CLIENT, None, out)
    rt.append([])  # as after a restart: the backlog is read through Fetch
    await eventually(lambda: [d.message.seq for d in out.got] == [1, 3])
    assert [(letter.message.seq, letter.reason) for letter in store.letters] == [
        (2, DeadLetterReason.UNDELIVERABLE)
    ]
    await rt.close()


async def test_an_unexpected_error_in_a_step_is_logged_and_the_group_keeps_delivering(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = FakeStore()
    rt = _runtime(store)
    out = Output(store)
    rt.bind("f", "c", 10, AckMode.CLIENT, None, out)
    await rt.flush()
    real = out.deliver
    calls = 0

    def deliver_failing_once(deliveries: Sequence[actions.Deliver]) -> list[actions.Deliver]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug")
        return real(deliveries)

    out.deliver = deliver_failing_once  # type: ignore[method-assign]
    _append(rt, store, 1)
    await eventually(lambda: calls == 1)
    _append(rt, store, 2)
    await eventually(lambda: [d.message.seq for d in out.got] == [2])
    assert "a step failed (deliveries at (partition, seq) [(0, 1)])" in caplog.text
    await rt.close()
