"""Consumer state: dispatch records, offsets, dead letters, assignments and flows.

``record_dispatch`` is group-committed like appends (the broker awaits it before sending,
DESIGN.md §4 crash semantics) and writes only two things: the partition's dispatched and
reserved seqs (never moving backwards) and the delivery records of redeliveries.
``write_offsets`` takes full, idempotent ack state and drops the delivery records of
settled seqs; it moves dispatched_seq forwards only and sets reserved_seq as given (a
reservation shrinks when its partition stops sending, docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Final

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from core.actions import (
    AssignmentChanged,
    DeadLetter,
    DeadLetterKey,
    FlowChanged,
    KeyParked,
    KeyReleased,
    OffsetUpdate,
    RecordDispatch,
    RetryScheduled,
)
from core.ledger import AckLedger
from core.model import (
    DEAD_LETTER_REASON,
    DELIVERY_COUNT,
    FIRST_DELIVERY_TIME,
    ORIGINAL_GROUP,
    ORIGINAL_PARTITION,
    ORIGINAL_QUEUE,
    ORIGINAL_SEQ,
    DeadLetterReason,
    FlowState,
    Message,
    PropertyValue,
)
from core.partition import has_tags
from storage.admin import AdminOps
from storage.base import Allocation, StoreBase
from storage.batcher import GroupCommitter
from storage.codec import salvage_message
from storage.schema import (
    kg_deliveries,
    kg_flows,
    kg_group_offsets,
    kg_groups,
    kg_messages,
    kg_parked_keys,
    kg_partition_assignments,
    kg_partitions,
)
from storage.statements import advance_dispatched, upsert, write_offsets

DISPATCH_BATCH: Final = 1000
DispatchCall = tuple[str, str, Sequence[RecordDispatch]]
KeyChange = KeyParked | KeyReleased

_d: Final = kg_deliveries
_k: Final = kg_parked_keys
_UNPARK: Final = sa.delete(_k).where(
    _k.c.queue == sa.bindparam("b_queue"),
    _k.c.group_name == sa.bindparam("b_group"),
    _k.c.partition == sa.bindparam("b_partition"),
    _k.c.key == sa.bindparam("b_key"),
)


def dead_letter_copy(
    letter: DeadLetter, group: str | None, dlq: str, partition: int, seq: int, now: float
) -> Message:
    """The message as appended to the dead-letter queue, with its x- properties (no
    ``x-original-group`` for a message no group held: expired before any existed)."""
    original = letter.message
    properties: dict[str, PropertyValue] = {
        **original.properties,
        DEAD_LETTER_REASON: letter.reason.value,
        ORIGINAL_QUEUE: original.queue,
        ORIGINAL_PARTITION: original.partition,
        ORIGINAL_SEQ: original.seq,
        DELIVERY_COUNT: letter.delivery_count,
    }
    if group is not None:
        properties[ORIGINAL_GROUP] = group
    if letter.first_delivery_time is not None:
        properties[FIRST_DELIVERY_TIME] = letter.first_delivery_time
    # A dead letter is kept for inspection: no schedule, no expiry.
    return dataclasses.replace(
        original,
        queue=dlq,
        partition=partition,
        seq=seq,
        properties=properties,
        publish_time=now,
        deliver_at=None,
        expire_at=None,
    )


def append_dead_letters(
    conn: sa.Connection,
    store: StoreBase,
    dlq: str,
    letters: Sequence[DeadLetter],
    group: str | None,
    now: float,
) -> tuple[Allocation, list[Message]]:
    """Append the copies of ``letters`` to ``dlq`` (its one partition, head locked and
    written in ``conn``'s transaction); the allocation and copies, for ``store.committed``
    after COMMIT. A group's dead letters and the expiry sweep's (no group) both go here."""
    allocation = store.lock_heads(conn, [(dlq, 0)])
    copies = [
        dead_letter_copy(letter, group, dlq, 0, allocation.next(dlq, 0), now) for letter in letters
    ]
    store.insert_messages(conn, copies)
    store.write_heads(conn, allocation)
    return allocation, copies


class ConsumerOps(AdminOps):
    dispatcher: GroupCommitter[DispatchCall, None]

    def start_dispatcher(self, linger: float) -> None:
        self.dispatcher = GroupCommitter(
            self._write_dispatches, max_weight=DISPATCH_BATCH, linger=linger, name="kg-dispatch"
        )

    async def record_dispatch(
        self, queue: str, group: str, records: Sequence[RecordDispatch]
    ) -> None:
        """Persist dispatch records; durable on return (group-committed)."""
        if records:
            await self.dispatcher.submit((queue, group, records), len(records))

    async def _write_dispatches(self, calls: list[DispatchCall]) -> list[None]:
        now = time.time()
        advances: list[tuple[str, str, int, int, int]] = []
        deliveries: list[dict[str, object]] = []
        for queue, group, records in calls:
            for record in records:
                partition = record.partition
                advances.append(
                    (queue, group, partition, record.dispatched_seq, record.reserved_seq)
                )
                deliveries.extend(
                    {
                        "queue": queue,
                        "group_name": group,
                        "partition": partition,
                        "seq": seq,
                        "delivery_count": count,
                        "first_delivery_time": first,
                    }
                    for seq, count, first in record.redeliveries
                )

        def advance(conn: sa.Connection) -> None:
            advance_dispatched(conn, advances, now=now)
            if deliveries:
                keys = ("queue", "group_name", "partition", "seq")
                stmt = upsert(conn, _d, keys, ("delivery_count", "first_delivery_time"))
                conn.execute(stmt, deliveries)

        # Urgent: deliveries wait for it, and must not wait behind the publishes queued.
        await self.write(advance, pipelined=True, urgent=True)
        return [None] * len(calls)

    async def write_offsets(
        self,
        queue: str,
        group: str,
        updates: Sequence[OffsetUpdate],
        *,
        retries: Sequence[RetryScheduled] = (),
    ) -> None:
        """Write full ack state per partition and forget the settled delivery records;
        ``retries`` are recorded first, so any of them settled meanwhile is dropped too."""
        if updates or retries:
            await self.write(
                lambda conn: self._write_offsets(conn, queue, group, updates, retries),
                pipelined=True,
                urgent=True,  # the acks' flush: never behind the publishes queued
            )

    def _write_offsets(
        self,
        conn: sa.Connection,
        queue: str,
        group: str,
        updates: Sequence[OffsetUpdate],
        retries: Sequence[RetryScheduled] = (),
    ) -> None:
        if retries:
            keys = ("queue", "group_name", "partition", "seq")
            changed = ("delivery_count", "first_delivery_time", "redeliver_at")
            records = [
                {
                    "queue": queue,
                    "group_name": group,
                    "partition": r.partition,
                    "seq": r.seq,
                    "delivery_count": r.delivery_count,
                    "first_delivery_time": r.first_delivery_time,
                    "redeliver_at": r.due,
                }
                for r in retries
            ]
            # Never below a count the redelivery already recorded (it may precede the flush).
            newer = _d.c.delivery_count <= sa.literal_column("excluded.delivery_count")
            conn.execute(upsert(conn, _d, keys, changed, where=newer), records)
        write_offsets(conn, queue, group, updates, now=time.time())

    async def dead_letter(
        self,
        queue: str,
        group: str,
        letters: Sequence[DeadLetter],
        offsets: Sequence[OffsetUpdate],
        *,
        now: float,
        keys: Sequence[KeyChange] = (),
        retries: Sequence[RetryScheduled] = (),
        moves: Sequence[DeadLetterKey] = (),
    ) -> list[list[int]]:
        """Append copies to the dead-letter queue and write ``offsets`` and the parked-key
        changes ``keys``, in one transaction. Each of ``moves`` adds the stored messages of
        its key it names (after ``letters``) and settles them in ``offsets``, which must
        hold an update of its partition; returns the seqs each move settled.

        Dead letters bypass the DLQ's max_depth: refusing them would leave the message
        unsettled forever. With no DLQ configured the letters are dropped.
        """
        async with self.seq_lock:
            config = self.queue(queue)
            dlq = config.dlq_name
            allocation = Allocation({})
            created = []
            async with self.transaction() as conn:
                moved: list[list[int]] = []
                if moves:
                    followers, offsets, moved = await self._key_moves(
                        conn, queue, group, moves, offsets
                    )
                    letters = [*letters, *followers]
                copies: list[Message] = []
                if dlq is not None and letters:
                    created = await self._ensure_dlq(conn, config)
                    allocation, copies = await conn.run_sync(
                        append_dead_letters, self, dlq, letters, group, now
                    )
                await conn.run_sync(self._write_offsets, queue, group, offsets, retries)
                await conn.run_sync(self._write_key_changes, queue, group, keys)
            for created_queue in created:
                self._remember(created_queue)
            self.committed(allocation, copies)
            return moved

    async def _key_moves(
        self,
        conn: AsyncConnection,
        queue: str,
        group: str,
        moves: Sequence[DeadLetterKey],
        offsets: Sequence[OffsetUpdate],
    ) -> tuple[list[DeadLetter], list[OffsetUpdate], list[list[int]]]:
        """The dead letters of ``moves`` (stored messages not settled in ``offsets``, in
        seq order, with their delivery records), the offsets with them settled, and the
        settled seqs of each move."""
        latest = {update.partition: update for update in offsets}
        letters: list[DeadLetter] = []
        moved: list[list[int]] = []
        m = kg_messages
        for move in moves:
            update = latest[move.partition]  # KeyError: the machine broke its contract
            ledger = AckLedger(update.committed_seq, update.acked_above)
            query = (
                sa.select(m, _d.c.delivery_count, _d.c.first_delivery_time)
                .outerjoin(
                    _d,
                    sa.and_(
                        _d.c.queue == m.c.queue,
                        _d.c.group_name == group,
                        _d.c.partition == m.c.partition,
                        _d.c.seq == m.c.seq,
                    ),
                )
                .where(
                    m.c.queue == queue,
                    m.c.partition == move.partition,
                    m.c.key == move.key,
                    m.c.seq > move.after_seq,
                )
                .order_by(m.c.seq)
            )
            seqs: list[int] = []
            for row in (await conn.execute(query)).mappings():
                message, _ = salvage_message(row)
                if not ledger.settle(message.seq):
                    continue  # settled before
                seqs.append(message.seq)
                if has_tags(message, move.tags):
                    count = row["delivery_count"] or 0
                    reason = DeadLetterReason.KEY_DEAD_LETTERED
                    letters.append(DeadLetter(message, reason, count, row["first_delivery_time"]))
            latest[move.partition] = OffsetUpdate(move.partition, ledger.committed, ledger.ranges())
            moved.append(seqs)
        return letters, list(latest.values()), moved

    async def write_key_changes(self, queue: str, group: str, keys: Sequence[KeyChange]) -> None:
        """Park and release keys (kg_parked_keys), in order."""
        if keys:
            await self.write(lambda conn: self._write_key_changes(conn, queue, group, keys))

    def _write_key_changes(
        self, conn: sa.Connection, queue: str, group: str, keys: Sequence[KeyChange]
    ) -> None:
        for change in keys:
            if isinstance(change, KeyParked):
                p = change.parked
                row = {
                    "queue": queue,
                    "group_name": group,
                    "partition": p.partition,
                    "key": p.key,
                    "since": p.since,
                    "message_id": p.message_id,
                    "reason": p.reason,
                }
                stmt = upsert(
                    conn,
                    _k,
                    ("queue", "group_name", "partition", "key"),
                    ("since", "message_id", "reason"),
                )
                conn.execute(stmt, [row])
            else:
                where = {"b_queue": queue, "b_group": group, "b_partition": change.partition}
                conn.execute(_UNPARK, [{**where, "b_key": change.key}])

    async def unpark_key(self, queue: str, group: str, key: str) -> int:
        """Release a key of a group that is not running (it flows at the group's next
        load); the number of partitions it was parked in."""
        stmt = sa.delete(_k).where(_k.c.queue == queue, _k.c.group_name == group, _k.c.key == key)
        async with self.transaction() as conn:
            result = await conn.execute(stmt)
        return int(result.rowcount)

    async def parked_keys(self, queue: str, group: str) -> list[dict[str, object]]:
        """The group's parked keys as stored, by partition and key."""
        query = (
            sa.select(_k.c.partition, _k.c.key, _k.c.since, _k.c.message_id, _k.c.reason)
            .where(_k.c.queue == queue, _k.c.group_name == group)
            .order_by(_k.c.partition, _k.c.key)
        )
        async with self.transaction() as conn:
            return [dict(row) for row in (await conn.execute(query)).mappings()]

    async def write_assignments(
        self, queue: str, group: str, changes: Sequence[AssignmentChanged], *, now: float
    ) -> None:
        if not changes:
            return
        keys = ("queue", "group_name", "partition")
        rows = [
            {
                "queue": queue,
                "group_name": group,
                "partition": c.partition,
                "state": c.state.value,
                "flow_id": c.flow_id,
                "updated_at": now,
                "handoff_since": c.handoff_since,
            }
            for c in changes
        ]
        changed = ("state", "flow_id", "updated_at", "handoff_since")
        await self.write(
            lambda conn: conn.execute(upsert(conn, kg_partition_assignments, keys, changed), rows)
        )

    async def write_flows(
        self, queue: str, group: str, flows: Sequence[FlowChanged], *, now: float
    ) -> None:
        """Upsert running and leaving flows; exited flows are removed."""
        exited = [{"b_flow": f.flow_id} for f in flows if f.state is FlowState.EXITED]
        live = [
            {
                "flow_id": f.flow_id,
                "queue": queue,
                "group_name": group,
                "client": f.client,
                "state": f.state.value,
                "window_size": f.window,
                "ack_mode": f.ack_mode.value,
                "pending": 0,
                "bound_at": now,
                "last_seen": now,
            }
            for f in flows
            if f.state is not FlowState.EXITED
        ]

        def record(conn: sa.Connection) -> None:
            if live:
                changed = ("client", "state", "window_size", "ack_mode", "last_seen")
                conn.execute(upsert(conn, kg_flows, ("flow_id",), changed), live)
            if exited:
                drop = sa.delete(kg_flows).where(kg_flows.c.flow_id == sa.bindparam("b_flow"))
                conn.execute(drop, exited)

        await self.write(record, pipelined=True)

    async def forget_consumers(self, lease_owner: str) -> None:
        """At a gateway's start: the flows of any earlier run, and the partitions they
        owned, are gone with that run's connections (a crash leaves their rows behind).
        Native group leases held under ``lease_owner`` are released; binds take them again.
        Dispatch reservations end at the partition heads: nothing appended from now on can
        have been sent by that run.
        """
        g, o, p = kg_groups, kg_group_offsets, kg_partitions
        head = (
            sa.select(p.c.head_seq)
            .where(p.c.queue == o.c.queue, p.c.partition == o.c.partition)
            .scalar_subquery()
        )
        async with self.transaction() as conn:
            await conn.execute(
                sa.update(o).where(o.c.reserved_seq > head).values(reserved_seq=head)
            )
            await conn.execute(sa.delete(kg_flows))
            await conn.execute(sa.delete(kg_partition_assignments))
            await conn.execute(
                sa.update(g)
                .where(g.c.lease_kind == "native", g.c.lease_owner == lease_owner)
                .values(lease_kind=None, lease_owner=None, lease_expires=None)
            )

    async def update_flow_pending(self, pending: Mapping[str, int], *, now: float) -> None:
        """Record how many unacked messages each flow holds (for inspection)."""
        if not pending:
            return
        f = kg_flows
        stmt = (
            sa.update(f)
            .where(f.c.flow_id == sa.bindparam("b_flow"))
            .values(pending=sa.bindparam("b_pending"), last_seen=sa.bindparam("b_now"))
        )
        rows = [{"b_flow": k, "b_pending": v, "b_now": now} for k, v in pending.items()]
        await self.write(lambda conn: conn.execute(stmt, rows), pipelined=True)
