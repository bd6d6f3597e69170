"""``consume_batch``: read a group's backlog, run the user's function, settle in SQL.

How it works:

1. Create the group if absent and take its Spark lease (refused while native consumers
   hold it). Snapshot every partition's committed seq and head.
2. Build the DataFrame with the ``keygate`` source for exactly ``committed < seq <= end``
   (``end`` = head, or less under ``max_messages``). The source skips seqs the group acked
   individually above its committed seq, so the batch is the unsettled backlog, and a
   message nacked by an earlier batch is in it again once its redelivery is due (the
   queue's backoff, recorded in ``kg_deliveries.redeliver_at``); one not due yet is left
   out and stays pending.
3. Call ``fn(df)``. It may return the ids of messages that failed (an iterable of
   strings, or a DataFrame with a ``message_id`` column). If it raises, the rows that make
   it raise are isolated by re-running it on halves (spark/isolate.py); they count as
   failed, with the exception's type as their dead-letter reason. If it raises on every
   row, nothing is written and the exception is raised.
4. In one transaction, first proving the lease taken in 1. was never lost (otherwise
   LeaseLost, nothing settled: spark.lease.keep): successes acked (committed seq over
   contiguous successes, ranges above it for the rest); each failure's delivery count + 1
   in ``kg_deliveries`` (first delivery time kept, due again after the queue's backoff);
   a failure whose count reaches the queue's ``max_deliveries`` is copied to the
   dead-letter queue with its ``x-`` properties and settled.
5. Release the lease.

Dead letters get seq = the DLQ partition's last seq + 1 inside the transaction (the
partition row is the lock). A running gateway also appends to the DLQ and keeps its
heads in memory; see docs/spark.md, "Dead letters written by Spark".
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import sqlalchemy as sa
from pyspark.sql import DataFrame, SparkSession

from core.actions import DeadLetter
from core.backoff import redelivery_delay
from core.errors import InvalidArgument
from core.ledger import AckLedger
from core.model import DEAD_LETTER_REASON, DeadLetterReason, Message, QueueConfig
from spark import lease
from spark.db import (
    PartitionState,
    ensure_group,
    ensure_queue,
    load_partitions,
    write_engine,
    write_offsets,
)
from spark.isolate import DEFAULT_ISOLATION_RUNS, Outcome, run_isolated
from spark.options import DEFAULT_LEASE_TIMEOUT, offsets_json
from spark.plan import limit_offsets
from spark.source import KeygateDataSource
from storage.codec import message_from_row, message_row
from storage.consumer import dead_letter_copy
from storage.schema import kg_deliveries, kg_messages, kg_partitions
from storage.statements import upsert

DLQ_PARTITION: Final = 0
_ID_CHUNK: Final = 500


@dataclass(frozen=True, slots=True)
class BatchResult:
    """What one consume_batch call did. ``committed`` is the group's committed seq per
    partition afterwards."""

    read: int
    acked: int
    nacked: int
    dead_lettered: int
    committed: dict[int, int]


@dataclass(frozen=True, slots=True)
class _Failure:
    message: Message
    delivery_count: int
    first_delivery_time: float
    # The exception's type when fn raised on this row alone (poison), else None.
    error: str | None = None


def _in_batch(
    message: Message,
    start: Mapping[int, int],
    end: Mapping[int, int],
    states: Mapping[int, PartitionState],
) -> bool:
    p = message.partition
    if not start.get(p, 0) < message.seq <= end.get(p, -1):
        return False
    return not any(lo <= message.seq <= hi for lo, hi in states[p].acked_above)


def _count_read(
    conn: sa.Connection,
    queue: str,
    start: Mapping[int, int],
    end: Mapping[int, int],
    states: Mapping[int, PartitionState],
) -> int:
    m = kg_messages
    total = 0
    for p, hi in end.items():
        if hi <= start[p]:
            continue
        hidden = (*states[p].acked_above, *states[p].deferred, *states[p].expired)
        skipped = [sa.not_(m.c.seq.between(lo, top)) for lo, top in hidden]
        query = sa.select(sa.func.count()).where(
            m.c.queue == queue, m.c.partition == p, m.c.seq > start[p], m.c.seq <= hi, *skipped
        )
        total += int(conn.execute(query).scalar_one())
    return total


def _failures(
    conn: sa.Connection,
    queue: str,
    group: str,
    outcome: Outcome,
    start: Mapping[int, int],
    end: Mapping[int, int],
    states: Mapping[int, PartitionState],
    now: float,
) -> list[_Failure]:
    m, d = kg_messages, kg_deliveries
    messages: list[Message] = []
    ids = outcome.failed | outcome.poison.keys()
    ordered = sorted(ids)
    for i in range(0, len(ordered), _ID_CHUNK):
        query = sa.select(m).where(
            m.c.queue == queue, m.c.message_id.in_(ordered[i : i + _ID_CHUNK])
        )
        messages.extend(
            message
            for message in map(message_from_row, conn.execute(query).mappings())
            if _in_batch(message, start, end, states)
        )
    unknown = ids - {message.message_id for message in messages}
    if unknown:
        raise InvalidArgument(
            f"fn reported {len(unknown)} message id(s) that are not in this batch, "
            f"e.g. {sorted(unknown)[0]!r}; nothing was committed"
        )
    records: dict[tuple[int, int], tuple[int, float | None]] = {}
    seqs: dict[int, list[int]] = {}
    for message in messages:
        seqs.setdefault(message.partition, []).append(message.seq)
    for partition, wanted in seqs.items():
        for i in range(0, len(wanted), _ID_CHUNK):
            query = sa.select(d.c.seq, d.c.delivery_count, d.c.first_delivery_time).where(
                d.c.queue == queue,
                d.c.group_name == group,
                d.c.partition == partition,
                d.c.seq.in_(wanted[i : i + _ID_CHUNK]),
            )
            for row in conn.execute(query):
                records[(partition, row.seq)] = (row.delivery_count, row.first_delivery_time)
    failures = []
    for message in messages:
        # No record: delivered once before iff at or below dispatched_seq (see reader).
        seen = int(message.seq <= states[message.partition].dispatched)
        before, first = records.get((message.partition, message.seq), (seen, None))
        error = outcome.poison.get(message.message_id)
        failures.append(_Failure(message, before + 1, first if first is not None else now, error))
    return failures


def _append_dead_letters(
    conn: sa.Connection,
    config: QueueConfig,
    group: str,
    letters: list[DeadLetter],
    errors: Mapping[str, str],
    now: float,
) -> None:
    """Append ``letters`` to the DLQ; a poison row's reason is ``exception:<type>``."""
    dlq = config.dlq_name
    if dlq is None or not letters:
        return
    ensure_queue(conn, QueueConfig(name=dlq, dead_letter_queue=""), now)
    p, m = kg_partitions, kg_messages
    this = sa.and_(p.c.queue == dlq, p.c.partition == DLQ_PARTITION)
    head = conn.execute(sa.select(p.c.head_seq).where(this).with_for_update()).scalar_one()
    stored = conn.execute(
        sa.select(sa.func.max(m.c.seq)).where(m.c.queue == dlq, m.c.partition == DLQ_PARTITION)
    ).scalar_one()
    seq = max(head, stored or 0)
    copies = []
    for letter in letters:
        seq += 1
        copy = dead_letter_copy(letter, group, dlq, DLQ_PARTITION, seq, now)
        error = errors.get(letter.message.message_id)
        if error is not None:
            reason = {**copy.properties, DEAD_LETTER_REASON: f"exception:{error}"}
            copy = dataclasses.replace(copy, properties=reason)
        copies.append(copy)
    conn.execute(sa.insert(m), [message_row(copy) for copy in copies])
    conn.execute(sa.update(p).where(this).values(head_seq=seq))


