"""Shared fixtures: database URLs for SQLite and (when available) PostgreSQL.

``postgres_url`` gives every test its own PostgreSQL schema (through the URL's
``search_path``), so tests run in parallel with other suites on the same database without
seeing each other's kg_ tables. It skips, saying why, when KEYGATE_TEST_POSTGRES_URL is
unset or the server does not answer.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Final

import psycopg
import pytest

from benchmarks.native import libpq_url, postgres_target
from core.model import Message
from storage import SqlStore, open_store

POSTGRES_ENV: Final = "KEYGATE_TEST_POSTGRES_URL"


@functools.cache
def _postgres_unavailable() -> str | None:
    """Why PostgreSQL tests cannot run, or None when they can (checked once per session)."""
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        return f"{POSTGRES_ENV} is not set"
    try:
        with psycopg.connect(libpq_url(url), connect_timeout=3):
            return None
    except psycopg.Error as e:
        return f"PostgreSQL at {POSTGRES_ENV} is unreachable: {e}"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh schema, dropped after the test."""
    reason = _postgres_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with postgres_target(os.environ[POSTGRES_ENV], prefix="kg_test_") as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return "sqlite:///" + str(tmp_path / "keygate.db")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """Each test using it runs once on SQLite and once on PostgreSQL."""
    name = "postgres_url" if request.param == "postgres" else "sqlite_url"
    url: str = request.getfixturevalue(name)
    return url


MessageFactory = Callable[..., Message]


@pytest.fixture
def make_message() -> MessageFactory:
    """Build a publishable Message (seq 0, unique id): ``make_message("orders", 3, b"x")``."""

    def make(queue: str, partition: int = 0, payload: bytes = b"payload", **fields: Any) -> Message:
        fields.setdefault("publish_time", 1_700_000_000.0)
        return Message(
            message_id=uuid.uuid4().hex,
            queue=queue,
            partition=partition,
            seq=0,
            key=fields.pop("key", None),
            payload=payload,
            **fields,
        )

    return make


@pytest.fixture
async def store(db_url: str) -> AsyncIterator[SqlStore]:
    """An open SqlStore on SQLite and on PostgreSQL, closed after the test."""
    opened = await open_store(db_url)
    try:
        yield opened
    finally:
        await opened.close()
