"""Retention: deleting what every group settled, expired messages and dedup records.

How it works. A run reads, per partition, the lowest committed seq over the queue's groups
and deletes up to it in short transactions, each taking the oldest seqs of up to
RETENTION_RANGES partitions at once: partitions fill side by side, so their oldest rows
share pages, and a transaction rewrites each page about once instead of once per
partition on it. Publishes share the writer with these deletes (SQLite has one writer;
PostgreSQL appends go through the same writer thread), so a run that the housekeeping
starts is paced over ``spread`` seconds and publishes never wait behind more than one
chunk of it.

On SQLite a paced chunk does not even take a transaction of its own while publishes flow:
it rides in the next append transaction (``Riders``), which commits and flushes anyway,
so the deletes cost the publishes a few hundred microseconds of SQL each rather than a
4 to 5 ms wait behind a transaction with its own flush now and then (the 99th percentile of
publish latency at 5,000 msg/s, docs/performance.md). A run behind its pace rides
without pausing, a chunk in every append transaction, rather than writing chunks on its
own back to back (which brought the stalls back at the end of a run at 5,000 msg/s). A
chunk no append takes within RIDE_WAIT (no publishes) is written on its own, without a
flush of its own (``durable=False``): a delete lost in a crash is done again by the next
run.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import sqlalchemy as sa

from core.actions import DeadLetter
from core.model import DeadLetterReason, Message
from storage.admin import AdminOps
from storage.base import Allocation
from storage.codec import salvage_message
from storage.consumer import append_dead_letters
from storage.schema import kg_dedup, kg_group_offsets, kg_groups, kg_messages, kg_queues
from storage.statements import per_dialect

# Settled messages deleted per retention transaction: short transactions, so that appends
# (SQLite has one writer) wait for at most one; more when a run has more to delete than
# RETENTION_STEPS of them (each commit costs a flush: at 5,000 msg/s, 64-message chunks
# took a third of the writer), up to RETENTION_MAX_CHUNK. RETENTION_RANGES: partitions a
# transaction takes them from.
RETENTION_CHUNK: Final = 64
RETENTION_STEPS: Final = 64
RETENTION_MAX_CHUNK: Final = 1024
RETENTION_RANGES: Final = 32
# A chunk that rides in an append transaction: RIDE_CHUNK messages, or a RIDE_STEPS-th of
# the run's backlog, at most RETENTION_MAX_CHUNK; written alone after RIDE_WAIT seconds.
RIDE_CHUNK: Final = 32
RIDE_STEPS: Final = 256
RIDE_WAIT: Final = 0.05

Deleted = dict[str, list[int]]  # queue -> [messages, bytes]
# (queue, partition, seq after which, seq up to which): one partition's span to delete.
Span = tuple[str, int, int, int]
# Told of a groupless queue's expired messages: (queue, how many, dead-lettered or dropped).
Expired = Callable[[str, int, bool], None]

# A chunk of several spans travels as one JSON document (storage.statements.json_rows),
# so that building and compiling the statement costs the same however many partitions
# it takes: as an OR of one condition per partition, building it took 7 % of the event
# loop while a 256-partition queue was consumed, and deleting 60,000 messages of 256
# partitions took 3.1 s of CPU against 1.5 s now. A single span (one partition) is a
# plain range delete, 20 % cheaper than through the document.
_ONE_SPAN: Final = sa.text(
    """DELETE FROM kg_messages WHERE queue = :queue AND "partition" = :partition
    AND seq > :after AND seq <= :upto RETURNING queue, size"""
)
_SPAN: Final = {"queue": "text", "partition": "integer", "after": "bigint", "upto": "bigint"}
_IN_SPAN: Final = """m.queue = j.queue AND m."partition" = j."partition" AND m.seq > j.after
    AND m.seq <= j.upto"""
_DELETE: Final = per_dialect(
    f"""DELETE FROM kg_messages WHERE rowid IN (
    SELECT m.rowid FROM {{rows}} CROSS JOIN kg_messages AS m WHERE {_IN_SPAN})
RETURNING queue, size""",
    _SPAN,
    "spans",
    postgres=f"""DELETE FROM kg_messages AS m USING {{rows}} WHERE {_IN_SPAN}
