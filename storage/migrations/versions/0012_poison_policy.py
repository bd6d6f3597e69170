"""Per-key poison policy: kg_queues.on_dead_letter and the kg_parked_keys table.

Revision ID: 0012
Revises: 0004
Create Date: 2026-11-22 21:20:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from storage.views import drop_views

revision = "0012"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "kg_queues",
        sa.Column("on_dead_letter", sa.String(20), nullable=False, server_default="continue"),
    )
    op.create_table(
        "kg_parked_keys",
        sa.Column("queue", sa.String(200), primary_key=True),
        sa.Column("group_name", sa.String(200), primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True),
        sa.Column("key", sa.String(1000), primary_key=True),
        sa.Column("since", sa.Double(), nullable=False),
        sa.Column("message_id", sa.String(64), nullable=False),
        sa.Column("reason", sa.String(50), nullable=False),
    )


def downgrade() -> None:
    # SQLite rebuilds kg_queues to drop a column, which its views would block; they are
    # derived objects that storage.migrate recreates at head.
    drop_views(op.get_bind())
    op.drop_table("kg_parked_keys")
    with op.batch_alter_table("kg_queues") as batch:
        batch.drop_column("on_dead_letter")
