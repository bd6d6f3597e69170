"""State shared by the store's parts: the engine, the in-memory caches, transactions.

Only one active gateway writes a database (DESIGN.md §8), so the store keeps each queue's
depth and partition heads in memory, loaded at open and updated after each commit.
``seq_lock`` serialises everything that assigns seqs or rewrites a queue (appends, dead
letters, purge, delete), so seqs are handed out in commit order. Seqs themselves are
assigned from ``kg_partitions.head_seq`` read inside the writing transaction (row-locked
on PostgreSQL; SQLite's BEGIN IMMEDIATE already excludes other writers): a Spark job
dead-lettering into the same DLQ cannot make the gateway reuse a seq.

Two ways to write: ``write`` (one function run on the writer thread, storage.writer: the
steady-state writes — appends, ack offsets, dispatch records, flows and assignments, key
changes, QoS 2 releases, retention deletes) and ``transaction`` (the async engine: reads,
administration, dead letters). The statement helpers they share (``lock_heads``,
``insert_messages``, ``write_heads``) are blocking functions of a Connection; async callers
run them through ``AsyncConnection.run_sync``. On SQLite both ways queue on one in-process lock.

Fencing: the active gateway arms ``fence`` with its lease epoch; from then on every write
transaction proves, as its first statement, that the lease is still its own
(storage.fence). One that finds it taken raises Fenced (the transaction rolls back; the
publish it carried is not confirmed) and tells the gateway, which stops at once. The
writer thread's transactions also renew the lease: at most every ``ttl / 3`` the proof is
an UPDATE that pushes the expiry on (``lease_renewed_at`` says when, once committed). A
gateway whose writes queue behind each other for the single SQLite writer cannot then
lose its lease while they are committing: the writes keep it, and the gateway's own
renewals only matter when idle.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Any, Final, TypeVar

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from core.errors import Fenced, KeygateError, QueueNotFound, StorageError
from core.model import Message, QueueConfig
from storage.codec import MESSAGE_COLUMNS, message_values, queue_from_row
from storage.engine import HEADS_CHANNEL
from storage.fence import (
    LEASE_HELD_SQLITE,
    LEASE_TAKEN_SQLSTATE,
    GatewayLease,
    LeaseTaken,
    prove,
)
from storage.outage import OutageLog, driver_errors, storage_error
from storage.schema import (
    kg_messages,
    kg_partitions,
    kg_queues,
    kg_subscriptions,
)
from storage.writer import Body, WriteLock, WriterThread, wrapped_driver_error

T = TypeVar("T")

# The hot statements, built once: SQLAlchemy memoizes a statement's cache key on the
# object, so executing a prebuilt one skips rebuilding and re-keying it on every call.
_p = kg_partitions
_HEADS = sa.select(_p.c.queue, _p.c.partition, _p.c.head_seq).where(
    sa.tuple_(_p.c.queue, _p.c.partition).in_(sa.bindparam("parts", expanding=True))
)
_HEADS_LOCKED = _HEADS.order_by(_p.c.queue, _p.c.partition).with_for_update()
_WRITE_HEADS = (
    sa.update(_p)
    .where(_p.c.queue == sa.bindparam("b_queue"), _p.c.partition == sa.bindparam("b_p"))
    .values(head_seq=sa.bindparam("b_head"))
)
_PING = sa.select(sa.literal(1))
# Migration 0016: moves heads only from the values given, else raises HEADS_MOVED.
_ADVANCE_HEADS = sa.text("CALL kg_advance_heads(:b_queues, :b_partitions, :b_olds, :b_news)")
_HEADS_MOVED_SQLSTATE: Final = "KG002"
# An append of at least this many messages on PostgreSQL is written with COPY, in a
# transaction of a few round trips rather than one pipelined round trip: for large
# batches the CPU COPY saves outweighs the round trips (docs/performance.md).
COPY_ROWS: Final = 128
_COPY_SQL: Final = "COPY kg_messages ({}) FROM STDIN".format(
    ", ".join(f'"{column}"' for column in MESSAGE_COLUMNS)
)
_ADVANCE_HEADS_SQLITE: Final = (
    'UPDATE kg_partitions SET head_seq = ? WHERE queue = ? AND "partition" = ? AND head_seq = ?'
)
_ADVANCE_FENCED_HEADS_SQLITE: Final = f"{_ADVANCE_HEADS_SQLITE} AND {LEASE_HELD_SQLITE}"


class HeadsMoved(StorageError):
    """An append with seqs from the cache found partition heads that another writer moved
    since the store read them: nothing was written; the append runs again, reading them."""

    def __init__(self) -> None:
        super().__init__("partition heads moved")


_log = logging.getLogger("keygate.storage")


class Allocation:
    """Seqs handed out by one transaction; applied to the cache only once it commits."""

    def __init__(self, heads: Mapping[tuple[str, int], int]) -> None:
        self._heads = dict(heads)
        self.assigned: dict[tuple[str, int], int] = {}

    def start(self, key: tuple[str, int]) -> int:
        """The head ``key`` had before this transaction."""
        return self._heads.get(key, 0)

    def next(self, queue: str, partition: int) -> int:
        key = (queue, partition)
        seq = self.assigned.get(key, self._heads.get(key, 0)) + 1
        self.assigned[key] = seq
        return seq


class StoreBase:
    def __init__(self, url: str, engine: AsyncEngine, writer: WriterThread) -> None:
        self.url = url
        self.engine = engine
        self.writer = writer
        self.seq_lock = asyncio.Lock()
        self.queues: dict[str, QueueConfig] = {}
        self.heads: dict[tuple[str, int], int] = {}
        # queue -> [messages, bytes] currently stored.
        self.depths: dict[str, list[int]] = {}
        self.listeners: list[Callable[[Sequence[Message]], None]] = []
        # SQLite has one writer at a time and every transaction starts BEGIN IMMEDIATE.
        # Separate connections racing for it fall into SQLite's busy handler, which
        # sleeps in growing steps (tens of ms); queueing on a lock in this process costs
        # nothing. Other processes (Spark, a standby) still wait on busy_timeout.
        self._sqlite_lock = WriteLock() if engine.dialect.name == "sqlite" else None
        self._driver_errors = driver_errors(engine.dialect.name)
        self._fence: GatewayLease | None = None
        self._on_fenced: Callable[[Fenced], None] | None = None
        # True once a transaction found the gateway lease taken over.
        self.fenced = False
        # time.monotonic() before the last committed write that renewed the lease
        # (never later than the database's own renewal); -inf until one has.
        self.lease_renewed_at = -math.inf
        self._renewing = False
        self.outage = OutageLog(_log)

    def add_commit_listener(self, fn: Callable[[Sequence[Message]], None]) -> None:
        """Call ``fn`` with every committed batch of new messages, in commit order and seq
        order, before the writers' calls return. ``fn`` must not block or raise."""
        self.listeners.append(fn)

    def lock_heads(self, conn: sa.Connection, partitions: Iterable[tuple[str, int]]) -> Allocation:
        """Read (and on PostgreSQL lock) the heads of ``partitions`` for this transaction
        (a blocking call: the writer thread's, or through ``AsyncConnection.run_sync``)."""
        locked = conn.dialect.name == "postgresql"
        rows = conn.execute(_HEADS_LOCKED if locked else _HEADS, {"parts": sorted(set(partitions))})
        return Allocation({(queue, partition): head for queue, partition, head in rows})

    def insert_messages(
        self, conn: sa.Connection, messages: Sequence[Message], *, copy: bool = False
    ) -> None:
        """INSERT into kg_messages through the driver's executemany: SQLAlchemy's per-row
        bind processing would cost more than the database does (benchmarks/store_append.py).
        The statement is still compiled by SQLAlchemy, once per driver. ``copy``: with
        COPY instead, on the writer thread's psycopg connection outside a pipeline (half
        the client's CPU per row of a pipelined executemany: docs/performance.md)."""
        if copy:
            driver: Any = conn.connection.driver_connection
            try:
                with driver.cursor() as cursor, cursor.copy(_COPY_SQL) as rows:
                    for message in messages:
                        rows.write_row(message_values(message))
            except driver.Error as e:  # raised by psycopg itself, outside SQLAlchemy
                raise wrapped_driver_error(conn, e, _COPY_SQL) from e
            return
        conn.exec_driver_sql(_insert_sql(conn.dialect), [message_values(m) for m in messages])

    def write_heads(self, conn: sa.Connection, allocation: Allocation) -> None:
        if allocation.assigned:
            conn.execute(
                _WRITE_HEADS,
                [
                    {"b_queue": queue, "b_p": partition, "b_head": head}
                    for (queue, partition), head in allocation.assigned.items()
                ],
            )

    def advance_heads(self, conn: sa.Connection, allocation: Allocation) -> None:
        """``write_heads`` for an append that did not lock the heads (its seqs came from
        the cache): each head moves only from the value it allocated from, else nothing is
        written and the transaction fails with HeadsMoved (``write``). PostgreSQL: one
        procedure call, at its COMMIT; SQLite: conditional UPDATEs, counted at once, that
        also need the store's lease held (HeadsMoved if not: the append then runs the
        ordinary way, whose fence check says Fenced), so they prove the fence."""
        keys = sorted(allocation.assigned)
        if conn.dialect.name == "postgresql":
            conn.execute(
                _ADVANCE_HEADS,
                {
                    "b_queues": [queue for queue, _ in keys],
                    "b_partitions": [partition for _, partition in keys],
                    "b_olds": [allocation.start(key) for key in keys],
                    "b_news": [allocation.assigned[key] for key in keys],
                },
            )
            return
        rows = [(allocation.assigned[key], *key, allocation.start(key)) for key in keys]
        if self._fence is None:
            moved = conn.exec_driver_sql(_ADVANCE_HEADS_SQLITE, rows)
        else:
            lease = (self._fence.name, self._fence.holder, self._fence.epoch)
            fenced = [(*row, *lease) for row in rows]
            moved = conn.exec_driver_sql(_ADVANCE_FENCED_HEADS_SQLITE, fenced)
        if moved.rowcount != len(keys):
            raise HeadsMoved()

    def committed(self, allocation: Allocation, messages: Sequence[Message]) -> None:
        """After COMMIT: advance the caches, then tell the listeners."""
        self.heads.update(allocation.assigned)
        for message in messages:
            depth = self.depths.setdefault(message.queue, [0, 0])
            depth[0] += 1
            depth[1] += message.size
        if messages:
            for listener in self.listeners:
                try:
                    listener(messages)
                except Exception:
                    # The data is committed: a faulty listener must not fail the writers.
                    _log.exception("commit listener %r failed", listener)

    def fence(self, lease: GatewayLease, on_fenced: Callable[[Fenced], None]) -> None:
        """From now on every fenced transaction first checks, in the database, that
        ``lease`` is still held; the first that finds it taken calls ``on_fenced`` once,
        and it and every later transaction raise Fenced."""
        self._fence = lease
        self._on_fenced = on_fenced

    def _check_fence(self, conn: sa.Connection) -> None:
        assert self._fence is not None
        prove(conn, self._fence, renew=False)

    def _renew_fence(self, conn: sa.Connection) -> None:
        assert self._fence is not None
        prove(conn, self._fence, renew=True)

    def _first_write(self, conn: sa.Connection) -> None:
        """The writer thread's first statement: the fence check, else ``_ping``."""
        if self._fence is not None:
            self._check_fence(conn)
        else:
            _ping(conn)

    async def write(
        self,
        body: Body[T],
        *,
        pipelined: bool = False,
        proves_fence: bool = False,
        durable: bool = True,
        urgent: bool = False,
        fenced: bool = True,
    ) -> T:
        """Run ``body`` as one fenced write transaction on the writer thread
        (storage.writer); returns its result after COMMIT. Errors as ``transaction``.
        ``pipelined`` (PostgreSQL; ignored on SQLite): the fence, ``body`` and the COMMIT
        go out as one pipeline, one round trip; ``body`` must not read any result
        (WriterThread.run). ``proves_fence`` (SQLite; ignored on PostgreSQL): ``body``
        writes nothing unless the lease is held and then fails (``advance_heads``), so
        the separate fence check is left out unless the lease is due for renewal.
        ``durable=False``: a write that may be lost in a crash because it is done again
        (retention's deletes): on SQLite its COMMIT does not flush (WriterThread.run), and
        it never renews the lease. ``urgent``: before every ordinary write waiting (for
        the gateway's safety: ack offsets, the lease). ``fenced=False``: no fence check
        (the lease's own statements, as ``transaction``)."""
        if fenced and self._fence is not None and self.fenced:
            raise self._fenced_off()
        started = time.monotonic()
        renew = fenced and durable and self._renewal_due(started)
        if not fenced:
            first = _ping
        elif proves_fence and not renew and self._sqlite_lock is not None:
            first = _no_check
        else:
            first = self._renew_fence if renew else self._first_write
        try:
            if self._sqlite_lock is None:
                result = await self.writer.run(
                    first, body, pipelined=pipelined, durable=durable, urgent=urgent
                )
            else:
                async with self._sqlite_lock.hold(urgent=urgent):
                    result = await self.writer.run(first, body, durable=durable, urgent=urgent)
        except LeaseTaken:
            raise self._fenced_off() from None
        except self._driver_errors as e:
            raise self._driver_error(e) from e
        finally:
            self._renewing = self._renewing and not renew
        if renew:
            self.lease_renewed_at = max(self.lease_renewed_at, started)
        self.outage.answered()
        return result

    def _renewal_due(self, now: float) -> bool:
        """Whether this write should renew the lease (one renewal in flight at a time)."""
        if self._fence is None or self._renewing:
            return False
        self._renewing = now - self.lease_renewed_at >= self._fence.ttl / 3
        return self._renewing

    def _driver_error(self, error: BaseException) -> KeygateError:
        """What a driver error means: the lease taken (kg_fence), heads moved
        (kg_advance_heads), or a storage failure."""
        sqlstate = getattr(getattr(error, "orig", None), "sqlstate", None)
        if sqlstate == LEASE_TAKEN_SQLSTATE:
            return self._fenced_off()
        if sqlstate == _HEADS_MOVED_SQLSTATE:
            return HeadsMoved()
        return storage_error(error, self.outage)

    def _fenced_off(self) -> Fenced:
        assert self._fence is not None
        error = Fenced(self._fence.name)
        if not self.fenced:
            self.fenced = True
            if self._on_fenced is not None:
                self._on_fenced(error)
        return error

    async def foreign_heads(self, queues: Iterable[str]) -> dict[str, dict[int, int]]:
        """Heads that other writers advanced past this store's cache, per queue and
        partition, in one query; the cache takes them over, so each is reported once.
        Read on the writer thread, in one hand-over: through the async engine, on SQLite,
        it held the write lock (its BEGIN IMMEDIATE) for a loop round trip per step, and
        under a publish flood every append waited seconds behind it."""
        names = sorted(set(queues) & self.queues.keys())
        if not names:
            return {}
        p = kg_partitions
        query = sa.select(p.c.queue, p.c.partition, p.c.head_seq).where(p.c.queue.in_(names))
        rows = await self.write(lambda conn: conn.execute(query).all(), fenced=False)
        advanced: dict[str, dict[int, int]] = {}
        for queue, partition, head in rows:
            if head > self.heads.get((queue, partition), 0):
                self.heads[(queue, partition)] = head
                advanced.setdefault(queue, {})[partition] = head
        return advanced

    async def listen_heads(self, hint: Callable[[], None]) -> Callable[[], Awaitable[None]]:
        """On PostgreSQL, call ``hint`` whenever another writer advances a partition head
        (the HEADS_CHANNEL notification); returns the coroutine function that stops. A
        no-op on SQLite, and after a lost connection: the periodic head check (Broker.
        check_heads) is the guarantee, the notification only makes it prompt."""
        if self.engine.dialect.name != "postgresql":
            return _nothing
        try:
            conn = await self.engine.connect()
            driver: Any = (await conn.get_raw_connection()).driver_connection
        except self._driver_errors as e:
            raise storage_error(e, self.outage) from e

        def notified(*_: object) -> None:
            hint()

        async def stop() -> None:
            with suppress(Exception):  # the connection may be gone already
                await driver.remove_listener(HEADS_CHANNEL, notified)
            with suppress(*self._driver_errors):
                await conn.close()

        try:
            await driver.add_listener(HEADS_CHANNEL, notified)
        except Exception as e:
            await stop()
            raise StorageError(f"cannot listen for {HEADS_CHANNEL}: {e}") from e
        return stop

    @asynccontextmanager
    async def transaction(self, *, fenced: bool = True) -> AsyncIterator[AsyncConnection]:
        """One transaction; driver failures become StorageError, keygate errors pass.

        Once the store is fenced (``fence``), the transaction starts with the lease check
        unless ``fenced`` is False (the lease's own statements); a fenced-off store runs
        no such transaction at all.
        """
        check = fenced and self._fence is not None
        if check and self.fenced:
            raise self._fenced_off()
        try:
            if self._sqlite_lock is None:
                async with self.engine.begin() as connection:
                    if check:
                        await connection.run_sync(self._check_fence)
                    yield connection
            else:
                async with self._sqlite_lock.hold(), self.engine.begin() as connection:
                    if check:
                        await connection.run_sync(self._check_fence)
                    yield connection
        except LeaseTaken:
            raise self._fenced_off() from None
        except self._driver_errors as e:
            raise self._driver_error(e) from e
        self.outage.answered()

    async def load_caches(self) -> None:
        async with self.transaction() as conn:
            queues = await read_queues(conn)
            heads = await conn.execute(sa.select(kg_partitions))
            depths = await conn.execute(
                sa.select(
                    kg_messages.c.queue,
                    sa.func.count(),
                    sa.func.coalesce(sa.func.sum(kg_messages.c.size), 0),
                ).group_by(kg_messages.c.queue)
            )
            self.queues = {q.name: q for q in queues}
            self.heads = {(r.queue, r.partition): r.head_seq for r in heads}
            self.depths = {name: [0, 0] for name in self.queues}
            for queue, count, size in depths:
                self.depths[queue] = [int(count), int(size)]

    def queue(self, name: str) -> QueueConfig:
        try:
            return self.queues[name]
        except KeyError:
            raise QueueNotFound(name) from None

    def forget_queue(self, name: str) -> None:
        config = self.queues.pop(name, None)
        self.depths.pop(name, None)
        for partition in range(config.slots if config else 0):
            self.heads.pop((name, partition), None)


