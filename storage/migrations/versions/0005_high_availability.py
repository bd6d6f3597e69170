"""High availability: kg_gateway_lease.epoch (the fencing token of the active gateway),
protocol state kept in SQL (kg_amqp_exchanges, kg_mqtt_sessions) and, on PostgreSQL, the
kg_heads notification of other writers' appends.

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


# Other writers' appends (Spark, tools) notify the active gateway, which reads the heads at
# once instead of at its next poll; the gateway's own sessions (application_name
# keygate-gateway) do not notify: NOTIFY serialises commits.
_NOTIFY_FUNCTION = """
CREATE FUNCTION kg_notify_heads() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.head_seq > OLD.head_seq
       AND current_setting('application_name', true) IS DISTINCT FROM 'keygate-gateway' THEN
        PERFORM pg_notify('kg_heads', NEW.queue);
    END IF;
    RETURN NULL;
END $$
"""
_NOTIFY_TRIGGER = """
CREATE TRIGGER kg_partitions_notify AFTER UPDATE OF head_seq ON kg_partitions
FOR EACH ROW EXECUTE FUNCTION kg_notify_heads()
"""


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
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_NOTIFY_FUNCTION)
        op.execute(_NOTIFY_TRIGGER)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER kg_partitions_notify ON kg_partitions")
        op.execute("DROP FUNCTION kg_notify_heads()")
    op.drop_table("kg_mqtt_sessions")
    op.drop_table("kg_amqp_exchanges")
    # Views read kg_ tables; storage.migrate recreates them after any upgrade or downgrade.
    with op.batch_alter_table("kg_gateway_lease") as batch:
        batch.drop_column("epoch")
