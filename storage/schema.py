"""keygate's SQL schema: the one canonical definition, public (docs/sql.md lists every column).

Tables are SQLAlchemy Core; the inspection views are SQLAlchemy selects compiled for the
connected dialect, so the same definition works on SQLite and PostgreSQL. Times are
``DOUBLE PRECISION`` seconds since the Unix epoch (the model's floats, unchanged).
Text columns are sized from core.ingress's limits, which every publication passes before
it is stored, so a row never fails for its length (PostgreSQL enforces VARCHAR(n)).

Ack state is compact (DESIGN.md §4): per (group, partition) a committed seq plus ranges
acked above it (``acked_above``, JSON) and their count (``acked_count``, so the views can
compute lag without parsing JSON). Seqs are contiguous per partition and retention only
deletes at or below the lowest committed seq, so counts are differences of seqs.
``kg_partitions.head_seq`` is the durable last-assigned seq of each partition: it survives
retention deleting every message, so seqs never restart.
"""

from __future__ import annotations

from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import DDLCompiler
from sqlalchemy.sql.ddl import ExecutableDDLElement

from core.ingress import MAX_CLIENT_NAME_BYTES, MAX_ID_BYTES, MAX_KEY_BYTES, MAX_TOPIC_BYTES

metadata: Final = sa.MetaData()

# JSON text on SQLite, JSONB on PostgreSQL (indexable, queryable with ->>).
JsonType: Final = sa.JSON().with_variant(JSONB(), "postgresql")
Seq: Final = sa.BigInteger
Time: Final = sa.Double


def _name(column: str, **kw: Any) -> sa.Column[str]:
    return sa.Column(column, sa.String(200), **kw)


kg_queues: Final = sa.Table(
    "kg_queues",
    metadata,
    _name("name", primary_key=True),
    sa.Column("partitions", sa.Integer, nullable=False),
    sa.Column("max_message_size", sa.Integer, nullable=False),
    sa.Column("max_depth_messages", sa.BigInteger),
    sa.Column("max_depth_bytes", sa.BigInteger),
    sa.Column("ttl", Time),
    sa.Column("max_deliveries", sa.Integer, nullable=False),
    sa.Column("backoff_initial", Time, nullable=False),
    sa.Column("backoff_multiplier", Time, nullable=False),
    sa.Column("backoff_max", Time, nullable=False),
    # NULL = "<name>.dlq", '' = dead letters are dropped (QueueConfig.dead_letter_queue).
    _name("dead_letter_queue"),
    sa.Column("rebalance_delay", Time, nullable=False),
    sa.Column("max_handoff_time", Time, nullable=False),
    sa.Column("window_size", sa.Integer, nullable=False),
    sa.Column("dedup_window", Time, nullable=False),
    sa.Column("key_from", sa.String(50)),
    sa.Column("dead_letter_expired", sa.Boolean, nullable=False),
    # Seconds settled messages are kept after publish (0 = deleted once settled).
    sa.Column("retention", Time, nullable=False, server_default="0"),
    # core.model.DeadLetterPolicy: continue | park_key | dead_letter_key.
    sa.Column("on_dead_letter", sa.String(20), nullable=False, server_default="continue"),
    sa.Column("created_at", Time, nullable=False),
)

kg_subscriptions: Final = sa.Table(
    "kg_subscriptions",
    metadata,
    _name("queue", primary_key=True),
    sa.Column("pattern", sa.String(1000), primary_key=True),
)

kg_partitions: Final = sa.Table(
    "kg_partitions",
    metadata,
    _name("queue", primary_key=True),
    sa.Column("partition", sa.Integer, primary_key=True),
    sa.Column("head_seq", Seq, nullable=False),
)

