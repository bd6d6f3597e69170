"""MemoryStore: the in-memory twin of ``storage.SqlStore`` for the tests of the layers above.

It implements ``PublishStore``, ``GroupStore`` and ``AdminStore`` (storage.interfaces), and
behaves as SqlStore does, and tests/integration/test_store_contract.py runs
the same tests against both: seqs per (queue, partition) from 1; an append is all or
nothing with the same limit errors; commit listeners see each append's new messages after
the write, in seq order; dedup within the queue's dedup window; offsets, dispatch records,
parked keys and dead letters as a group's snapshot shows them (storage.memory_group).
Stricter than SQL in one way: a write-through for a group that was never created raises
GroupNotFound (SQL would store orphan rows), so a test's missing set-up shows at once.

No I/O and no concurrency to guard: every call completes in one step of the event loop,
so each is its own transaction in commit order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any, cast

from core.actions import (
    AssignmentChanged,
    DeadLetter,
    DeadLetterKey,
    FlowChanged,
    GroupSnapshot,
    OffsetUpdate,
    RecordDispatch,
    RetryScheduled,
    fetched,
)
from core.errors import (
    AlreadyExists,
    GroupNotFound,
    InvalidArgument,
    KeygateError,
    QueueNotFound,
)
from core.model import GroupConfig, Message, QueueConfig, ResetKind, ResetPosition
from storage.admin import _ALTERABLE, _with_patterns, validate_pattern
from storage.appends import DedupKey, _dedup_key
from storage.consumer import dead_letter_copy
from storage.limits import check_append
from storage.memory_group import GroupState, KeyChange

_log = logging.getLogger("keygate.storage")


class MemoryStore:
    """Queues, messages and group state in dicts. Create queues with ``create_queue``."""

    def __init__(self) -> None:
        self.queues: dict[str, QueueConfig] = {}
        self.heads: dict[tuple[str, int], int] = {}
        # queue -> [messages, bytes] currently stored.
        self.depths: dict[str, list[int]] = {}
        self._messages: dict[tuple[str, int], list[Message]] = {}
        self._dedup: dict[DedupKey, tuple[Message, float]] = {}
        self._groups: dict[tuple[str, str], GroupState] = {}
        self._listeners: list[Callable[[Sequence[Message]], None]] = []

    # --- publishing -------------------------------------------------------------------

    def queue(self, name: str) -> QueueConfig:
        try:
            return self.queues[name]
        except KeyError:
            raise QueueNotFound(name) from None

    def add_commit_listener(self, fn: Callable[[Sequence[Message]], None]) -> None:
        self._listeners.append(fn)

    async def append(
        self,
        messages: Sequence[Message],
        *,
        now: float,
        qos2: tuple[str, int] | None = None,
        source: Hashable = None,
    ) -> list[Message]:
        """As SqlStore's; ``qos2`` is ignored: MQTT sessions are not twinned (nor is
        ``source``: there are no batches to take turns for)."""
        return self._append(messages, now)

    def _append(self, messages: Sequence[Message], now: float) -> list[Message]:
        if not messages:
            return []
        check_append(messages, self.queue, self.depths, {})
        result: list[Message] = []
        new: list[Message] = []
        for message in messages:
            window = self.queues[message.queue].dedup_window
            key = _dedup_key(message) if window > 0 else None
            seen = self._dedup.get(key) if key is not None else None
            if seen is not None and seen[1] > now:
                result.append(seen[0])
                continue
            stored = self._store(message, message.queue, message.partition)
            if key is not None:
                self._dedup[key] = (_as_read(stored), now + window)
            result.append(stored)
            new.append(stored)
        self._committed(new)
        return result

    def append_each(
        self, units: Sequence[Sequence[Message]], *, now: float, source: Hashable = None
    ) -> asyncio.Future[list[list[Message] | KeygateError]]:
        """As SqlStore's (stored at once: there is no commit to wait for)."""
        outcomes: list[list[Message] | KeygateError] = []
        for unit in units:
            try:
                outcomes.append(self._append(unit, now))
            except KeygateError as e:
                outcomes.append(e)
        done: asyncio.Future[list[list[Message] | KeygateError]]
        done = asyncio.get_running_loop().create_future()
        done.set_result(outcomes)
        return done

    def _store(self, message: Message, queue: str, partition: int) -> Message:
        seq = self.heads.get((queue, partition), 0) + 1
        self.heads[(queue, partition)] = seq
        stored = dataclasses.replace(message, queue=queue, partition=partition, seq=seq)
        # The publisher is no column: SQL reads it back as None.
        self._messages.setdefault((queue, partition), []).append(_as_read(stored))
        depth = self.depths.setdefault(queue, [0, 0])
        depth[0] += 1
        depth[1] += stored.size
        return stored

    def _committed(self, messages: Sequence[Message]) -> None:
        if messages:
            for listener in self._listeners:
                try:
                    listener(messages)
                except Exception:
                    _log.exception("commit listener %r failed", listener)

    async def read(self, queue: str, partition: int, after_seq: int, limit: int) -> list[Message]:
        stored = self._messages.get((queue, partition), [])
        return [m for m in stored if m.seq > after_seq][:limit]

    async def read_for_delivery(
        self, queue: str, pages: Sequence[tuple[int, int, int, int]]
    ) -> dict[int, tuple[list[Message], frozenset[int]]]:
        """``fetched`` of each page; every message kept in memory reads back whole."""
        found: dict[int, tuple[list[Message], frozenset[int]]] = {}
        for p, after, limit, max_bytes in pages:
            after_seq = (m for m in self._messages.get((queue, p), []) if m.seq > after)
            found[p] = (fetched(after_seq, limit, max_bytes), frozenset())
        return found

    async def read_seqs(
        self, queue: str, wanted: Sequence[tuple[int, Sequence[int]]]
    ) -> dict[int, tuple[list[Message], frozenset[int]]]:
        found: dict[int, tuple[list[Message], frozenset[int]]] = {}
        for p, seqs in wanted:
            chosen = set(seqs)
            stored = self._messages.get((queue, p), [])
            found[p] = ([m for m in stored if m.seq in chosen], frozenset())
        return found

    async def head_seqs(self, queue: str) -> dict[int, int]:
        return {p: self.heads.get((queue, p), 0) for p in range(self.queue(queue).slots)}

    async def depth(self, queue: str) -> tuple[int, int]:
        self.queue(queue)
        messages, size = self.depths[queue]
        return messages, size

    # --- administration ---------------------------------------------------------------

    async def create_queue(self, config: QueueConfig, *, exist_ok: bool = False) -> QueueConfig:
        config = _with_patterns(config, config.subscriptions)
        stored = self.queues.get(config.name)
        if stored is not None:
            if not exist_ok or stored.partitions != config.partitions:
                raise AlreadyExists(f"queue {config.name!r} exists")
        else:
            stored = self._remember(config)
        self._ensure_dlq(stored)
        return stored

    def _ensure_dlq(self, config: QueueConfig) -> None:
        name = config.dlq_name
        if name is not None and name not in self.queues:
            self._remember(QueueConfig(name=name, dead_letter_queue=""))

    def _remember(self, config: QueueConfig) -> QueueConfig:
        self.queues[config.name] = config
        self.depths[config.name] = [0, 0]
        for partition in range(config.slots):
            self.heads[(config.name, partition)] = 0
        return config

    async def alter_queue(self, name: str, **changes: object) -> QueueConfig:
        unknown = set(changes) - _ALTERABLE
        if unknown:
            raise InvalidArgument(f"unknown or read-only queue settings: {sorted(unknown)}")
        old = self.queue(name)
        if changes.get("partitions", old.partitions) != old.partitions:
            raise InvalidArgument("the partition count of a queue cannot be changed")
        try:
            new = dataclasses.replace(old, **cast(dict[str, Any], changes))
        except TypeError as e:
            raise InvalidArgument(f"invalid queue settings: {e}") from e
        self.queues[name] = new = _with_patterns(new, new.subscriptions)
        self._ensure_dlq(new)
        return new

    async def delete_queue(self, name: str) -> int:
        """As SqlStore: the messages deleted; the dead-letter queue is kept."""
        self.queue(name)
        deleted = self.depths.pop(name)[0]
        for partition in range(self.queues.pop(name).slots):
            self._messages.pop((name, partition), None)
            del self.heads[(name, partition)]
        self._dedup = {k: v for k, v in self._dedup.items() if k[0] != name}
        self._groups = {k: v for k, v in self._groups.items() if k[0] != name}
        return deleted

    async def purge_queue(self, name: str) -> int:
        config = self.queue(name)
        deleted = self.depths[name][0]
        self.depths[name] = [0, 0]
        heads = {p: self.heads[(name, p)] for p in range(config.slots)}
        for partition in heads:
            self._messages.pop((name, partition), None)
        for (queue, _), group in self._groups.items():
            if queue == name:
                group.reset(heads)
        return deleted

    async def get_queue(self, name: str) -> QueueConfig:
        return self.queue(name)

    async def list_queues(self) -> list[QueueConfig]:
        return [config for _, config in sorted(self.queues.items())]

    async def add_subscription(self, queue: str, pattern: str) -> None:
        patterns = (*self.queue(queue).subscriptions, validate_pattern(pattern))
        await self.alter_queue(queue, subscriptions=patterns)

    async def remove_subscription(self, queue: str, pattern: str) -> None:
        patterns = tuple(p for p in self.queue(queue).subscriptions if p != pattern)
        await self.alter_queue(queue, subscriptions=patterns)

    def _positions(self, queue: QueueConfig, target: ResetPosition) -> dict[int, int]:
        """As storage.admin's: partition -> committed seq of a group (re)starting at
        ``target`` (the seq before the first message it delivers)."""
        heads = {p: self.heads[(queue.name, p)] for p in range(queue.slots)}
        if target.kind is ResetKind.SEQ:
            if any(partition >= queue.slots for partition in target.seqs):
                raise InvalidArgument(f"queue {queue.name!r} has {queue.slots} partition(s)")
            return {p: min(seq - 1, heads[p]) for p, seq in target.seqs.items()}
        if target.kind is ResetKind.LATEST:
            return heads
        since = target.time if target.kind is ResetKind.TIME else float("-inf")
        if since is None:
            return heads  # as in SQL: nothing was published at or after NULL
        for p in heads:
            stored = self._messages.get((queue.name, p), [])
            first = next((m.seq for m in stored if m.publish_time >= since), None)
            if first is not None:
                heads[p] = first - 1
        return heads

    async def create_group(
        self, config: GroupConfig, *, exist_ok: bool = True
    ) -> tuple[GroupConfig, GroupSnapshot]:
        """As SqlStore: ``earliest`` starts before the oldest stored message, ``latest``
        at the head."""
        queue = self.queue(config.queue)
        group = self._groups.get((config.queue, config.name))
        if group is not None and not exist_ok:
            raise AlreadyExists(f"group {config.name!r} of {config.queue!r} exists")
        if group is None:
            starts = self._positions(queue, ResetPosition(ResetKind(config.start.value)))
            group = GroupState(config, starts)
            self._groups[(config.queue, config.name)] = group
        return group.config, group.snapshot()

    def _group(self, queue: str, name: str) -> GroupState:
        try:
            return self._groups[(queue, name)]
        except KeyError:
            raise GroupNotFound(queue, name) from None

    async def get_group(self, queue: str, name: str) -> GroupConfig:
        return self._group(queue, name).config

    async def list_groups(self, queue: str | None = None) -> list[GroupConfig]:
        return [
            group.config
            for (q, _), group in sorted(self._groups.items())
            if queue is None or q == queue
        ]

    async def load_group(self, queue: str, name: str) -> GroupSnapshot:
        return self._group(queue, name).snapshot()

    async def delete_group(self, queue: str, name: str) -> None:
        self._group(queue, name)
        del self._groups[(queue, name)]

    async def reset_group(self, queue: str, name: str, target: ResetPosition) -> dict[int, int]:
        config = self.queue(queue)
        group = self._group(queue, name)
        positions = self._positions(config, target)
        group.reset(positions)
        return positions

    # --- a running group ---------------------------------------------------------------

    async def record_dispatch(
        self, queue: str, group: str, records: Sequence[RecordDispatch]
    ) -> None:
        state = self._groups.get((queue, group))
        if state is not None:  # else as SQL's UPDATE of no row
            state.record_dispatch(records)

    async def write_offsets(
        self,
        queue: str,
        group: str,
        updates: Sequence[OffsetUpdate],
        *,
        retries: Sequence[RetryScheduled] = (),
    ) -> None:
        state = self._groups.get((queue, group))
        if state is not None:
            state.write_offsets(updates, retries)

    async def dead_letter(
        self,
        queue: str,
        group: str,
        letters: Sequence[DeadLetter],
        offsets: Sequence[OffsetUpdate],
        *,
        now: float,
        keys: Sequence[KeyChange] = (),
        retries: Sequence[RetryScheduled] = (),
        moves: Sequence[DeadLetterKey] = (),
    ) -> list[list[int]]:
        """As SqlStore: copies go to partition 0 of the dead-letter queue (created if
        missing, its max_depth ignored), or are dropped without one."""
        config = self.queue(queue)
        state = self._group(queue, group)
        moved: list[list[int]] = []
        if moves:
            stored = {m.partition: self._messages.get((queue, m.partition), []) for m in moves}
            followers, offsets, moved = state.key_moves(stored, moves, offsets)
            letters = [*letters, *followers]
        copies: list[Message] = []
        dlq = config.dlq_name
        if dlq is not None and letters:
            self._ensure_dlq(config)
            for letter in letters:
                copy = dead_letter_copy(letter, group, dlq, 0, 0, now)
                copies.append(self._store(copy, dlq, 0))
        state.write_offsets(offsets, retries)
        state.change_keys(keys)
        self._committed(copies)
        return moved

    async def write_key_changes(self, queue: str, group: str, keys: Sequence[KeyChange]) -> None:
        self._group(queue, group).change_keys(keys)

    async def write_assignments(
        self, queue: str, group: str, changes: Sequence[AssignmentChanged], *, now: float
    ) -> None:
        state = self._group(queue, group)
        state.assignments.update((change.partition, change) for change in changes)

    async def write_flows(
        self, queue: str, group: str, flows: Sequence[FlowChanged], *, now: float
    ) -> None:
        self._group(queue, group).change_flows(flows)


def _as_read(message: Message) -> Message:
    return dataclasses.replace(message, publisher=None)
