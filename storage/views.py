"""The inspection views: SQLAlchemy selects over storage.schema's tables, compiled for the
connected dialect, so the same definition works on SQLite and PostgreSQL (docs/sql.md).
storage.migrate recreates them at the head revision; a migration that rebuilds a table on
SQLite drops them first (``drop_views``).
"""

from __future__ import annotations

from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import DDLCompiler, SQLCompiler
from sqlalchemy.sql.ddl import ExecutableDDLElement
from sqlalchemy.sql.functions import FunctionElement

from storage.schema import (
    kg_deliveries,
    kg_flows,
    kg_group_offsets,
    kg_groups,
    kg_messages,
    kg_parked_keys,
    kg_partition_assignments,
    kg_partitions,
    kg_queues,
    metadata,
)


class CreateView(ExecutableDDLElement):
    def __init__(self, name: str, select: sa.Select[Any]) -> None:
        self.name = name
        self.select = select


class DropView(ExecutableDDLElement):
    def __init__(self, name: str) -> None:
        self.name = name


@compiles(CreateView)
def _create_view(element: CreateView, compiler: DDLCompiler, **kw: Any) -> str:
    body = compiler.sql_compiler.process(element.select, literal_binds=True)
    return "CREATE VIEW " + compiler.preparer.quote(element.name) + " AS " + body


@compiles(DropView)
def _drop_view(element: DropView, compiler: DDLCompiler, **kw: Any) -> str:
    return "DROP VIEW IF EXISTS " + compiler.preparer.quote(element.name)


def _non_negative(expr: sa.ColumnElement[int]) -> sa.ColumnElement[int]:
    # GREATEST is PostgreSQL-only and SQLite's two-argument max() is SQLite-only.
    return sa.case((expr > 0, expr), else_=0)


def _partition_status() -> sa.Select[Any]:
    o, p, a = kg_group_offsets, kg_partitions, kg_partition_assignments
    f, g = kg_flows, kg_groups
    done = o.c.committed_seq + o.c.acked_count
    spark = sa.and_(g.c.lease_kind == "spark", a.c.flow_id.is_(None))
    return (
        sa.select(
            o.c.queue,
            o.c.group_name,
            o.c.partition,
            sa.func.coalesce(a.c.state, "unassigned").label("state"),
            a.c.flow_id.label("owner_flow"),
            sa.case((spark, g.c.lease_owner), else_=f.c.client).label("owner_client"),
            _non_negative(
                p.c.head_seq
                - sa.case(
                    (o.c.dispatched_seq > o.c.committed_seq, o.c.dispatched_seq),
                    else_=o.c.committed_seq,
                )
            ).label("backlog"),
            _non_negative(o.c.dispatched_seq - done).label("in_flight"),
            o.c.committed_seq,
            o.c.dispatched_seq,
            p.c.head_seq,
            _non_negative(p.c.head_seq - done).label("lag"),
        )
        .select_from(o)
        .join(p, sa.and_(p.c.queue == o.c.queue, p.c.partition == o.c.partition))
        .join(g, sa.and_(g.c.queue == o.c.queue, g.c.group_name == o.c.group_name))
        .outerjoin(
            a,
            sa.and_(
                a.c.queue == o.c.queue,
                a.c.group_name == o.c.group_name,
                a.c.partition == o.c.partition,
            ),
        )
        .outerjoin(f, f.c.flow_id == a.c.flow_id)
    )


_status: Final = sa.table(
    "kg_partition_status",
    sa.column("queue"),
    sa.column("group_name"),
    sa.column("partition"),
    sa.column("backlog"),
    sa.column("in_flight"),
    sa.column("lag"),
)


def _group_lag() -> sa.Select[Any]:
    s, g = _status, kg_groups
    return (
        sa.select(
            g.c.queue,
            g.c.group_name,
            g.c.mode,
            g.c.lease_kind,
            g.c.lease_owner,
            sa.func.count(s.c.partition).label("partitions"),
            sa.func.coalesce(sa.func.sum(s.c.lag), 0).label("lag"),
            sa.func.coalesce(sa.func.sum(s.c.backlog), 0).label("backlog"),
            sa.func.coalesce(sa.func.sum(s.c.in_flight), 0).label("in_flight"),
            sa.func.coalesce(sa.func.max(s.c.lag), 0).label("max_partition_lag"),
        )
        .select_from(g)
        .outerjoin(s, sa.and_(s.c.queue == g.c.queue, s.c.group_name == g.c.group_name))
        .group_by(g.c.queue, g.c.group_name, g.c.mode, g.c.lease_kind, g.c.lease_owner)
    )


