"""kg_queues.retention: keep settled messages for a period (replay, browse).

Revision ID: 0011
Revises: 0002
Create Date: 2026-11-22 20:50:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from storage.views import drop_views

revision = "0011"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "kg_queues", sa.Column("retention", sa.Double(), nullable=False, server_default="0")
    )


def downgrade() -> None:
    # SQLite rebuilds kg_queues to drop a column, which its views would block; they are
    # derived objects that storage.migrate recreates at head.
    drop_views(op.get_bind())
    with op.batch_alter_table("kg_queues") as batch:
        batch.drop_column("retention")
