"""What a group state machine asks its owner to do, and the state it is rebuilt from.

The machine (core.group.GroupMachine) is sans-IO: every event method returns a list of
actions, in the order they must be carried out. The owner (the gateway broker) follows
three rules:

1. ``RecordDispatch`` actions must be durable before any ``Deliver`` that follows them in
   the same list is sent (so delivery counts survive a crash, DESIGN.md §4). A first
   delivery inside the partition's durable reservation comes with no record.
2. ``DeadLetter`` and the ``OffsetUpdate`` that settles it are written in one transaction,
   with the ``KeyParked`` / ``KeyReleased`` changes and the ``DeadLetterKey`` moves of the
   same list (each followed, in its list, by an ``OffsetUpdate`` of its partition).
3. ``OffsetUpdate`` is idempotent full state for one (group, partition): the owner may
   keep only the newest one per partition and flush in batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

from core.frozen import frozen
from core.model import AckMode, DeadLetterReason, FlowState, Message, PartitionState

SeqRanges = tuple[tuple[int, int], ...]
"""Inclusive, sorted, non-overlapping, non-adjacent (lo, hi) ranges of seqs."""


@frozen
class Deliver:
    flow_id: str
    message: Message
    delivery_count: int
    redelivered: bool


@dataclass(frozen=True, slots=True)
class PartitionsChanged:
    """The flow's assigned partition set changed (pushed to the consumer)."""

    flow_id: str
    partitions: frozenset[int]


@dataclass(frozen=True, slots=True)
class Fetch:
    """Load up to ``limit`` messages of ``partition`` with seq > ``after_seq`` from storage
    and feed them back, as a ``Page``, with ``GroupMachine.loaded``. ``max_bytes`` is what
    the read reserved of the group's budget: storage ends the page with the large message
    that takes it past that (``fetched``; the store's ``read_for_delivery``), so a backlog of
    messages much larger than the group's estimate is not read into memory whole.

    With ``seqs``, load exactly those (noted scheduled messages come due, at or below
    ``after_seq``; the store's ``read_seqs``): the Page holds those still stored."""

    partition: int
    after_seq: int
    limit: int
    max_bytes: int
    seqs: tuple[int, ...] = ()


# A message whose stored size is over this many bytes is large: a page ends with the large
# message that takes the page's large messages past its Fetch's max_bytes (storage finds
# them in a partial index of kg_messages that no smaller message is in).
LARGE_MESSAGE: Final = 4096


def fetched(messages: Iterable[Message], limit: int, max_bytes: int) -> list[Message]:
    """The page a Fetch reads from ``messages``, its partition's after its ``after_seq`` in
    seq order: up to ``limit`` of them, ending with the large message that takes the
    page's large messages past ``max_bytes``. The sizing of pages guesses how large
    messages are; this keeps a wrong guess (a backlog of 4 MiB messages read by a group
    that has seen 1 KiB ones) from reading far more than the read reserved: at most
    ``max_bytes``, plus ``limit`` messages of up to LARGE_MESSAGE bytes, plus one message."""
    page: list[Message] = []
    large = 0
    for message in messages:
        if len(page) >= limit or large > max_bytes:
            break
        page.append(message)
        if message.size > LARGE_MESSAGE:
            large += message.size
    return page


@dataclass(frozen=True, slots=True)
class Page:
    """The answer to a Fetch: the partition's messages after its ``after_seq``, in seq
    order. Seqs in ``undeliverable`` were stored but cannot be read back whole."""

    partition: int
    messages: Sequence[Message]
    undeliverable: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class RecordDispatch:
    """Durable before sending: every unsettled message up to ``dispatched_seq`` was sent
    (a low-water mark), first deliveries up to ``reserved_seq`` may happen without another
    record, and the listed messages are being (re)delivered with these counts."""

    partition: int
    dispatched_seq: int
    # (seq, delivery_count, first_delivery_time) of redeliveries; empty for first sends.
    redeliveries: tuple[tuple[int, int, float], ...] = ()
    reserved_seq: int = 0


def merge_dispatch(records: Iterable[RecordDispatch]) -> list[RecordDispatch]:
    """One record per partition for one write: the highest positions, every redelivery."""
    merged: dict[int, RecordDispatch] = {}
    for rec in records:
        old = merged.get(rec.partition)
        if old is None:
            merged[rec.partition] = rec
        else:
            merged[rec.partition] = RecordDispatch(
                rec.partition,
                max(old.dispatched_seq, rec.dispatched_seq),
                old.redeliveries + rec.redeliveries,
                max(old.reserved_seq, rec.reserved_seq),
            )
    return list(merged.values())


