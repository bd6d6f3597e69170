"""SQL both writers of a group run: the store (storage/) and a Spark job (spark/).

The gateway and a Spark job take the same group lease and write the same offsets, so
each statement is defined once, here, and both sides run it: a change to what "free"
means or to how offsets move cannot reach one writer and miss the other. Builders return
SQLAlchemy Core statements; the offset statements take bind parameters (``b_*``) so one
statement serves a whole executemany. Sync and async connections run them alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from core.actions import OffsetUpdate
from storage.codec import encode_ranges, ranges_count
from storage.schema import kg_deliveries, kg_group_offsets, kg_groups

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

_o: Final = kg_group_offsets
_d: Final = kg_deliveries
OFFSET_WHERE: Final = sa.and_(
    _o.c.queue == sa.bindparam("b_queue"),
    _o.c.group_name == sa.bindparam("b_group"),
    _o.c.partition == sa.bindparam("b_partition"),
)
DELIVERY_GROUP: Final = sa.and_(
    _d.c.queue == sa.bindparam("b_queue"),
    _d.c.group_name == sa.bindparam("b_group"),
    _d.c.partition == sa.bindparam("b_partition"),
)


def _not_back(column: sa.Column[Any], name: str) -> sa.ColumnElement[Any]:
    value: sa.BindParameter[Any] = sa.bindparam(name)
    return sa.case((value > column, value), else_=column)


# Full ack state of one partition; dispatched_seq never moves back; reserved_seq is set
# as given (a reservation may shrink), or kept when b_reserved is NULL (Spark reserves
# nothing).
WRITE_OFFSET: Final = (
    sa.update(_o)
    .where(OFFSET_WHERE)
    .values(
        committed_seq=sa.bindparam("b_committed"),
        acked_above=sa.bindparam("b_ranges", type_=_o.c.acked_above.type),
        acked_count=sa.bindparam("b_count"),
        dispatched_seq=_not_back(_o.c.dispatched_seq, "b_dispatched"),
        reserved_seq=sa.func.coalesce(
            sa.bindparam("b_reserved", type_=_o.c.reserved_seq.type), _o.c.reserved_seq
        ),
        updated_at=sa.bindparam("b_now"),
    )
)
ADVANCE_DISPATCHED: Final = (
    sa.update(_o)
    .where(OFFSET_WHERE)
    .values(
        dispatched_seq=_not_back(_o.c.dispatched_seq, "b_seq"),
        reserved_seq=_not_back(_o.c.reserved_seq, "b_reserved"),
        updated_at=sa.bindparam("b_now"),
    )
)
DROP_SETTLED: Final = sa.delete(_d).where(DELIVERY_GROUP, _d.c.seq <= sa.bindparam("b_hi"))
DROP_ACKED: Final = sa.delete(_d).where(
    DELIVERY_GROUP, _d.c.seq.between(sa.bindparam("b_lo"), sa.bindparam("b_hi"))
)


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
    settles. ``keep_reserved`` leaves reserved_seq alone (Spark reserves nothing)."""
    if not updates:
        return
    rows: list[dict[str, Any]] = []
    ranges: list[dict[str, Any]] = []
    for update in updates:
        key = {"b_queue": queue, "b_group": group, "b_partition": update.partition}
        rows.append(
            {
                **key,
                "b_committed": update.committed_seq,
                "b_ranges": encode_ranges(update.acked_above),
                "b_count": ranges_count(update.acked_above),
                "b_dispatched": update.dispatched_seq,
                "b_reserved": None if keep_reserved else update.reserved_seq,
                "b_now": now,
            }
        )
        ranges.extend({**key, "b_lo": lo, "b_hi": hi} for lo, hi in update.acked_above)
    conn.execute(WRITE_OFFSET, rows)
    conn.execute(DROP_SETTLED, [{**row, "b_hi": row["b_committed"]} for row in rows])
    if ranges:
        conn.execute(DROP_ACKED, ranges)


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
    "ADVANCE_DISPATCHED",
    "DELIVERY_GROUP",
    "DROP_ACKED",
    "DROP_SETTLED",
    "OFFSET_WHERE",
    "WRITE_OFFSET",
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
