"""WriterThread's pipelined transactions on a real PostgreSQL: committed or rolled back
whole although nothing is read until the COMMIT, and a connection the server ended while
idle replaced before anything is sent on it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import sqlalchemy as sa

from core.model import Message, QueueConfig
from storage import SqlStore, open_store
from storage import writer as writer_module
from storage.base import COPY_ROWS
from storage.engine import sync_engine
from storage.writer import WriterThread
from tests.support.wait import eventually

NOW = 1_700_000_000.0

# The writer's sessions, which the second test ends (and no one else's).
WRITER = "kg-test-pipelined-writer"


@pytest.fixture
async def writer(postgres_url: str) -> AsyncIterator[tuple[WriterThread, sa.Engine]]:
    reader = sync_engine(postgres_url)
    with reader.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (v INTEGER PRIMARY KEY)")
    thread = WriterThread(sync_engine(postgres_url, application_name=WRITER))
    yield thread, reader
    await thread.close()
    reader.dispose()


def _values(reader: sa.Engine) -> list[int]:
    with reader.connect() as conn:
        return [row[0] for row in conn.exec_driver_sql("SELECT v FROM t ORDER BY v")]


def _insert(*values: int) -> Callable[[sa.Connection], None]:
    def body(conn: sa.Connection) -> None:
        conn.exec_driver_sql("INSERT INTO t VALUES (%s)", [(v,) for v in values])

    return body


def _first(conn: sa.Connection) -> None:
    conn.exec_driver_sql("SET LOCAL lock_timeout = '1s'")  # answers no rows


async def test_pipelined_transactions_commit_whole_or_not_at_all(
    writer: tuple[WriterThread, sa.Engine],
) -> None:
    thread, reader = writer
    await thread.run(_first, _insert(1, 2), pipelined=True)  # a new connection: first alone
    await thread.run(_first, _insert(3), pipelined=True)  # an idle one: all in one pipeline
    assert _values(reader) == [1, 2, 3]
    # 4 is fine, 1 exists: the error only shows at the COMMIT, and 4 must not be kept.
    with pytest.raises(sa.exc.IntegrityError):
        await thread.run(_first, _insert(4, 1), pipelined=True)
    assert _values(reader) == [1, 2, 3]
    await thread.run(_first, _insert(5), pipelined=True)
    assert _values(reader) == [1, 2, 3, 5]


async def test_a_session_the_server_ended_while_idle_is_replaced_before_sending(
    writer: tuple[WriterThread, sa.Engine],
) -> None:
    thread, reader = writer
    await thread.run(_first, _insert(1), pipelined=True)
    with reader.connect() as conn:
        ended = conn.exec_driver_sql(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s",
            (WRITER,),
        ).scalar_one()
    assert ended >= 1
    # pg_terminate_backend only signals: wait until the session has really ended (under
    # load it may not have when the next send goes out, which then fails instead).
    gone = "SELECT count(*) = 0 FROM pg_stat_activity WHERE application_name = %s"
    await eventually(lambda: asyncio.to_thread(_scalar_where, reader, gone, WRITER))
    await thread.run(_first, _insert(2), pipelined=True)  # not failed: retried on a new one
    assert _values(reader) == [1, 2]


async def test_an_append_whose_connection_dies_during_its_round_trip_is_stored_once(
    postgres_url: str, make_message: Callable[..., Message], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server ends the session just as the pipeline goes out (its FATAL not yet on the
    socket): the append cannot know whether it committed, the heads say it did not, and
    it runs again on a new connection."""
    store = await open_store(postgres_url)
    try:
        await store.create_queue(QueueConfig("orders"))
        await store.append([make_message("orders", payload=b"1")], now=NOW)
        monkeypatch.setattr(writer_module, "_quiet", lambda conn: True)
        await _end_writer_session(store, postgres_url)
        [stored] = await store.append([make_message("orders", payload=b"2")], now=NOW)
        assert stored.seq == 2
        assert [m.payload for m in await store.read("orders", 0, 0, 10)] == [b"1", b"2"]
    finally:
        await store.close()


async def _end_writer_session(store: SqlStore, url: str) -> None:
    """Have the server end the store's writer session, and wait until it is gone."""
    assert store.writer._conn is not None
    pid = store.writer._conn.connection.driver_connection.info.backend_pid
    assert _scalar(url, f"SELECT pg_terminate_backend({pid})")
    gone = f"SELECT count(*) = 0 FROM pg_stat_activity WHERE pid = {pid}"
    await eventually(lambda: asyncio.to_thread(_scalar, url, gone))


def _scalar_where(engine: sa.Engine, query: str, value: str) -> object:
    with engine.connect() as conn:
        return conn.exec_driver_sql(query, (value,)).scalar_one()


def _scalar(url: str, query: str) -> object:
    engine = sync_engine(url)
    try:
        with engine.connect() as conn:
            return conn.exec_driver_sql(query).scalar_one()
    finally:
        engine.dispose()


async def test_a_copy_sized_append_after_its_connection_died_while_idle_is_stored_once(
    postgres_url: str, make_message: Callable[..., Message]
) -> None:
    """An append large enough for COPY runs outside the pipeline: a session the server
    ended while idle is found by the transaction's first statement and replaced, and the
    COPY runs on the new one."""
    store = await open_store(postgres_url)
    try:
        await store.create_queue(QueueConfig("orders"))
        await store.append([make_message("orders", payload=b"first")], now=NOW)
        await _end_writer_session(store, postgres_url)
        batch = [make_message("orders", payload=b"%d" % i) for i in range(COPY_ROWS)]
        stored = await store.append(batch, now=NOW)
        assert [m.seq for m in stored] == list(range(2, 2 + COPY_ROWS))
        payloads = [m.payload for m in await store.read("orders", 0, 0, 1000)]
        assert payloads == [b"first", *(m.payload for m in batch)]
    finally:
        await store.close()
