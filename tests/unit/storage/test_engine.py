"""The PostgreSQL drivers are an extra: without them a clear error names the extra. The
sqlite3 adapters storage.engine registers for the whole process change no value."""

from __future__ import annotations

import importlib.util
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from importlib.machinery import ModuleSpec
from pathlib import Path

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


def test_a_sqlite_store_does_not_load_the_postgresql_drivers(tmp_path: Path) -> None:
    """A gateway on SQLite imports neither asyncpg nor psycopg: together they cost 12 MB of
    memory (the gateway's peak RSS in benchmarks.native went 94 -> 107 MB when the store's
    error handling imported them unconditionally)."""
    script = (
        "import asyncio, sys\n"
        "from storage import open_store\n"
        "async def main():\n"
        f"    store = await open_store('sqlite:///{tmp_path / 'k.db'}')\n"
        "    await store.close()\n"
        "asyncio.run(main())\n"
        "print(sorted({'asyncpg', 'psycopg'} & set(sys.modules)))\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert ran.stdout.strip() == "[]", ran.stdout + ran.stderr
