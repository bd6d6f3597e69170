"""Apply keygate's Alembic migrations (shipped in ``storage/migrations``) to a database.

Tables come from the migration scripts; the views (storage.views.VIEWS) are derived
objects, dropped and recreated after every upgrade to head so they always match the code.

How it works, beside other gateways (docs/operations.md, "Upgrades"): the schema is
changed only while no other gateway holds a live gateway lease (``kg_gateway_lease``:
columns name, holder and expires_at, present at every revision). Everything happens in one
transaction, which on PostgreSQL first takes an advisory lock, so two starting gateways
run it one after the other:

1. The revision in ``alembic_version`` must be one of ours; a newer keygate's is refused
   (SchemaTooNew), nothing changed.
2. If another holder's lease is live, nothing is changed: a caller that would change the
   schema, or a gateway (``claim``), gets SchemaBusy and waits as a standby; a tool
   opening the store of an up-to-date database beside a live gateway just goes on (the
   views are left as they are).
3. Otherwise the lease table is locked (PostgreSQL: EXCLUSIVE, which plain reads pass but
   a renewal or a fenced write of the gateway whose lease lapsed waits for; SQLite's
   BEGIN IMMEDIATE already excludes every writer), the leases are read again, the schema
   is upgraded and the views recreated, and a gateway takes its lease (``claim``) in the
   same transaction: the old gateway, if it is still running, finds the lease taken at
   its next renewal and stops, and never writes to the changed schema.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from core.errors import SchemaBusy, SchemaTooNew
from storage.engine import sync_engine
from storage.fence import database_now
from storage.schema import kg_gateway_lease
from storage.views import create_views, drop_views

__all__ = ["SCRIPT_LOCATION", "LeaseClaim", "alembic_config", "migrate", "migrate_sync"]

SCRIPT_LOCATION: Final = "storage:migrations"
# pg_advisory_xact_lock key: "keygate" in ASCII, as a bigint.
_MIGRATION_LOCK: Final = 0x6B657967617465
# How long the lease table's lock waits for a lapsed gateway's last transaction.
_LEASE_LOCK_TIMEOUT: Final = "1000ms"
_LOCK_NOT_AVAILABLE: Final = "55P03"
# The lease columns every revision has (the epoch came with 0005).
_ANY_REVISION_LEASE: Final = sa.table(
    "kg_gateway_lease", sa.column("name"), sa.column("holder"), sa.column("expires_at")
)


@dataclass(frozen=True, slots=True)
class LeaseClaim:
    """The gateway lease a starting gateway takes in the migration's transaction."""

    name: str
    holder: str
    # Seconds of the database's clock the lease is taken for.
    ttl: float


def alembic_config(connection: sa.Connection | None = None) -> Config:
    """An Alembic config for keygate's scripts, bound to ``connection`` when given."""
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@functools.cache
def _scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def migrate_sync(url: str, revision: str = "head", *, claim: LeaseClaim | None = None) -> None:
    """Upgrade the database at ``url`` to ``revision`` (blocking) unless another gateway's
    lease is live (SchemaBusy); with ``claim``, also take that gateway lease. SchemaTooNew
    if a newer keygate migrated the database."""
    if claim is not None and revision != "head":
        raise ValueError("a gateway claims its lease only with the schema at head")
    engine = sync_engine(url)
    try:
        with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(sa.select(sa.func.pg_advisory_xact_lock(_MIGRATION_LOCK)))
            _migrate(connection, revision, claim)
    finally:
        engine.dispose()


async def migrate(url: str, revision: str = "head", *, claim: LeaseClaim | None = None) -> None:
    """``migrate_sync`` without blocking the event loop."""
    await asyncio.to_thread(migrate_sync, url, revision, claim=claim)


