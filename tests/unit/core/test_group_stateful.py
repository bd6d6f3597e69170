"""Random binds, unbinds, publishes, settles and time against GroupMachine's invariants.

The checks look at the machine's internal partition records where the invariant is about
what the machine holds (who has unacked messages of a partition, what waits for retry).
"""

from __future__ import annotations

from collections import Counter, defaultdict

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from core.model import (
    AckMode,
    DeadLetterPolicy,
    GroupConfig,
    GroupMode,
    KeyOrder,
    Message,
    PartitionState,
    QueueConfig,
)
from core.partition import Sent, buffered_cost, note_cost
from tests.unit.core.driver import Driver

KEYS = ("A", "B", "C", "D", None)
CLIENTS = ("c1", "c2", "c3", "c4")


class GroupMachineRules(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.d: Driver
        self.mode = GroupMode.PARTITIONED
        self.strict = False
        self.flow_no = 0
        self.bound: dict[str, str] = {}  # flow id -> client
        self.last_held: dict[str, frozenset[int]] = {}  # client -> partitions at unbind
        self.published: list[Message] = []
        self.settle_log: dict[str | None, list[int]] = defaultdict(list)
        self.seen = 0  # deliveries already checked
        # Flows whose connection is behind -> how many deliveries they had when it fell behind.
        self.behind: dict[str, int] = {}

    @initialize(
        mode=st.sampled_from(GroupMode),
        strict=st.booleans(),
        partitions=st.integers(0, 4),
        max_deliveries=st.sampled_from([0, 3]),
        handoff=st.sampled_from([0.0, 2.0]),
        delay=st.sampled_from([0.0, 3.0]),
        ack_timeout=st.sampled_from([None, 5.0]),
        buffer_size=st.integers(1, 4),
        buffer_bytes=st.sampled_from([1, 1500, 3000, 1 << 20]),
        auto_fetch=st.booleans(),
        policy=st.sampled_from(DeadLetterPolicy),
    )
    def setup(
        self,
        mode: GroupMode,
        strict: bool,
        partitions: int,
        max_deliveries: int,
        handoff: float,
        delay: float,
        ack_timeout: float | None,
        buffer_size: int,
        buffer_bytes: int,
        auto_fetch: bool,
        policy: DeadLetterPolicy,
    ) -> None:
        self.mode = mode
        self.strict = strict
        queue = QueueConfig(
            "q",
            partitions=partitions,
            max_deliveries=max_deliveries,
            max_handoff_time=handoff,
            rebalance_delay=delay,
            backoff_initial=0.5,
            backoff_max=2.0,
            on_dead_letter=policy.value,
        )
        order = KeyOrder.STRICT if strict else KeyOrder.PARTITION
        group = GroupConfig("q", "g", mode=mode, key_order=order, ack_timeout=ack_timeout)
        self.d = Driver(
            queue,
            group,
            buffer_size=buffer_size,
            buffer_bytes=buffer_bytes,
            auto_fetch=auto_fetch,
        )

    # -- helpers ----------------------------------------------------------------------------

    def partition_of(self, key: str | None, draw: int) -> int:
        slots = self.d.queue.slots
        if key is None:
            return draw % slots
        return KEYS.index(key) % slots

    def stable(self) -> bool:
        m = self.d.machine
        return not m._reservations and not m._paused

    # -- rules ------------------------------------------------------------------------------

    @rule(
        client=st.sampled_from(CLIENTS),
        use_previous=st.booleans(),
        window=st.integers(1, 3),
        auto=st.integers(0, 9),
    )
    def bind(self, client: str, use_previous: bool, window: int, auto: int) -> None:
        self.flow_no += 1
        flow = f"f{self.flow_no}"
        previous = self.last_held.get(client) if use_previous else None
        before = {f: self.d.machine.partitions_of(f) for f in self.bound}
        check_moves = (
            self.mode is GroupMode.PARTITIONED
            and self.stable()
            and not previous
            and 0 < len(self.bound) < self.d.queue.slots
            and sum(len(p) for p in before.values()) == self.d.queue.slots
        )
        mode = AckMode.AUTO if auto == 0 else AckMode.CLIENT
        self.d.bind(flow, client, window, mode, previous)
        self.bound[flow] = client
        if check_moves:
            parts = self.d.machine._parts
            moving = [p for p in parts if p.owner == flow]
            assert len(moving) == self.d.queue.slots // (len(self.bound))

    @precondition(lambda self: bool(self.bound))
    @rule(data=st.data(), shutdown=st.booleans())
    def unbind(self, data: st.DataObject, shutdown: bool) -> None:
        flow = data.draw(st.sampled_from(sorted(self.bound)))
        self.last_held[self.bound.pop(flow)] = self.d.machine.partitions_of(flow)
        self.d.unacked.pop(flow, None)
        self.behind.pop(flow, None)
        self.d.call(self.d.machine.unbind, flow, shutdown=shutdown)

    @rule(
        key=st.sampled_from(KEYS),
        draw=st.integers(0, 3),
        delay=st.sampled_from([None, None, None, 0.5, 3.0, 25.0]),
    )
    def publish(self, key: str | None, draw: int, delay: float | None) -> None:
        # A scheduled one is buffered (due soon), or noted while the notes budget has room.
        partition = self.partition_of(key, draw)
        deliver_at = None if delay is None else self.d.now + delay
        message = self.d.publish(
            key, partition=partition, publish_time=self.d.now, deliver_at=deliver_at
        )
        self.published.append(message)

    @precondition(lambda self: bool(self.d.parked))
    @rule(data=st.data(), skip=st.booleans())
    def release(self, data: st.DataObject, skip: bool) -> None:
        _, key = data.draw(st.sampled_from(sorted(self.d.parked)))
        self.d.call(self.d.machine.release_key, key, skip=skip)

    @precondition(lambda self: any(self.d.unacked[f] for f in self.bound))
    @rule(data=st.data(), op=st.sampled_from(["ack", "ack", "ack", "nack", "reject"]))
    def settle(self, data: st.DataObject, op: str) -> None:
        flow = data.draw(st.sampled_from([f for f in sorted(self.bound) if self.d.unacked[f]]))
        held = list(self.d.unacked[flow].values())
        key = data.draw(st.sampled_from(sorted({repr(x.message.key) for x in held})))
        # Settle each key in receive order: the oldest unacked delivery of that key.
        target = next(x.message for x in held if repr(x.message.key) == key)
        was = self.d.settled(target.partition, target.seq)
        if op == "ack":
            self.d.ack(flow, target)
            # A scheduled one enters its key's order at deliver_at, not at its publish.
            scheduled = target.deliver_at is not None
            if not was and not scheduled and self.d.settled(target.partition, target.seq):
                self.settle_log[target.key].append(target.seq)
        elif op == "nack":
            self.d.nack(flow, target)
        else:
            self.d.unacked[flow].pop(target.message_id)
            self.d.call(self.d.machine.reject, flow, [target.message_id])

    @precondition(lambda self: bool(self.bound))
    @rule(data=st.data())
    def ack_another_flows_message(self, data: st.DataObject) -> None:
        # What is in flight to another flow, or waits for its retry after another flow's
        # delivery, is not this flow's to settle.
        flow = data.draw(st.sampled_from(sorted(self.bound)))
        parts = self.d.machine._parts
        foreign = [
            (part.index, seq)
            for part in parts
            for seq, held in (*part.inflight.items(), *part.retry.items())
            if (held.flow_id if isinstance(held, Sent) else held.holder) != flow
        ]
        if not foreign:
            return
        p, seq = data.draw(st.sampled_from(sorted(foreign)))
        part = parts[p]
        held = part.inflight.get(seq) or part.retry[seq]
        self.d.call(self.d.machine.ack, flow, [held.message.message_id])
        assert seq in part.inflight or seq in part.retry
        assert not self.d.settled(p, seq)

    @precondition(lambda self: bool(self.bound))
    @rule(data=st.data(), window=st.integers(0, 4))
    def credit(self, data: st.DataObject, window: int) -> None:
        flow = data.draw(st.sampled_from(sorted(self.bound)))
        self.d.call(self.d.machine.credit, flow, window)

    @precondition(lambda self: bool(self.bound))
    @rule(data=st.data(), on=st.booleans())
    def backpressure(self, data: st.DataObject, on: bool) -> None:
        flow = data.draw(st.sampled_from(sorted(self.bound)))
        if on:
            self.behind.setdefault(flow, self.delivered_to(flow))
        else:
            self.behind.pop(flow, None)
        self.d.call(self.d.machine.backpressure, flow, on)

    def delivered_to(self, flow: str) -> int:
        return sum(1 for x in self.d.deliveries if x.flow_id == flow)

    @rule(seconds=st.sampled_from([0.5, 1.0, 2.5, 6.0]))
    def advance(self, seconds: float) -> None:
        self.d.advance(seconds)

    @precondition(lambda self: bool(self.d.pending_fetches))
    @rule(data=st.data(), stale=st.booleans())
    def answer_fetches(self, data: st.DataObject, stale: bool) -> None:
        count = data.draw(st.integers(1, len(self.d.pending_fetches)))
        self.d.answer(count, stale=stale)

    @precondition(lambda self: bool(self.d.pending_moves))
    @rule()
    def answer_move(self) -> None:
        self.d.answer_move()

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def only_the_owner_and_a_flow_handing_off_hold_a_partitions_messages(self) -> None:
        if self.mode is GroupMode.SHARED:
            return
        for part in self.d.machine._parts:
            holders = {sent.flow_id for sent in part.inflight.values()}
            assert holders <= {part.owner, *part.handoffs}
            # Of each key, only one of them holds unacked messages.
            owners: dict[str, set[str]] = defaultdict(set)
            for sent in part.inflight.values():
                if sent.message.key is not None:
                    owners[sent.message.key].add(sent.flow_id)
            assert all(len(flows) == 1 for flows in owners.values()), owners

    @invariant()
    def buffers_keep_to_their_byte_budget(self) -> None:
        # Beyond the group's budget only by the message each partition may always take,
        # and by what the flows with nothing to send read while others hold the budget
        # (their parts of it: core/reads.py). Each flow's account is its partitions'.
        m = self.d.machine
        firsts = 0
        for part in m._parts:
            assert part.buffered_bytes == sum(map(buffered_cost, part.buffer.values()))
            firsts += buffered_cost(next(iter(part.buffer.values()))) if part.buffer else 0
        assert m._use.bytes == sum(part.buffered_bytes for part in m._parts)
        assert m._use.bytes <= 2 * m._buffer_bytes + firsts
        assert m._use.reading == sum(part.fetch_bytes for part in m._parts)
        # Notes keep to a budget of their own, the group's.
        noted = [note for part in m._parts for note in part.notes.values()]
        assert m._noted == sum(note_cost(key) for _, key, _ in noted) <= m._buffer_bytes
        for flow in m._flows.values():
            owned = [part for part in m._parts if part.owner == flow.flow_id]
            assert flow.use.bytes == sum(part.buffered_bytes for part in owned)

    @invariant()
    def a_flow_whose_connection_is_behind_is_sent_nothing(self) -> None:
        for flow, count in self.behind.items():
            assert self.delivered_to(flow) == count, flow

    @invariant()
    def strict_groups_have_one_unacked_message_per_key(self) -> None:
        if not self.strict:
            return
        for part in self.d.machine._parts:
            keys = Counter(s.message.key for s in part.inflight.values() if s.message.key)
            assert all(n == 1 for n in keys.values()), keys

    @invariant()
    def a_retried_message_is_never_overtaken(self) -> None:
        parts = self.d.machine._parts
        for action in self.d.deliveries[self.seen :]:
            if action.delivery_count == 1:
                m = action.message
                if m.key is None:
                    continue
                waiting = parts[m.partition].retry.values()
                assert not any(r.message.key == m.key and r.message.seq < m.seq for r in waiting)
        self.seen = len(self.d.deliveries)

    @invariant()
    def every_message_is_settled_or_still_known(self) -> None:
        for m in self.published:
            part = self.d.machine._parts[m.partition]
            known = m.seq in part.buffer or m.seq in part.inflight or m.seq in part.retry
            known = known or m.seq in part.notes
            # Or skipped for want of note room, in a range read again when due.
            for lo, hi in (part.skipped[:2] if part.skipped else (1, 0), part.rescan or (0, 0)):
                known = known or lo <= m.seq <= hi
            assert known or m.seq > part.cursor or self.d.settled(m.partition, m.seq), m

    @invariant()
    def every_unsettled_message_up_to_dispatched_seq_was_sent(self) -> None:
        # dispatched_seq as storage holds it is a low-water mark: recovery counts such a
        # message as seen (and may dead-letter it), so it must have been.
        sent = {(x.message.partition, x.message.seq) for x in self.d.deliveries}
        for m in self.published:
            if m.seq <= self.d.dispatched[m.partition]:
                assert (m.partition, m.seq) in sent or self.d.settled(m.partition, m.seq), m

    @invariant()
    def settled_messages_of_a_key_follow_publish_order_in_strict_groups(self) -> None:
        if self.strict:
            for key, seqs in self.settle_log.items():
                if key is not None:
                    assert seqs == sorted(seqs), (key, seqs)

    def teardown(self) -> None:
        if not hasattr(self, "d"):
            return
        d = self.d
        d.auto_fetch = True
        d.answer_fetches()
        # Once flows stop changing and the delays pass, the assignment is balanced.
        d.advance(10.0)
        d.advance(10.0)
        self.check_balanced()
        for flow in sorted(self.bound):
            d.call(d.machine.unbind, flow, shutdown=True)
        d.unacked.clear()
        for key in sorted({key for _, key in d.parked}):
            d.call(d.machine.release_key, key)
        d.bind("drain", "drain", 1000, AckMode.CLIENT)
        for _ in range(40):
            d.ack("drain", *[x.message for x in d.unacked["drain"].values()])
            d.advance(10.0)
        # Settled is not enough: each message must have been settled for a reason — delivered
        # (then acked), dead-lettered or dropped (expired / filtered) — never skipped silently.
        accounted = {x.message.message_id for x in (*d.deliveries, *d.dead, *d.dropped)}
        for m in self.published:
            assert d.settled(m.partition, m.seq), m
            assert m.message_id in accounted, f"{m} was settled without being delivered"
        dead = Counter(x.message.message_id for x in d.dead)
        assert all(n == 1 for n in dead.values())
        assert d.parked == {}

    def check_balanced(self) -> None:
        status = self.d.machine.status()
        flows = len(status.flows)
        if not flows:
            return
        assert all(p.state is PartitionState.READY for p in status.partitions)
        counts = sorted((len(f.partitions) for f in status.flows), reverse=True)
        slots = self.d.queue.slots
        if self.mode is GroupMode.PARTITIONED:
            active = min(flows, slots)
            low, high = slots // active, -(-slots // active)
            assert all(low <= c <= high for c in counts[:active])
            assert not any(counts[active:])
        elif self.mode is GroupMode.EXCLUSIVE:
            assert counts[0] == slots and not any(counts[1:])


GroupMachineRules.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestGroupMachine = GroupMachineRules.TestCase
