"""Queue, subscription and group administration (validated, written through at once)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Final

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from core import topics
from core.actions import DeliveryRecord, GroupSnapshot, ParkedKey, PartitionSnapshot
from core.errors import (
    AlreadyExists,
    GroupLimitReached,
    GroupNotFound,
    InvalidArgument,
    QueueNotFound,
)
from core.model import GroupConfig, QueueConfig, ResetKind, ResetPosition
from storage.base import StoreBase, read_queues
from storage.codec import decode_ranges, group_from_row, group_row, queue_row
from storage.schema import (
    kg_dedup,
    kg_deliveries,
    kg_flows,
    kg_group_offsets,
    kg_groups,
    kg_messages,
    kg_parked_keys,
    kg_partition_assignments,
    kg_partitions,
    kg_queues,
    kg_subscriptions,
)
from storage.statements import first_offsets

MAX_PATTERN_LENGTH: Final = 1000
_QUEUE_TABLES: Final = (
    kg_messages,
    kg_groups,
    kg_group_offsets,
    kg_deliveries,
    kg_flows,
    kg_partition_assignments,
    kg_parked_keys,
    kg_dedup,
    kg_subscriptions,
    kg_partitions,
)
_ALTERABLE: Final = frozenset(f.name for f in dataclasses.fields(QueueConfig)) - {"name"}
_GROUP_TABLES: Final = (
    kg_group_offsets,
    kg_deliveries,
    kg_flows,
    kg_partition_assignments,
    kg_parked_keys,
    kg_groups,
)


def validate_pattern(pattern: str) -> str:
    """core.topics' MQTT rules, plus the column's length limit."""
    if isinstance(pattern, str) and len(pattern) > MAX_PATTERN_LENGTH:
        raise InvalidArgument(f"subscription patterns are limited to {MAX_PATTERN_LENGTH} chars")
    return topics.validate_pattern(pattern)


def _with_patterns(config: QueueConfig, patterns: Iterable[str]) -> QueueConfig:
    """``config`` with its patterns validated, normalised, sorted and unique, as stored."""
    return dataclasses.replace(
        config, subscriptions=tuple(sorted({validate_pattern(p) for p in patterns}))
    )


def _group_where(table: sa.Table, queue: str, group: str) -> sa.ColumnElement[bool]:
    return sa.and_(table.c.queue == queue, table.c.group_name == group)


async def _positions(
    conn: AsyncConnection, queue: QueueConfig, target: ResetPosition
) -> dict[int, int]:
    """Partition -> committed seq (everything at or below it counts as done) for a group
    that starts, or is reset, at ``target``."""
    p, m = kg_partitions, kg_messages
    heads = {
        row.partition: row.head_seq
        for row in await conn.execute(sa.select(p).where(p.c.queue == queue.name))
    }
    if target.kind is ResetKind.SEQ:
        if any(partition >= queue.slots for partition in target.seqs):
            raise InvalidArgument(f"queue {queue.name!r} has {queue.slots} partition(s)")
        return {part: min(seq - 1, heads.get(part, 0)) for part, seq in target.seqs.items()}
    positions = {partition: heads.get(partition, 0) for partition in range(queue.slots)}
    if target.kind is ResetKind.LATEST:
        return positions
    first = sa.select(m.c.partition, sa.func.min(m.c.seq)).where(m.c.queue == queue.name)
    if target.kind is ResetKind.TIME:
        first = first.where(m.c.publish_time >= target.time)
    for partition, seq in await conn.execute(first.group_by(m.c.partition)):
        positions[partition] = seq - 1
    return positions


class AdminOps(StoreBase):
    async def create_queue(self, config: QueueConfig, *, exist_ok: bool = False) -> QueueConfig:
        """Create ``config`` and its dead-letter queue.

        An existing queue is returned as stored when ``exist_ok`` and it has the same
        partition count; otherwise AlreadyExists.
        """
        config = _with_patterns(config, config.subscriptions)
        async with self.seq_lock, self.transaction() as conn:
            existing = await read_queues(conn, config.name)
            if existing:
                if not exist_ok or existing[0].partitions != config.partitions:
                    raise AlreadyExists(
                        f"queue {config.name!r} exists with {existing[0].partitions} partitions"
                    )
                stored = existing[0]
            else:
                await self._insert_queue(conn, config)
                stored = config
            created = [stored, *await self._ensure_dlq(conn, stored)]
        for queue in created:
            self._remember(queue)
        return stored

    async def _insert_queue(self, conn: AsyncConnection, config: QueueConfig) -> None:
        await conn.execute(sa.insert(kg_queues), [{**queue_row(config), "created_at": time.time()}])
        await conn.execute(
            sa.insert(kg_partitions),
            [{"queue": config.name, "partition": p, "head_seq": 0} for p in range(config.slots)],
        )
        if config.subscriptions:
            await conn.execute(
                sa.insert(kg_subscriptions),
                [{"queue": config.name, "pattern": p} for p in config.subscriptions],
            )

    async def _ensure_dlq(self, conn: AsyncConnection, config: QueueConfig) -> list[QueueConfig]:
        name = config.dlq_name
        if name is None or await read_queues(conn, name):
            return []
        dlq = QueueConfig(name=name, dead_letter_queue="")
        await self._insert_queue(conn, dlq)
        return [dlq]

    def _remember(self, config: QueueConfig) -> None:
        if config.name not in self.queues:
            for partition in range(config.slots):
                self.heads.setdefault((config.name, partition), 0)
            self.depths.setdefault(config.name, [0, 0])
        self.queues[config.name] = config

    async def alter_queue(self, name: str, **changes: object) -> QueueConfig:
        """Change settings of queue ``name``; the partition count cannot change."""
        unknown = set(changes) - _ALTERABLE
        if unknown:
            raise InvalidArgument(f"unknown or read-only queue settings: {sorted(unknown)}")
        async with self.seq_lock, self.transaction() as conn:
            existing = await read_queues(conn, name)
            if not existing:
                raise QueueNotFound(name)
            old = existing[0]
            if "partitions" in changes and changes["partitions"] != old.partitions:
                raise InvalidArgument("the partition count of a queue cannot be changed")
            try:
                new = dataclasses.replace(old, **changes)  # type: ignore[arg-type]
                new = _with_patterns(new, new.subscriptions)
            except TypeError as e:
                raise InvalidArgument(f"invalid queue settings: {e}") from e
            row = queue_row(new)
            await conn.execute(sa.update(kg_queues).where(kg_queues.c.name == name).values(row))
            await conn.execute(sa.delete(kg_subscriptions).where(kg_subscriptions.c.queue == name))
            if new.subscriptions:
                await conn.execute(
                    sa.insert(kg_subscriptions),
                    [{"queue": name, "pattern": p} for p in new.subscriptions],
                )
            created = [new, *await self._ensure_dlq(conn, new)]
        for queue in created:
            self._remember(queue)
        return new

    async def delete_queue(self, name: str) -> int:
        """Delete the queue with its messages and groups; return the messages deleted.

        Its dead-letter queue is an ordinary queue and is kept.
        """
        async with self.seq_lock, self.transaction() as conn:
            if not await read_queues(conn, name):
                raise QueueNotFound(name)
            deleted = await self._count_messages(conn, name)
            for table in _QUEUE_TABLES:
                await conn.execute(sa.delete(table).where(table.c.queue == name))
            await conn.execute(sa.delete(kg_queues).where(kg_queues.c.name == name))
        self.forget_queue(name)
        return deleted

    async def purge_queue(self, name: str) -> int:
        """Delete every message; every group's offsets move to the head. Returns the count."""
        async with self.seq_lock, self.transaction() as conn:
            if not await read_queues(conn, name):
                raise QueueNotFound(name)
            deleted = await self._count_messages(conn, name)
            await conn.execute(sa.delete(kg_messages).where(kg_messages.c.queue == name))
            await conn.execute(sa.delete(kg_deliveries).where(kg_deliveries.c.queue == name))
            o, p = kg_group_offsets, kg_partitions
            head = (
                sa.select(p.c.head_seq)
                .where(p.c.queue == o.c.queue, p.c.partition == o.c.partition)
                .scalar_subquery()
            )
            await conn.execute(
                sa.update(o)
                .where(o.c.queue == name)
                .values(
                    committed_seq=head,
                    dispatched_seq=head,
                    reserved_seq=head,
                    acked_above=[],
                    acked_count=0,
                    updated_at=time.time(),
                )
            )
        self.depths[name] = [0, 0]
        return deleted

    async def _count_messages(self, conn: AsyncConnection, name: str) -> int:
        count = sa.select(sa.func.count()).where(kg_messages.c.queue == name)
        return int((await conn.execute(count)).scalar_one())

    async def get_queue(self, name: str) -> QueueConfig:
        async with self.transaction() as conn:
            queues = await read_queues(conn, name)
        if not queues:
            raise QueueNotFound(name)
        return queues[0]

    async def list_queues(self) -> list[QueueConfig]:
        async with self.transaction() as conn:
            return await read_queues(conn)

    async def add_subscription(self, queue: str, pattern: str) -> None:
        config = await self.get_queue(queue)
        if validate_pattern(pattern) not in config.subscriptions:
            await self.alter_queue(queue, subscriptions=(*config.subscriptions, pattern))

    async def remove_subscription(self, queue: str, pattern: str) -> None:
        config = await self.get_queue(queue)
        if pattern in config.subscriptions:
            remaining = tuple(p for p in config.subscriptions if p != pattern)
            await self.alter_queue(queue, subscriptions=remaining)

    async def create_group(
        self, config: GroupConfig, *, exist_ok: bool = True, limit: int = 0
    ) -> tuple[GroupConfig, GroupSnapshot]:
        """Create the group (or return the stored one when ``exist_ok``) and its offsets;
        GroupLimitReached when the queue has ``limit`` groups already (0: no limit).

        ``earliest`` starts before the oldest retained message, ``latest`` at the head.
        """
        # Under seq_lock so that "latest" is a committed head no append is racing past.
        async with self.seq_lock, self.transaction() as conn:
            queues = await read_queues(conn, config.queue)
            if not queues:
                raise QueueNotFound(config.queue)
            stored = await self._read_group(conn, config.queue, config.name)
            if stored is not None:
                if not exist_ok:
                    raise AlreadyExists(f"group {config.name!r} of {config.queue!r} exists")
            else:
                if limit and await self._count_groups(conn, config.queue) >= limit:
                    raise GroupLimitReached(
                        f"queue {config.queue!r} has {limit} groups, its most "
                        "(max_groups_per_queue); an administrator may create more"
                    )
                await self._insert_group(conn, config, queues[0])
                stored = config
            return stored, await self._snapshot(conn, config.queue, config.name)

    async def _count_groups(self, conn: AsyncConnection, queue: str) -> int:
        count = sa.select(sa.func.count()).where(kg_groups.c.queue == queue)
        return int((await conn.execute(count)).scalar_one())

    async def _insert_group(
        self, conn: AsyncConnection, config: GroupConfig, queue: QueueConfig
    ) -> None:
        now = time.time()
        await conn.execute(sa.insert(kg_groups), [{**group_row(config), "created_at": now}])
        starts = await _positions(conn, queue, ResetPosition(ResetKind(config.start.value)))
        offsets = first_offsets(queue.name, config.name, starts, queue.slots, now)
        await conn.execute(sa.insert(kg_group_offsets), offsets)

    async def reset_group(self, queue: str, name: str, target: ResetPosition) -> dict[int, int]:
        """Move group ``name`` to ``target`` (replay or skip): per partition the committed seq
        becomes the target's, acks above it and delivery counts are forgotten. Returns
        partition -> committed seq for the partitions it moved. The caller makes sure no
        running state machine holds the group (gateway.broker reloads it)."""
        config = self.queue(queue)
        o, d = kg_group_offsets, kg_deliveries
        async with self.seq_lock, self.transaction() as conn:
            if await self._read_group(conn, queue, name) is None:
                raise GroupNotFound(queue, name)
            positions = await _positions(conn, config, target)
            now = time.time()
            for partition, committed in positions.items():
                await conn.execute(
                    sa.update(o)
                    .where(_group_where(o, queue, name), o.c.partition == partition)
                    .values(
                        committed_seq=committed,
                        dispatched_seq=committed,
                        reserved_seq=committed,
                        acked_above=[],
                        acked_count=0,
                        updated_at=now,
                    )
                )
                await conn.execute(
                    sa.delete(d).where(_group_where(d, queue, name), d.c.partition == partition)
                )
        return positions

    async def _read_group(self, conn: AsyncConnection, queue: str, name: str) -> GroupConfig | None:
        row = (
            (await conn.execute(sa.select(kg_groups).where(_group_where(kg_groups, queue, name))))
            .mappings()
            .first()
        )
        return group_from_row(row) if row is not None else None

    async def get_group(self, queue: str, name: str) -> GroupConfig:
        async with self.transaction() as conn:
            group = await self._read_group(conn, queue, name)
        if group is None:
            raise GroupNotFound(queue, name)
        return group

    async def list_groups(self, queue: str | None = None) -> list[GroupConfig]:
        query = sa.select(kg_groups).order_by(kg_groups.c.queue, kg_groups.c.group_name)
        if queue is not None:
            query = query.where(kg_groups.c.queue == queue)
        async with self.transaction() as conn:
            return [group_from_row(row) for row in (await conn.execute(query)).mappings()]

    async def delete_group(self, queue: str, name: str) -> None:
        async with self.transaction() as conn:
            if await self._read_group(conn, queue, name) is None:
                raise GroupNotFound(queue, name)
            for table in _GROUP_TABLES:
                await conn.execute(sa.delete(table).where(_group_where(table, queue, name)))

    async def load_group(self, queue: str, name: str) -> GroupSnapshot:
        """The group's durable state, for recovery after a restart."""
        async with self.transaction() as conn:
            if await self._read_group(conn, queue, name) is None:
                raise GroupNotFound(queue, name)
            return await self._snapshot(conn, queue, name)

    async def _snapshot(self, conn: AsyncConnection, queue: str, name: str) -> GroupSnapshot:
        o, d = kg_group_offsets, kg_deliveries
        deliveries: dict[int, list[DeliveryRecord]] = {}
        query = sa.select(d).where(_group_where(d, queue, name)).order_by(d.c.partition, d.c.seq)
        for row in await conn.execute(query):
            record = DeliveryRecord(row.seq, row.delivery_count, row.first_delivery_time)
            deliveries.setdefault(row.partition, []).append(record)
        partitions: dict[int, PartitionSnapshot] = {}
        for row in await conn.execute(sa.select(o).where(_group_where(o, queue, name))):
            partitions[row.partition] = PartitionSnapshot(
                committed_seq=row.committed_seq,
                acked_above=decode_ranges(row.acked_above),
                dispatched_seq=row.dispatched_seq,
                reserved_seq=row.reserved_seq,
                deliveries=tuple(deliveries.get(row.partition, ())),
            )
        k = kg_parked_keys
        query = sa.select(k).where(_group_where(k, queue, name)).order_by(k.c.partition, k.c.key)
        parked = tuple(
            ParkedKey(row.partition, row.key, row.since, row.message_id, row.reason)
            for row in await conn.execute(query)
        )
        return GroupSnapshot(partitions=partitions, parked=parked)
