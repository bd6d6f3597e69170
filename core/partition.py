"""The mutable records a GroupMachine keeps per partition and per flow, and the frozen
status views it hands out. Internal to core.group except the status dataclasses."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from core.actions import ParkedKey, PartitionSnapshot
from core.ledger import AckLedger
from core.model import AckMode, FlowState, GroupMode, Message, PartitionState, PropertyValue

# What a buffered message is counted as beyond its size (Message.size): the objects that
# hold it in memory. Buffer budgets (DeliveryBook) count buffered_cost.
MESSAGE_OVERHEAD: Final = 512

# Timer kinds of a group's heap, and its entries: (time, kind, partition, seq, count).
WAKE: Final = 0
EXPIRE: Final = 1
ACK_TIMEOUT: Final = 2
NOTE: Final = 3  # a noted scheduled message comes due (or expires): read it back
Timer = tuple[float, int, int, int, int]
# A scheduled message held out of memory until it comes due (DeliveryBook._note):
# (when to read it back: deliver_at or an earlier expire_at, key, buffered_cost).
Note = tuple[float, str | None, int]
# What a note counts against its group's notes budget (``note_cost``) beside its key's
# length: the note, its entry in Partition.notes and its timer (235 bytes measured with
# tracemalloc over 20,000 notes) and the key string it keeps alive (~50 + its length).
NOTE_COST: Final = 300
# A paused partition delivers to its new owner every key the old owner holds nothing of.
DELIVERING: Final = frozenset({PartitionState.READY, PartitionState.PAUSED})


def buffered_cost(message: Message) -> int:
    """Bytes a buffered message counts against its group's buffer budget."""
    return message.size + MESSAGE_OVERHEAD


def note_cost(key: str | None) -> int:
    """Bytes a note of a message of ``key`` counts against its group's notes budget."""
    return NOTE_COST + (len(key) if key is not None else 0)


@dataclass(slots=True)
class BufferUse:
    """The buffered_cost of what a group's partitions (or a flow's) hold buffered, and
    the bytes their reads on the way reserved (core/reads.py)."""

    bytes: int = 0
    reading: int = 0


@dataclass(frozen=True, slots=True)
class PartitionStatus:
    partition: int
    state: PartitionState
    # The owner; for an unbound partition the flow it is reserved for.
    flow_id: str | None
    client: str | None
    in_flight: int
    committed_seq: int
    buffered: int
    # Publish time of the oldest message loaded and not settled (None: none loaded).
    oldest: float | None = None


@dataclass(frozen=True, slots=True)
class FlowStatus:
    flow_id: str
    client: str
    state: FlowState
    window: int
    pending: int
    ack_mode: AckMode
    # The partitions it is served from, as its BIND_OK says: those it owns; in shared
    # mode every partition.
    partitions: frozenset[int]
    bound_at: float
    # Its connection is behind (GroupMachine.backpressure): it is sent nothing for now.
    behind: bool = False


@dataclass(frozen=True, slots=True)
class GroupStatus:
    queue: str
    group: str
    mode: GroupMode
    partitions: tuple[PartitionStatus, ...]
    flows: tuple[FlowStatus, ...]


@dataclass(slots=True)
class Sent:
    """A message delivered to a client-ack flow and not settled yet."""

    message: Message
    flow_id: str
    count: int
    first_time: float


@dataclass(slots=True)
class Retry:
    """A message waiting for its next delivery (``count`` is that delivery's number).
    ``holder`` is the flow whose delivery ended: it may still ack the message until then."""

    message: Message
    count: int
    first_time: float | None
    due: float
    holder: str


@dataclass(slots=True)
class Handoff:
    """What a partition's previous owner still holds of it after the partition moved on:
    how many unacked messages of each key (those keys wait), from the move (``since``)
    until ``deadline``."""

    keys: Counter[str]
    since: float
    deadline: float


