"""The SQL store: keygate's durable store, composed of its parts, and the reads. Appends
live in storage.appends, retention in storage.retention, the rest of its interface in
storage.admin (queues, groups), storage.consumer (dispatch, offsets, dead letters,
flows), storage.leases, storage.protocol_state (AMQP exchanges, MQTT sessions) and
storage.inspection (the views as dicts).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Sequence
from operator import attrgetter
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from core.errors import StorageError, StorageMisconfigured
from core.model import Message
from storage.appends import AppendCall, AppendOps, AppendOutcome
from storage.batcher import GroupCommitter
from storage.codec import message_from_row, salvage_values
from storage.consumer import ConsumerOps
from storage.engine import async_engine, sync_engine
from storage.inspection import InspectionOps
from storage.leases import LeaseOps
from storage.migrate import LeaseClaim, migrate
from storage.outage import detail, diagnose
from storage.retention import Riders
from storage.schema import LARGE_ROWS, kg_messages
from storage.statements import json_rows, per_dialect
from storage.writer import WriterThread

_log = logging.getLogger("keygate.storage")

DEFAULT_MAX_BATCH: Final = 1000
DEFAULT_LINGER: Final = 0.0


def _partition_query(queue: str, partition: int, after_seq: int, limit: int) -> sa.Select[Any]:
    m = kg_messages
    return (
        sa.select(m)
        .where(m.c.queue == queue, m.c.partition == partition, m.c.seq > after_seq)
        .order_by(m.c.seq)
        .limit(limit)
    )


# Partition pages read_for_delivery reads in one statement on SQLite (it allows 500
# SELECTs in a compound statement).
READ_PAGES: Final = 64
_SEQ: Final = attrgetter("seq")
_COLUMNS: Final = ", ".join(f'"{column.name}"' for column in kg_messages.c)
# Past any seq: a page that meets no large message it must end before.
_NO_SEQ: Final = 2**63 - 1


def _page_end(partition: str, after: str, limit: str, max_bytes: str) -> str:
    """SQL for the last seq a page may hold (core.actions.fetched): that of the large
    message with which the sizes of its large messages pass ``max_bytes``, found in
    ix_kg_messages_large alone. Arguments: SQL for the page's values. The sum is asked for
    only when the partition has a large message past ``after``: a seek in that index, where
    the window over none cost SQLite 4 µs a page."""
    large = (
        f'kg_messages WHERE queue = :queue AND "partition" = {partition} AND seq > {after}'
        f" AND {LARGE_ROWS.text}"
    )
    return (
        f"CASE WHEN EXISTS (SELECT 1 FROM {large}) THEN COALESCE((SELECT seq FROM"
        f" (SELECT seq, SUM(size) OVER (ORDER BY seq) AS upto FROM {large} ORDER BY seq"
        f" LIMIT {limit}) AS large WHERE upto > {max_bytes} LIMIT 1), {_NO_SEQ})"
        f" ELSE {_NO_SEQ} END"
    )


@functools.cache
def _pages_query(pages: int) -> sa.TextClause:
    """SQLite: pages of several partitions in one statement (text: a compound select built
    by SQLAlchemy is compiled again on most executions), columns in MESSAGE_COLUMNS order.

    Several pages: their rowids are found in the key index alone, and the rows then read
    in rowid order, which is the order they were appended in. Messages of many partitions
    interleave on the table's pages, so a page of one partition touches as many table
    pages as it has messages; read in rowid order, each table page is read once for every
    partition's messages on it. For one page it costs more than it saves (an index of
    the rowids is built first), so one page reads its rows in key order. Instructions per
    message consumed: 3-4 % less at 16 and 256 partitions, 3 % more for a single page
    (benchmarks.native_instructions --partitions N)."""
    selected = "rowid" if pages > 1 else _COLUMNS
    arms = " UNION ALL ".join(
        f"SELECT * FROM (SELECT {selected} FROM kg_messages WHERE queue = :queue"
        f' AND "partition" = :p{i} AND seq > :a{i}'
        f" AND seq <= {_page_end(f':p{i}', f':a{i}', f':l{i}', f':b{i}')}"
        f" ORDER BY seq LIMIT :l{i}) AS page{i}"
        for i in range(pages)
    )
    if pages > 1:
        arms = f"SELECT {_COLUMNS} FROM kg_messages WHERE rowid IN ({arms})"
    # No column types: rows come as the driver made them, with no per-row processing
    # (codec.salvage_values decodes them).
    return sa.text(arms)


# PostgreSQL: every page of a read in one statement whose text does not depend on how
# many pages there are (the pages are one JSON document, storage.statements.json_rows, as
# in the offset flush; each page an index scan of its own): one prepared statement and
# plan per connection. As a UNION ALL of N pages (a statement per N, each of up to 192
# parameters planned again and again) the reads cost PostgreSQL 1.2 s of CPU per 100,000
# messages consumed at 256 partitions, against 0.5-0.7 s in one statement
# (docs/performance.md, "Eleventh session").
_PAGES: Final = sa.text(
    "SELECT m.* FROM "
    + json_rows(
        {"partition": "integer", "after": "bigint", "max_rows": "integer", "max_bytes": "bigint"},
        postgres=True,
        param="pages",
    )
    + f" CROSS JOIN LATERAL (SELECT {_COLUMNS} FROM kg_messages WHERE queue = :queue"
    ' AND "partition" = j."partition" AND seq > j.after'
    + " AND seq <= "
    + _page_end('j."partition"', "j.after", "j.max_rows", "j.max_bytes")
    + " ORDER BY seq LIMIT j.max_rows) AS m"
)


# Messages by (partition, seq), the pairs one JSON document (read_seqs): noted scheduled
# messages read back when due, from any number of partitions in one statement.
_SEQS: Final = per_dialect(
    "SELECT " + ", ".join(f'm."{column.name}"' for column in kg_messages.c) + " FROM {rows}"
    ' JOIN kg_messages AS m ON m.queue = :queue AND m."partition" = j."partition"'
    " AND m.seq = j.seq",
    {"partition": "integer", "seq": "bigint"},
)


def _page_statements(
    queue: str, pages: Sequence[tuple[int, int, int, int]], postgres: bool
) -> list[tuple[sa.TextClause, dict[str, Any]]]:
    """The statements that read ``pages`` (partition, after_seq, limit, max_bytes), with
    parameters."""
    if postgres:
        document = [
            {"partition": p, "after": a, "max_rows": n, "max_bytes": b} for p, a, n, b in pages
        ]
        return [(_PAGES, {"queue": queue, "pages": json.dumps(document)})]
    statements = []
    for start in range(0, len(pages), READ_PAGES):
        chunk = pages[start:][:READ_PAGES]
        params: dict[str, Any] = {"queue": queue}
        for i, (partition, after_seq, limit, max_bytes) in enumerate(chunk):
            params.update(
                {f"p{i}": partition, f"a{i}": after_seq, f"l{i}": limit, f"b{i}": max_bytes}
            )
        statements.append((_pages_query(len(chunk)), params))
    return statements


class SqlStore(InspectionOps, LeaseOps, AppendOps, ConsumerOps):
    """keygate's durable store. Create it with ``open_store``; one active writer per DB."""

    def __init__(
        self, url: str, engine: AsyncEngine, writer: WriterThread, *, max_batch: int, linger: float
    ) -> None:
        super().__init__(url, engine, writer)
        self.appender = GroupCommitter[list[AppendCall], list[AppendOutcome]](
            self._write_appends, max_weight=max_batch, linger=linger, name="kg-append"
        )
        self.start_dispatcher(linger)
        self._pipelines = engine.dialect.name == "postgresql"
        # Untyped reads get properties as JSON text from SQLite, decoded from JSONB.
        self._json_text = engine.dialect.name == "sqlite"
        self._retained = {}
        self.riders = None if self._pipelines else Riders()

    def tasks(self) -> dict[str, asyncio.Task[None]]:
        """The store's background tasks by what they do; each runs until ``close``."""
        return {
            "the append writer": self.appender.task,
            "the dispatch writer": self.dispatcher.task,
        }

    async def close(self) -> None:
        """Write every pending append and dispatch record, then release the database."""
        await self.appender.close()
        await self.dispatcher.close()
        await self.writer.close()
        await self.engine.dispose()

    async def read(self, queue: str, partition: int, after_seq: int, limit: int) -> list[Message]:
        """Up to ``limit`` stored messages of the partition with seq > ``after_seq``, in order."""
        query = _partition_query(queue, partition, after_seq, limit)
        async with self.transaction(fenced=False) as conn:
            return [message_from_row(row) for row in (await conn.execute(query)).mappings()]

    async def read_for_delivery(
        self, queue: str, pages: Sequence[tuple[int, int, int, int]]
    ) -> dict[int, tuple[list[Message], frozenset[int]]]:
        """For each (partition, after_seq, limit, max_bytes) page: ``read`` ended as
        ``core.actions.fetched`` ends it (by ix_kg_messages_large), except that a row whose
        properties cannot be decoded (written by an older version, or by hand) does not
        fail the read: it comes back salvaged (the unreadable values as JSON text) and its
        seq is in the returned set, for the group to dead-letter as undeliverable. One
        transaction: one statement on PostgreSQL, one per READ_PAGES pages on SQLite."""
        return await self._pages(
            [page[0] for page in pages], _page_statements(queue, pages, self._pipelines)
        )

    async def read_seqs(
        self, queue: str, wanted: Sequence[tuple[int, Sequence[int]]]
    ) -> dict[int, tuple[list[Message], frozenset[int]]]:
        """For each (partition, seqs): those of its messages still stored, in seq order, and
        the seqs of those that could not be read back whole (as ``read_for_delivery``).
        Noted scheduled messages come due (core.actions.Fetch ``seqs``). One statement
        with one parameter (the seqs as a JSON document), however many seqs."""
        document = json.dumps([{"partition": p, "seq": s} for p, seqs in wanted for s in seqs])
        statement = _SEQS["postgresql" if self._pipelines else "sqlite"]
        return await self._pages(
            [p for p, _ in wanted], [(statement, {"queue": queue, "rows": document})]
        )

    async def _pages(
        self, partitions: Sequence[int], statements: Sequence[tuple[sa.TextClause, dict[str, Any]]]
    ) -> dict[int, tuple[list[Message], frozenset[int]]]:
        """Run ``statements`` (reads of whole kg_messages rows) in one transaction: per
        partition its messages in seq order and the seqs of those that could not be read
        back whole (salvaged, for the group to dead-letter as undeliverable)."""
        found: dict[int, list[Message]] = {p: [] for p in partitions}
        unreadable: dict[int, set[int]] = {p: set() for p in partitions}
        async with self.transaction() as conn:
            for statement, params in statements:
                result = await conn.execute(statement, params)
                # The driver's own rows (the async adapters fetch them all at execute):
                # no Row object per message.
                rows = result.cursor.fetchall()
                result.close()
                for row in rows:
                    message, readable = salvage_values(row, json_text=self._json_text)
                    found[message.partition].append(message)
                    if not readable:
                        unreadable[message.partition].add(message.seq)
        return {
            p: (sorted(messages, key=_SEQ), frozenset(unreadable[p]))
            for p, messages in found.items()
        }

    async def head_seqs(self, queue: str) -> dict[int, int]:
        """The last committed seq of every partition (0 = nothing stored yet)."""
        config = self.queue(queue)
        return {p: self.heads.get((queue, p), 0) for p in range(config.slots)}

    async def depth(self, queue: str) -> tuple[int, int]:
        """(messages, bytes) currently stored in the queue."""
        self.queue(queue)
        messages, size = self.depths.get(queue, [0, 0])
        return messages, size


