"""kg_partition_assignments.handoff_since: when the keys of a paused partition began to wait.

kg_key_status showed a handoff's ``blocked_since`` as the assignment row's
``updated_at``, rewritten at every move: after a chained handoff (A -> B -> C while A
still holds keys) it said the move B -> C, though A's keys had waited since A -> B. The
gateway now writes the start of the oldest handoff still pending; rows written before
are cleared when a gateway becomes active (SqlStore.forget_consumers), so none is left
NULL while paused.

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-28 08:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from storage.views import drop_views

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "kg_partition_assignments", sa.Column("handoff_since", sa.Double(), nullable=True)
    )


def downgrade() -> None:
    # SQLite rebuilds the table to drop a column, which its views would block; they are
    # derived objects that storage.migrate recreates at head.
    drop_views(op.get_bind())
    with op.batch_alter_table("kg_partition_assignments") as batch:
        batch.drop_column("handoff_since")
