"""kg_gateway_lease.epoch: the fencing token of the active gateway.

Revision ID: 0005
Revises: 0011
Create Date: 2026-11-22 21:15:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "kg_gateway_lease",
        sa.Column("epoch", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
    )


def downgrade() -> None:
    # Views read kg_ tables; storage.migrate recreates them after any upgrade or downgrade.
    with op.batch_alter_table("kg_gateway_lease") as batch:
        batch.drop_column("epoch")
