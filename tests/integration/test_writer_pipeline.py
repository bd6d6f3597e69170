"""WriterThread's pipelined transactions on a real PostgreSQL: committed or rolled back
whole although nothing is read until the COMMIT, and a connection the server ended while
idle replaced before anything is sent on it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
import sqlalchemy as sa

from storage.engine import sync_engine
from storage.writer import WriterThread

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
    await thread.run(_first, _insert(2), pipelined=True)  # not failed: retried on a new one
    assert _values(reader) == [1, 2]
