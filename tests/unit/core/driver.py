"""A fake owner for GroupMachine tests: executes actions against an in-memory store and
checks the action contract (RecordDispatch before Deliver, DeadLetter and DeadLetterKey
then OffsetUpdate, one Fetch at a time per partition)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from core.actions import (
    Action,
    AssignmentChanged,
    DeadLetter,
    DeadLetterKey,
    Deliver,
    Dropped,
    Fetch,
    FlowChanged,
    GroupSnapshot,
    KeyParked,
    KeyReleased,
    OffsetUpdate,
    Page,
    ParkedKey,
    PartitionsChanged,
    RecordDispatch,
    fetched,
)
from core.group import GroupMachine
from core.model import (
    AckMode,
    DeadLetterReason,
    GroupConfig,
    Message,
    PartitionState,
    QueueConfig,
)
from core.partition import has_tags


class Driver:
    def __init__(
        self,
        queue: QueueConfig,
        group: GroupConfig,
        *,
        snapshot: GroupSnapshot | None = None,
        buffer_size: int = 1000,
        buffer_bytes: int = 8 * 1024 * 1024,
        store: dict[int, list[Message]] | None = None,
        auto_fetch: bool = True,
    ) -> None:
        self.queue = queue
        self.now = 0.0
        self.machine = GroupMachine(
            queue,
            group,
            now=self.now,
            snapshot=snapshot,
            buffer_size=buffer_size,
            buffer_bytes=buffer_bytes,
        )
        self.store: dict[int, list[Message]] = store if store is not None else defaultdict(list)
        self.auto_fetch = auto_fetch
        self.pending_fetches: dict[int, Fetch] = {}
        # DeadLetterKey moves not carried out yet (without auto_fetch: the machine runs on
        # while the owner's transaction is under way).
        self.pending_moves: list[DeadLetterKey] = []
        # Rows of the partition when each pending Fetch was issued: a real query's snapshot
        # is taken somewhere between issue and answer, so it may miss later commits.
        self.rows_at_issue: dict[int, int] = {}
        self.deliveries: list[Deliver] = []
        self.unacked: dict[str, dict[str, Deliver]] = defaultdict(dict)
        self.offsets: dict[int, OffsetUpdate] = {}
        self.dead: list[DeadLetter] = []
        self.parked: dict[tuple[int, str], ParkedKey] = {}
        self.dropped: list[Dropped] = []
        self.assignment: dict[int, tuple[PartitionState, str | None]] = {}
        self.handoff_since: dict[int, float | None] = {}
        self.partitions: dict[str, frozenset[int]] = {}
        self.flows: dict[str, FlowChanged] = {}
        # What storage holds: RecordDispatch moves both marks up; an OffsetUpdate moves
        # dispatched up and sets the reservation as is (it may shrink).
        self.dispatched: dict[int, int] = defaultdict(int)
        self.reserved: dict[int, int] = defaultdict(int)
        self.first_sent: dict[int, int] = defaultdict(int)
        self.recorded: set[tuple[int, int, int]] = set()
        for p, saved in (snapshot.partitions if snapshot else {}).items():
            self.dispatched[p] = saved.dispatched_seq
            self.reserved[p] = saved.reserved_seq
        self.counter = 0

    # -- driving ----------------------------------------------------------------------------

    def publish(self, key: str | None, partition: int = 0, **fields: object) -> Message:
        stored = self.store.setdefault(partition, [])
        seq = (stored[-1].seq if stored else 0) + 1
        self.counter += 1
        message = Message(
            f"m{self.counter}",
            self.queue.name,
            partition,
            seq,
            key,
            fields.pop("payload", b"x"),  # type: ignore[arg-type]
            **fields,  # type: ignore[arg-type]
        )
        stored.append(message)
        self.run(self.machine.append(self.now, [message]))
        return message

    def call(
        self, method: Callable[..., list[Action]], *args: object, **kw: object
    ) -> list[Action]:
        actions = method(self.now, *args, **kw)
        self.run(actions)
        return actions

    def bind(
        self,
        flow: str,
        client: str | None = None,
        window: int = 100,
        ack_mode: AckMode = AckMode.CLIENT,
        previous: frozenset[int] | None = None,
        owner: str | None = None,
    ) -> list[Action]:
        actions = self.call(
            self.machine.bind, flow, client or flow, window, ack_mode, previous, owner=owner
        )
        # What the bind answers (BIND_OK): the machine announces only later changes.
        self.partitions[flow] = self.machine.partitions_of(flow)
        return actions

    def advance(self, seconds: float) -> list[Action]:
        self.now += seconds
        return self.call(self.machine.tick)

    def answer_fetches(self) -> None:
        while self.pending_fetches or self.pending_moves:
            if self.pending_moves:
                self.answer_move()
            else:
                self.answer(len(self.pending_fetches))

    def answer_move(self) -> None:
        """Carry out the oldest DeadLetterKey as storage does, in one transaction."""
        move = self.pending_moves.pop(0)
        moved = [
            m
            for m in self.store.get(move.partition, [])
            if m.key == move.key and m.seq > move.after_seq and not self.settled(m.partition, m.seq)
        ]
        for m in moved:
            if has_tags(m, move.tags):
                self.dead.append(DeadLetter(m, DeadLetterReason.KEY_DEAD_LETTERED, 0, None))
        seqs = [m.seq for m in moved]
        actions = self.machine.key_dead_lettered(self.now, move.partition, move.key, seqs)
        self.run(actions, nested=True)

    def answer(self, count: int = 1, *, stale: bool = False) -> None:
        """Answer the ``count`` oldest Fetches in one step, as the runtime answers the
        Fetches of one read; ``stale`` answers from the rows committed before each was
        issued (its query ran before later appends committed)."""
        pages = []
        for partition, fetch in list(self.pending_fetches.items())[:count]:
            del self.pending_fetches[partition]
            stored = self.store.get(partition, [])
            issued = self.rows_at_issue.pop(partition)
            if fetch.seqs:  # noted messages: committed long before, whatever ``stale``
                wanted = set(fetch.seqs)
                pages.append(Page(partition, [m for m in stored if m.seq in wanted]))
                continue
            rows = [m for m in (stored[:issued] if stale else stored) if m.seq > fetch.after_seq]
            pages.append(Page(partition, fetched(rows, fetch.limit, fetch.max_bytes)))
        self.run(self.machine.loaded(self.now, pages), nested=True)

    def run(self, actions: list[Action], *, nested: bool = False) -> None:
        owed_offsets: set[tuple[int, int]] = set()
        for action in actions:
            if isinstance(action, RecordDispatch):
                p = action.partition
                assert action.dispatched_seq >= self.dispatched[p]
                self.dispatched[p] = action.dispatched_seq
                self.reserved[p] = max(self.reserved[p], action.reserved_seq)
                for seq, count, _ in action.redeliveries:
                    self.recorded.add((action.partition, seq, count))
            elif isinstance(action, Deliver):
                m = action.message
                durable = max(self.dispatched[m.partition], self.reserved[m.partition])
                if action.delivery_count == 1 and not action.redelivered:
                    if m.seq > durable:
                        raise AssertionError(f"Deliver of {m.seq} before its RecordDispatch")
                    self.first_sent[m.partition] = max(self.first_sent[m.partition], m.seq)
                else:  # a redelivery, or a recovered maybe-seen message capped at count 1
                    assert (m.partition, m.seq, action.delivery_count) in self.recorded
                assert action.redelivered or action.delivery_count == 1
                assert not self.settled(m.partition, m.seq), f"{m.seq} delivered after settle"
                assert (m.partition, m.key) not in self.parked, f"{m.seq} of a parked key sent"
                self.deliveries.append(action)
                self.unacked[action.flow_id][m.message_id] = action
            elif isinstance(action, Fetch):
                assert action.partition not in self.pending_fetches, "second Fetch"
                self.pending_fetches[action.partition] = action
                self.rows_at_issue[action.partition] = len(self.store.get(action.partition, []))
            elif isinstance(action, OffsetUpdate):
                p = action.partition
                self.offsets[p] = action
                self.dispatched[p] = max(self.dispatched[p], action.dispatched_seq)
                self.reserved[p] = action.reserved_seq
                # A shrinking reservation never uncovers an unsettled first send that has
                # no record (a clean shutdown records those it uncovers).
                durable = max(self.dispatched[p], self.reserved[p])
                if durable < self.first_sent[p]:
                    recorded = {(q, seq) for q, seq, _ in self.recorded}
                    for x in self.deliveries:
                        s = x.message.seq
                        if x.message.partition == p and s > durable and not self.settled(p, s):
                            assert (p, s) in recorded, f"{s} sent, unsettled, not durable"
                owed_offsets = {
                    (q, s)
                    for q, s in owed_offsets
                    if (q != p if s == -1 else not self.settled(q, s))
                }
            elif isinstance(action, DeadLetter):
                self.dead.append(action)
                owed_offsets.add((action.message.partition, action.message.seq))
            elif isinstance(action, DeadLetterKey):
                self.pending_moves.append(action)
                owed_offsets.add((action.partition, -1))
            elif isinstance(action, KeyParked):
                assert owed_offsets, "KeyParked without its DeadLetter"
                self.parked[action.parked.partition, action.parked.key] = action.parked
            elif isinstance(action, KeyReleased):
                self.parked.pop((action.partition, action.key), None)
            elif isinstance(action, Dropped):
                self.dropped.append(action)
            elif isinstance(action, AssignmentChanged):
                self.assignment[action.partition] = (action.state, action.flow_id)
                self.handoff_since[action.partition] = action.handoff_since
            elif isinstance(action, PartitionsChanged):
                self.partitions[action.flow_id] = action.partitions
            elif isinstance(action, FlowChanged):
                self.flows[action.flow_id] = action
        assert not owed_offsets, f"DeadLetter without a settling OffsetUpdate: {owed_offsets}"
        if self.auto_fetch and not nested:
            self.answer_fetches()

    # -- consumer side ------------------------------------------------------------------

    def ack(self, flow: str, *messages: Message) -> list[Action]:
        for m in messages:
            self.unacked[flow].pop(m.message_id, None)
        return self.call(self.machine.ack, flow, [m.message_id for m in messages])

    def nack(self, flow: str, *messages: Message, delay: float | None = None) -> list[Action]:
        for m in messages:
            self.unacked[flow].pop(m.message_id, None)
        return self.call(self.machine.nack, flow, [m.message_id for m in messages], delay)

    def received(self, flow: str) -> list[Message]:
        return [d.message for d in self.deliveries if d.flow_id == flow]

    def seqs(self, flow: str) -> list[int]:
        return [m.seq for m in self.received(flow)]

    def settled(self, partition: int, seq: int) -> bool:
        update = self.offsets.get(partition)
        if update is None:
            return False
        if seq <= update.committed_seq:
            return True
        return any(lo <= seq <= hi for lo, hi in update.acked_above)