def _record_nacks(
    conn: sa.Connection, config: QueueConfig, group: str, nacked: list[_Failure], now: float
) -> None:
    """Count the failed delivery and set when the message is due again (the queue's
    redelivery backoff, as for a native consumer's nack)."""
    if not nacked:
        return
    keys = ("queue", "group_name", "partition", "seq")
    conn.execute(
        upsert(conn, kg_deliveries, keys, ("delivery_count", "redeliver_at")),
        [
            {
                "queue": config.name,
                "group_name": group,
                "partition": f.message.partition,
                "seq": f.message.seq,
                "delivery_count": f.delivery_count,
                "first_delivery_time": f.first_delivery_time,
                "redeliver_at": now + redelivery_delay(config, f.delivery_count, None),
            }
            for f in nacked
        ],
    )


def _expired_letters(
    conn: sa.Connection,
    config: QueueConfig,
    group: str,
    states: Mapping[int, PartitionState],
    start: Mapping[int, int],
    end: Mapping[int, int],
) -> list[DeadLetter]:
    """Dead letters for the expired messages of this batch's ranges (the queue asked)."""
    m, d = kg_messages, kg_deliveries
    letters = []
    for p, hi in end.items():
        for lo, top in states[p].expired:
            lo, top = max(lo, start[p] + 1), min(top, hi)
            if lo > top:
                continue
            where = sa.and_(m.c.queue == config.name, m.c.partition == p, m.c.seq.between(lo, top))
            counts: dict[int, int] = dict(
                conn.execute(  # type: ignore[arg-type]
                    sa.select(d.c.seq, d.c.delivery_count).where(
                        d.c.queue == config.name,
                        d.c.group_name == group,
                        d.c.partition == p,
                        d.c.seq.between(lo, top),
                    )
                ).all()
            )
            for row in conn.execute(sa.select(m).where(where).order_by(m.c.seq)).mappings():
                message = message_from_row(row)
                letters.append(
                    DeadLetter(message, DeadLetterReason.EXPIRED, counts.get(message.seq, 0), None)
                )
    return letters