def _queue_stats() -> sa.Select[Any]:
    q, m, o = kg_queues, kg_messages.alias("m"), kg_group_offsets
    dlq = sa.case((q.c.dead_letter_queue.is_(None), q.c.name + ".dlq"), else_=q.c.dead_letter_queue)
    in_flight = _non_negative(o.c.dispatched_seq - o.c.committed_seq - o.c.acked_count)
    return sa.select(
        q.c.name.label("queue"),
        q.c.partitions,
        sa.select(sa.func.count()).where(m.c.queue == q.c.name).scalar_subquery().label("depth"),
        sa.select(sa.func.coalesce(sa.func.sum(m.c.size), 0))
        .where(m.c.queue == q.c.name)
        .scalar_subquery()
        .label("bytes"),
        sa.select(sa.func.coalesce(sa.func.sum(in_flight), 0))
        .where(o.c.queue == q.c.name)
        .scalar_subquery()
        .label("in_flight"),
        sa.select(sa.func.count()).where(m.c.queue == dlq).scalar_subquery().label("dead_letters"),
    )


class _Acked(FunctionElement[bool]):
    """Whether a seq lies in a JSON list of inclusive [lo, hi] ranges
    (kg_group_offsets.acked_above): ``_Acked(ranges, seq)``."""

    type = sa.Boolean()
    inherit_cache = True


@compiles(_Acked, "sqlite")
def _acked_sqlite(element: _Acked, compiler: SQLCompiler, **kw: Any) -> str:
    ranges, seq = (compiler.process(c, **kw) for c in element.clauses)
    return (
        f"EXISTS (SELECT 1 FROM json_each({ranges}) AS kg_r WHERE "
        f"json_extract(kg_r.value, '$[0]') <= {seq} AND {seq} <= json_extract(kg_r.value, '$[1]'))"
    )


@compiles(_Acked, "postgresql")
def _acked_postgresql(element: _Acked, compiler: SQLCompiler, **kw: Any) -> str:
    ranges, seq = (compiler.process(c, **kw) for c in element.clauses)
    return (
        f"EXISTS (SELECT 1 FROM jsonb_array_elements({ranges}) AS kg_r(v) WHERE "
        f"(kg_r.v ->> 0)::bigint <= {seq} AND {seq} <= (kg_r.v ->> 1)::bigint)"
    )


def _strict_holds() -> sa.Select[Any]:
    """Keys of strict groups held behind an unacked message: the key's oldest unsettled
    message at or below dispatched_seq (delivered: not retrying, not parked) while a later
    message of the key is stored unsettled. Since: the later of that message's publish
    time and the unacked one's first delivery (its publish time when not recorded)."""
    g, o, d, k = kg_groups, kg_group_offsets, kg_deliveries, kg_parked_keys
    m, head, w = kg_messages.alias("m"), kg_messages.alias("head"), kg_messages.alias("w")
    where = sa.and_(m.c.queue == o.c.queue, m.c.partition == o.c.partition)
    held = (
        sa.select(
            o.c.queue, o.c.group_name, o.c.partition, m.c.key, sa.func.min(m.c.seq).label("seq")
        )
        .select_from(o)
        .join(g, sa.and_(g.c.queue == o.c.queue, g.c.group_name == o.c.group_name))
        .join(m, sa.and_(where, m.c.seq > o.c.committed_seq, m.c.seq <= o.c.dispatched_seq))
        .where(
            g.c.key_order == "strict",
            m.c.key.is_not(None),
            sa.not_(_Acked(o.c.acked_above, m.c.seq)),
        )
        .group_by(o.c.queue, o.c.group_name, o.c.partition, m.c.key)
        .subquery("held")
    )
    queue, group, partition, key, seq = held.c
    offsets = sa.and_(o.c.queue == queue, o.c.group_name == group, o.c.partition == partition)
    waiting_since = (
        sa.select(w.c.publish_time)
        .where(
            w.c.queue == queue,
            w.c.partition == partition,
            w.c.key == key,
            w.c.seq > seq,
            sa.not_(_Acked(o.c.acked_above, w.c.seq)),
        )
        .order_by(w.c.seq)
        .limit(1)
        .scalar_subquery()
    )
    delivered = sa.func.coalesce(d.c.first_delivery_time, head.c.publish_time)
    holds = (
        sa.select(
            queue,
            group,
            partition,
            key,
            head.c.message_id,
            sa.func.coalesce(d.c.delivery_count, 1).label("attempts"),
            delivered.label("delivered"),
            waiting_since.label("waiting_since"),
        )
        .select_from(held)
        .join(o, offsets)
        .join(
            head, sa.and_(head.c.queue == queue, head.c.partition == partition, head.c.seq == seq)
        )
        .outerjoin(
            d,
            sa.and_(
                d.c.queue == queue,
                d.c.group_name == group,
                d.c.partition == partition,
                d.c.seq == seq,
            ),
        )
        .where(
            # A retrying head shows as 'retry'.
            sa.or_(d.c.seq.is_(None), sa.and_(d.c.delivery_count < 2, d.c.redeliver_at.is_(None))),
            ~sa.exists().where(
                k.c.queue == queue,
                k.c.group_name == group,
                k.c.partition == partition,
                k.c.key == key,
            ),
        )
        .subquery("holds")
    )
    h = holds.c
    return sa.select(
        h.queue,
        h.group_name,
        h.partition,
        h.key,
        sa.literal("strict"),
        sa.cast(sa.null(), sa.String),
        h.message_id,
        h.attempts,
        sa.cast(sa.null(), sa.Integer),
        sa.case((h.waiting_since > h.delivered, h.waiting_since), else_=h.delivered),
    ).where(h.waiting_since.is_not(None))


