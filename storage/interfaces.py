"""The store as the layers above see it: three small interfaces instead of one wide class.

``storage.SqlStore`` provides all three, and so does ``storage.memory.MemoryStore``, the
in-memory twin the unit tests of the layers above use (mypy checks both: the end of this
module), kept honest by tests/integration/test_store_contract.py.

- ``PublishStore``: the publish path (gateway.broker): append, queue lookup, commit
  listeners, depths and heads.
- ``GroupStore``: one consumer group at run time (gateway.runtime): dispatch records,
  offsets, dead letters, parked keys, assignments, flows and the reads for delivery.
- ``AdminStore``: queue, subscription and group administration (gateway.broker,
  gateway.group_ops, gateway.http).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Protocol

from core.actions import (
    AssignmentChanged,
    DeadLetter,
    DeadLetterKey,
    FlowChanged,
    GroupSnapshot,
    KeyParked,
    KeyReleased,
    OffsetUpdate,
    RecordDispatch,
    RetryScheduled,
)
from core.errors import KeygateError
from core.model import GroupConfig, Message, QueueConfig, ResetPosition


class PublishStore(Protocol):
    """What the publish path needs: appends and what tells whether they fit."""

    async def append(
        self,
        messages: Sequence[Message],
        *,
        now: float,
        qos2: tuple[str, int] | None = None,
        source: Hashable = None,
    ) -> list[Message]:
        """Store ``messages`` all or none (MessageTooLarge, QueueFull, QueueNotFound,
        InvalidArgument for a partition the queue lacks); return them as stored, with
        seqs from 1 per (queue, partition), after the commit. A message whose (publisher,
        producer, dedup id) was stored within its queue's dedup window comes back as the
        original instead of being stored again. The messages become the store's: it may
        give them their seqs in place, so hand in messages built for the call, each once.
        ``source`` (the publishing connection): sources take turns for the writer's
        batches, so one connection's backlog does not delay another's appends."""
        ...

    def append_each(
        self, units: Sequence[Sequence[Message]], *, now: float, source: Hashable = None
    ) -> asyncio.Future[list[list[Message] | KeygateError]]:
        """Queue ``units`` for storage now, behind every append ``source`` queued before; the future
        gives each unit as ``append`` would return it, or the error that refused that unit
        alone. Storage failing gives every unit that error, or fails the future."""
        ...

    def queue(self, name: str) -> QueueConfig:
        """The queue's settings as the store knows them (QueueNotFound)."""
        ...

    def add_commit_listener(self, fn: Callable[[Sequence[Message]], None]) -> None:
        """Call ``fn`` with every committed batch of new messages, in commit order and seq
        order, before the appending calls return."""
        ...

    async def depth(self, queue: str) -> tuple[int, int]:
        """(messages, bytes) currently stored in the queue."""
        ...

    async def head_seqs(self, queue: str) -> dict[int, int]:
        """The last committed seq of every partition (0 = nothing stored yet)."""
        ...

    async def read(self, queue: str, partition: int, after_seq: int, limit: int) -> list[Message]:
        """Up to ``limit`` stored messages of the partition with seq > ``after_seq``."""
        ...


class GroupStore(Protocol):
    """What a group runtime writes and reads: the small part of the store it needs."""

    async def record_dispatch(
        self, queue: str, group: str, records: Sequence[RecordDispatch]
    ) -> None: ...

    async def write_offsets(
        self,
        queue: str,
        group: str,
        updates: Sequence[OffsetUpdate],
        *,
        retries: Sequence[RetryScheduled] = (),
    ) -> None: ...

    async def dead_letter(
        self,
        queue: str,
        group: str,
        letters: Sequence[DeadLetter],
        offsets: Sequence[OffsetUpdate],
        *,
        now: float,
        keys: Sequence[KeyParked | KeyReleased] = (),
        retries: Sequence[RetryScheduled] = (),
        moves: Sequence[DeadLetterKey] = (),
    ) -> list[list[int]]:
        """Returns, per move, the seqs it moved."""
        ...

    async def write_key_changes(
        self, queue: str, group: str, keys: Sequence[KeyParked | KeyReleased]
    ) -> None: ...

    async def write_assignments(
        self, queue: str, group: str, changes: Sequence[AssignmentChanged], *, now: float
    ) -> None: ...

    async def write_flows(
        self, queue: str, group: str, flows: Sequence[FlowChanged], *, now: float
    ) -> None: ...

    async def read_for_delivery(
        self, queue: str, pages: Sequence[tuple[int, int, int, int]]
    ) -> dict[int, tuple[list[Message], frozenset[int]]]:
        """For each (partition, after_seq, limit, max_bytes) page the messages
        ``core.actions.fetched`` takes of the partition's after ``after_seq``, and the seqs
        of those that could not be read back whole (to dead-letter as undeliverable)."""
        ...

    async def read_seqs(
        self, queue: str, wanted: Sequence[tuple[int, Sequence[int]]]
    ) -> dict[int, tuple[list[Message], frozenset[int]]]:
        """For each (partition, seqs) those of the messages still stored, in seq order, and
        the seqs of those that could not be read back whole (a Fetch of ``seqs``)."""
        ...


class AdminStore(Protocol):
    """Queue, subscription and group administration; every call is written through."""

    async def create_queue(self, config: QueueConfig, *, exist_ok: bool = False) -> QueueConfig:
        """Create the queue and its dead-letter queue (AlreadyExists)."""
        ...

    async def alter_queue(self, name: str, **changes: object) -> QueueConfig: ...

    async def delete_queue(self, name: str) -> int:
        """Delete the queue, its messages and groups; the messages deleted."""
        ...

    async def purge_queue(self, name: str) -> int:
        """Delete every message, every group moves to the head; the messages deleted."""
        ...

    async def get_queue(self, name: str) -> QueueConfig: ...

    async def list_queues(self) -> list[QueueConfig]: ...

    async def add_subscription(self, queue: str, pattern: str) -> None: ...

    async def remove_subscription(self, queue: str, pattern: str) -> None: ...

    async def create_group(
        self, config: GroupConfig, *, exist_ok: bool = True
    ) -> tuple[GroupConfig, GroupSnapshot]:
        """Create the group (or return the stored one when ``exist_ok``) and its state."""
        ...

    async def get_group(self, queue: str, name: str) -> GroupConfig: ...

    async def list_groups(self, queue: str | None = None) -> list[GroupConfig]: ...

    async def delete_group(self, queue: str, name: str) -> None: ...

    async def reset_group(self, queue: str, name: str, target: ResetPosition) -> dict[int, int]:
        """Move the group to ``target``; partition -> committed seq of those it moved."""
        ...

    async def load_group(self, queue: str, name: str) -> GroupSnapshot:
        """The group's durable state, for recovery after a restart."""
        ...


if TYPE_CHECKING:
    from storage.memory import MemoryStore
    from storage.store import SqlStore

    # Never run: mypy proves that both stores fit where each interface is wanted.
    def _as_each(store: SqlStore | MemoryStore) -> tuple[PublishStore, GroupStore, AdminStore]:
        return store, store, store
