"""SQL shared by the driver side of the Spark source: engines, group state, offset commits.

Writers use ``storage.engine.sync_engine`` (on SQLite every transaction is
``BEGIN IMMEDIATE``, queueing behind the gateway's writers). Readers must not take the
SQLite write lock, or a long Spark scan would stall the gateway's appends for its whole
duration: ``read_engine`` opens SQLite with a deferred ``BEGIN`` (a WAL read snapshot,
no lock that writers wait on). On PostgreSQL both are the same psycopg engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from core.actions import OffsetUpdate, SeqRanges
from core.errors import QueueNotFound
from core.ledger import AckLedger
from core.model import GroupConfig, QueueConfig
from storage import statements
from storage.codec import decode_ranges, group_row, queue_from_row, queue_row
from storage.engine import SQLITE_BUSY_TIMEOUT_MS, is_sqlite, sync_engine
from storage.schema import (
    kg_deliveries,
    kg_group_offsets,
    kg_groups,
    kg_messages,
    kg_partitions,
    kg_queues,
    kg_subscriptions,
)


@dataclass(frozen=True, slots=True)
class PartitionState:
    """One partition as the group sees it when a read is planned."""

    committed: int
    acked_above: SeqRanges
    dispatched: int
    head: int
    # Seq just before the oldest retained message (the head when the partition is empty).
    earliest: int
    # consume_batch only. Not due yet (a nacked message's backoff, or deliver_at later):
    # left out of the batch and left pending.
    deferred: SeqRanges = ()
    # Past expire_at: left out of the batch and settled (dead-lettered if the queue asks).
    expired: SeqRanges = ()


def write_engine(url: str) -> sa.Engine:
    return sync_engine(url)


def read_engine(url: str) -> sa.Engine:
    """An engine for scans that never blocks the gateway's writers (see module doc)."""
    if not is_sqlite(url):
        return sync_engine(url)
    engine = sa.create_engine(make_url(url).set(drivername="sqlite+pysqlite"))

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _begin(connection: sa.Connection) -> None:
        connection.exec_driver_sql("BEGIN")

    return engine


def read_queue(conn: sa.Connection, name: str) -> QueueConfig:
    row = conn.execute(sa.select(kg_queues).where(kg_queues.c.name == name)).mappings().first()
    if row is None:
        raise QueueNotFound(name)
    patterns = conn.execute(
        sa.select(kg_subscriptions.c.pattern).where(kg_subscriptions.c.queue == name)
    ).scalars()
    return queue_from_row(row, tuple(sorted(patterns)))


def ensure_queue(conn: sa.Connection, config: QueueConfig, now: float) -> None:
    """Create the queue and its partitions unless it exists (used for a missing DLQ)."""
    conn.execute(
        statements.insert_missing(conn, kg_queues), [{**queue_row(config), "created_at": now}]
    )
    conn.execute(
        statements.insert_missing(conn, kg_partitions),
        [{"queue": config.name, "partition": p, "head_seq": 0} for p in range(config.slots)],
    )


def ensure_group(conn: sa.Connection, queue: str, group: str, now: float) -> QueueConfig:
    """Create the group (start earliest) with its offsets unless it exists; the queue must.

    Mirrors the store's group creation; ON CONFLICT DO NOTHING makes a concurrent
    creation by the gateway harmless.
    """
    config = read_queue(conn, queue)
    exists = conn.execute(
        sa.select(kg_groups.c.group_name).where(
            kg_groups.c.queue == queue, kg_groups.c.group_name == group
        )
    ).first()
    if exists is not None:
        return config
    conn.execute(
        statements.insert_missing(conn, kg_groups),
        [{**group_row(GroupConfig(queue=queue, name=group)), "created_at": now}],
    )
    starts = {
        row.partition: row.head_seq
        for row in conn.execute(sa.select(kg_partitions).where(kg_partitions.c.queue == queue))
    }
    m = kg_messages
    oldest = sa.select(m.c.partition, sa.func.min(m.c.seq)).where(m.c.queue == queue)
    for partition, seq in conn.execute(oldest.group_by(m.c.partition)):
        starts[partition] = seq - 1
    conn.execute(
        statements.insert_missing(conn, kg_group_offsets),
        statements.first_offsets(queue, group, starts, config.slots, now),
    )
    return config


def group_tags(conn: sa.Connection, queue: str, group: str) -> tuple[tuple[str, str], ...]:
    """The group's tag filter as sorted (property, value) pairs; empty when it has none."""
    g = kg_groups
    tags = conn.execute(
        sa.select(g.c.tags).where(g.c.queue == queue, g.c.group_name == group)
    ).scalar()
    return tuple(sorted((str(k), str(v)) for k, v in (tags or {}).items()))


