"""The writer thread: a hot write transaction in one hop.

How it works. Through the async engine every statement of a transaction is a round trip
through the event loop: aiosqlite runs each call in its own thread and wakes the loop with
the result; asyncpg waits for the socket in the loop. Under load each such wake-up waits
behind everything else the loop has to do, so a five-statement append took 10 ms of wall
clock at 1,000 msg/s while its SQL took well under one (and, SQLite having one writer,
every other write queued behind it). The hot transactions (appends, ack offsets) run
instead as one plain function on a dedicated thread that owns one blocking connection
(sqlite3, or psycopg on PostgreSQL): the loop hands the function over and is woken once,
when it has committed. The hand-over is a ``queue.SimpleQueue`` and the wake-up one
``call_soon_threadsafe``: half the CPU of ``run_in_executor``'s round trip (21 against
43 µs under uvloop), which a lone publish pays once per commit.

The connection is kept for the life of the store. A connection the database dropped
(restart, failover, an idle-connection killer) fails the transaction's first statement;
nothing was written then, so the transaction runs once more on a new connection. A
failure after that, COMMIT included, is reported: the caller cannot know whether it
committed, exactly as with the async engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import select
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa

T = TypeVar("T")

Body = Callable[[sa.Connection], T]

# A job: the loop and future to wake, and the function to run on the writer thread.
_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[[], Any]]


def _quiet(conn: sa.Connection) -> bool:
    """Whether an idle connection's socket has nothing to read: no sign the server ended
    the session (a healthy idle PostgreSQL session is sent nothing)."""
    if conn.invalidated:
        return False
    driver: Any = conn.connection.driver_connection
    readable, _, _ = select.select([driver.fileno()], [], [], 0)
    return not readable


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return  # the caller gave up waiting; the transaction ran (or failed) regardless
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class WriterThread:
    """One thread, one connection of ``engine``; ``run`` executes one transaction on it."""

    def __init__(self, engine: sa.Engine, *, name: str = "kg-writer") -> None:
        self._engine = engine
        self._conn: sa.Connection | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closing = False
        # A daemon: a store nobody closed must not keep the interpreter alive.
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def run(self, first: Body[None], body: Body[T], *, pipelined: bool = False) -> T:
        """Run ``first`` then ``body`` in one transaction on the writer thread and commit;
        returns what ``body`` returned. ``first`` is the transaction's first statement: if
        it finds the connection dropped, the transaction is tried once more on a new one.
        Driver errors propagate as SQLAlchemy raised them.

        ``pipelined`` (PostgreSQL): ``first``, ``body`` and the COMMIT go out in one psycopg
        pipeline, a single round trip, so neither may read a result (their statements'
        errors surface at the COMMIT). A dropped connection must still be found before
        anything is sent: a server that ends a session (restart, failover, an idle
        killer, ``pg_terminate_backend``) says so on the socket first, so when the idle
        connection has something to read, ``first`` runs on its own as above, then the
        pipeline."""
        result: T = await self._call(lambda: self._transaction(first, body, pipelined))
        return result

    async def close(self) -> None:
        """Wait for the transactions handed over, then close the connection and the engine
        (on the writer thread: an sqlite3 connection may only be closed by its thread)."""
        if self._closing:
            return
        future = self._call(self._shut_down)
        self._closing = True
        await future
        self._jobs.put(None)
        await asyncio.to_thread(self._thread.join)

    def _call(self, function: Callable[[], Any]) -> asyncio.Future[Any]:
        if self._closing:
            raise RuntimeError("the writer thread is closed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((loop, future, function))
        return future

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, function = job
            result, error = None, None
            try:
                result = function()
            except BaseException as e:  # handed to the caller, as run_in_executor does
                error = e
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                loop.call_soon_threadsafe(_settle, future, result, error)
            del job, result, error  # no reference to the last result while idle

    def _shut_down(self) -> None:
        self._disconnect()
        self._engine.dispose()

    def _transaction(self, first: Body[None], body: Body[T], pipelined: bool) -> T:
        if pipelined and self._conn is not None and _quiet(self._conn):
            self._conn.begin()
            return self._pipelined(self._conn, first, body)
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
        return self._pipelined(conn, None, body) if pipelined else self._finish(conn, body)

    def _finish(self, conn: sa.Connection, body: Body[T]) -> T:
        try:
            result = body(conn)
            conn.commit()
        except BaseException:
            self._rollback(conn)
            raise
        return result

    def _pipelined(self, conn: sa.Connection, first: Body[None] | None, body: Body[T]) -> T:
        """``first`` (if any), ``body`` and the COMMIT in one psycopg pipeline."""
        driver: Any = conn.connection.driver_connection
        try:
            with driver.pipeline():
                if first is not None:
                    first(conn)
                result = body(conn)
                conn.commit()
        except BaseException:
            # A statement that failed in the pipeline fails the COMMIT, after which
            # SQLAlchemy takes the transaction as ended; the server's is still open (aborted).
            self._rollback(conn)
            if self._conn is not None:
                try:
                    driver.rollback()
                except Exception:
                    self._disconnect()
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
