"""The ``keygate`` PySpark data source: batch and streaming reads of one queue for one group.

Planning (``partitions``, offsets, commits) runs on the driver and talks to SQL through
engines created lazily and never pickled; ``read`` runs on executors with its own
connection (spark.reader). A streaming query takes the group's Spark lease (spark.lease)
on its first offset request and keeps it as it plans and commits: a renewal that finds
the lease lost (taken over after it lapsed) raises LeaseLost and the query fails. The
lease is not taken when the reader is built: PySpark also builds stream readers in worker
processes that only ``read``. PySpark never calls ``stop`` when a query ends; the listener that
``spark.register`` adds releases a stopped query's lease (spark.stopping), and without it
the lease lapses after ``leaseTimeout`` (a restart waits for it, spark.lease).
``commit(end)`` is idempotent and monotonic (spark.db.commit_through).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

import pyarrow as pa
import sqlalchemy as sa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from spark import lease, stopping
from spark.db import (
    PartitionState,
    commit_through,
    ensure_group,
    first_not_due,
    group_tags,
    load_partitions,
    write_engine,
)
from spark.options import Offsets, SourceOptions, offsets_json, parse_options
from spark.plan import ReadRange, end_offsets, limit_offsets, read_ranges, start_offsets
from spark.reader import SCHEMA_DDL, read_range

# A lease is renewed once a third of its time has passed: two missed plans still keep it.
RENEW_FRACTION: Final = 1 / 3


class _Planner:
    """Driver-side SQL access shared by the batch and stream readers."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._engine: sa.Engine | None = None
        self._renewed = -math.inf
        self._tags: tuple[tuple[str, str], ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        # Executors only need the options; an engine holds sockets and locks.
        return {"options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.options = state["options"]
        self._engine = None
        self._renewed = -math.inf
        self._tags = ()

    @property
    def engine(self) -> sa.Engine:
        if self._engine is None:
            self._engine = write_engine(self.options.url)
        return self._engine

    def states(self, owner: str | None = None) -> dict[int, PartitionState]:
        """Group state after checking holders: Spark lease renewed for ``owner`` when given,
        otherwise only native holders are refused."""
        o, now = self.options, time.time()
        if owner is not None and now - self._renewed >= o.lease_timeout * RENEW_FRACTION:
            # Renewing is a write: not on every poll of an idle stream.
            with self.engine.begin() as conn:
                ensure_group(conn, o.queue, o.group, now)
                if self._renewed > -math.inf:
                    lease.keep(conn, o.queue, o.group, owner, o.lease_timeout, now)
            if self._renewed == -math.inf:
                lease.acquire_waiting(self.engine, o.queue, o.group, owner, o.lease_timeout)
                stopping.claim(o.url, o.queue, o.group, owner)
            self._renewed = time.time()
        with self.engine.begin() as conn:
            ensure_group(conn, o.queue, o.group, now)
            if owner is None:
                lease.refuse_native_holders(conn, o.queue, o.group, now)
            self._tags = group_tags(conn, o.queue, o.group)
            return load_partitions(conn, o.queue, o.group, due_at=o.due_at)

    def ranges(
        self,
        states: dict[int, PartitionState],
        start: Offsets,
        end: Offsets,
        live_at: float | None = None,
    ) -> list[ReadRange]:
        o = self.options
        return read_ranges(
            url=o.url,
            queue=o.queue,
            group=o.group,
            states=states,
            start=start,
            end=end,
            min_partitions=o.min_partitions,
            include_properties=o.include_properties,
            tags=self._tags,
            live_at=live_at,
        )

    def dispose(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None


def _offsets(raw: dict[str, Any]) -> Offsets:
    return {int(partition): int(seq) for partition, seq in raw.items()}


class KeygateBatchReader(_Planner, DataSourceReader):
    """``spark.read``: the group's messages from startingOffsets to endingOffsets.

    A batch read commits nothing, so it takes no lease; consume_batch does.
    """

    def partitions(self) -> Sequence[InputPartition]:
        try:
            states = self.states()
            start = start_offsets(states, self.options.start)
            return self.ranges(states, start, end_offsets(states, self.options.end))
        finally:
            self.dispose()

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        # Nothing to read: PySpark replaces an empty partition list with one
        # InputPartition(None).
        return read_range(partition) if isinstance(partition, ReadRange) else iter(())


class KeygateStreamReader(_Planner, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream``: per-partition seq offsets, committed to the group in SQL."""

    def __init__(self, options: SourceOptions) -> None:
        super().__init__(options)
        self.owner = lease.new_owner("stream")
        self._target: Offsets | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "owner": self.owner}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.owner = state["owner"]
        self._target = None

    def initialOffset(self) -> dict[str, int]:
        return offsets_json(start_offsets(self.states(self.owner), self.options.start))

    def getDefaultReadLimit(self) -> ReadLimit:
        limit = self.options.max_offsets_per_trigger
        return ReadMaxRows(limit) if limit else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = end_offsets(self.states(self.owner), None)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        states = self.states(self.owner)
        begin = {p: _offsets(start).get(p, s.committed) for p, s in states.items()}
        end = end_offsets(states, self._target)
        end = {p: max(begin[p], seq) for p, seq in end.items()}
        if isinstance(limit, ReadMaxRows):
            end = limit_offsets(begin, end, limit.max_rows)
        return offsets_json(self._due(begin, end))

    def _due(self, begin: Offsets, end: Offsets) -> Offsets:
        """``end`` stopped just before each partition's first message that is not due
        (scheduled later, or nacked with its redelivery later): it is read once due, and
        no later message of its partition, so of its key, overtakes it."""
        o = self.options
        spans = {p: (begin[p], seq) for p, seq in end.items()}
        with self.engine.connect() as conn:
            held = first_not_due(conn, o.queue, o.group, spans, time.time())
        return {p: min(seq, held[p] - 1) if p in held else seq for p, seq in end.items()}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        # Expired messages are left out (the commit settles them); planned again after a
        # restart, more may have expired: they are left out too.
        states = self.states(self.owner)
        return self.ranges(states, _offsets(start), _offsets(end), live_at=time.time())

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, ReadRange)
        return read_range(partition)

    def commit(self, end: dict[str, Any]) -> None:
        o, now = self.options, time.time()
        with self.engine.begin() as conn:
            if self._renewed == -math.inf:
                lease.acquire(conn, o.queue, o.group, self.owner, o.lease_timeout, now)
                stopping.claim(o.url, o.queue, o.group, self.owner)
            else:
                lease.keep(conn, o.queue, o.group, self.owner, o.lease_timeout, now)
            self._renewed = now
            commit_through(conn, o.queue, o.group, _offsets(end), now)

    def stop(self) -> None:
        try:
            if self._renewed > -math.inf:  # only an instance that took the lease gives it up
                with self.engine.begin() as conn:
                    lease.release(conn, self.options.queue, self.options.group, self.owner)
        finally:
            self.dispose()


class KeygateDataSource(DataSource):
    """``format("keygate")``; options in docs/spark.md."""

    @classmethod
    def name(cls) -> str:
        return "keygate"

    def schema(self) -> str:
        return SCHEMA_DDL

    def reader(self, schema: StructType) -> DataSourceReader:
        return KeygateBatchReader(parse_options(self.options))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return KeygateStreamReader(parse_options(self.options))


__all__ = ["KeygateBatchReader", "KeygateDataSource", "KeygateStreamReader"]
