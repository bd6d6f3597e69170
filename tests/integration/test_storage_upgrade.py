"""Upgrading the schema beside a live gateway (docs/operations.md, "Upgrades").

A gateway changes the schema only while no other gateway holds a live gateway lease: a
new version started beside an older active one waits as a standby without migrating, and
migrates in the transaction that takes the lease over. A database migrated by a newer
keygate is refused, saying so. "Older" is simulated by migrating to revision 0002 (the
schema of keygate before high availability's epoch) and writing the lease row the way
that version did.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import sqlalchemy as sa
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from core.errors import SchemaBusy, SchemaTooNew
from storage import LeaseClaim, migrate_sync, open_store, sync_engine
from storage.migrate import alembic_config
from tests.integration.conftest import start_gateway
from tests.support.wait import eventually

OLD_REVISION = "0002"
_lease = sa.table(
    "kg_gateway_lease", sa.column("name"), sa.column("holder"), sa.column("expires_at")
)


def _head() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def _revision(url: str) -> str | None:
    engine = sync_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def _execute(url: str, statement: sa.Executable) -> list[sa.Row[tuple[object, ...]]]:
    engine = sync_engine(url)
    try:
        with engine.begin() as conn:
            result = conn.execute(statement)
            return list(result.all()) if result.returns_rows else []
    finally:
        engine.dispose()


def _old_gateway_active(url: str, *, expires_in: float, holder: str = "old-gateway") -> None:
    """The schema of an older keygate, whose active gateway holds the lease (it wrote
    ``expires_at`` from its host's clock, as keygate before epochs did)."""
    migrate_sync(url, OLD_REVISION)
    row = {"name": "keygate", "holder": holder, "expires_at": time.time() + expires_in}
    _execute(url, sa.insert(_lease).values(row))


async def test_a_gateway_waits_as_standby_without_migrating_while_an_older_one_is_active(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    _old_gateway_active(db_url, expires_in=3600)
    caplog.set_level(logging.INFO, logger="keygate.server")
    starting = asyncio.create_task(start_gateway(db_url, lease_ttl=0.6))
    try:
        await eventually(lambda: "standby" in caplog.text)
        # Several polls later it still has not touched the schema.
        await asyncio.sleep(1.0)
        assert not starting.done()
        assert _revision(db_url) == OLD_REVISION
        # The old gateway stops: its release deleted the row.
        _execute(db_url, sa.delete(_lease))
        gateway = await asyncio.wait_for(starting, 30)
    except BaseException:
        starting.cancel()
        raise
    try:
        assert _revision(db_url) == _head()
        holders = _execute(db_url, sa.select(_lease.c.holder))
        assert holders == [(gateway.holder,)]
    finally:
        await gateway.stop()


async def test_a_lapsed_lease_of_an_older_gateway_is_taken_over_with_the_migration(
    db_url: str,
) -> None:
    _old_gateway_active(db_url, expires_in=-1)
    gateway = await start_gateway(db_url, lease_ttl=5)
    try:
        assert _revision(db_url) == _head()
        lease = sa.table("kg_gateway_lease", sa.column("holder"), sa.column("epoch"))
        [(holder, epoch)] = _execute(db_url, sa.select(lease.c.holder, lease.c.epoch))
        assert holder == gateway.holder
        assert epoch >= 1
    finally:
        await gateway.stop()


async def test_opening_a_store_refuses_to_migrate_while_a_gateway_holds_the_lease(
    db_url: str,
) -> None:
    _old_gateway_active(db_url, expires_in=3600, holder="host-a:123:abcd")
    with pytest.raises(SchemaBusy, match="host-a:123:abcd"):
        await open_store(db_url)
    assert _revision(db_url) == OLD_REVISION


async def test_opening_a_store_beside_an_active_gateway_of_this_version_changes_nothing(
    postgres_url: str,
) -> None:
    migrate_sync(postgres_url)
    row = {"name": "keygate", "holder": "active", "expires_at": time.time() + 3600}
    _execute(postgres_url, sa.insert(_lease).values(row))
    view = sa.text("SELECT 'kg_queue_stats'::regclass::oid")
    before = _execute(postgres_url, view)
    store = await open_store(postgres_url)
    await store.close()
    # The views were not dropped and created again under the active gateway's reads.
    assert _execute(postgres_url, view) == before


async def test_a_database_migrated_by_a_newer_keygate_is_refused_saying_so(db_url: str) -> None:
    migrate_sync(db_url)
    version = sa.table("alembic_version", sa.column("version_num"))
    _execute(db_url, sa.update(version).values(version_num="9999"))
    with pytest.raises(SchemaTooNew, match=r"9999.*newer"):
        await open_store(db_url)
    assert _revision(db_url) == "9999"


async def test_a_lease_taken_with_the_migration_is_renewed_when_the_gateway_becomes_active(
    db_url: str,
) -> None:
    # The claim's expiry runs from the migration; the gateway's renewals count from when it
    # became active, after loading its caches: that is when the lease must be renewed.
    migrate_sync(db_url, claim=LeaseClaim("keygate", "me", ttl=1.0))
    [(claimed,)] = _execute(db_url, sa.select(_lease.c.expires_at))
    store = await open_store(db_url)
    try:
        assert await store.acquire_gateway_lease("keygate", "me", ttl=60.0) == 1
    finally:
        await store.close()
    [(expires,)] = _execute(db_url, sa.select(_lease.c.expires_at))
    assert expires > claimed + 50