async def read_queues(conn: AsyncConnection, name: str | None = None) -> list[QueueConfig]:
    """Queues as stored (all, or the one named), with their subscriptions."""
    queues = sa.select(kg_queues).order_by(kg_queues.c.name)
    subs = sa.select(kg_subscriptions).order_by(kg_subscriptions.c.pattern)
    if name is not None:
        queues = queues.where(kg_queues.c.name == name)
        subs = subs.where(kg_subscriptions.c.queue == name)
    patterns: dict[str, list[str]] = {}
    for row in await conn.execute(subs):
        patterns.setdefault(row.queue, []).append(row.pattern)
    rows = (await conn.execute(queues)).mappings()
    return [queue_from_row(row, tuple(patterns.get(row["name"], ()))) for row in rows]


@functools.cache
def _insert_sql(dialect: sa.Dialect) -> str:
    """The kg_messages INSERT in ``dialect``'s SQL with positional parameters (psycopg's
    named default style is compiled as its positional ``%s`` one)."""
    if not dialect.positional:
        same_driver: Any = type(dialect)
        dialect = same_driver(paramstyle="format")
    compiled = sa.insert(kg_messages).compile(dialect=dialect, column_keys=list(MESSAGE_COLUMNS))
    return str(compiled)


def _ping(conn: sa.Connection) -> None:
    """A first statement on PostgreSQL, where a dropped connection shows before anything
    was written (none on SQLite: its connection is a file)."""
    if conn.dialect.name == "postgresql":
        conn.execute(_PING)


def _no_check(conn: sa.Connection) -> None:
    """No first statement: the write's body proves the fence itself."""


async def _nothing() -> None:
    return None
