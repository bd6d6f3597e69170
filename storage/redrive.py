"""Dead-letter redrive: move dead letters back to the queue they came from (or another).

How it works. One call moves one batch in one transaction: it reads up to ``limit`` rows
of the dead-letter queue after a (partition, seq) cursor, appends a copy of each to its
target queue — the key and the user's properties kept, the dead-lettering's ``x-``
properties taken off, ``x-redrive-count`` counted up, a new message id — and deletes the
rows it moved. Every group of the dead-letter queue counts a moved letter as settled in
the same transaction (as a purge moves offsets past what it deletes): a letter that is
gone is not waiting for anyone, so it leaves their lag and in-flight counts (the
redrive runs with those groups unloaded, so their state is read back from SQL). Rows it
cannot move (no original queue and no explicit target, or a target that does not exist)
stay and are skipped by the cursor. The new messages reach running groups through the
store's commit listeners, as an append's do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from core.actions import OffsetUpdate
from core.keys import partition_for
from core.ledger import AckLedger
from core.model import (
    DEAD_LETTER_PROPERTIES,
    ORIGINAL_QUEUE,
    REDRIVE_COUNT,
    Message,
    QueueConfig,
)
from storage.base import StoreBase
from storage.codec import decode_ranges, message_from_row, with_seq
from storage.schema import kg_group_offsets, kg_messages
from storage.statements import write_offsets


@dataclass(frozen=True, slots=True)
class RedriveBatch:
    moved: tuple[Message, ...]  # as stored in their target queues
    skipped: int
    cursor: tuple[int, int] | None  # (partition, seq) of the last row read; None = no rows


def _target(message: Message, to: str | None, queues: dict[str, QueueConfig]) -> str | None:
    name = to if to is not None else message.properties.get(ORIGINAL_QUEUE)
    return name if isinstance(name, str) and name in queues else None


def _redriven(message: Message, target: QueueConfig, new_id: str, now: float) -> Message:
    properties = {k: v for k, v in message.properties.items() if k not in DEAD_LETTER_PROPERTIES}
    count = message.properties.get(REDRIVE_COUNT, 0)
    properties[REDRIVE_COUNT] = (count if isinstance(count, int) else 0) + 1
    return dataclasses.replace(
        message,
        message_id=new_id,
        queue=target.name,
        partition=partition_for(message.key, target.partitions),
        properties=properties,
        publish_time=now,
        dedup_id=None,
    )


def _settled_everywhere(
    conn: sa.Connection, dlq: str, moved: Sequence[Message], now: float
) -> None:
    """Mark ``moved`` settled in every group of ``dlq`` (their delivery records go too)."""
    seqs: dict[int, list[int]] = {}
    for letter in moved:
        seqs.setdefault(letter.partition, []).append(letter.seq)
    o = kg_group_offsets
    rows = conn.execute(sa.select(o).where(o.c.queue == dlq, o.c.partition.in_(seqs)))
    updates: dict[str, list[OffsetUpdate]] = {}
    for row in rows:
        ledger = AckLedger(row.committed_seq, decode_ranges(row.acked_above))
        for seq in seqs[row.partition]:
            ledger.settle(seq)
        updates.setdefault(row.group_name, []).append(
            OffsetUpdate(
                row.partition,
                ledger.committed,
                ledger.ranges(),
                row.dispatched_seq,
                row.reserved_seq,
            )
        )
    for group, group_updates in updates.items():
        write_offsets(conn, dlq, group, group_updates, now=now)


async def redrive_batch(
    store: StoreBase,
    dlq: str,
    *,
    to: str | None,
    key: str | None,
    after: tuple[int, int],
    limit: int,
    new_id: Callable[[], str],
    now: float,
) -> RedriveBatch:
    """Move up to ``limit`` dead letters of ``dlq`` found after ``after`` (see the module's
    docstring). Raises QueueNotFound for an unknown ``dlq``."""
    store.queue(dlq)
    m = kg_messages
    partition, seq = after
    where = [
        m.c.queue == dlq,
        sa.or_(m.c.partition > partition, sa.and_(m.c.partition == partition, m.c.seq > seq)),
    ]
    if key is not None:
        where.append(m.c.key == key)
    query = sa.select(m).where(*where).order_by(m.c.partition, m.c.seq).limit(limit)
    async with store.seq_lock, store.transaction() as conn:
        letters = [message_from_row(row) for row in (await conn.execute(query)).mappings()]
        moves = [(letter, _target(letter, to, store.queues)) for letter in letters]
        copies = [
            _redriven(letter, store.queues[target], new_id(), now)
            for letter, target in moves
            if target is not None
        ]
        touched = {(c.queue, c.partition) for c in copies}
        allocation = await conn.run_sync(store.lock_heads, touched)
        stored = [with_seq(c, allocation.next(c.queue, c.partition)) for c in copies]
        if stored:
            await conn.run_sync(store.insert_messages, stored)
            await conn.run_sync(store.write_heads, allocation)
            moved = [letter for letter, target in moves if target is not None]
            await conn.execute(
                sa.delete(m).where(
                    m.c.queue == dlq,
                    sa.tuple_(m.c.partition, m.c.seq).in_([(x.partition, x.seq) for x in moved]),
                )
            )
            await conn.run_sync(_settled_everywhere, dlq, moved, now)
    if stored:
        depth = store.depths.setdefault(dlq, [0, 0])
        depth[0] -= len(stored)
        depth[1] -= sum(letter.size for letter, target in moves if target is not None)
        store.committed(allocation, stored)
    cursor = (letters[-1].partition, letters[-1].seq) if letters else None
    return RedriveBatch(tuple(stored), len(letters) - len(stored), cursor)


__all__ = ["RedriveBatch", "redrive_batch"]
