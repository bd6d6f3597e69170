"""SQL both writers of a group run: the store (storage/) and a Spark job (spark/).

The gateway and a Spark job take the same group lease and write the same offsets, so
each statement is defined once, here, and both sides run it: a change to what "free"
means or to how offsets move cannot reach one writer and miss the other. Builders return
SQLAlchemy Core statements; a dispatch record and an offset flush are text statements
per dialect whose rows travel as one JSON document. Sync and async connections run them alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from core.actions import OffsetUpdate
from storage.codec import encode_ranges, ranges_count
from storage.schema import kg_groups

# --- group lease (kg_groups.lease_*; DESIGN.md §7) ---------------------------------------


def group_is(queue: str, group: str) -> sa.ColumnElement[bool]:
    """The group's kg_groups row."""
    return sa.and_(kg_groups.c.queue == queue, kg_groups.c.group_name == group)


def lease_free(kind: str, owner: str, now: float) -> sa.ColumnElement[bool]:
    """The lease may be taken by ``(kind, owner)``: nobody holds it, it lapsed, or it is
    theirs already (a renewal). A lease with no expiry never lapses (``NULL <= now`` is
    not true)."""
    g = kg_groups
    return sa.or_(
        g.c.lease_kind.is_(None),
        g.c.lease_expires <= now,
        sa.and_(g.c.lease_kind == kind, g.c.lease_owner == owner),
    )


def take_lease(queue: str, group: str, kind: str, owner: str, *, ttl: float, now: float) -> Any:
    """Take or renew the lease if it is free for ``(kind, owner)``: conditional, so of two
    racing takers one UPDATE matches the row and the other none (rowcount 0)."""
    return (
        sa.update(kg_groups)
        .where(group_is(queue, group), lease_free(kind, owner, now))
        .values(lease_kind=kind, lease_owner=owner, lease_expires=now + ttl)
    )


def lease_holder(queue: str, group: str) -> sa.Select[Any]:
    """Who holds the group's lease: ``lease_kind``, ``lease_owner``, ``lease_expires``."""
    g = kg_groups
    return sa.select(g.c.lease_kind, g.c.lease_owner, g.c.lease_expires).where(
        group_is(queue, group)
    )


def release_lease(queue: str, group: str, owner: str) -> Any:
    """Clear the lease if ``owner`` holds it. Owner ids name their holder and kind
    (``gateway:<name>``, ``<role>@<host>/<uuid>`` for Spark jobs), so the owner alone
    says whose lease it is."""
    g = kg_groups
    return (
        sa.update(g)
        .where(group_is(queue, group), g.c.lease_owner == owner)
        .values(lease_kind=None, lease_owner=None, lease_expires=None)
    )


# --- offsets and delivery records --------------------------------------------------------

# First deliveries recorded (RecordDispatch): dispatched_seq and reserved_seq never move
# back. One statement per dispatch transaction, its rows one JSON document, as the offset
# flush below (an executemany of one UPDATE per partition cost the writer a Python step
# per row, and on PostgreSQL two polls and a send per row in the pipeline; at 256
# partitions a transaction carries dozens).
_SQLITE_ADVANCE: Final = sa.text(
    """UPDATE kg_group_offsets SET
    dispatched_seq = CASE WHEN j.dispatched > dispatched_seq THEN j.dispatched
        ELSE dispatched_seq END,
    reserved_seq = CASE WHEN j.reserved > reserved_seq THEN j.reserved ELSE reserved_seq END,
    updated_at = :now
FROM (
    SELECT json_extract(value, '$.queue') AS queue, json_extract(value, '$.group') AS grp,
        json_extract(value, '$.partition') AS "partition",
        json_extract(value, '$.dispatched') AS dispatched,
        json_extract(value, '$.reserved') AS reserved
    FROM json_each(:rows) LIMIT -1) AS j
WHERE kg_group_offsets.queue = j.queue AND kg_group_offsets.group_name = j.grp
    AND kg_group_offsets."partition" = j."partition"
"""
)
_POSTGRES_ADVANCE: Final = sa.text(
    """UPDATE kg_group_offsets AS o SET
    dispatched_seq = CASE WHEN j.dispatched > o.dispatched_seq THEN j.dispatched
        ELSE o.dispatched_seq END,
    reserved_seq = CASE WHEN j.reserved > o.reserved_seq THEN j.reserved
        ELSE o.reserved_seq END,
    updated_at = :now
FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS j(
    queue text, "group" text, "partition" integer, dispatched bigint, reserved bigint)
WHERE o.queue = j.queue AND o.group_name = j."group" AND o."partition" = j."partition"
"""
)


