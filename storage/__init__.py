"""keygate's durable SQL store: schema, migrations and the group-committing store."""

from storage.engine import async_engine, sync_engine
from storage.migrate import migrate, migrate_sync
from storage.store import SqlStore, open_store

__all__ = ["SqlStore", "async_engine", "migrate", "migrate_sync", "open_store", "sync_engine"]
