"""The writer thread: a hot write transaction in one hop.

How it works. Through the async engine every statement of a transaction is a round trip
through the event loop: aiosqlite runs each call in its own thread and wakes the loop with
the result; asyncpg waits for the socket in the loop. Under load each such wake-up waits
behind everything else the loop has to do, so a five-statement append took 10 ms of wall
clock at 1,000 msg/s while its SQL took well under one (and, SQLite having one writer,
every other write queued behind it). The hot transactions (appends, ack offsets) run
instead as one plain function on a dedicated thread that owns one blocking connection
(sqlite3, or psycopg on PostgreSQL): the loop hands the function over and is woken once,
when it has committed.

The connection is kept for the life of the store. A connection the database dropped
(restart, failover, an idle-connection killer) fails the transaction's first statement;
nothing was written then, so the transaction runs once more on a new connection. A
failure after that, COMMIT included, is reported: the caller cannot know whether it
committed, exactly as with the async engine.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import sqlalchemy as sa

T = TypeVar("T")

Body = Callable[[sa.Connection], T]


class WriterThread:
    """One thread, one connection of ``engine``; ``run`` executes one transaction on it."""

    def __init__(self, engine: sa.Engine, *, name: str = "kg-writer") -> None:
        self._engine = engine
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._conn: sa.Connection | None = None

    async def run(self, first: Body[None], body: Body[T]) -> T:
        """Run ``first`` then ``body`` in one transaction on the writer thread and commit;
        returns what ``body`` returned. ``first`` is the transaction's first statement: if
        it finds the connection dropped, the transaction is tried once more on a new one.
        Driver errors propagate as SQLAlchemy raised them."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._transaction, first, body)

    async def close(self) -> None:
        """Wait for the transaction in progress, then close the connection and the engine
        (on the writer thread: an sqlite3 connection may only be closed by its thread)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._shut_down)
        self._executor.shutdown(wait=True)

    def _shut_down(self) -> None:
        self._disconnect()
        self._engine.dispose()

    def _transaction(self, first: Body[None], body: Body[T]) -> T:
        for attempt in range(2):
            conn = self._connection()
            try:
                conn.begin()
                first(conn)
                break
            except sa.exc.DBAPIError as e:
                if not e.connection_invalidated:
                    self._rollback(conn)
                    raise
                # Dropped while idle: nothing of this transaction reached the database.
                self._disconnect()
                if attempt:
                    raise
            except BaseException:
                self._rollback(conn)
                raise
        try:
            result = body(conn)
            conn.commit()
        except BaseException:
            self._rollback(conn)
            raise
        return result

    def _connection(self) -> sa.Connection:
        if self._conn is not None and self._conn.invalidated:
            self._disconnect()
        if self._conn is None:
            self._conn = self._engine.connect()
        return self._conn

    def _rollback(self, conn: sa.Connection) -> None:
        if conn.invalidated:
            self._disconnect()
            return
        try:
            conn.rollback()
        except sa.exc.SQLAlchemyError:
            self._disconnect()

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(sa.exc.SQLAlchemyError, OSError):
                conn.close()


__all__ = ["Body", "WriterThread"]