def advance_dispatched(
    conn: sa.Connection, advances: Iterable[tuple[str, str, int, int, int]], *, now: float
) -> None:
    """Move each (queue, group, partition)'s dispatched_seq and reserved_seq up to the
    given ones (never back), in one statement. A partition named more than once (records
    of several steps in one transaction) moves to the highest of each."""
    rows: dict[tuple[str, str, int], dict[str, Any]] = {}
    for queue, group, partition, dispatched, reserved in advances:
        row = rows.get((queue, group, partition))
        if row is None:
            row = {"queue": queue, "group": group, "partition": partition}
            row |= {"dispatched": dispatched, "reserved": reserved}
            rows[(queue, group, partition)] = row
        else:
            row["dispatched"] = max(row["dispatched"], dispatched)
            row["reserved"] = max(row["reserved"], reserved)
    if rows:
        statement = _POSTGRES_ADVANCE if conn.dialect.name == "postgresql" else _SQLITE_ADVANCE
        conn.execute(statement, {"rows": json.dumps(list(rows.values())), "now": now})


def first_offsets(
    queue: str, group: str, starts: Mapping[int, int], slots: int, now: float
) -> list[dict[str, Any]]:
    """A new group's kg_group_offsets rows: every partition starts at ``starts`` (0 when
    absent), nothing acked."""
    return [
        {
            "queue": queue,
            "group_name": group,
            "partition": partition,
            "committed_seq": starts.get(partition, 0),
            "dispatched_seq": starts.get(partition, 0),
            "acked_above": [],
            "acked_count": 0,
            "updated_at": now,
        }
        for partition in range(slots)
    ]


# One statement per flush, however many partitions it writes: the rows travel as one
# JSON document (an executemany ran a statement per partition, and on SQLite the writer
# thread gave up and took back the GIL at every row). dispatched_seq never moves back;
# reserved_seq is kept when the row's is null (Spark reserves nothing).
_SQLITE_OFFSETS: Final = sa.text(
    # LIMIT -1 makes SQLite materialize the rows and look each partition up by its key;
    # joined as a table-valued function, it scanned the document once per partition.
    """UPDATE kg_group_offsets SET
    committed_seq = j.committed, acked_above = j.ranges, acked_count = j.acked,
    dispatched_seq = max(dispatched_seq, j.dispatched),
    reserved_seq = coalesce(j.reserved, reserved_seq),
    updated_at = :now
FROM (
    SELECT json_extract(value, '$.partition') AS "partition",
        json_extract(value, '$.committed') AS committed,
        json_extract(value, '$.ranges') AS ranges,
        json_extract(value, '$.acked') AS acked,
        json_extract(value, '$.dispatched') AS dispatched,
        json_extract(value, '$.reserved') AS reserved
    FROM json_each(:rows) LIMIT -1) AS j
WHERE kg_group_offsets.queue = :queue AND kg_group_offsets.group_name = :group
    AND kg_group_offsets."partition" = j."partition"
"""
)
_POSTGRES_OFFSETS: Final = sa.text(
    """UPDATE kg_group_offsets AS o SET
    committed_seq = j.committed, acked_above = j.ranges, acked_count = j.acked,
    dispatched_seq = greatest(o.dispatched_seq, j.dispatched),
    reserved_seq = coalesce(j.reserved, o.reserved_seq),
    updated_at = :now
FROM jsonb_to_recordset(CAST(:rows AS jsonb)) AS j(
    "partition" integer, committed bigint, ranges jsonb, acked bigint, dispatched bigint,
    reserved bigint)
WHERE o.queue = :queue AND o.group_name = :group AND o."partition" = j."partition"
"""
)
# The delivery records of settled seqs: each row a (partition, lo, hi) span.
_SQLITE_DROP: Final = sa.text(
    """DELETE FROM kg_deliveries WHERE rowid IN (
    SELECT d.rowid FROM json_each(:spans) AS j CROSS JOIN kg_deliveries AS d
    WHERE d.queue = :queue AND d.group_name = :group
        AND d."partition" = json_extract(j.value, '$.partition')
        AND d.seq BETWEEN json_extract(j.value, '$.lo') AND json_extract(j.value, '$.hi'))"""
)
_POSTGRES_DROP: Final = sa.text(
    """DELETE FROM kg_deliveries AS d
USING jsonb_to_recordset(CAST(:spans AS jsonb)) AS j("partition" integer, lo bigint, hi bigint)
WHERE d.queue = :queue AND d.group_name = :group AND d."partition" = j."partition"
    AND d.seq BETWEEN j.lo AND j.hi"""
)