def _migrate(conn: sa.Connection, revision: str, claim: LeaseClaim | None) -> None:
    current = MigrationContext.configure(conn).get_current_heads()
    scripts = _scripts()
    heads = scripts.get_heads()
    known = {script.revision for script in scripts.walk_revisions()}
    newer = sorted(set(current) - known)
    if newer:
        raise SchemaTooNew(
            f"the database's schema is at revision {', '.join(newer)}, newer than this "
            f"keygate knows (its newest is {', '.join(heads)}): a newer keygate migrated "
            "it; run that version or a later one. Nothing was changed."
        )
    target = tuple(heads) if revision == "head" else (revision,)
    behind = set(current) != set(target)
    holder = claim.holder if claim is not None else None
    if (live := _live_leases(conn, holder)) and not behind and claim is None:
        return
    if not live and _has_leases(conn):
        live = _lock_leases(conn, holder)
    if live:
        raise SchemaBusy(_busy(live, current, target, behind))
    command.upgrade(alembic_config(conn), revision)
    if revision == "head":
        drop_views(conn)
        create_views(conn)
    if claim is not None:
        _take(conn, claim)


def _has_leases(conn: sa.Connection) -> bool:
    return sa.inspect(conn).has_table("kg_gateway_lease")


def _live_leases(conn: sa.Connection, holder: str | None) -> list[tuple[str, str]]:
    """(name, holder) of every unexpired lease not ``holder``'s, by the database's clock
    (a gateway before epochs wrote its host's clock: hosts of a pair keep time in sync)."""
    if not _has_leases(conn):
        return []
    lease = _ANY_REVISION_LEASE
    query = sa.select(lease.c.name, lease.c.holder).where(
        lease.c.expires_at > database_now(conn.dialect.name)
    )
    if holder is not None:
        query = query.where(lease.c.holder != holder)
    return [(row.name, row.holder) for row in conn.execute(query.order_by(lease.c.name))]


def _lock_leases(conn: sa.Connection, holder: str | None) -> list[tuple[str, str]]:
    """Lock the lease table until the transaction ends and read the live leases again."""
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{_LEASE_LOCK_TIMEOUT}'")
        try:
            conn.exec_driver_sql("LOCK TABLE kg_gateway_lease IN EXCLUSIVE MODE")
        except sa.exc.OperationalError as e:
            if getattr(e.orig, "sqlstate", None) != _LOCK_NOT_AVAILABLE:
                raise
            raise SchemaBusy(
                "taking the gateway lease failed: another gateway's transaction holds its "
                f"row (waited {_LEASE_LOCK_TIMEOUT})"
            ) from e
        # The migration itself waits for its locks as long as it must.
        conn.exec_driver_sql("SET LOCAL lock_timeout TO DEFAULT")
    return _live_leases(conn, holder)


def _take(conn: sa.Connection, claim: LeaseClaim) -> None:
    """Take the lease ``claim.name`` (free or lapsed: _live_leases said so under the lock)
    for ``claim.holder``; a takeover increments the epoch, as LeaseOps does."""
    lease = kg_gateway_lease
    expires = database_now(conn.dialect.name) + claim.ttl
    taken = conn.execute(
        sa.update(lease)
        .where(lease.c.name == claim.name)
        .values(holder=claim.holder, epoch=lease.c.epoch + 1, expires_at=expires)
    )
    if taken.rowcount == 0:
        conn.execute(
            sa.insert(lease).values(
                name=claim.name, holder=claim.holder, epoch=1, expires_at=expires
            )
        )


def _busy(
    live: list[tuple[str, str]], current: Sequence[str], target: Sequence[str], behind: bool
) -> str:
    held = ", ".join(f"gateway {holder!r} holds the lease {name!r}" for name, holder in live)
    if not behind:
        return held
    return (
        f"{held}, and the schema (revision {', '.join(current) or 'none'}) needs migrating "
        f"to {', '.join(target)}: it is not changed while another gateway is live, but by "
        "the gateway that takes the lease over (docs/operations.md, Upgrades)"
    )
