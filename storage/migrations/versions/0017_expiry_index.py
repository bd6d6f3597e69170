"""An index for the expiry sweep: kg_messages(queue, expire_at) where expire_at is set.

The retention job looks for expired messages every ``retention_interval`` (5 s) on the
writer's connection. With no index it read the whole of kg_messages each time, holding
SQLite's write lock meanwhile: with millions of messages stored, appends stalled for
seconds at every sweep and a gateway could not renew its lease (it stopped itself
at about 3 million 1 KiB messages on a loaded machine).

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-23 12:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

_SET = sa.text("expire_at IS NOT NULL")


def upgrade() -> None:
    op.create_index(
        "ix_kg_messages_expire_at",
        "kg_messages",
        ["queue", "expire_at"],
        sqlite_where=_SET,
        postgresql_where=_SET,
    )


def downgrade() -> None:
    op.drop_index("ix_kg_messages_expire_at", table_name="kg_messages")