RETURNING m.queue, m.size""",
)
# The last seq of each span published by ``before`` (a queue's retention period).
_OLD_ENOUGH: Final = per_dialect(
    f"""SELECT j.queue, j."partition", (
    SELECT max(m.seq) FROM kg_messages AS m WHERE {_IN_SPAN} AND m.publish_time <= j.before)
FROM {{rows}}""",
    {**_SPAN, "before": "double precision"},
    "spans",
)


@dataclass(eq=False)
class Rider:
    """A chunk of deletes waiting for an append transaction to carry it."""

    spans: list[Span]
    done: asyncio.Future[Deleted]
    deleted: Deleted = field(default_factory=dict)


class Riders:
    """The chunks waiting to ride (SQLite), taken by the append transaction (SqlStore)."""

    def __init__(self) -> None:
        self._waiting: list[Rider] = []

    def __len__(self) -> int:
        """Chunks waiting for a transaction."""
        return len(self._waiting)

    def board(self) -> list[Rider]:
        """Take every waiting chunk for the transaction about to be handed to the writer."""
        riders, self._waiting = self._waiting, []
        return riders

    def arrived(self, riders: list[Rider]) -> None:
        """The transaction that carried ``riders`` committed."""
        for rider in riders:
            if not rider.done.done():
                rider.done.set_result(rider.deleted)

    def failed(self, riders: list[Rider], error: Exception) -> None:
        """The transaction that carried ``riders`` failed: their runs write them alone."""
        for rider in riders:
            if not rider.done.done():
                rider.done.set_exception(error)

    def stranded(self, riders: list[Rider]) -> None:
        """The transaction was not sent (cancelled): the riders wait for the next one."""
        self._waiting[:0] = riders

    def wait(self, rider: Rider) -> None:
        self._waiting.append(rider)

    def leave(self, rider: Rider) -> bool:
        """Take ``rider`` back if no transaction has boarded it."""
        if rider in self._waiting:
            self._waiting.remove(rider)
            return True
        return False


def carry(conn: sa.Connection, riders: list[Rider]) -> None:
    """In the append transaction, after its inserts: delete the riders' messages."""
    for rider in riders:
        rider.deleted = {}
        delete_into(conn, spans=rider.spans, deleted=rider.deleted)


def delete_into(conn: sa.Connection, *, spans: list[Span], deleted: Deleted) -> None:
    """Delete the messages of ``spans``, adding them to ``deleted``."""
    rows = [{"queue": q, "partition": p, "after": a, "upto": u} for q, p, a, u in spans]
    if len(rows) == 1:
        result = conn.execute(_ONE_SPAN, rows[0])
    else:
        result = conn.execute(_DELETE[conn.dialect.name], {"spans": json.dumps(rows)})
    for queue, size in result:
        total = deleted.setdefault(queue, [0, 0])
        total[0] += 1
        total[1] += size


