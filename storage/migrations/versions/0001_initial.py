"""Initial schema: every kg_ table (views are recreated by storage.migrate after upgrades).

Revision ID: 0001
Revises:
Create Date: 2026-11-21 02:43:31.107119
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

from storage.views import drop_views

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('kg_dedup',
    sa.Column('queue', sa.String(length=200), nullable=False),
    sa.Column('producer', sa.String(length=500), nullable=False),
    sa.Column('dedup_id', sa.String(length=500), nullable=False),
    sa.Column('message_id', sa.String(length=64), nullable=False),
    sa.Column('partition', sa.Integer(), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('expires_at', sa.Double(), nullable=False),
    sa.PrimaryKeyConstraint('queue', 'producer', 'dedup_id')
    )
    op.create_index('ix_kg_dedup_expires_at', 'kg_dedup', ['expires_at'], unique=False)

    op.create_table('kg_deliveries',
    sa.Column('queue', sa.String(length=200), nullable=False),
    sa.Column('group_name', sa.String(length=200), nullable=False),
    sa.Column('partition', sa.Integer(), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('delivery_count', sa.Integer(), nullable=False),
    sa.Column('first_delivery_time', sa.Double(), nullable=True),
    sa.PrimaryKeyConstraint('queue', 'group_name', 'partition', 'seq')
    )
    op.create_table('kg_flows',
    sa.Column('flow_id', sa.String(length=64), nullable=False),
    sa.Column('queue', sa.String(length=200), nullable=False),
    sa.Column('group_name', sa.String(length=200), nullable=False),
    sa.Column('client', sa.String(length=500), nullable=False),
    sa.Column('state', sa.String(length=20), nullable=False),
    sa.Column('window_size', sa.Integer(), nullable=False),
    sa.Column('ack_mode', sa.String(length=20), nullable=True),
    sa.Column('pending', sa.Integer(), nullable=False),
    sa.Column('bound_at', sa.Double(), nullable=False),
    sa.Column('last_seen', sa.Double(), nullable=False),
    sa.PrimaryKeyConstraint('flow_id')
    )
    op.create_index('ix_kg_flows_group', 'kg_flows', ['queue', 'group_name'], unique=False)

    op.create_table('kg_gateway_lease',
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('holder', sa.String(length=500), nullable=False),
    sa.Column('expires_at', sa.Double(), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('kg_group_offsets',
    sa.Column('queue', sa.String(length=200), nullable=False),
    sa.Column('group_name', sa.String(length=200), nullable=False),
    sa.Column('partition', sa.Integer(), nullable=False),
    sa.Column('committed_seq', sa.BigInteger(), nullable=False),
    sa.Column('acked_above', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('acked_count', sa.BigInteger(), nullable=False),
    sa.Column('dispatched_seq', sa.BigInteger(), nullable=False),
    sa.Column('updated_at', sa.Double(), nullable=False),
    sa.PrimaryKeyConstraint('queue', 'group_name', 'partition')
    )
    op.create_table('kg_groups',
    sa.Column('queue', sa.String(length=200), nullable=False),
    sa.Column('group_name', sa.String(length=200), nullable=False),
    sa.Column('mode', sa.String(length=20), nullable=False),
    sa.Column('key_order', sa.String(length=20), nullable=False),
    sa.Column('start_position', sa.String(length=20), nullable=False),
    sa.Column('tags', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('ack_timeout', sa.Double(), nullable=True),
    sa.Column('created_at', sa.Double(), nullable=False),
    sa.Column('lease_kind', sa.String(length=20), nullable=True),
    sa.Column('lease_owner', sa.String(length=500), nullable=True),
    sa.Column('lease_expires', sa.Double(), nullable=True),
    sa.PrimaryKeyConstraint('queue', 'group_name')
    )
    op.create_table('kg_messages',
    sa.Column('queue', sa.String(length=200), nullable=False),
    sa.Column('partition', sa.Integer(), nullable=False),
    sa.Column('seq', sa.BigInteger(), nullable=False),
    sa.Column('message_id', sa.String(length=64), nullable=False),
    sa.Column('key', sa.String(length=1000), nullable=True),
    sa.Column('payload', sa.LargeBinary(), nullable=False),
    sa.Column('properties', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('topic', sa.String(length=1000), nullable=True),
    sa.Column('publish_time', sa.Double(), nullable=False),
    sa.Column('deliver_at', sa.Double(), nullable=True),
    sa.Column('expire_at', sa.Double(), nullable=True),
    sa.Column('producer', sa.String(length=500), nullable=True),
    sa.Column('dedup_id', sa.String(length=500), nullable=True),
    sa.Column('content_type', sa.String(length=200), nullable=True),
    sa.Column('correlation_id', sa.String(length=500), nullable=True),
    sa.Column('reply_to', sa.String(length=1000), nullable=True),
    sa.Column('size', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('queue', 'partition', 'seq')
    )
    op.create_table('kg_partition_assignments',
    sa.Column('queue', sa.String(length=200), nullable=False),
    sa.Column('group_name', sa.String(length=200), nullable=False),
    sa.Column('partition', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=20), nullable=False),
    sa.Column('flow_id', sa.String(length=64), nullable=True),
    sa.Column('updated_at', sa.Double(), nullable=False),
    sa.PrimaryKeyConstraint('queue', 'group_name', 'partition')
    )
    op.create_table('kg_partitions',
    sa.Column('queue', sa.String(length=200), nullable=False),
    sa.Column('partition', sa.Integer(), nullable=False),
    sa.Column('head_seq', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('queue', 'partition')
    )
    op.create_table('kg_queues',
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('partitions', sa.Integer(), nullable=False),
    sa.Column('max_message_size', sa.Integer(), nullable=False),
    sa.Column('max_depth_messages', sa.BigInteger(), nullable=True),
    sa.Column('max_depth_bytes', sa.BigInteger(), nullable=True),
    sa.Column('ttl', sa.Double(), nullable=True),
    sa.Column('max_deliveries', sa.Integer(), nullable=False),
    sa.Column('backoff_initial', sa.Double(), nullable=False),
    sa.Column('backoff_multiplier', sa.Double(), nullable=False),
    sa.Column('backoff_max', sa.Double(), nullable=False),
    sa.Column('dead_letter_queue', sa.String(length=200), nullable=True),
    sa.Column('rebalance_delay', sa.Double(), nullable=False),
    sa.Column('max_handoff_time', sa.Double(), nullable=False),
    sa.Column('window_size', sa.Integer(), nullable=False),
    sa.Column('dedup_window', sa.Double(), nullable=False),
    sa.Column('key_from', sa.String(length=50), nullable=True),
    sa.Column('dead_letter_expired', sa.Boolean(), nullable=False),
    sa.Column('created_at', sa.Double(), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('kg_subscriptions',
    sa.Column('queue', sa.String(length=200), nullable=False),
    sa.Column('pattern', sa.String(length=1000), nullable=False),
    sa.PrimaryKeyConstraint('queue', 'pattern')
    )


def downgrade() -> None:
    drop_views(op.get_bind())
    op.drop_table('kg_subscriptions')
    op.drop_table('kg_queues')
    op.drop_table('kg_partitions')
    op.drop_table('kg_partition_assignments')
    op.drop_table('kg_messages')
    op.drop_table('kg_groups')
    op.drop_table('kg_group_offsets')
    op.drop_table('kg_gateway_lease')
    op.drop_index('ix_kg_flows_group', table_name='kg_flows')

    op.drop_table('kg_flows')
    op.drop_table('kg_deliveries')
    op.drop_index('ix_kg_dedup_expires_at', table_name='kg_dedup')

    op.drop_table('kg_dedup')
