"""One consumer group's durable state in memory, for ``storage.memory.MemoryStore``: what
kg_group_offsets, kg_deliveries, kg_parked_keys, kg_partition_assignments and kg_flows
hold for it in SQL, with the same rules as storage.consumer (a dispatched seq never moves
back, delivery records of settled seqs are dropped, a retry never lowers a count)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from core.actions import (
    AssignmentChanged,
    DeadLetter,
    DeadLetterKey,
    DeliveryRecord,
    FlowChanged,
    GroupSnapshot,
    KeyParked,
    KeyReleased,
    OffsetUpdate,
    ParkedKey,
    PartitionSnapshot,
    RecordDispatch,
    RetryScheduled,
)
from core.ledger import AckLedger
from core.model import DeadLetterReason, FlowState, GroupConfig, Message
from core.partition import has_tags

KeyChange = KeyParked | KeyReleased


class GroupState:
    """A group's offsets, delivery records, parked keys, assignments and flows."""

    def __init__(self, config: GroupConfig, starts: dict[int, int]) -> None:
        self.config = config
        self.offsets = {
            p: PartitionSnapshot(committed_seq=s, dispatched_seq=s) for p, s in starts.items()
        }
        # partition -> seq -> record, of messages delivered and not settled.
        self.deliveries: dict[int, dict[int, DeliveryRecord]] = {p: {} for p in starts}
        self.parked: dict[tuple[int, str], ParkedKey] = {}
        self.assignments: dict[int, AssignmentChanged] = {}
        self.flows: dict[str, FlowChanged] = {}

    def snapshot(self) -> GroupSnapshot:
        partitions = {
            p: dataclasses.replace(
                offsets, deliveries=tuple(v for _, v in sorted(self.deliveries[p].items()))
            )
            for p, offsets in self.offsets.items()
        }
        parked = tuple(parked for _, parked in sorted(self.parked.items()))
        return GroupSnapshot(partitions=partitions, parked=parked)

    def reset(self, positions: dict[int, int]) -> None:
        """Move the partitions to the committed seqs of ``positions``: acks above them and
        delivery records are forgotten (a reset group, a purged queue)."""
        for partition, committed in positions.items():
            self.offsets[partition] = PartitionSnapshot(
                committed_seq=committed, dispatched_seq=committed, reserved_seq=committed
            )
            self.deliveries[partition] = {}

    def record_dispatch(self, records: Sequence[RecordDispatch]) -> None:
        for record in records:
            old = self.offsets[record.partition]
            self.offsets[record.partition] = dataclasses.replace(
                old,
                dispatched_seq=max(old.dispatched_seq, record.dispatched_seq),
                reserved_seq=max(old.reserved_seq, record.reserved_seq),
            )
            for seq, count, first in record.redeliveries:
                self.deliveries[record.partition][seq] = DeliveryRecord(seq, count, first)

    def write_offsets(
        self, updates: Sequence[OffsetUpdate], retries: Sequence[RetryScheduled]
    ) -> None:
        """Retries first, then the full ack state; records of settled seqs are dropped."""
        for retry in retries:
            records = self.deliveries[retry.partition]
            known = records.get(retry.seq)
            if known is None or known.delivery_count <= retry.delivery_count:
                record = DeliveryRecord(retry.seq, retry.delivery_count, retry.first_delivery_time)
                records[retry.seq] = record
        for update in updates:
            old = self.offsets[update.partition]
            self.offsets[update.partition] = dataclasses.replace(
                old,
                committed_seq=update.committed_seq,
                acked_above=update.acked_above,
                dispatched_seq=max(old.dispatched_seq, update.dispatched_seq),
                reserved_seq=update.reserved_seq,
            )
            ledger = AckLedger(update.committed_seq, update.acked_above)
            records = self.deliveries[update.partition]
            for seq in [seq for seq in records if ledger.is_settled(seq)]:
                del records[seq]

    def key_moves(
        self,
        stored: dict[int, list[Message]],
        moves: Sequence[DeadLetterKey],
        offsets: Sequence[OffsetUpdate],
    ) -> tuple[list[DeadLetter], list[OffsetUpdate], list[list[int]]]:
        """As SqlStore's: the dead letters of ``moves`` among the ``stored`` messages
        (partition -> messages in seq order), ``offsets`` with them settled, and the seqs
        each move settled."""
        latest = {update.partition: update for update in offsets}
        letters: list[DeadLetter] = []
        moved: list[list[int]] = []
        for move in moves:
            update = latest[move.partition]  # KeyError: the machine broke its contract
            ledger = AckLedger(update.committed_seq, update.acked_above)
            records = self.deliveries[move.partition]
            seqs: list[int] = []
            for message in _of_key(stored.get(move.partition, []), move.key, move.after_seq):
                if not ledger.settle(message.seq):
                    continue  # settled before
                seqs.append(message.seq)
                if has_tags(message, move.tags):
                    record = records.get(message.seq)
                    count = 0 if record is None else record.delivery_count
                    first = None if record is None else record.first_delivery_time
                    reason = DeadLetterReason.KEY_DEAD_LETTERED
                    letters.append(DeadLetter(message, reason, count, first))
            latest[move.partition] = OffsetUpdate(move.partition, ledger.committed, ledger.ranges())
            moved.append(seqs)
        return letters, list(latest.values()), moved

    def change_keys(self, keys: Sequence[KeyChange]) -> None:
        for change in keys:
            if isinstance(change, KeyParked):
                parked = change.parked
                self.parked[(parked.partition, parked.key)] = parked
            else:
                self.parked.pop((change.partition, change.key), None)

    def change_flows(self, flows: Sequence[FlowChanged]) -> None:
        for flow in flows:
            if flow.state is FlowState.EXITED:
                self.flows.pop(flow.flow_id, None)
            else:
                self.flows[flow.flow_id] = flow


def _of_key(messages: Iterable[Message], key: str, after_seq: int) -> Iterable[Message]:
    return (m for m in messages if m.key == key and m.seq > after_seq)
