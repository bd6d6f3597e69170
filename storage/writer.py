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

Urgent transactions (``urgent=True``: the gateway lease's statements, ack offsets,
dispatch records) go before every ordinary one waiting, on the writer thread and, on
SQLite, for the store's write lock (``WriteLock``): the gateway's safety must not wait
behind the publishes queued for the append writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import select
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, Final, TypeVar

import sqlalchemy as sa

from storage.engine import SQLITE_SYNCHRONOUS

T = TypeVar("T")

Body = Callable[[sa.Connection], T]

# psycopg's pq.TransactionStatus.IDLE, without importing psycopg (SQLite needs none).
_IDLE: Final = 0
# A job: the loop and future to wake, and the function to run on the writer thread.
_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[[], Any]]
# Put in the ordinary queue for each urgent job, to wake the thread for it.
_URGENT: Final = "urgent"


def _quiet(conn: sa.Connection) -> bool:
    """Whether an idle connection's socket has nothing to read: no sign the server ended
    the session (a healthy idle PostgreSQL session is sent nothing)."""
    if conn.invalidated:
        return False
    driver: Any = conn.connection.driver_connection
    readable, _, _ = select.select([driver.fileno()], [], [], 0)
    return not readable


def wrapped_driver_error(
    conn: sa.Connection, error: Exception, statement: str = "-- a pipelined transaction"
) -> sa.exc.StatementError:
    """A psycopg error raised outside SQLAlchemy (a pipeline's sync, a COPY) as SQLAlchemy
    would have raised it, the connection invalidated if it is lost."""
    driver: Any = conn.connection.driver_connection
    if driver.broken:
        conn.invalidate()
    return sa.exc.DBAPIError.instance(
        statement,
        None,
        error,
        type(driver).Error,
        connection_invalidated=bool(driver.broken),
    )


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
        self._jobs: queue.SimpleQueue[_Job | str | None] = queue.SimpleQueue()
        self._urgent: deque[_Job] = deque()  # served before any job in _jobs
        self._closing = False
        # A daemon: a store nobody closed must not keep the interpreter alive.
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def run(
        self,
        first: Body[None],
        body: Body[T],
        *,
        pipelined: bool = False,
        durable: bool = True,
        urgent: bool = False,
    ) -> T:
        """Run ``first`` then ``body`` in one transaction on the writer thread and commit;
        returns what ``body`` returned. ``first`` is the transaction's first statement: if
        it finds the connection dropped, the transaction is tried once more on a new one.
        Driver errors propagate as SQLAlchemy raised them.

        ``pipelined`` (PostgreSQL): ``first``, ``body`` and the COMMIT go out in one psycopg
        pipeline, a single round trip, so neither may read a result (their statements'
        errors surface at the COMMIT). A dropped connection must still be found before
        anything is sent: a server that ends a session (restart, failover, an idle
        killer, ``pg_terminate_backend``) says so on the socket first, so when the idle
        connection has something to read (or there is none yet) the transaction runs the
        ordinary way instead, ``first`` finding the drop and the retry replacing it.

        ``durable=False`` (SQLite; ignored on PostgreSQL): the COMMIT returns without
        flushing the log (``synchronous=NORMAL`` around the transaction). A power loss may
        lose such a transaction, never corrupt anything, and the next durable COMMIT
        flushes it with its own: the log is written in order. For writes that are done
        again when lost (retention's deletes): a flush per chunk was half of their time on
        the writer, while publishes waited. Not on PostgreSQL: a server that crashed and
        restarted under a running gateway would undo deletes the gateway's caches had
        already counted (on SQLite the gateway goes down with the machine).

        ``urgent``: runs before every ordinary transaction handed over and not yet begun."""
        if durable or self._engine.dialect.name != "sqlite":
            result: T = await self._call(
                lambda: self._transaction(first, body, pipelined), urgent=urgent
            )
        else:
            result = await self._call(lambda: self._relaxed(first, body), urgent=urgent)
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

    def _call(self, function: Callable[[], Any], *, urgent: bool = False) -> asyncio.Future[Any]:
        if self._closing:
            raise RuntimeError("the writer thread is closed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if urgent:
            self._urgent.append((loop, future, function))
            self._jobs.put(_URGENT)
        else:
            self._jobs.put((loop, future, function))
        return future

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            while self._urgent:
                self._execute(self._urgent.popleft())
            if isinstance(job, tuple):  # _URGENT: its job ran already, just now or before
                self._execute(job)
            del job

    @staticmethod
    def _execute(job: _Job) -> None:
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
        try:
            result = body(conn)
            conn.commit()
        except BaseException:
            self._rollback(conn)
            raise
        return result

    def _relaxed(self, first: Body[None], body: Body[T]) -> T:
        """``_transaction`` on SQLite without the COMMIT's flush (``run``)."""
        conn = self._connection()
        # SQLite refuses to change the setting inside a transaction: around it, on the
        # driver's connection (autocommit, so no transaction begins for the PRAGMA).
        driver: Any = conn.connection.driver_connection
        driver.execute("PRAGMA synchronous=NORMAL")
        try:
            return self._transaction(first, body, False)
        finally:
            try:
                driver.execute(f"PRAGMA synchronous={SQLITE_SYNCHRONOUS}")
            except Exception:
                # Never leave the connection that stores publishes without its flush: a
                # new one starts with the engine's settings.
                self._disconnect()
                raise

    def _pipelined(self, conn: sa.Connection, first: Body[None], body: Body[T]) -> T:
        """``first``, ``body`` and the COMMIT in one psycopg pipeline: one round
        trip. The driver connection is in autocommit mode meanwhile, because psycopg would
        otherwise send a BEGIN of its own and wait for its answer (two more round trips
        with the pipeline's own closing sync); BEGIN and COMMIT are ours, queued with the
        rest, and SQLAlchemy's transaction around them sends nothing."""
        driver: Any = conn.connection.driver_connection
        driver.autocommit = True
        failed: BaseException | None = None
        try:
            try:
                with driver.pipeline():
                    try:
                        conn.exec_driver_sql("BEGIN")
                        first(conn)
                        result = body(conn)
                        conn.exec_driver_sql("COMMIT")
                    except BaseException as e:
                        # Leave the block normally: an exception through it makes psycopg
                        # log its own failing sync as a warning.
                        failed = e
            except driver.Error as e:  # raised by the pipeline's sync, outside SQLAlchemy
                if failed is None:
                    raise wrapped_driver_error(conn, e) from e
            if failed is not None:
                raise failed
        except BaseException:
            self._abandon(conn, driver)
            raise
        driver.autocommit = False
        conn.commit()
        return result

    def _abandon(self, conn: sa.Connection, driver: Any) -> None:
        """After a failed pipeline: roll the server's transaction back (a failed statement
        leaves it open and aborted) and the driver out of autocommit, else drop it."""
        try:
            if not driver.broken and driver.info.transaction_status != _IDLE:
                driver.execute("ROLLBACK")
            driver.autocommit = False
        except Exception:
            self._disconnect()
            return
        self._rollback(conn)

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


class WriteLock:
    """SQLite's one writer, taken in this process: ``asyncio.Lock``'s first come, first
    served, except that urgent holders go before every ordinary waiter. The lock passes
    straight from its holder to the next waiter."""

    def __init__(self) -> None:
        self._held = False
        self._urgent: deque[asyncio.Future[None]] = deque()
        self._ordinary: deque[asyncio.Future[None]] = deque()

    @contextlib.asynccontextmanager
    async def hold(self, *, urgent: bool = False) -> AsyncIterator[None]:
        if self._held or self._urgent or (self._ordinary and not urgent):
            turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            (self._urgent if urgent else self._ordinary).append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():
                    self._release()  # handed over just before the cancellation
                raise
        else:
            self._held = True
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        for waiters in (self._urgent, self._ordinary):
            while waiters:
                turn = waiters.popleft()
                if not turn.done():  # not cancelled
                    turn.set_result(None)
                    return
        self._held = False


__all__ = ["Body", "WriteLock", "WriterThread", "wrapped_driver_error"]
