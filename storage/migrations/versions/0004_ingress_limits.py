"""Text columns sized for core.ingress's limits: keys and topics up to 4096 bytes, ids
(producer, dedup id, content type, correlation id, reply-to) up to 1024.

Revision ID: 0004
Revises: 0005
Create Date: 2026-11-22 21:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from storage.views import drop_views

revision = "0004"
down_revision = "0005"
branch_labels = None
depends_on = None

# (table, column, old length, new length)
_WIDENED = (
    ("kg_messages", "key", 1000, 4096),
    ("kg_messages", "topic", 1000, 4096),
    ("kg_messages", "producer", 500, 1024),
    ("kg_messages", "dedup_id", 500, 1024),
    ("kg_messages", "content_type", 200, 1024),
    ("kg_messages", "correlation_id", 500, 1024),
    ("kg_messages", "reply_to", 1000, 1024),
    ("kg_dedup", "producer", 500, 1024),
    ("kg_dedup", "dedup_id", 500, 1024),
)


def _alter(new: bool) -> None:
    # PostgreSQL cannot retype a column a view reads; storage.migrate recreates the views.
    drop_views(op.get_bind())
    for table in sorted({table for table, _, _, _ in _WIDENED}):
        # batch mode: SQLite rebuilds the table (it keeps the declared length only as text).
        with op.batch_alter_table(table) as batch:
            for name, column, old_length, new_length in _WIDENED:
                if name == table:
                    batch.alter_column(
                        column,
                        existing_type=sa.String(old_length if new else new_length),
                        type_=sa.String(new_length if new else old_length),
                    )


def upgrade() -> None:
    _alter(new=True)


def downgrade() -> None:
    _alter(new=False)
