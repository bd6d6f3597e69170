"""kg_deliveries.redeliver_at: when a nacked message is due again.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 03:55:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("kg_deliveries", sa.Column("redeliver_at", sa.Double(), nullable=True))


def downgrade() -> None:
    # Views read kg_ tables; storage.migrate recreates them after any upgrade or downgrade.
    with op.batch_alter_table("kg_deliveries") as batch:
        batch.drop_column("redeliver_at")
