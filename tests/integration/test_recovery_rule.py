"""The recovery rule through SqlStore (SQLite and PostgreSQL): a GroupMachine's actions
are written as the runtime writes them, then a restart — after a crash, or after a clean
stop that wrote ``GroupMachine.close`` — loads what storage kept. A message that was
never sent is neither counted nor dead-lettered (DESIGN.md §4 Crash semantics,
docs/performance.md *Dispatch reservations*)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from core.actions import (
    Action,
    DeadLetter,
    Deliver,
    Fetch,
    OffsetUpdate,
    Page,
    RecordDispatch,
    RetryScheduled,
)
from core.group import GroupMachine
from core.model import AckMode, GroupConfig, KeyOrder, Message, QueueConfig
from storage import SqlStore, open_store

NOW = 1_700_000_000.0
MessageFactory = Callable[..., Message]


class Run:
    """One gateway run of group g of queue hq: its machine and what it sent."""

    def __init__(self, store: SqlStore, machine: GroupMachine) -> None:
        self.store, self.machine = store, machine
        self.sent: list[Deliver] = []
        self.dead: list[DeadLetter] = []

    async def carry(self, actions: Sequence[Action], now: float = NOW) -> None:
        """Write the actions as the runtime does (every offset update flushed at once)."""
        pending = list(actions)
        while pending:
            action = pending.pop(0)
            if isinstance(action, RecordDispatch):
                await self.store.record_dispatch("hq", "g", [action])
            elif isinstance(action, OffsetUpdate):
                await self.store.write_offsets("hq", "g", [action])
            elif isinstance(action, RetryScheduled):
                await self.store.write_offsets("hq", "g", [], retries=[action])
            elif isinstance(action, DeadLetter):
                self.dead.append(action)
                await self.store.dead_letter("hq", "g", [action], [], now=now)
            elif isinstance(action, Deliver):
                self.sent.append(action)
            elif isinstance(action, Fetch):
                if action.seqs:
                    found = await self.store.read_seqs("hq", [(action.partition, action.seqs)])
                else:
                    page = (action.partition, action.after_seq, action.limit, action.max_bytes)
                    found = await self.store.read_for_delivery("hq", [page])
                messages, unreadable = found[action.partition]
                page_ = Page(action.partition, messages, unreadable)
                pending.extend(self.machine.loaded(now, [page_]))

    def seen(self) -> dict[bytes, tuple[int, bool]]:
        return {x.message.payload: (x.delivery_count, x.redelivered) for x in self.sent}


async def first_run(db_url: str, key_order: KeyOrder) -> tuple[Run, QueueConfig, GroupConfig]:
    store = await open_store(db_url)
    queue = QueueConfig("hq", partitions=1, max_deliveries=1, backoff_initial=20.0)
    group = GroupConfig("hq", "g", key_order=key_order)
    await store.create_queue(queue)
    await store.create_group(group)
    run = Run(store, GroupMachine(queue, group, now=NOW))
    await run.carry(run.machine.bind(NOW, "f1", "c", 10, AckMode.CLIENT))
    return run, queue, group


async def publish(run: Run, make: MessageFactory, payload: bytes, key: str, **kw: object) -> None:
    stored = await run.store.append([make("hq", 0, payload, key=key, **kw)], now=NOW)
    await run.carry(run.machine.append(NOW, stored))


async def ack(run: Run, payload: bytes) -> None:
    [message_id] = [x.message.message_id for x in run.sent if x.message.payload == payload]
    await run.carry(run.machine.ack(NOW, "f1", [message_id]))


async def restart(
    db_url: str, run: Run, queue: QueueConfig, group: GroupConfig, *, clean: bool
) -> Run:
    if clean:
        await run.carry(run.machine.close())
    await run.store.close()
    store = await open_store(db_url)
    await store.forget_consumers("next-run")
    snapshot = await store.load_group("hq", "g")
    again = Run(store, GroupMachine(queue, group, now=NOW + 1, snapshot=snapshot))
    await again.carry(again.machine.bind(NOW + 1, "f2", "c", 10, AckMode.CLIENT), NOW + 1)
    return again


@pytest.mark.parametrize("clean", [False, True], ids=["crash", "clean"])
async def test_a_scheduled_message_never_sent_is_not_counted_at_restart(
    db_url: str, make_message: MessageFactory, clean: bool
) -> None:
    run, queue, group = await first_run(db_url, KeyOrder.PARTITION)
    await publish(run, make_message, b"scheduled", "s", deliver_at=NOW + 12)
    await publish(run, make_message, b"normal", "n")
    await ack(run, b"normal")
    assert run.seen() == {b"normal": (1, False)}
    again = await restart(db_url, run, queue, group, clean=clean)
    try:
        assert again.dead == [] and again.sent == []
        await again.carry(again.machine.tick(NOW + 12), NOW + 12)
        assert again.seen() == {b"scheduled": (1, False)}
    finally:
        await again.store.close()


@pytest.mark.parametrize("clean", [False, True], ids=["crash", "clean"])
async def test_a_message_held_behind_its_key_in_strict_order_is_not_counted_at_restart(
    db_url: str, make_message: MessageFactory, clean: bool
) -> None:
    run, queue, group = await first_run(db_url, KeyOrder.STRICT)
    await publish(run, make_message, b"K1", "k")
    await publish(run, make_message, b"K2", "k")  # held behind K1, never sent
    await publish(run, make_message, b"J1", "j")
    await ack(run, b"J1")
    assert run.seen() == {b"K1": (1, False), b"J1": (1, False)}
    again = await restart(db_url, run, queue, group, clean=clean)
    try:
        # K1 was sent once: at max_deliveries = 1 the restart ends it. K2 never was.
        assert [x.message.payload for x in again.dead] == [b"K1"]
        assert again.seen() == {b"K2": (1, False)}
    finally:
        await again.store.close()


async def test_a_clean_stop_counts_an_unacked_message_once_more_and_nothing_else(
    db_url: str, make_message: MessageFactory
) -> None:
    run, queue, group = await first_run(db_url, KeyOrder.STRICT)
    await publish(run, make_message, b"K1", "k")
    await publish(run, make_message, b"K2", "k")
    await publish(run, make_message, b"J1", "j")
    await ack(run, b"J1")
    queue = QueueConfig("hq", partitions=1, max_deliveries=3)
    again = await restart(db_url, run, queue, group, clean=True)
    try:
        # What the stop wrote: nothing is left to count as maybe seen.
        part = again.machine._parts[0]
        assert (part.restored_dispatched, part.restored_reserved) == (1, 1)
        assert again.seen() == {b"K1": (2, True)}
        await again.carry(again.machine.ack(NOW + 1, "f2", [again.sent[0].message.message_id]))
        assert again.seen() == {b"K1": (2, True), b"K2": (1, False)}
    finally:
        await again.store.close()


async def test_after_a_crash_a_message_behind_a_retry_is_maybe_seen_never_dead_lettered(
    db_url: str, make_message: MessageFactory
) -> None:
    queue_two = QueueConfig("hq", partitions=1, max_deliveries=2, backoff_initial=20.0)
    run, _, group = await first_run(db_url, KeyOrder.PARTITION)
    run.machine.reconfigure(queue_two)
    await publish(run, make_message, b"K1", "k")
    [k1] = run.sent
    await run.carry(run.machine.nack(NOW, "f1", [k1.message.message_id]))
    await publish(run, make_message, b"K2", "k")  # behind the retry of K1, never sent
    await publish(run, make_message, b"J1", "j")
    await ack(run, b"J1")
    queue_one = QueueConfig("hq", partitions=1, max_deliveries=1)
    again = await restart(db_url, run, queue_one, group, clean=False)
    try:
        # K1 was delivered once: at max_deliveries = 1 it ends. K2 may have been sent
        # before K1's nack, for all storage knows: counted, flagged, still delivered.
        assert [x.message.payload for x in again.dead] == [b"K1"]
        assert again.seen() == {b"K2": (1, True)}
    finally:
        await again.store.close()
