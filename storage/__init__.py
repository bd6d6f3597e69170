"""keygate's durable SQL store: schema, migrations and the group-committing store, the small
interfaces the layers above use (storage.interfaces) and its in-memory twin."""

from storage.engine import async_engine, sync_engine
from storage.interfaces import AdminStore, GroupStore, PublishStore
from storage.memory import MemoryStore
from storage.migrate import LeaseClaim, migrate, migrate_sync
from storage.store import SqlStore, open_store

__all__ = [
    "AdminStore",
    "GroupStore",
    "LeaseClaim",
    "MemoryStore",
    "PublishStore",
    "SqlStore",
    "async_engine",
    "migrate",
    "migrate_sync",
    "open_store",
    "sync_engine",
]
