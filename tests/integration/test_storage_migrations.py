"""Alembic migrations build exactly the schema in storage.schema (SQLite and PostgreSQL)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from storage import migrate, migrate_sync, sync_engine
from storage.migrate import alembic_config
from storage.schema import metadata
from storage.views import VIEWS


def test_migrating_an_empty_database_gives_exactly_the_metadata(db_url: str) -> None:
    migrate_sync(db_url)
    engine = sync_engine(db_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, metadata) == []
            views = set(sa.inspect(conn).get_view_names())
            assert views == {name for name, _ in VIEWS}
            for name, _ in VIEWS:
                conn.execute(sa.select(sa.text("*")).select_from(sa.table(name)))
    finally:
        engine.dispose()


async def test_migrating_twice_is_harmless(db_url: str) -> None:
    await migrate(db_url)
    await migrate(db_url)
    engine = sync_engine(db_url)
    try:
        with engine.connect() as conn:
            head = ScriptDirectory.from_config(alembic_config()).get_current_head()
            assert MigrationContext.configure(conn).get_current_revision() == head
    finally:
        engine.dispose()


def test_downgrade_to_base_removes_every_table_and_view(db_url: str) -> None:
    migrate_sync(db_url)
    engine = sync_engine(db_url)
    try:
        with engine.begin() as conn:
            command.downgrade(alembic_config(conn), "base")
        with engine.connect() as conn:
            inspector = sa.inspect(conn)
            assert [t for t in inspector.get_table_names() if t.startswith("kg_")] == []
            assert inspector.get_view_names() == []
    finally:
        engine.dispose()