kg_messages: Final = sa.Table(
    "kg_messages",
    metadata,
    _name("queue", primary_key=True),
    sa.Column("partition", sa.Integer, primary_key=True),
    sa.Column("seq", Seq, primary_key=True),
    sa.Column("message_id", sa.String(64), nullable=False),
    sa.Column("key", sa.String(MAX_KEY_BYTES)),
    sa.Column("payload", sa.LargeBinary, nullable=False),
    # Property values: JSON str/int/float/bool; bytes as {"$b64": "<base64>"}.
    sa.Column("properties", JsonType, nullable=False),
    sa.Column("topic", sa.String(MAX_TOPIC_BYTES)),
    sa.Column("publish_time", Time, nullable=False),
    sa.Column("deliver_at", Time),
    sa.Column("expire_at", Time),
    sa.Column("producer", sa.String(MAX_ID_BYTES)),
    sa.Column("dedup_id", sa.String(MAX_ID_BYTES)),
    sa.Column("content_type", sa.String(MAX_ID_BYTES)),
    sa.Column("correlation_id", sa.String(MAX_ID_BYTES)),
    sa.Column("reply_to", sa.String(MAX_ID_BYTES)),
    sa.Column("size", sa.Integer, nullable=False),
)

kg_groups: Final = sa.Table(
    "kg_groups",
    metadata,
    _name("queue", primary_key=True),
    _name("group_name", primary_key=True),
    sa.Column("mode", sa.String(20), nullable=False),
    sa.Column("key_order", sa.String(20), nullable=False),
    sa.Column("start_position", sa.String(20), nullable=False),
    sa.Column("tags", JsonType),
    sa.Column("ack_timeout", Time),
    sa.Column("created_at", Time, nullable=False),
    # Who consumes the group: 'native' flows through the gateway or a 'spark' job; the
    # other kind is refused while the lease is unexpired (core.errors.GroupLeased).
    sa.Column("lease_kind", sa.String(20)),
    sa.Column("lease_owner", sa.String(500)),
    sa.Column("lease_expires", Time),
)

kg_group_offsets: Final = sa.Table(
    "kg_group_offsets",
    metadata,
    _name("queue", primary_key=True),
    _name("group_name", primary_key=True),
    sa.Column("partition", sa.Integer, primary_key=True),
    sa.Column("committed_seq", Seq, nullable=False),
    # [[lo, hi], ...] inclusive ranges acked above committed_seq; acked_count = their size.
    sa.Column("acked_above", JsonType, nullable=False),
    sa.Column("acked_count", Seq, nullable=False),
    sa.Column("dispatched_seq", Seq, nullable=False),
    # First deliveries up to here may go out without a further commit (DESIGN.md §4;
    # docs/performance.md): recovery counts (dispatched_seq, reserved_seq] as maybe seen.
    sa.Column("reserved_seq", Seq, nullable=False, server_default="0"),
    sa.Column("updated_at", Time, nullable=False),
)

kg_deliveries: Final = sa.Table(
    "kg_deliveries",
    metadata,
    _name("queue", primary_key=True),
    _name("group_name", primary_key=True),
    sa.Column("partition", sa.Integer, primary_key=True),
    sa.Column("seq", Seq, primary_key=True),
    sa.Column("delivery_count", sa.Integer, nullable=False),
    sa.Column("first_delivery_time", Time),
    # When a nacked message is due again (Spark's consume_batch; NULL = at once).
    sa.Column("redeliver_at", Time),
)

# Keys stopped by on_dead_letter = park_key after their message ``message_id`` was
# dead-lettered. Deleting a row releases the key (at the group's next load; the admin API
# and CLI release a running group at once).
kg_parked_keys: Final = sa.Table(
    "kg_parked_keys",
    metadata,
    _name("queue", primary_key=True),
    _name("group_name", primary_key=True),
    sa.Column("partition", sa.Integer, primary_key=True),
    sa.Column("key", sa.String(1000), primary_key=True),
    sa.Column("since", Time, nullable=False),
    sa.Column("message_id", sa.String(64), nullable=False),
    sa.Column("reason", sa.String(50), nullable=False),
)

