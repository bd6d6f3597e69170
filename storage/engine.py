"""Database URLs and engines: the store's only contact with drivers.

Users give ``sqlite:///path`` or ``postgresql://user@host/db``; the store runs on
aiosqlite / asyncpg and migrations run on sqlite3 / psycopg. A ``search_path`` query
parameter on a PostgreSQL URL puts every keygate table in that schema
(``postgresql://host/db?search_path=keygate``).

SQLite durability: WAL journal with ``synchronous=FULL``, so a commit is on disk (fsync of
the WAL) before a publish is confirmed; group commit amortises the fsync. Every SQLite
transaction starts with ``BEGIN IMMEDIATE`` so two writers queue on ``busy_timeout``
instead of failing with "database is locked" when a read lock cannot be upgraded.
"""

from __future__ import annotations

import importlib.util
import sqlite3
from typing import Any, Final, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from core.errors import InvalidArgument

SQLITE_BUSY_TIMEOUT_MS: Final = 30_000
SQLITE_SYNCHRONOUS: Final = "FULL"
_SQLITE_PRAGMAS: Final = (
    "PRAGMA journal_mode=WAL",
    f"PRAGMA synchronous={SQLITE_SYNCHRONOUS}",
    f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}",
)
_SEARCH_PATH: Final = "search_path"
IDLE_IN_TRANSACTION_TIMEOUT_MS: Final = 5000
# The gateway's PostgreSQL sessions. The kg_partitions trigger (migration 0005) sends the
# HEADS_CHANNEL notification for other writers' appends (Spark, tools), never for these.
GATEWAY_APPLICATION: Final = "keygate-gateway"
HEADS_CHANNEL: Final = "kg_heads"


def _require_driver(module: str) -> None:
    """PostgreSQL drivers are the ``postgres`` extra: SQLite users do not install them."""
    if importlib.util.find_spec(module) is None:
        raise InvalidArgument(
            f"PostgreSQL needs the {module} driver: install keygate with its postgres extra "
            "(pip install '/path/to/keygate[postgres]'; README, Installing keygate elsewhere)"
        )


def _parse(url: str) -> tuple[URL, str | None]:
    """Split a user URL into a driverless URL and the optional PostgreSQL search_path."""
    try:
        parsed = make_url(url)
    except sa.exc.ArgumentError as e:
        raise InvalidArgument(f"invalid database URL: {e}") from e
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise InvalidArgument(f"unsupported database {backend!r}: use sqlite:// or postgresql://")
    search_path = parsed.query.get(_SEARCH_PATH)
    if isinstance(search_path, tuple):
        raise InvalidArgument("search_path may be given once")
    return parsed.difference_update_query([_SEARCH_PATH]), search_path


def is_sqlite(url: str) -> bool:
    return _parse(url)[0].get_backend_name() == "sqlite"


_Value = TypeVar("_Value")


def _as_is(value: _Value) -> _Value:
    return value


# Python's sqlite3 binds int, float, str and bytearray parameters directly, but asks its
# adapter registry about every other one, None and bytes included, and the registry's
# miss is slow (CPython 3.11 formats an AttributeError for "__adapt__" and drops it):
# nearly half an executemany's time for rows like kg_messages', whose optional columns
# are mostly None and whose payload is bytes. An adapter found in the registry returns
# at once. The registry is the sqlite3 module's, for the whole process: these two leave
# every value as it is.
sqlite3.register_adapter(type(None), _as_is)
sqlite3.register_adapter(bytes, _as_is)


def _sqlite_setup(engine: sa.Engine) -> None:
    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event, not the driver, decide how transactions start.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        for pragma in _SQLITE_PRAGMAS:
            cursor.execute(pragma)
        cursor.close()

    @sa.event.listens_for(engine, "begin")
    def _begin(connection: sa.Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def async_engine(url: str, *, application_name: str | None = None) -> AsyncEngine:
    """An engine for the store: aiosqlite or asyncpg. ``application_name`` names the
    PostgreSQL sessions (the active gateway's: GATEWAY_APPLICATION)."""
    parsed, search_path = _parse(url)
    if parsed.get_backend_name() == "sqlite":
        engine = create_async_engine(parsed.set(drivername="sqlite+aiosqlite"))
        _sqlite_setup(engine.sync_engine)
        return engine
    _require_driver("asyncpg")
    # A transaction left open by a frozen (SIGSTOPped) gateway holds the gateway lease
    # row FOR SHARE (storage.base): the server ends such a session, so a standby can
    # take the lease over.
    settings = {"idle_in_transaction_session_timeout": str(IDLE_IN_TRANSACTION_TIMEOUT_MS)}
    if search_path:
        settings["search_path"] = search_path
    if application_name:
        settings["application_name"] = application_name
    connect_args: dict[str, Any] = {"server_settings": settings}
    # pre_ping: a connection the server dropped (restart, failover, idle timeout) is
    # replaced at checkout instead of failing the transaction (one round-trip per
    # transaction, which group commit amortises).
    return create_async_engine(
        parsed.set(drivername="postgresql+asyncpg"),
        connect_args=connect_args,
        pool_size=10,
        pool_pre_ping=True,
    )


def sync_engine(url: str, *, application_name: str | None = None) -> sa.Engine:
    """A blocking engine (sqlite3 or psycopg 3) for migrations, tools, Spark and the
    store's writer thread (storage.writer), whose PostgreSQL sessions are named and
    bounded like the async engine's when ``application_name`` is given."""
    parsed, search_path = _parse(url)
    if parsed.get_backend_name() == "sqlite":
        engine = sa.create_engine(parsed.set(drivername="sqlite+pysqlite"))
        _sqlite_setup(engine)
        return engine
    _require_driver("psycopg")
    options = []
    if search_path:
        options.append("-csearch_path=" + search_path)
    connect_args: dict[str, Any] = {}
    if application_name:
        options.append(f"-cidle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_TIMEOUT_MS}")
        connect_args["application_name"] = application_name
    if options:
        connect_args["options"] = " ".join(options)
    return sa.create_engine(parsed.set(drivername="postgresql+psycopg"), connect_args=connect_args)
