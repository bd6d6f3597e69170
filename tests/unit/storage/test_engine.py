"""The PostgreSQL drivers are an extra: without them a clear error names the extra. The
sqlite3 adapters storage.engine registers for the whole process change no value."""

from __future__ import annotations

import importlib.util
import sqlite3
from collections.abc import Callable
from importlib.machinery import ModuleSpec

import pytest

from core.errors import InvalidArgument
from storage import engine


@pytest.mark.parametrize(
    ("make", "driver"), [(engine.async_engine, "asyncpg"), (engine.sync_engine, "psycopg")]
)
def test_postgres_url_without_the_driver_names_the_postgres_extra(
    monkeypatch: pytest.MonkeyPatch, make: Callable[[str], object], driver: str
) -> None:
    real = importlib.util.find_spec

    def missing(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name == driver else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", missing)
    with pytest.raises(InvalidArgument, match=r"keygate\[postgres\]"):
        make("postgresql://keygate@127.0.0.1/keygate")


def test_sqlite_url_needs_no_postgres_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, package=None: None)
    engine.sync_engine("sqlite:///:memory:").dispose()


def test_sqlite_adapters_store_none_and_bytes_as_they_are() -> None:
    # Registered at import for speed; every sqlite3 connection of the process sees them.
    assert (type(None), sqlite3.PrepareProtocol) in sqlite3.adapters
    assert (bytes, sqlite3.PrepareProtocol) in sqlite3.adapters
    connection = sqlite3.connect(":memory:")
    try:
        connection.execute("CREATE TABLE t (a, b, c)")
        connection.execute("INSERT INTO t VALUES (?, ?, ?)", (None, b"\x00\xff", bytearray(b"x")))
        row = connection.execute(
            "SELECT a, b, c, typeof(a), typeof(b), typeof(c) FROM t"
        ).fetchone()
    finally:
        connection.close()
    assert row == (None, b"\x00\xff", b"x", "null", "blob", "blob")
