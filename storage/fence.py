"""The gateway lease's fence: the statement every write transaction of the active gateway
starts with, proving in the database that the lease (``kg_gateway_lease``) is still its own.

The proof comes in two strengths. The plain one reads the row; on PostgreSQL it holds it
FOR SHARE, so a takeover (an UPDATE of the row) waits until the transaction ends and
nothing it writes can commit after another gateway became active; SQLite's BEGIN
IMMEDIATE already excludes every other writer for the whole transaction. The renewing one
also pushes the expiry on (an UPDATE, which makes a takeover wait the same way): the
store's writes renew the lease at most every ``ttl / 3`` (StoreBase.write).

On PostgreSQL both are the procedure ``kg_fence`` (migration 0016), which raises SQLSTATE
KG001 instead of returning a result: a statement that answers nothing can be queued with
the rest of an append in one pipeline (WriterThread.run) and still abort it. On SQLite
they are plain statements whose result is checked here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Final

import sqlalchemy as sa

from storage.schema import kg_gateway_lease

__all__ = [
    "LEASE_HELD_SQLITE",
    "LEASE_TAKEN_SQLSTATE",
    "GatewayLease",
    "LeaseTaken",
    "database_now",
    "prove",
]

# kg_fence's SQLSTATE when the lease is no longer held (migration 0016).
LEASE_TAKEN_SQLSTATE: Final = "KG001"

_lease = kg_gateway_lease
_LEASE_IS = (
    _lease.c.name == sa.bindparam("b_name"),
    _lease.c.holder == sa.bindparam("b_holder"),
    _lease.c.epoch == sa.bindparam("b_epoch"),
)
_HELD = sa.select(_lease.c.epoch).where(*_LEASE_IS)
_CALL_FENCE = sa.text("CALL kg_fence(:b_name, :b_holder, :b_epoch, :b_ttl)")
# The lease as a condition of another SQLite statement (parameters: name, holder, epoch):
# the statement changes nothing once the lease is taken, which its row count shows.
LEASE_HELD_SQLITE: Final = (
    "EXISTS (SELECT 1 FROM kg_gateway_lease WHERE name = ? AND holder = ? AND epoch = ?)"
)


@dataclass(frozen=True, slots=True)
class GatewayLease:
    """The gateway lease a store's writes are fenced with: ``epoch`` is the token."""

    name: str
    holder: str
    epoch: int
    # How long a renewal keeps it, in seconds of the database's clock.
    ttl: float


class LeaseTaken(Exception):
    """Raised inside a transaction (possibly on the writer thread) that found the gateway
    lease taken over; the store turns it into Fenced on the event loop."""


def prove(conn: sa.Connection, lease: GatewayLease, *, renew: bool) -> None:
    """Prove, as a statement of ``conn``'s transaction, that ``lease`` is still held, and
    renew it when ``renew``. LeaseTaken (SQLite) or a KG001 database error (PostgreSQL,
    possibly only when a pipeline syncs: StoreBase._driver_error) if it is not."""
    params = {"b_name": lease.name, "b_holder": lease.holder, "b_epoch": lease.epoch}
    if conn.dialect.name == "postgresql":
        conn.execute(_CALL_FENCE, {**params, "b_ttl": lease.ttl if renew else None})
        return
    if renew:
        held = conn.execute(_renewal(conn.dialect.name), {**params, "b_ttl": lease.ttl}).rowcount
    else:
        held = len(conn.execute(_HELD, params).all())
    if held != 1:
        raise LeaseTaken


def database_now(dialect: str) -> sa.ColumnElement[float]:
    """The database server's clock in Unix seconds, as a SQL expression."""
    if dialect == "postgresql":
        return sa.cast(sa.func.extract("epoch", sa.func.clock_timestamp()), sa.Double)
    return (sa.func.julianday("now") - 2440587.5) * 86400.0


@functools.cache
def _renewal(dialect: str) -> sa.Update:
    """UPDATE our lease row (name, holder, epoch) to expire ``ttl`` seconds from now."""
    expires = database_now(dialect) + sa.bindparam("b_ttl", type_=sa.Double)
    return sa.update(_lease).where(*_LEASE_IS).values(expires_at=expires)