@dataclass(slots=True)
class Flow:
    flow_id: str
    client: str
    window: int
    ack_mode: AckMode
    order: int
    bound_at: float
    pending: int = 0
    partitions: set[int] = field(default_factory=set)
    announced: frozenset[int] = frozenset()
    # Owned partitions waiting for room to send, served in turn (DeliveryBook._pump).
    work: dict[int, None] = field(default_factory=dict)
    # The authenticated user that bound it (None: anonymous); with ``client`` it names who
    # may take back a reservation.
    owner: str | None = None
    # What its partitions hold buffered and are reading, and those waiting for room to
    # read, in the order they asked (core/reads.py; not in shared mode).
    use: BufferUse = field(default_factory=BufferUse)
    reads: dict[int, None] = field(default_factory=dict)
    # More than its connection's write buffer waits for the socket (GroupMachine.backpressure).
    behind: bool = False
    # What it may hold now: its window, 0 while it is behind (``set_limit``).
    limit: int = 0

    def __post_init__(self) -> None:
        self.limit = self.window

    def set_limit(self, *, window: int, behind: bool) -> None:
        self.window, self.behind = window, behind
        self.limit = 0 if behind else window

    def has_room(self) -> bool:
        return self.pending < self.limit

    def status(self, partitions: frozenset[int]) -> FlowStatus:
        """Its status, served from ``partitions`` (GroupMachine.partitions_of)."""
        return FlowStatus(
            flow_id=self.flow_id,
            client=self.client,
            state=FlowState.RUNNING,
            window=self.window,
            pending=self.pending,
            ack_mode=self.ack_mode,
            partitions=partitions,
            bound_at=self.bound_at,
            behind=self.behind,
        )


@dataclass(slots=True)
class Reservation:
    """Partitions kept for a disconnected flow through the rebalance delay, for a flow of
    the same client name bound by the same user (``owner``)."""

    flow_id: str
    client: str
    order: int
    deadline: float
    partitions: set[int]
    owner: str | None = None