@dataclass(frozen=True, slots=True)
class OffsetUpdate:
    """Full ack state of one (group, partition): everything <= committed_seq is done, plus
    ``acked_above``. Storage drops delivery records of every settled seq. It also carries
    the first-delivery low-water mark ``dispatched_seq`` (never moves back in storage) and the
    dispatch reservation ``reserved_seq`` (written as is: a reservation may shrink)."""

    partition: int
    committed_seq: int
    acked_above: SeqRanges = ()
    dispatched_seq: int = 0
    reserved_seq: int = 0


@dataclass(frozen=True, slots=True)
class RetryScheduled:
    """For inspection (kg_key_status), written with the next offset flush: the message was
    delivered ``delivery_count`` times and waits for redelivery at ``due``."""

    partition: int
    seq: int
    delivery_count: int
    first_delivery_time: float
    due: float


@dataclass(frozen=True, slots=True)
class DeadLetter:
    message: Message
    reason: DeadLetterReason
    delivery_count: int
    first_delivery_time: float | None


@dataclass(frozen=True, slots=True)
class DeadLetterKey:
    """The rest of a dead-lettered key that is not in memory (on_dead_letter =
    dead_letter_key): every message of ``key`` stored in ``partition`` with a seq above
    ``after_seq`` and not settled follows it to the dead-letter queue (reason
    key-dead-lettered, in seq order, after the list's DeadLetters) and is settled — its seq
    merged into the partition's OffsetUpdate of the same transaction. A message the group's
    ``tags`` filter out is settled without a copy. The owner then reports the settled seqs
    with ``GroupMachine.key_dead_lettered``."""

    partition: int
    key: str
    after_seq: int
    tags: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ParkedKey:
    """A key that stopped after its message ``message_id`` was dead-lettered for
    ``reason`` (on_dead_letter = park_key): its later messages of the partition wait."""

    partition: int
    key: str
    since: float
    message_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class KeyParked:
    """Write-through: remember the parked key (in the transaction of its dead letter)."""

    parked: ParkedKey


@dataclass(frozen=True, slots=True)
class KeyReleased:
    """Write-through: the key of the partition flows again."""

    partition: int
    key: str


@dataclass(frozen=True, slots=True)
class Dropped:
    """A message settled without delivery: expired (and not dead-lettered) or filtered out
    by the group's tags. Counted by the owner."""

    message: Message
    reason: str


@dataclass(frozen=True, slots=True)
class AssignmentChanged:
    """Write-through: the partition's state, owner or handoff start changed."""

    partition: int
    state: PartitionState
    flow_id: str | None
    # While PAUSED: when the keys that wait began to, the move that started the oldest
    # handoff still pending (kg_partition_assignments.handoff_since); None otherwise.
    handoff_since: float | None = None


@dataclass(frozen=True, slots=True)
class FlowChanged:
    """Write-through: a flow was bound, changed state or exited."""

    flow_id: str
    client: str
    state: FlowState
    window: int
    ack_mode: AckMode = AckMode.CLIENT


@dataclass(frozen=True, slots=True)
class DeliveryRecord:
    """What storage remembers of a message that was delivered and is not settled yet."""

    seq: int
    delivery_count: int
    first_delivery_time: float | None


@dataclass(frozen=True, slots=True)
class PartitionSnapshot:
    committed_seq: int = 0
    acked_above: SeqRanges = ()
    dispatched_seq: int = 0
    reserved_seq: int = 0
    deliveries: tuple[DeliveryRecord, ...] = ()


@dataclass(frozen=True, slots=True)
class GroupSnapshot:
    """A group's durable state, as storage recovers it after a restart."""

    partitions: dict[int, PartitionSnapshot] = field(default_factory=dict)
    parked: tuple[ParkedKey, ...] = ()


Action = (
    Deliver
    | PartitionsChanged
    | Fetch
    | RecordDispatch
    | OffsetUpdate
    | DeadLetter
    | DeadLetterKey
    | RetryScheduled
    | KeyParked
    | KeyReleased
    | Dropped
    | AssignmentChanged
    | FlowChanged
)
