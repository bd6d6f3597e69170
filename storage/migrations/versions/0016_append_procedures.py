"""PostgreSQL procedures that let an append run in one round trip: ``kg_fence`` (the gateway
lease check, renewing it when asked) and ``kg_advance_heads`` (move partition heads only
from the values the gateway expects). Both raise instead of returning a result, so the
gateway can queue them with the INSERT and the COMMIT in one psycopg pipeline
(storage/writer.py, storage/store.py) and still roll back when either check fails.

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-23 12:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

# SQLSTATEs of our own (class "KG"): StoreBase._driver_error maps them back to errors.
_FENCE = """
CREATE PROCEDURE kg_fence(lease_name text, lease_holder text, lease_epoch bigint,
                          renew_ttl double precision)
LANGUAGE plpgsql AS $$
BEGIN
    IF renew_ttl IS NULL THEN
        -- FOR SHARE: a takeover (an UPDATE of the row) waits until this transaction ends.
        PERFORM 1 FROM kg_gateway_lease
        WHERE name = lease_name AND holder = lease_holder AND epoch = lease_epoch
        FOR SHARE;
    ELSE
        UPDATE kg_gateway_lease
        SET expires_at = extract(epoch FROM clock_timestamp()) + renew_ttl
        WHERE name = lease_name AND holder = lease_holder AND epoch = lease_epoch;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'gateway lease % is no longer held by % with epoch %',
            lease_name, lease_holder, lease_epoch USING ERRCODE = 'KG001';
    END IF;
END $$
"""
_ADVANCE_HEADS = """
CREATE PROCEDURE kg_advance_heads(queues text[], partitions integer[], olds bigint[],
                                  news bigint[])
LANGUAGE plpgsql AS $$
DECLARE
    moved integer;
BEGIN
    UPDATE kg_partitions AS p SET head_seq = v.new
    FROM unnest(queues, partitions, olds, news) AS v(queue, partition, old, new)
    WHERE p.queue = v.queue AND p.partition = v.partition AND p.head_seq = v.old;
    GET DIAGNOSTICS moved = ROW_COUNT;
    IF moved <> cardinality(queues) THEN
        RAISE EXCEPTION 'partition heads moved under the gateway' USING ERRCODE = 'KG002';
    END IF;
END $$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_FENCE)
        op.execute(_ADVANCE_HEADS)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP PROCEDURE kg_advance_heads(text[], integer[], bigint[], bigint[])")
        op.execute("DROP PROCEDURE kg_fence(text, text, bigint, double precision)")