class Partition:
    """Delivery state of one partition for one group."""

    def __init__(self, index: int, snapshot: PartitionSnapshot, use: BufferUse) -> None:
        self.index = index
        # The group's account, and its owner's (Flow.use outside shared mode, when it has
        # one; otherwise an account of its own that no budget reads).
        self.use = use
        self.owner_use = BufferUse()
        self.state = PartitionState.UNASSIGNED
        self.owner: str | None = None
        self.reserved_by: str | None = None
        # Key-granular handoff: each previous owner still holding unacked messages of the
        # partition (a chain A -> B -> C can leave two), with its keys and deadline; and
        # their keys summed, which wait (the others flow to the owner).
        self.handoffs: dict[str, Handoff] = {}
        self.handoff_keys: Counter[str] = Counter()
        # (state, flow id, handoff_since) last written through; None forces the first write.
        self.announced: tuple[PartitionState, str | None, float | None] | None = None
        self.ledger = AckLedger(snapshot.committed_seq, snapshot.acked_above)
        # Highest seq sent a first time (a high-water mark: seqs below it may be waiting,
        # held back or scheduled); first sends up to ``reserved`` need no record (the
        # reservation is durable). Storage gets ``low_water()`` as its dispatched_seq. A
        # reservation of a crashed run ends at the head the next run found
        # (SqlStore.forget_consumers).
        self.dispatched = snapshot.dispatched_seq
        self.reserved = max(snapshot.reserved_seq, snapshot.dispatched_seq)
        self.restored_dispatched = snapshot.dispatched_seq
        self.restored_reserved = self.reserved
        # Buffered seqs in (restored_dispatched, restored_reserved]: maybe seen before the
        # restart; their recovered count never dead-letters them by itself.
        self.maybe_seen: set[int] = set()
        # Strict key order, at recovery: keys with an unsettled message (not scheduled)
        # at or below restored_reserved read so far; a later one of the key cannot have
        # been sent while it was unsettled (DeliveryBook._recovered_count).
        self.recovered_keys: set[str] = set()
        self.records: dict[int, tuple[int, float | None]] = {
            record.seq: (record.delivery_count, record.first_delivery_time)
            for record in snapshot.deliveries
        }
        # Not yet sent, ascending seq (loads and appends arrive in seq order); changed
        # only through put/take, which keep ``buffered_bytes`` (their buffered_cost).
        self.buffer: dict[int, Message] = {}
        self.buffered_bytes = 0
        # Scheduled messages not due yet, held as notes (core/notes.py), ascending seq (a
        # skipped range read again may note some again: ``notes_unsorted`` until sorted);
        # their keys, counted; and the seqs due (or expiring) to read back (a Fetch of
        # ``fetch_seqs``).
        self.notes: dict[int, Note] = {}
        self.notes_unsorted = False
        self.noted_keys: Counter[str] = Counter()
        self.due: set[int] = set()
        self.fetch_seqs: tuple[int, ...] = ()
        # Scheduled messages skipped for want of note room: (lowest seq, highest seq, when
        # the first comes due); and the range being read again for them, (after, up to).
        self.skipped: tuple[int, int, float] | None = None
        self.rescan: tuple[int, int] | None = None
        self.fetch_rescan = False
        # A page of the range was read: the next read is of what follows the cursor, if
        # it wants one (reads alternate, so neither waits for the other to end).
        self.rescan_yield = False
        # Sends in its current turn of its flow's queue (DeliveryBook._serve).
        self.turn = 0
        # Deliveries before a restart of buffered seqs: (count, first delivery time).
        self.prior: dict[int, tuple[int, float | None]] = {}
        self.inflight: dict[int, Sent] = {}
        self.held: Counter[str] = Counter()
        self.retry: dict[int, Retry] = {}
        self.retry_keys: Counter[str] = Counter()
        self.inflight_keys: Counter[str] = Counter()
        # on_dead_letter: keys waiting for a release; keys whose messages up to the given
        # seq (in flight then) follow their dead letter (dead_letter_key, release --skip);
        # keys whose stored messages storage is moving (DeadLetterKey): held until it
        # reports which it moved.
        self.parked: dict[str, ParkedKey] = {}
        self.draining: dict[str, int] = {}
        self.key_moves: Counter[str] = Counter()
        # Highest seq loaded into memory (or skipped as settled); loads continue after it.
        self.cursor = self.ledger.committed
        self.known = self.cursor
        # ``known`` when the outstanding Fetch was issued: an empty answer is authoritative
        # only if no append committed while its query ran.
        self.known_at_fetch = self.known
        self.fetching = False
        self.fetch_limit = 0
        # What the outstanding Fetch reserved of the budgets (core/reads.py), and the
        # owner's account it reserved it in.
        self.fetch_bytes = 0
        self.fetch_use: BufferUse | None = None
        # Whether storage may hold messages after ``cursor``; unknown (True) at start.
        self.more = True
        # The buffered_cost of the message after ``cursor`` when the last read found no
        # room for it (0: none): no read is issued until there is room for that much,
        # else the same message would be read again and again (DeliveryBook).
        self.next_cost = 0

    def put(self, message: Message) -> int:
        """Buffer the message; returns its buffered_cost."""
        cost = buffered_cost(message)
        self.buffer[message.seq] = message
        self.buffered_bytes += cost
        self.use.bytes += cost
        self.owner_use.bytes += cost
        return cost

    def take(self, seq: int) -> Message:
        """Remove a buffered message (KeyError if it is not buffered)."""
        message = self.buffer.pop(seq)
        cost = buffered_cost(message)
        self.buffered_bytes -= cost
        self.use.bytes -= cost
        self.owner_use.bytes -= cost
        return message

    def reorder(self) -> None:
        """Put the buffer back in seq order, after messages read again joined it."""
        self.buffer = dict(sorted(self.buffer.items()))

    def low_water(self) -> int:
        """The dispatched_seq storage gets: every unsettled seq at or below it was sent
        (it is in flight or waits for a retry) or was found sent at the restart. What is
        buffered or noted was not sent in this run (both are in seq order), nor was what
        was skipped."""
        low = self.dispatched
        if self.buffer:
            first = next(iter(self.buffer)) - 1
            if first < low:
                low = first
        if self.notes:
            first = next(iter(self.notes)) - 1
            if first < low:
                low = first
        if self.skipped is not None and self.skipped[0] - 1 < low:
            low = self.skipped[0] - 1
        if self.rescan is not None and self.rescan[0] < low:
            low = self.rescan[0]
        return low if low > self.restored_dispatched else self.restored_dispatched

    def discard(self, seq: int) -> None:
        if seq in self.buffer:
            self.take(seq)

    @property
    def holder(self) -> str | None:
        """The flow id shown for this partition: owner, or the flow it is reserved for."""
        return self.owner if self.owner is not None else self.reserved_by

    def oldest(self) -> float | None:
        """Publish time of the oldest loaded message not settled yet: in flight, waiting for
        a retry, or the first one buffered (the buffer is in seq order)."""
        times = [sent.message.publish_time for sent in self.inflight.values()]
        times.extend(retry.message.publish_time for retry in self.retry.values())
        if self.buffer:
            times.append(next(iter(self.buffer.values())).publish_time)
        return min(times, default=None)


def count_down(counts: Counter[str], key: str) -> None:
    """One fewer of ``key`` (counted), forgotten at zero. ``pop``, not ``del``: a Counter's
    ``del`` is a Python method, and this runs for every message acked."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        counts.pop(key)


def has_tags(message: Message, tags: Iterable[tuple[str, str]]) -> bool:
    """Whether the message carries every (property, value) of a group's tag filter."""
    return all(
        name in message.properties and property_text(message.properties[name]) == value
        for name, value in tags
    )


def property_text(value: PropertyValue) -> str:
    """A property value as the text a tag filter compares with."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
