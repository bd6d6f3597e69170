"""An index of the large messages: kg_messages(queue, partition, seq, size) where size > 4096.

A delivery read sizes its pages from the messages its group has seen, so a backlog of
large messages behind small ones was read whole: 60 messages of 4 MiB (240 MiB) in one
read for a group whose buffer budget is 2 MiB. A read now ends a page with the large
message that takes it past what the read reserved (core.actions.fetched), finding
the large messages and their sizes here without reading their rows. Only messages over
core.actions.LARGE_MESSAGE (4096 bytes) have an entry: smaller ones cost appends nothing.

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-28 08:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

# The condition of storage.schema.LARGE_ROWS as this revision made it.
_LARGE = sa.text("size > 4096")


def upgrade() -> None:
    op.create_index(
        "ix_kg_messages_large",
        "kg_messages",
        ["queue", "partition", "seq", "size"],
        sqlite_where=_LARGE,
        postgresql_where=_LARGE,
    )


def downgrade() -> None:
    op.drop_index("ix_kg_messages_large", table_name="kg_messages")