def _runs(pairs: Iterable[tuple[int, int]]) -> dict[int, SeqRanges]:
    """(partition, seq) pairs as sorted, merged seq ranges per partition."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    for partition, seq in sorted(set(pairs)):
        runs = ranges.setdefault(partition, [])
        if runs and runs[-1][1] == seq - 1:
            runs[-1] = (runs[-1][0], seq)
        else:
            runs.append((seq, seq))
    return {partition: tuple(runs) for partition, runs in ranges.items()}


def _not_due(
    conn: sa.Connection, queue: str, group: str, due_at: float
) -> tuple[dict[int, SeqRanges], dict[int, SeqRanges]]:
    """(deferred, expired) seqs per partition at ``due_at``: deferred are nacked messages
    whose redelivery is not due and messages scheduled later (deliver_at); expired are
    past their expire_at (DESIGN.md §4: not delivered)."""
    d, m = kg_deliveries, kg_messages
    expired = {
        (row.partition, row.seq)
        for row in conn.execute(
            sa.select(m.c.partition, m.c.seq).where(m.c.queue == queue, m.c.expire_at <= due_at)
        )
    }
    later = conn.execute(
        sa.select(d.c.partition, d.c.seq)
        .where(d.c.queue == queue, d.c.group_name == group, d.c.redeliver_at > due_at)
        .union(sa.select(m.c.partition, m.c.seq).where(m.c.queue == queue, m.c.deliver_at > due_at))
    )
    deferred = {(row.partition, row.seq) for row in later} - expired
    return _runs(deferred), _runs(expired)


def _live(m: sa.Table, now: float) -> sa.ColumnElement[bool]:
    return sa.or_(m.c.expire_at.is_(None), m.c.expire_at > now)


def first_not_due(
    conn: sa.Connection,
    queue: str,
    group: str,
    spans: Mapping[int, tuple[int, int]],
    now: float,
) -> dict[int, int]:
    """Per partition, the first seq in its span ``(lo, hi]`` that is not due at ``now``:
    scheduled later (deliver_at) or nacked with its redelivery later (redeliver_at), and
    not expired. A stream's offsets stop just before it (spark.source)."""
    m, d = kg_messages, kg_deliveries
    wanted = [(p, lo, hi) for p, (lo, hi) in spans.items() if hi > lo]
    if not wanted:
        return {}

    def in_spans(table: sa.Table) -> sa.ColumnElement[bool]:
        return sa.or_(
            *(
                sa.and_(table.c.partition == p, table.c.seq > lo, table.c.seq <= hi)
                for p, lo, hi in wanted
            )
        )

    scheduled = sa.select(m.c.partition, m.c.seq).where(
        m.c.queue == queue, in_spans(m), m.c.deliver_at > now, _live(m, now)
    )
    retried = (
        sa.select(d.c.partition, d.c.seq)
        .join(
            m, sa.and_(m.c.queue == d.c.queue, m.c.partition == d.c.partition, m.c.seq == d.c.seq)
        )
        .where(
            d.c.queue == queue,
            d.c.group_name == group,
            in_spans(d),
            d.c.redeliver_at > now,
            _live(m, now),
        )
    )
    held = sa.union_all(scheduled, retried).subquery()
    rows = conn.execute(
        sa.select(held.c.partition, sa.func.min(held.c.seq)).group_by(held.c.partition)
    )
    return {int(partition): int(seq) for partition, seq in rows}


def load_partitions(
    conn: sa.Connection, queue: str, group: str, *, due_at: float | None = None
) -> dict[int, PartitionState]:
    """Every partition's offsets, head and oldest retained seq, in one snapshot; with
    ``due_at``, also what is not due by then and what has expired (see ``_not_due``)."""
    o, p, m = kg_group_offsets, kg_partitions, kg_messages
    deferred, expired = ({}, {}) if due_at is None else _not_due(conn, queue, group, due_at)
    oldest: dict[int, int] = dict(
        conn.execute(  # type: ignore[arg-type]
            sa.select(m.c.partition, sa.func.min(m.c.seq))
            .where(m.c.queue == queue)
            .group_by(m.c.partition)
        ).all()
    )
    rows = conn.execute(
        sa.select(
            o.c.partition, o.c.committed_seq, o.c.acked_above, o.c.dispatched_seq, p.c.head_seq
        )
        .join(p, sa.and_(p.c.queue == o.c.queue, p.c.partition == o.c.partition))
        .where(o.c.queue == queue, o.c.group_name == group)
    )
    return {
        row.partition: PartitionState(
            committed=row.committed_seq,
            acked_above=decode_ranges(row.acked_above),
            dispatched=row.dispatched_seq,
            head=row.head_seq,
            earliest=oldest[row.partition] - 1 if row.partition in oldest else row.head_seq,
            deferred=deferred.get(row.partition, ()),
            expired=expired.get(row.partition, ()),
        )
        for row in rows
    }


def write_offsets(
    conn: sa.Connection,
    queue: str,
    group: str,
    ledgers: Mapping[int, AckLedger],
    dispatched: Mapping[int, int],
    now: float,
) -> None:
    """Write each partition's ack state, never moving dispatched_seq backwards, and drop
    the delivery records of seqs that are now settled (the store's statements; Spark
    reserves nothing, so reserved_seq is left alone)."""
    updates = [
        OffsetUpdate(
            partition=partition,
            committed_seq=ledger.committed,
            acked_above=ledger.ranges(),
            dispatched_seq=dispatched.get(partition, ledger.committed),
        )
        for partition, ledger in ledgers.items()
    ]
    statements.write_offsets(conn, queue, group, updates, now=now, keep_reserved=True)


def commit_through(
    conn: sa.Connection, queue: str, group: str, end: Mapping[int, int], now: float
) -> None:
    """Mark everything up to ``end`` (per partition) consumed: idempotent and monotonic.

    Spark commits batch N while planning N+1, maybe twice after a restart, maybe from
    another process: an end at or below the committed seq changes nothing. Ranges acked
    above the committed seq are folded in (and dropped when at or below it).
    """
    states = load_partitions(conn, queue, group)
    ledgers: dict[int, AckLedger] = {}
    for partition, seq in end.items():
        state = states.get(partition)
        if state is None or seq <= state.committed:
            continue
        ledger = AckLedger(state.committed, state.acked_above)
        ledger.settle_range(state.committed + 1, seq)
        ledgers[partition] = ledger
    write_offsets(conn, queue, group, ledgers, {p: end[p] for p in ledgers}, now)


__all__ = [
    "PartitionState",
    "commit_through",
    "ensure_group",
    "ensure_queue",
    "first_not_due",
    "group_tags",
    "load_partitions",
    "read_engine",
    "read_queue",
    "write_engine",
    "write_offsets",
]
