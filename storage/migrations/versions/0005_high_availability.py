"""High availability: kg_gateway_lease.epoch (the fencing token of the active gateway),
and protocol state kept in SQL: kg_amqp_exchanges, kg_mqtt_sessions.

Revision ID: 0005
Revises: 0002
Create Date: 2026-11-22 21:15:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "kg_gateway_lease",
        sa.Column("epoch", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
    )
    op.create_table(
        "kg_amqp_exchanges",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("type", sa.String(length=20), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "kg_mqtt_sessions",
        sa.Column("client_id", sa.String(length=500), nullable=False),
        sa.Column("qos2_waiting", sa.Text(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=True),
        sa.PrimaryKeyConstraint("client_id"),
    )


def downgrade() -> None:
    op.drop_table("kg_mqtt_sessions")
    op.drop_table("kg_amqp_exchanges")
    # Views read kg_ tables; storage.migrate recreates them after any upgrade or downgrade.
    with op.batch_alter_table("kg_gateway_lease") as batch:
        batch.drop_column("epoch")
