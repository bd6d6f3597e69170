"""WriterThread: one transaction per call on its own thread, committed or rolled back
whole, and a connection found dropped at the first statement replaced once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from storage.engine import sync_engine
from storage.writer import WriteLock, WriterThread


@pytest.fixture
async def writer(tmp_path: Path) -> AsyncIterator[tuple[WriterThread, sa.Engine]]:
    url = f"sqlite:///{tmp_path / 'w.db'}"
    reader = sync_engine(url)
    with reader.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (v INTEGER)")
    thread = WriterThread(sync_engine(url))
    yield thread, reader
    await thread.close()
    reader.dispose()


def _nothing(conn: sa.Connection) -> None:
    return None


def _values(reader: sa.Engine) -> list[int]:
    with reader.connect() as conn:
        return [row[0] for row in conn.exec_driver_sql("SELECT v FROM t ORDER BY v")]


async def test_a_body_runs_on_the_writer_thread_and_its_result_comes_back_after_commit(
    writer: tuple[WriterThread, sa.Engine],
) -> None:
    thread, reader = writer
    names: list[str] = []

    def insert(conn: sa.Connection) -> int:
        names.append(threading.current_thread().name)
        conn.exec_driver_sql("INSERT INTO t VALUES (1), (2)")
        return 2

    assert await thread.run(_nothing, insert) == 2
    assert _values(reader) == [1, 2]
    assert names[0].startswith("kg-writer") and names[0] != threading.current_thread().name


async def test_a_failing_body_writes_nothing_and_the_next_transaction_works(
    writer: tuple[WriterThread, sa.Engine],
) -> None:
    thread, reader = writer

    def half_then_fail(conn: sa.Connection) -> None:
        conn.exec_driver_sql("INSERT INTO t VALUES (1)")
        raise RuntimeError("bug in the middle of a transaction")

    with pytest.raises(RuntimeError):
        await thread.run(_nothing, half_then_fail)
    assert _values(reader) == []
    await thread.run(_nothing, lambda conn: conn.exec_driver_sql("INSERT INTO t VALUES (3)"))
    assert _values(reader) == [3]


def _dropped() -> sa.exc.OperationalError:
    return sa.exc.OperationalError(
        "SELECT 1", {}, Exception("server closed the connection"), connection_invalidated=True
    )


async def test_a_connection_dropped_before_the_first_statement_is_replaced_once(
    writer: tuple[WriterThread, sa.Engine],
) -> None:
    thread, reader = writer
    firsts: list[sa.Connection] = []

    def first(conn: sa.Connection) -> None:
        firsts.append(conn)
        if len(firsts) == 1:
            raise _dropped()

    await thread.run(first, lambda conn: conn.exec_driver_sql("INSERT INTO t VALUES (7)"))
    assert len(firsts) == 2 and firsts[0] is not firsts[1]  # a new connection the second time
    assert _values(reader) == [7]


async def test_a_connection_that_stays_dropped_fails_the_transaction(
    writer: tuple[WriterThread, sa.Engine],
) -> None:
    thread, reader = writer
    bodies: list[int] = []

    def first(conn: sa.Connection) -> None:
        raise _dropped()

    with pytest.raises(sa.exc.OperationalError):
        await thread.run(first, lambda conn: bodies.append(1))
    assert bodies == [] and _values(reader) == []
    await thread.run(_nothing, lambda conn: conn.exec_driver_sql("INSERT INTO t VALUES (8)"))
    assert _values(reader) == [8]


async def test_close_lets_the_transactions_handed_over_commit_then_ends_the_thread(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    reader = sync_engine(url)
    with reader.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE t (v INTEGER)")
    thread = WriterThread(sync_engine(url), name="kg-writer-close")

    def insert(value: int) -> Callable[[sa.Connection], None]:
        return lambda conn: conn.exec_driver_sql("INSERT INTO t VALUES (?)", (value,))

    runs = [asyncio.ensure_future(thread.run(_nothing, insert(v))) for v in range(3)]
    await asyncio.sleep(0)  # the three are handed over before close
    await thread.close()
    await asyncio.gather(*runs)
    assert _values(reader) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="closed"):
        await thread.run(_nothing, insert(3))
    assert "kg-writer-close" not in [t.name for t in threading.enumerate()]
    await thread.close()  # a second close is a no-op
    reader.dispose()


async def test_a_transaction_that_need_not_be_durable_commits_without_flushing_and_only_it(
    writer: tuple[WriterThread, sa.Engine],
) -> None:
    """Retention's deletes commit without waiting for the disk (synchronous=NORMAL for the
    transaction); every other transaction on the connection stays FULL (2)."""
    thread, reader = writer

    def insert_and_read_level(conn: sa.Connection) -> int:
        conn.exec_driver_sql("INSERT INTO t VALUES (1)")
        level: int = conn.exec_driver_sql("PRAGMA synchronous").scalar_one()
        return level

    assert await thread.run(_nothing, insert_and_read_level, durable=False) == 1
    assert await thread.run(_nothing, insert_and_read_level) == 2
    assert _values(reader) == [1, 1]


async def test_an_urgent_transaction_runs_before_the_ordinary_ones_waiting(
    writer: tuple[WriterThread, sa.Engine],
) -> None:
    thread, _ = writer
    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    def busy(conn: sa.Connection) -> None:
        started.set()
        release.wait(10)

    def note(name: str) -> Callable[[sa.Connection], None]:
        return lambda conn: order.append(name)

    first = asyncio.ensure_future(thread.run(_nothing, busy))
    await asyncio.to_thread(started.wait, 10)
    ordinary = [asyncio.ensure_future(thread.run(_nothing, note(f"o{i}"))) for i in range(3)]
    urgent = asyncio.ensure_future(thread.run(_nothing, note("urgent"), urgent=True))
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(first, *ordinary, urgent)
    assert order == ["urgent", "o0", "o1", "o2"]


async def test_the_write_lock_goes_to_urgent_waiters_first_then_in_arrival_order() -> None:
    lock = WriteLock()
    order: list[str] = []
    release = asyncio.Event()

    async def hold(name: str, urgent: bool = False) -> None:
        async with lock.hold(urgent=urgent):
            order.append(name)
            if name == "holder":
                await release.wait()

    holder = asyncio.create_task(hold("holder"))
    await asyncio.sleep(0)
    waiting = [asyncio.create_task(hold(f"o{i}")) for i in range(2)]
    gone = asyncio.create_task(hold("cancelled", urgent=True))
    waiting.append(asyncio.create_task(hold("urgent", urgent=True)))
    await asyncio.sleep(0)
    gone.cancel()
    release.set()
    await asyncio.gather(holder, *waiting)
    assert order == ["holder", "urgent", "o0", "o1"]
    async with lock.hold():  # free again
        pass
