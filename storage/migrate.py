"""Apply keygate's Alembic migrations (shipped in ``storage/migrations``) to a database.

Tables come from the migration scripts; the views (storage.views.VIEWS) are derived
objects, dropped and recreated after every upgrade to head so they always match the code.
Two gateways starting against one PostgreSQL serialise on an advisory lock, so the
schema is migrated once.
"""

from __future__ import annotations

import asyncio
from typing import Final

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

from storage.engine import sync_engine
from storage.views import create_views, drop_views

SCRIPT_LOCATION: Final = "storage:migrations"
# pg_advisory_xact_lock key: "keygate" in ASCII, as a bigint.
_MIGRATION_LOCK: Final = 0x6B657967617465


def alembic_config(connection: sa.Connection | None = None) -> Config:
    """An Alembic config for keygate's scripts, bound to ``connection`` when given."""
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def migrate_sync(url: str, revision: str = "head") -> None:
    """Upgrade the database at ``url`` to ``revision`` (blocking)."""
    engine = sync_engine(url)
    try:
        with engine.begin() as connection:
            if connection.dialect.name == "postgresql":
                connection.execute(sa.select(sa.func.pg_advisory_xact_lock(_MIGRATION_LOCK)))
            command.upgrade(alembic_config(connection), revision)
            if revision == "head":
                drop_views(connection)
                create_views(connection)
    finally:
        engine.dispose()


async def migrate(url: str, revision: str = "head") -> None:
    """Upgrade the database at ``url`` to ``revision`` without blocking the event loop."""
    await asyncio.to_thread(migrate_sync, url, revision)
