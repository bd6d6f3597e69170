"""Appends: group-committed, each call stored whole or refused alone. Mixed into SqlStore.

How an append works: the caller's messages (complete, seq 0) are queued for the append
writer (storage.batcher). The writer takes every pending call (up to ``max_batch``
messages: the calls that arrived while the previous transaction committed), rejects calls
that break a limit (MessageTooLarge, QueueFull, QueueNotFound: that call alone fails,
nothing of it stored), resolves dedup ids against ``kg_dedup``, assigns seqs from the
partitions' heads (read in the same transaction) and writes everything in ONE transaction,
run as one function on the writer thread (storage.writer). After COMMIT the cached heads
and depths advance, commit listeners see the new messages, and only then do the callers'
awaits return. If the database is unreachable (StorageUnavailable), every call of the
batch fails and nothing of it is stored (callers may retry; the broker turns it into a
negative confirm). If the transaction fails for any other reason, the batch is retried by
halves, so only the call the database refuses fails (ingress validation makes that rare:
a bug or an old schema).

``append_each`` submits many calls at once (one per publication of a protocol's lot):
each is accepted or refused alone inside the one transaction, so a lot is never retried
publication by publication, and a connection can queue its next lot before this one
committed without either overtaking the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
from collections.abc import Hashable, Sequence
from typing import Any, Final

import sqlalchemy as sa

from core.errors import Fenced, KeygateError, StorageError, StorageUnavailable
from core.model import Message
from storage.base import COPY_ROWS, Allocation, HeadsMoved
from storage.batcher import GroupCommitter
from storage.codec import message_from_row, with_seq
from storage.limits import check_append
from storage.protocol_state import ProtocolStateOps
from storage.retention import RetentionOps, Rider, carry
from storage.schema import kg_dedup, kg_messages, kg_partitions
from storage.statements import upsert

_log = logging.getLogger("keygate.storage")

# kg_dedup.producer is VARCHAR(500).
_DEDUP_PRODUCER_LENGTH: Final = 500


@dataclasses.dataclass(frozen=True, slots=True)
class AppendCall:
    """One ``append``: its messages, the time, and an MQTT QoS 2 packet id to record as
    received in the client's session in the same transaction ((client id, packet id))."""

    messages: Sequence[Message]
    now: float
    qos2: tuple[str, int] | None = None


AppendOutcome = list[Message] | KeygateError
"""One call's messages as stored, or the error that refused the call alone."""

DedupKey = tuple[str, str, str]


def _dedup_namespace(publisher: str | None, producer: str) -> str:
    """The ``kg_dedup.producer`` value: the authenticated user and the producer name, as
    a JSON pair (``["alice","amqp:alice"]``; ``null`` = anonymous). A pair, not a joined
    string, so no user name or producer name a client picks can reach into another
    user's namespace; past the column's 500 characters it is stored as its SHA-256."""
    pair = json.dumps([publisher, producer], separators=(",", ":"))
    if len(pair) <= _DEDUP_PRODUCER_LENGTH:
        return pair
    return "sha256:" + hashlib.sha256(pair.encode()).hexdigest()


def _dedup_key(message: Message) -> DedupKey | None:
    if message.producer is None or message.dedup_id is None:
        return None
    return (message.queue, _dedup_namespace(message.publisher, message.producer), message.dedup_id)


