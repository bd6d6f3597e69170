"""Dispatch reservations: kg_group_offsets.reserved_seq.

Revision ID: 0015
Revises: 0012
Create Date: 2026-11-23 00:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from storage.views import drop_views

revision = "0015"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "kg_group_offsets",
        sa.Column("reserved_seq", sa.BigInteger(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    # SQLite rebuilds kg_group_offsets to drop a column, which its views would block; they
    # are derived objects that storage.migrate recreates at head.
    drop_views(op.get_bind())
    with op.batch_alter_table("kg_group_offsets") as batch:
        batch.drop_column("reserved_seq")