def _key_status() -> sa.Select[Any]:
    """Keys that are not simply flowing: parked (kg_parked_keys), retrying (an unsettled
    message of the key failed a delivery, kg_deliveries), held by strict order behind an
    unacked message, and partitions in a handoff (key NULL: the keys the old owner holds
    wait)."""
    k, d, a = kg_parked_keys, kg_deliveries, kg_partition_assignments
    m = kg_messages.alias("m")

    def null(kind: Any) -> sa.ColumnElement[Any]:
        return sa.cast(sa.null(), kind)

    parked = sa.select(
        k.c.queue,
        k.c.group_name,
        k.c.partition,
        k.c.key,
        sa.literal("parked").label("reason"),
        k.c.reason.label("detail"),
        k.c.message_id,
        null(sa.Integer).label("attempts"),
        null(sa.Integer).label("messages"),
        k.c.since.label("blocked_since"),
    )
    retrying = (
        sa.select(
            d.c.queue,
            d.c.group_name,
            d.c.partition,
            m.c.key,
            sa.literal("retry"),
            null(sa.String),
            sa.func.min(m.c.message_id),
            sa.func.max(d.c.delivery_count),
            sa.func.count(),
            sa.func.min(d.c.first_delivery_time),
        )
        .select_from(d)
        .join(
            m,
            sa.and_(m.c.queue == d.c.queue, m.c.partition == d.c.partition, m.c.seq == d.c.seq),
        )
        .where(sa.or_(d.c.delivery_count >= 2, d.c.redeliver_at.is_not(None)), m.c.key.is_not(None))
        .group_by(d.c.queue, d.c.group_name, d.c.partition, m.c.key)
    )
    handoff = sa.select(
        a.c.queue,
        a.c.group_name,
        a.c.partition,
        null(sa.String),
        sa.literal("handoff"),
        a.c.flow_id,
        null(sa.String),
        null(sa.Integer),
        null(sa.Integer),
        a.c.handoff_since,
    ).where(a.c.state == "paused")
    union = sa.union_all(parked, retrying, _strict_holds(), handoff)
    return sa.select(union.subquery("key_status"))


# Creation order: a view may read the views before it.
VIEWS: Final[tuple[tuple[str, sa.Select[Any]], ...]] = (
    ("kg_partition_status", _partition_status()),
    ("kg_group_lag", _group_lag()),
    ("kg_queue_stats", _queue_stats()),
    ("kg_key_status", _key_status()),
)


def create_views(bind: sa.Connection) -> None:
    """Create every view (tables must exist). Used by metadata.create_all and storage.migrate."""
    for name, select in VIEWS:
        bind.execute(CreateView(name, select))


def drop_views(bind: sa.Connection) -> None:
    for name, _ in reversed(VIEWS):
        bind.execute(DropView(name))


@sa.event.listens_for(metadata, "after_create")
def _after_create(target: sa.MetaData, connection: sa.Connection, **kw: Any) -> None:
    create_views(connection)


@sa.event.listens_for(metadata, "before_drop")
def _before_drop(target: sa.MetaData, connection: sa.Connection, **kw: Any) -> None:
    drop_views(connection)