kg_flows: Final = sa.Table(
    "kg_flows",
    metadata,
    sa.Column("flow_id", sa.String(64), primary_key=True),
    _name("queue", nullable=False),
    _name("group_name", nullable=False),
    sa.Column("client", sa.String(MAX_CLIENT_NAME_BYTES), nullable=False),
    sa.Column("state", sa.String(20), nullable=False),
    sa.Column("window_size", sa.Integer, nullable=False),
    sa.Column("ack_mode", sa.String(20)),
    sa.Column("pending", sa.Integer, nullable=False),
    sa.Column("bound_at", Time, nullable=False),
    sa.Column("last_seen", Time, nullable=False),
    sa.Index("ix_kg_flows_group", "queue", "group_name"),
)

kg_partition_assignments: Final = sa.Table(
    "kg_partition_assignments",
    metadata,
    _name("queue", primary_key=True),
    _name("group_name", primary_key=True),
    sa.Column("partition", sa.Integer, primary_key=True),
    sa.Column("state", sa.String(20), nullable=False),
    sa.Column("flow_id", sa.String(64)),
    sa.Column("updated_at", Time, nullable=False),
)

kg_dedup: Final = sa.Table(
    "kg_dedup",
    metadata,
    _name("queue", primary_key=True),
    sa.Column("producer", sa.String(MAX_ID_BYTES), primary_key=True),
    sa.Column("dedup_id", sa.String(MAX_ID_BYTES), primary_key=True),
    sa.Column("message_id", sa.String(64), nullable=False),
    sa.Column("partition", sa.Integer, nullable=False),
    sa.Column("seq", Seq, nullable=False),
    sa.Column("expires_at", Time, nullable=False),
    sa.Index("ix_kg_dedup_expires_at", "expires_at"),
)

kg_gateway_lease: Final = sa.Table(
    "kg_gateway_lease",
    metadata,
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("holder", sa.String(500), nullable=False),
    sa.Column("expires_at", Time, nullable=False),
    # The fencing token: +1 at every takeover; the holder's writes check it (storage.base).
    sa.Column("epoch", sa.BigInteger, nullable=False, server_default=sa.text("0")),
)

kg_amqp_exchanges: Final = sa.Table(
    "kg_amqp_exchanges",
    metadata,
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("type", sa.String(20), nullable=False),
)

kg_mqtt_sessions: Final = sa.Table(
    "kg_mqtt_sessions",
    metadata,
    sa.Column("client_id", sa.String(500), primary_key=True),
    # QoS 2 packet ids stored and PUBREC'd, waiting for PUBREL: "1,5,9".
    sa.Column("qos2_waiting", sa.Text, nullable=False),
    # NULL while the client is connected; then when the session ends.
    sa.Column("expires_at", Time),
)


# -- views -------------------------------------------------------------------------------


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


def _key_status() -> sa.Select[Any]:
    """Keys that are not simply flowing: parked (kg_parked_keys), retrying (an unsettled
    message of the key failed a delivery, kg_deliveries) and partitions in a handoff (key
    NULL: the keys the old owner holds wait)."""
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
        a.c.updated_at,
    ).where(a.c.state == "paused")
    return sa.select(sa.union_all(parked, retrying, handoff).subquery("key_status"))


# Creation order: a view may read the views before it.
VIEWS: Final[tuple[tuple[str, sa.Select[Any]], ...]] = (
    ("kg_partition_status", _partition_status()),
    ("kg_group_lag", _group_lag()),
    ("kg_queue_stats", _queue_stats()),
    ("kg_key_status", _key_status()),
)


def create_views(bind: sa.Connection) -> None:
    """Create every view (tables must exist). Used by metadata.create_all and migrations."""
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


__all__ = [
    "VIEWS",
    "JsonType",
    "create_views",
    "drop_views",
    "kg_amqp_exchanges",
    "kg_dedup",
    "kg_deliveries",
    "kg_flows",
    "kg_gateway_lease",
    "kg_group_offsets",
    "kg_groups",
    "kg_messages",
    "kg_mqtt_sessions",
    "kg_parked_keys",
    "kg_partition_assignments",
    "kg_partitions",
    "kg_queues",
    "kg_subscriptions",
    "metadata",
]
