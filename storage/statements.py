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


def json_rows(columns: Mapping[str, str], *, postgres: bool, param: str) -> str:
    """The JSON document bound to ``param`` (a list of objects) as a table ``j`` of these
    columns (name -> PostgreSQL type), for a FROM clause: a statement writes rows of many
    partitions at once, however many there are. On SQLite a subquery that LIMIT -1 makes
    SQLite materialize, so each row is looked up by its key (joined as a table-valued
    function, SQLite's plan scanned the document once per row of the other side)."""
    if postgres:
        typed = ", ".join(f'"{name}" {kind}' for name, kind in columns.items())
        return f"jsonb_to_recordset(CAST(:{param} AS jsonb)) AS j({typed})"
    picked = ", ".join(f"json_extract(value, '$.{name}') AS \"{name}\"" for name in columns)
    return f"(SELECT {picked} FROM json_each(:{param}) LIMIT -1) AS j"


def per_dialect(
    template: str, columns: Mapping[str, str], param: str = "rows", *, postgres: str = ""
) -> dict[str, sa.TextClause]:
    """``template`` (``postgres``: another for PostgreSQL) with ``{rows}`` made
    ``json_rows`` for each dialect, by dialect name."""
    templates = {"sqlite": (template, False), "postgresql": (postgres or template, True)}
    return {
        name: sa.text(text.format(rows=json_rows(columns, postgres=pg, param=param)))
        for name, (text, pg) in templates.items()
    }


# First deliveries recorded (RecordDispatch): dispatched_seq and reserved_seq never move
# back. One statement per dispatch transaction, its rows one JSON document, as the offset
# flush below (an executemany of one UPDATE per partition cost the writer a Python step
# per row, and on PostgreSQL two polls and a send per row in the pipeline; at 256
# partitions a transaction carries dozens).
_ADVANCE: Final = per_dialect(
    """UPDATE kg_group_offsets AS o SET
    dispatched_seq = CASE WHEN j.dispatched > o.dispatched_seq THEN j.dispatched
        ELSE o.dispatched_seq END,
    reserved_seq = CASE WHEN j.reserved > o.reserved_seq THEN j.reserved
        ELSE o.reserved_seq END,
    updated_at = :now
FROM {rows}
WHERE o.queue = j.queue AND o.group_name = j."group" AND o."partition" = j."partition"
""",
    {
        "queue": "text",
        "group": "text",
        "partition": "integer",
        "dispatched": "bigint",
        "reserved": "bigint",
    },
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
            rows[(queue, group, partition)] = {
                "queue": queue,
                "group": group,
                "partition": partition,
                "dispatched": dispatched,
                "reserved": reserved,
            }
        else:
            row["dispatched"] = max(row["dispatched"], dispatched)
            row["reserved"] = max(row["reserved"], reserved)
    if rows:
        statement = _ADVANCE[conn.dialect.name]
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
_OFFSETS: Final = per_dialect(
    """UPDATE kg_group_offsets AS o SET
    committed_seq = j.committed, acked_above = j.ranges, acked_count = j.acked,
    dispatched_seq = CASE WHEN j.dispatched > o.dispatched_seq THEN j.dispatched
        ELSE o.dispatched_seq END,
    reserved_seq = coalesce(j.reserved, o.reserved_seq),
    updated_at = :now
FROM {rows}
WHERE o.queue = :queue AND o.group_name = :group AND o."partition" = j."partition"
""",
    {
        "partition": "integer",
        "committed": "bigint",
        "ranges": "jsonb",
        "acked": "bigint",
        "dispatched": "bigint",
        "reserved": "bigint",
    },
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
    conn.execute(_OFFSETS[conn.dialect.name], {**where, "rows": json.dumps(rows), "now": now})
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
    "json_rows",
    "lease_free",
    "lease_holder",
    "per_dialect",
    "release_lease",
    "take_lease",
    "upsert",
    "write_offsets",
]