def write_offsets(
    conn: sa.Connection,
    queue: str,
    group: str,
    updates: Sequence[OffsetUpdate],
    *,
    now: float,
    keep_reserved: bool = False,
) -> None:
    """Write each update's full ack state and drop the delivery records of the seqs it
    settles, in two statements. ``keep_reserved`` leaves reserved_seq alone (Spark
    reserves nothing)."""
    if not updates:
        return
    rows = [
        {
            "partition": update.partition,
            "committed": update.committed_seq,
            "ranges": encode_ranges(update.acked_above),
            "acked": ranges_count(update.acked_above),
            "dispatched": update.dispatched_seq,
            "reserved": None if keep_reserved else update.reserved_seq,
        }
        for update in updates
    ]
    spans = [{"partition": u.partition, "lo": 0, "hi": u.committed_seq} for u in updates]
    spans.extend(
        {"partition": u.partition, "lo": lo, "hi": hi} for u in updates for lo, hi in u.acked_above
    )
    postgres = conn.dialect.name == "postgresql"
    where = {"queue": queue, "group": group}
    conn.execute(
        _POSTGRES_OFFSETS if postgres else _SQLITE_OFFSETS,
        {**where, "rows": json.dumps(rows), "now": now},
    )
    drop = _POSTGRES_DROP if postgres else _SQLITE_DROP
    conn.execute(drop, {**where, "spans": json.dumps(spans)})


# --- dialect-specific inserts --------------------------------------------------------------


def _insert(conn: sa.Connection | AsyncConnection, table: sa.Table) -> Any:
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    return dialect.insert(table)


def upsert(
    conn: sa.Connection | AsyncConnection,
    table: sa.Table,
    keys: Sequence[str],
    set_: Iterable[str],
    *,
    where: sa.ColumnElement[bool] | None = None,
) -> Any:
    """INSERT ... ON CONFLICT (keys) DO UPDATE for the connection's dialect (sync or
    async connection).

    The ``set_`` columns take the inserted values; ``where`` limits which existing rows
    are updated (the others are left alone).
    """
    stmt = _insert(conn, table)
    values = {name: stmt.excluded[name] for name in set_}
    return stmt.on_conflict_do_update(index_elements=list(keys), set_=values, where=where)


def insert_missing(conn: sa.Connection | AsyncConnection, table: sa.Table) -> Any:
    """INSERT ... ON CONFLICT DO NOTHING: rows that exist already are left as they are."""
    return _insert(conn, table).on_conflict_do_nothing()


__all__ = [
    "advance_dispatched",
    "first_offsets",
    "group_is",
    "insert_missing",
    "lease_free",
    "lease_holder",
    "release_lease",
    "take_lease",
    "upsert",
    "write_offsets",
]
