"""The PostgreSQL drivers are an extra: without them a clear error names the extra."""

from __future__ import annotations

import importlib.util
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