class RetentionOps(AdminOps):
    # (queue, partition) -> seq up to which retention already deleted.
    _retained: dict[tuple[str, int], int]
    # SQLite: chunks that ride in append transactions; None on PostgreSQL, whose appends
    # are one pipelined round trip that cannot read what a DELETE returns.
    riders: Riders | None

    async def retention(
        self, *, now: float, spread: float = 0.0, on_expired: Expired | None = None
    ) -> int:
        """Delete what every group settled (and, on a queue with a ``retention`` period, was
        published longer ago than it), expired messages of queues without groups and expired
        dedup records. Returns the number of messages deleted.

        Deletes run in short transactions of RETENTION_CHUNK messages or, with more to
        delete, the run's share of RETENTION_STEPS (at most RETENTION_MAX_CHUNK), the oldest
        of up to RETENTION_RANGES partitions at a time (or expired messages), so publishes are
        not held up behind a large clean-up. ``spread``: seconds over which to pace the
        deletes of settled messages (the housekeeping's runs take half their interval),
        rather than taking the writer in one burst; on SQLite the paced chunks ride in
        append transactions while publishes flow (module docstring). ``on_expired(queue,
        count, dead_lettered)`` hears of the expired messages of queues without groups
        (a group counts its own), for the metrics."""
        lows, sweep = await self._settled()
        work: list[list[Any]] = []  # [queue, partition, deleted up to, may delete up to]
        kept: list[tuple[str, int, int, int, float]] = []  # within a retention period
        for queue, partition, settled in lows:
            done = self._retained.get((queue, partition), 0)
            config = self.queues.get(queue)
            if config is not None and config.retention > 0 and settled > done:
                kept.append((queue, partition, done, settled, now - config.retention))
            elif done < settled:
                work.append([queue, partition, done, settled])
        for queue, partition, done, low in await self._old_enough(kept):
            if done < low:
                work.append([queue, partition, done, low])
        total = 0
        deadline = time.monotonic() + spread
        backlog = sum(low - done for _, _, done, low in work)
        ride = self.riders is not None and spread > 0
        if ride:
            chunk = min(RETENTION_MAX_CHUNK, max(RIDE_CHUNK, -(-backlog // RIDE_STEPS)))
        else:
            chunk = min(RETENTION_MAX_CHUNK, max(RETENTION_CHUNK, -(-backlog // RETENTION_STEPS)))
        while work:
            batch, work = work[:RETENTION_RANGES], work[RETENTION_RANGES:]
            share = max(1, chunk // len(batch))
            for entry in batch:
                entry.append(min(entry[3], entry[2] + share))
            spans = [(q, p, done, upto) for q, p, done, _, upto in batch]
            deleted = await (self._ride(spans) if ride else self._delete_alone(spans))
            total += self._forget_depth(deleted)
            for queue, partition, _, low, upto in batch:
                self._retained[(queue, partition)] = upto
                if upto < low:
                    work.append([queue, partition, upto, low])
            if spread > 0 and work:
                chunks = -(-sum(low - done for _, _, done, low in work) // chunk)
                pause = (deadline - time.monotonic()) / chunks
                if pause > 0:
                    await asyncio.sleep(pause)
        return total + await self._expire(sweep, now, on_expired)

    async def _settled(self) -> tuple[list[Any], list[str]]:
        """Per (queue, partition) the lowest committed seq over its groups, and the queues
        without groups (a group dead-letters or drops its own expired messages)."""
        o, q = kg_group_offsets, kg_queues
        async with self.transaction() as conn:
            lows = list(
                await conn.execute(
                    sa.select(o.c.queue, o.c.partition, sa.func.min(o.c.committed_seq)).group_by(
                        o.c.queue, o.c.partition
                    )
                )
            )
            ungrouped = sa.select(q.c.name).where(q.c.name.not_in(sa.select(kg_groups.c.queue)))
            sweep = list((await conn.execute(ungrouped)).scalars())
        return lows, sweep

    async def _ride(self, spans: list[Span]) -> Deleted:
        """Delete ``spans`` in the next append transaction, or alone if none takes it
        within RIDE_WAIT."""
        assert self.riders is not None
        rider = Rider(spans, asyncio.get_running_loop().create_future())
        self.riders.wait(rider)
        try:
            return await asyncio.wait_for(asyncio.shield(rider.done), RIDE_WAIT)
        except TimeoutError:
            if not self.riders.leave(rider):
                with contextlib.suppress(Exception):  # failed: alone, below
                    return await rider.done  # boarded meanwhile: its transaction is under way
        except Exception:
            pass  # the transaction that carried it failed (and ran again without it)
        return await self._delete_alone(spans)

    async def _delete_alone(self, spans: list[Span]) -> Deleted:
        """Delete ``spans`` in a transaction of its own, which need not flush."""
        deleted: Deleted = {}
        delete = functools.partial(delete_into, spans=spans, deleted=deleted)
        await self.write(delete, durable=False)
        return deleted

    async def _expire(self, sweep: list[str], now: float, on_expired: Expired | None) -> int:
        """Delete expired messages of the queues in ``sweep`` — dead-lettering them first
        where the queue asks for it (``dead_letter_expired``) — and expired dedup records."""
        d = kg_dedup
        expiring: Deleted = {}
        for queue in sweep:
            config = self.queues.get(queue)
            dlq = config.dlq_name if config is not None and config.dead_letter_expired else None
            if config is not None and dlq is not None:
                async with self.transaction() as conn:
                    for created in await self._ensure_dlq(conn, config):
                        self._remember(created)
            while True:
                letters: list[tuple[Allocation, list[Message]]] = []
                expire = functools.partial(
                    self._expire_some, queue, dlq, now=now, deleted=expiring, letters=letters
                )
                async with self.seq_lock:  # seqs of the dead-letter queue's copies
                    more = await self.write(expire, durable=False)
                    for allocation, copies in letters:
                        self.committed(allocation, copies)
                if not more:
                    break
            if on_expired is not None and queue in expiring:
                on_expired(queue, expiring[queue][0], dlq is not None)
        forget = sa.delete(d).where(d.c.expires_at <= now)
        await self.write(lambda conn: conn.execute(forget), durable=False)
        return self._forget_depth(expiring)

    def _expire_some(
        self,
        queue: str,
        dlq: str | None,
        conn: sa.Connection,
        *,
        now: float,
        deleted: Deleted,
        letters: list[tuple[Allocation, list[Message]]],
    ) -> bool:
        """Delete up to RETENTION_CHUNK expired messages of ``queue`` (``expired_messages``),
        oldest expiry first, appending their dead-letter copies to ``dlq`` first (reason
        expired; into ``letters``, for the caches after COMMIT); True if there may be more.
        Read in expiry order through the expiry index, so the sweep costs what it deletes,
        not the size of the table."""
        m = kg_messages
        rows = conn.execute(expired_messages(queue, now)).all()
        if rows:
            keys = [(name, partition, seq) for name, partition, seq, _ in rows]
            where = sa.tuple_(m.c.queue, m.c.partition, m.c.seq).in_(keys)
            if dlq is not None:
                found = conn.execute(sa.select(m).where(where).order_by(m.c.expire_at))
                expired = [
                    DeadLetter(salvage_message(row)[0], DeadLetterReason.EXPIRED, 0, None)
                    for row in found.mappings()
                ]
                letters.append(append_dead_letters(conn, self, dlq, expired, None, now))
            conn.execute(sa.delete(m).where(where))
            total = deleted.setdefault(queue, [0, 0])
            total[0] += len(rows)
            total[1] += sum(size for *_, size in rows)
        return len(rows) == RETENTION_CHUNK

    async def _old_enough(
        self, kept: list[tuple[str, int, int, int, float]]
    ) -> list[tuple[str, int, int, int]]:
        """For each (queue, partition, deleted up to, settled up to, published by) of a
        queue that keeps settled messages for a ``retention`` period: how far retention
        may delete, the last settled seq published by then. One statement for all of
        them (a statement per partition cost 256 transactions a run at 256 partitions)."""
        if not kept:
            return []
        rows = [
            {"queue": q, "partition": p, "after": a, "upto": u, "before": b}
            for q, p, a, u, b in kept
        ]
        async with self.transaction() as conn:
            query = _OLD_ENOUGH[conn.dialect.name]
            found = await conn.execute(query, {"spans": json.dumps(rows)})
            bounds = {(queue, partition): seq for queue, partition, seq in found}
        return [
            (q, p, a, a if bounds.get((q, p)) is None else int(bounds[(q, p)]))
            for q, p, a, _, _ in kept
        ]

    def _forget_depth(self, deleted: Deleted) -> int:
        """Take deleted messages off the cached depths; returns how many there were."""
        for queue, (count, size) in deleted.items():
            depth = self.depths.get(queue)
            if depth is not None:
                depth[0] -= count
                depth[1] -= size
        return sum(count for count, _ in deleted.values())


def expired_messages(queue: str, now: float) -> sa.Select[tuple[str, int, int, int]]:
    """(queue, partition, seq, size) of up to RETENTION_CHUNK expired messages of
    ``queue``, oldest expiry first, read through ix_kg_messages_expire_at."""
    m = kg_messages
    return (
        sa.select(m.c.queue, m.c.partition, m.c.seq, m.c.size)
        .where(m.c.queue == queue, m.c.expire_at <= now)
        .order_by(m.c.expire_at)
        .limit(RETENTION_CHUNK)
    )


__all__ = [
    "RETENTION_CHUNK",
    "RIDE_CHUNK",
    "RetentionOps",
    "Rider",
    "Riders",
    "carry",
    "expired_messages",
]
