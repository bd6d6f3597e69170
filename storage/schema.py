"""keygate's SQL schema: the one canonical definition, public (docs/sql.md lists every column).

Tables are SQLAlchemy Core (the inspection views are in storage.views). Times are
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

from core.actions import LARGE_MESSAGE
from core.ingress import MAX_CLIENT_NAME_BYTES, MAX_ID_BYTES, MAX_KEY_BYTES, MAX_TOPIC_BYTES

metadata: Final = sa.MetaData()

# The rows of kg_messages in ix_kg_messages_large; a query must name the same condition
# for either database to use that index.
LARGE_ROWS: Final = sa.text(f"size > {LARGE_MESSAGE}")

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
    # The expiry sweep (SqlStore.retention, every few seconds) finds expired messages here;
    # without it the sweep read the whole table with the write lock held. Partial: most
    # messages have no TTL and cost the index nothing.
    # The large messages (core.actions.LARGE_MESSAGE) with their sizes, so that a delivery
    # read ends its page once they pass what the read reserved (core.actions.fetched)
    # without reading the rows: an entry per large message only.
    sa.Index(
        "ix_kg_messages_large",
        "queue",
        "partition",
        "seq",
        "size",
        sqlite_where=LARGE_ROWS,
        postgresql_where=LARGE_ROWS,
    ),
    sa.Index(
        "ix_kg_messages_expire_at",
        "queue",
        "expire_at",
        sqlite_where=sa.text("expire_at IS NOT NULL"),
        postgresql_where=sa.text("expire_at IS NOT NULL"),
    ),
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
    # dispatched_seq: a low-water mark, every unsettled message at or below it was sent.
    # First deliveries up to reserved_seq may go out without a further commit (DESIGN.md
    # §4; docs/performance.md): recovery counts (dispatched_seq, reserved_seq] as maybe seen.
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
    # While paused: when the keys that wait began to (core.actions.AssignmentChanged).
    sa.Column("handoff_since", Time),
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


__all__ = [
    "JsonType",
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