def _settle(
    conn: sa.Connection,
    config: QueueConfig,
    group: str,
    states: Mapping[int, PartitionState],
    start: Mapping[int, int],
    end: Mapping[int, int],
    failures: list[_Failure],
    now: float,
) -> tuple[list[_Failure], list[DeadLetter], dict[int, int]]:
    limit = config.max_deliveries
    dead = [f for f in failures if limit and f.delivery_count >= limit]
    nacked = [f for f in failures if not (limit and f.delivery_count >= limit)]
    unsettled: dict[int, set[int]] = {}
    for f in nacked:
        unsettled.setdefault(f.message.partition, set()).add(f.message.seq)
    for p, state in states.items():  # not due yet: not in this batch, still pending
        for lo, hi in state.deferred:
            unsettled.setdefault(p, set()).update(range(lo, hi + 1))
    ledgers: dict[int, AckLedger] = {}
    for p, hi in end.items():
        if hi <= start[p]:
            continue
        ledger = AckLedger(states[p].committed, states[p].acked_above)
        lo = start[p] + 1
        for seq in sorted(unsettled.get(p, ())):
            ledger.settle_range(lo, seq - 1)
            lo = seq + 1
        ledger.settle_range(lo, hi)
        ledgers[p] = ledger
    letters = [
        DeadLetter(
            f.message, DeadLetterReason.MAX_DELIVERIES, f.delivery_count, f.first_delivery_time
        )
        for f in dead
    ]
    if config.dead_letter_expired and config.dlq_name:
        letters += _expired_letters(conn, config, group, states, start, end)
    errors = {f.message.message_id: f.error for f in dead if f.error is not None}
    _append_dead_letters(conn, config, group, letters, errors, now)
    write_offsets(conn, config.name, group, ledgers, dict(end), now)
    _record_nacks(conn, config, group, nacked, now)
    return nacked, letters, {p: ledger.committed for p, ledger in ledgers.items()}


def consume_batch(
    session: SparkSession,
    url: str,
    queue: str,
    group: str,
    fn: Callable[[DataFrame], Any],
    *,
    max_messages: int | None = None,
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
    isolation_runs: int = DEFAULT_ISOLATION_RUNS,
) -> BatchResult:
    """Run ``fn`` on the group's unsettled backlog and settle it (blocks until done).

    Raises GroupLeased when native consumers or another Spark job hold the group. When
    ``fn`` raises, at most ``isolation_runs`` more runs on halves of the batch find the
    rows that make it raise (0 turns isolation off); they count as failed and the rest is
    settled. When it raises on every row (or the runs are spent), its exception is raised
    and nothing is committed. ``fn`` is not called when the backlog is empty.
    ``lease_timeout`` must exceed fn's run time (isolation runs included): the lease is
    renewed only when the batch is settled, and if another consumer took the group after
    it lapsed, LeaseLost is raised and nothing is settled.
    """
    if max_messages is not None and max_messages < 1:
        raise InvalidArgument("max_messages must be >= 1 or None")
    if isolation_runs < 0:
        raise InvalidArgument("isolation_runs must be >= 0")
    owner = lease.new_owner("consume_batch")
    engine = write_engine(url)
    try:
        now = time.time()
        with engine.begin() as conn:
            config = ensure_group(conn, queue, group, now)
            lease.acquire(conn, queue, group, owner, lease_timeout, now)
            states = load_partitions(conn, queue, group, due_at=now)
        try:
            return _run(
                session,
                url,
                engine,
                config,
                group,
                owner,
                states,
                fn,
                max_messages,
                lease_timeout,
                isolation_runs,
                due_at=now,
            )
        finally:
            with engine.begin() as conn:
                lease.release(conn, queue, group, owner)
    finally:
        engine.dispose()


def _run(
    session: SparkSession,
    url: str,
    engine: sa.Engine,
    config: QueueConfig,
    group: str,
    owner: str,
    states: dict[int, PartitionState],
    fn: Callable[[DataFrame], Any],
    max_messages: int | None,
    lease_timeout: float,
    isolation_runs: int,
    *,
    due_at: float,
) -> BatchResult:
    queue = config.name
    start = {p: s.committed for p, s in states.items()}
    end = {p: s.head for p, s in states.items()}
    if max_messages is not None:
        end = limit_offsets(start, end, max_messages)
    committed = dict(start)
    with engine.connect() as conn:
        read = _count_read(conn, queue, start, end, states)
    if read == 0:
        return BatchResult(0, 0, 0, 0, committed)
    session.dataSource.register(KeygateDataSource)
    df = (
        session.read.format("keygate")
        .option("url", url)
        .option("queue", queue)
        .option("group", group)
        .option("startingOffsets", _json(start))
        .option("endingOffsets", _json(end))
        .option("dueAt", repr(due_at))
        .load()
    )
    outcome = run_isolated(df, fn, isolation_runs)
    now = time.time()
    with engine.begin() as conn:
        # The lease taken before fn, or LeaseLost and nothing settled (spark.lease.keep).
        lease.keep(conn, queue, group, owner, lease_timeout, now)
        failures = _failures(conn, queue, group, outcome, start, end, states, now)
        nacked, dead, moved = _settle(conn, config, group, states, start, end, failures, now)
    committed.update(moved)
    return BatchResult(read, read - len(failures), len(nacked), len(dead), committed)


def _json(offsets: Mapping[int, int]) -> str:
    return json.dumps(offsets_json(offsets))


__all__ = ["BatchResult", "consume_batch"]