async def open_store(
    url: str,
    *,
    max_batch: int = DEFAULT_MAX_BATCH,
    linger: float = DEFAULT_LINGER,
    application_name: str | None = None,
    claim: LeaseClaim | None = None,
) -> SqlStore:
    """Migrate the database at ``url`` (sqlite:///path or postgresql://...) and open it.
    A gateway passes its ``claim``: the lease is taken in the migration's transaction.
    SchemaBusy (nothing changed) while another gateway's lease is live and the schema
    needs changing, or with ``claim``; SchemaTooNew for a newer keygate's schema."""
    try:
        await migrate(url, claim=claim)
    except (sa.exc.SQLAlchemyError, OSError) as e:
        # psycopg, which migrates, cannot say whether the server refused the session for
        # its settings: asyncpg asks again when that may be it (storage.outage).
        refused = await diagnose(url) if isinstance(e, sa.exc.OperationalError) else None
        if refused is not None:
            raise StorageMisconfigured(
                f"the database refuses the gateway's sessions: {detail(refused)} (check the "
                "user, password and database of the db setting)"
            ) from e
        raise StorageError(f"cannot migrate the database: {e}") from e
    engine = async_engine(url, application_name=application_name)
    writer = WriterThread(sync_engine(url, application_name=application_name))
    store = SqlStore(url, engine, writer, max_batch=max_batch, linger=linger)
    try:
        await store.load_caches()
    except BaseException:
        await store.close()
        raise
    return store