class AppendOps(ProtocolStateOps, RetentionOps):
    appender: GroupCommitter[list[AppendCall], list[AppendOutcome]]
    # Appends go out as one pipeline where the driver can (psycopg: PostgreSQL).
    _pipelines: bool

    @property
    def appends_pending(self) -> int:
        """Messages handed to ``append``/``append_each`` and not yet committed."""
        return self.appender.backlog

    async def append(
        self,
        messages: Sequence[Message],
        *,
        now: float,
        qos2: tuple[str, int] | None = None,
        source: Hashable = None,
    ) -> list[Message]:
        """Store ``messages`` (all or none); return them as stored, with seqs, after COMMIT.

        A message whose (publisher, producer, dedup id) was stored within the queue's dedup
        window is not stored again: the originally stored message is returned in its place.
        ``qos2`` (client id, packet id): the MQTT session records the packet id as received
        in the same transaction, so a QoS 2 PUBLISH re-sent after a failover is known.
        ``source`` (the publishing connection) takes turns with the other sources for
        room in the append writer's batches (storage.batcher), so a large backlog of one
        connection does not delay the others.
        """
        if not messages:
            return []
        call = AppendCall(messages, now, qos2)
        (outcome,) = await self.appender.submit([call], len(messages), source=source)
        if isinstance(outcome, KeygateError):
            raise outcome
        return outcome

    def append_each(
        self, units: Sequence[Sequence[Message]], *, now: float, source: Hashable = None
    ) -> asyncio.Future[list[AppendOutcome]]:
        """Queue ``units`` for the append writer now, behind every append ``source`` (as
        ``append``) queued before (so calls made in order are stored in order, without
        waiting for each other);
        the future gives, after COMMIT, each unit as stored (as ``append`` returns it) or
        the error that refused that unit alone (nothing of it stored). When storage fails
        (StorageError, StorageUnavailable, Fenced), nothing is stored and every unit has
        that error, or the future fails with it."""
        if not units:
            done: asyncio.Future[list[AppendOutcome]] = asyncio.get_running_loop().create_future()
            done.set_result([])
            return done
        calls = [AppendCall(unit, now) for unit in units]
        return self.appender.enqueue(calls, sum(len(unit) for unit in units), source=source)

    async def _write_appends(
        self, submissions: list[list[AppendCall]]
    ) -> list[list[AppendOutcome] | BaseException]:
        """The group commit's process: every call of every submission, each accepted or
        refused alone, in one transaction; the outcomes regrouped per submission."""
        # Checked under seq_lock: a queue deleted or altered meanwhile is seen as it is now.
        async with self.seq_lock:
            pending: dict[str, list[int]] = {}
            checked = [self._check(submission, pending) for submission in submissions]
            accepted = [
                call
                for submission, refusals in zip(submissions, checked, strict=True)
                for call, refusal in zip(submission, refusals, strict=True)
                if refusal is None
            ]
            results = iter(await self._commit_appends(accepted) if accepted else ())
        return [
            [next(results) if refusal is None else refusal for refusal in refusals]
            for refusals in checked
        ]

    def _check(
        self, submission: list[AppendCall], pending: dict[str, list[int]]
    ) -> list[KeygateError | None]:
        """What refuses each call of ``submission`` (check_append), None for those that
        fit: all at once when they fit together (the common case: one check per lot),
        else call by call, in order."""
        if len(submission) > 1:
            with contextlib.suppress(KeygateError):
                every = [m for call in submission for m in call.messages]
                check_append(every, self.queue, self.depths, pending)
                return [None] * len(submission)
        refusals: list[KeygateError | None] = []
        for call in submission:
            try:
                check_append(call.messages, self.queue, self.depths, pending)
            except KeygateError as e:
                refusals.append(e.as_outcome())
            else:
                refusals.append(None)
        return refusals

    async def _commit_appends(self, calls: list[AppendCall]) -> list[AppendOutcome]:
        """Write ``calls`` in one transaction. If it fails for a reason other than an
        unreachable database, retry each half on its own, so only the bad call fails."""
        try:
            allocation, results, new = await self._transact_appends(calls)
        except (StorageUnavailable, Fenced) as e:
            return [e.as_outcome()] * len(calls)  # nothing any call could change
        except Exception as e:
            if len(calls) == 1:
                if isinstance(e, StorageError):
                    return [e.as_outcome()]
                _log.exception("append of %d message(s) failed", len(calls[0].messages))
                return [StorageError("storage error")]
            half = len(calls) // 2
            return [
                *await self._commit_appends(calls[:half]),
                *await self._commit_appends(calls[half:]),
            ]
        self.committed(allocation, new)
        return list(results)

    async def _transact_appends(
        self, calls: list[AppendCall]
    ) -> tuple[Allocation, list[list[Message]], list[Message]]:
        """``_transact`` carrying the retention chunks waiting to ride (SQLite)."""
        riders = self.riders.board() if self.riders is not None else []
        if self.riders is None or not riders:
            return await self._transact(calls, [])
        try:
            outcome = await self._transact(calls, riders)
        except Exception as e:
            # Retention's deletes must never cost a publish: they go alone, and the
            # appends run again without them.
            self.riders.failed(riders, e)
            return await self._transact(calls, [])
        except BaseException:
            self.riders.stranded(riders)
            raise
        self.riders.arrived(riders)
        return outcome

    async def _transact(
        self, calls: list[AppendCall], riders: list[Rider]
    ) -> tuple[Allocation, list[list[Message]], list[Message]]:
        """The append transaction, then the deletes of ``riders``. When no call needs a
        read (a dedup lookup, a QoS 2 session), seqs come from the heads cache and each head
        moves only from the value allocated from, without reading or locking it first; on
        PostgreSQL the transaction goes out as one pipeline, a single round trip instead of
        six. If another writer (a Spark job's dead letters) moved a head meanwhile it fails
        whole, and runs again with the heads read and locked first, as everywhere else.

        A connection to PostgreSQL lost during that round trip leaves it unknown whether
        the COMMIT was processed; the heads tell (only the fenced gateway moves them from
        the values it allocated from): at the new values it was, at the old ones it was not
        and it runs again the ordinary way (whose first statement finds a dropped
        connection and replaces it), otherwise StorageUnavailable."""
        touched = {(m.queue, m.partition) for call in calls for m in call.messages}
        if not any(self._reads(call) for call in calls):
            allocation = Allocation({key: self.heads.get(key, 0) for key in touched})
            results, new, _ = self._assign(calls, allocation, {})
            copy = self._pipelines and len(new) >= COPY_ROWS

            def append(conn: sa.Connection) -> None:
                self.advance_heads(conn, allocation)
                self.insert_messages(conn, new, copy=copy)
                carry(conn, riders)

            try:
                pipelined = self._pipelines and not copy
                await self.write(append, pipelined=pipelined, proves_fence=True)
                return allocation, results, new
            except HeadsMoved:
                pass
            except StorageUnavailable:
                if not self._pipelines:
                    raise
                committed = await self._appended(allocation)
                if committed is None:
                    raise
                if committed:
                    return allocation, results, new

        def store(conn: sa.Connection) -> tuple[Allocation, list[list[Message]], list[Message]]:
            stored = self._store(conn, calls, self.lock_heads(conn, touched))
            carry(conn, riders)
            return stored

        return await self.write(store)

    async def _appended(self, allocation: Allocation) -> bool | None:
        """Whether a pipelined append whose connection was lost committed: True if every
        head it moves is at its new value, False if every one is still at its old value,
        None if neither (or the database cannot say)."""
        p = kg_partitions
        keys = sorted(allocation.assigned)
        query = sa.select(p.c.queue, p.c.partition, p.c.head_seq).where(
            sa.tuple_(p.c.queue, p.c.partition).in_(keys)
        )
        try:
            async with self.transaction(fenced=False) as conn:
                heads = {(q, n): h for q, n, h in await conn.execute(query)}
        except StorageError:
            return None
        if all(heads.get(key) == allocation.assigned[key] for key in keys):
            return True
        if all(heads.get(key) == allocation.start(key) for key in keys):
            return False
        return None

    def _reads(self, call: AppendCall) -> bool:
        """Whether storing ``call`` reads from the database (so cannot be pipelined)."""
        if call.qos2 is not None:
            return True
        return any(
            self.queues[m.queue].dedup_window > 0 and _dedup_key(m) is not None
            for m in call.messages
        )

    def _store(
        self, conn: sa.Connection, calls: list[AppendCall], allocation: Allocation
    ) -> tuple[Allocation, list[list[Message]], list[Message]]:
        """The append transaction's work (on the writer thread), with the heads read and
        locked; returns the allocation, each call's messages as stored, and the new ones."""
        results, new, dedup_rows = self._assign(
            calls, allocation, self._find_duplicates(conn, calls)
        )
        if new:
            self.write_heads(conn, allocation)
            self.insert_messages(conn, new)
        if dedup_rows:
            keys = ("queue", "producer", "dedup_id")
            changed = ("message_id", "partition", "seq", "expires_at")
            conn.execute(upsert(conn, kg_dedup, keys, changed), dedup_rows)
        for call in calls:
            if call.qos2 is not None:
                client_id, packet_id = call.qos2
                self.change_qos2(conn, client_id, add=(packet_id,))
        return allocation, results, new

    def _assign(
        self, calls: list[AppendCall], allocation: Allocation, seen: dict[DedupKey, Message]
    ) -> tuple[list[list[Message]], list[Message], list[dict[str, Any]]]:
        """Seqs for the messages of ``calls`` not in ``seen`` (stored already): each call's
        messages as stored, the new ones, and the dedup records to write."""
        results: list[list[Message]] = []
        new: list[Message] = []
        dedup_rows = []
        for call in calls:
            result = []
            now = call.now
            for message in call.messages:
                window = self.queues[message.queue].dedup_window
                key = _dedup_key(message) if window > 0 else None
                if key is not None and key in seen:
                    result.append(seen[key])
                    continue
                seq = allocation.next(message.queue, message.partition)
                stored = with_seq(message, seq)
                if key is not None:
                    seen[key] = stored
                    dedup_rows.append(
                        {
                            "queue": key[0],
                            "producer": key[1],
                            "dedup_id": key[2],
                            "message_id": stored.message_id,
                            "partition": stored.partition,
                            "seq": seq,
                            "expires_at": now + window,
                        }
                    )
                result.append(stored)
                new.append(stored)
            results.append(result)
        return results, new, dedup_rows

    def _find_duplicates(
        self, conn: sa.Connection, calls: list[AppendCall]
    ) -> dict[DedupKey, Message]:
        """Messages already stored under the dedup keys of ``calls`` (unexpired)."""
        wanted: dict[DedupKey, Message] = {}
        for call in calls:
            for message in call.messages:
                if self.queues[message.queue].dedup_window <= 0:
                    continue
                key = _dedup_key(message)
                if key is not None:
                    wanted.setdefault(key, message)
        if not wanted:
            return {}
        now = min(call.now for call in calls)
        d, m = kg_dedup, kg_messages
        rows = conn.execute(
            sa.select(d.c.queue, d.c.producer, d.c.dedup_id, d.c.message_id, d.c.partition, d.c.seq)
            .where(sa.tuple_(d.c.queue, d.c.producer, d.c.dedup_id).in_(list(wanted)))
            .where(d.c.expires_at > now)
        )
        found: dict[DedupKey, Message] = {}
        for queue, producer, dedup_id, message_id, partition, seq in rows:
            incoming = wanted[(queue, producer, dedup_id)]
            # Retention may have deleted the original: answer with its identity.
            found[(queue, producer, dedup_id)] = dataclasses.replace(
                incoming, message_id=message_id, partition=partition, seq=seq
            )
        if found:
            positions = [(msg.queue, msg.partition, msg.seq) for msg in found.values()]
            originals = conn.execute(
                sa.select(m).where(sa.tuple_(m.c.queue, m.c.partition, m.c.seq).in_(positions))
            )
            by_position = {(r["queue"], r["partition"], r["seq"]): r for r in originals.mappings()}
            for key, msg in found.items():
                row = by_position.get((msg.queue, msg.partition, msg.seq))
                if row is not None:
                    found[key] = message_from_row(row)
        return found


__all__ = ["AppendCall", "AppendOps", "AppendOutcome", "DedupKey"]
