"""GroupMachine: the sans-IO delivery state machine of one (queue, group) (DESIGN.md §4).

How it works. Every event method takes ``now`` and returns the actions the owner carries
out, in order. Each event first runs the timers that are due (reservation expiry, handoff
timeouts, ack timeouts, TTL), then applies itself, then:

1. reconciles the assignment if membership changed (core.membership): core.assignment
   over the partitions that are not reserved (``unbound``) for a disconnected flow, with
   the running flows in bind order (exclusive mode: only the active flow). A partition
   whose owner still holds unacked messages of it is ``paused``: it maps to the new owner
   at once, and only the keys the old owner holds unacked messages of wait until it
   settles them or max_handoff_time ends; then its leftovers are queued first for the new
   owner, with count + 1 (key-granular handoff);
2. writes through every partition and flow whose assignment changed;
3. pumps deliveries (core.pump, over the message state of core.delivery) and asks
   storage for more where a buffer ran low;
4. emits one ``OffsetUpdate`` per partition whose settled state changed.

A flow that unbinds without the shutdown code leaves its partitions reserved for its
client through the rebalance delay: re-binding with the previous set before it expires
takes exactly those back (a reclaimed flow also takes the old flow's place in bind order).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence

from core.actions import (
    Action,
    FlowChanged,
    GroupSnapshot,
    OffsetUpdate,
    Page,
    PartitionsChanged,
    RecordDispatch,
)
from core.errors import Conflict, InvalidArgument, KeyNotParked
from core.ingress import MAX_WINDOW, validate_client_name
from core.membership import Membership
from core.model import (
    AckMode,
    DeadLetterReason,
    FlowState,
    GroupConfig,
    GroupMode,
    Message,
    PartitionState,
    QueueConfig,
)
from core.partition import (
    ACK_TIMEOUT,
    EXPIRE,
    NOTE,
    WAKE,
    Flow,
    GroupStatus,
    PartitionStatus,
    Reservation,
)


def _check_window(window: int) -> None:
    if not 0 <= window <= MAX_WINDOW:
        raise InvalidArgument(f"window must be between 0 and {MAX_WINDOW}")


class GroupMachine(Membership):
    def __init__(
        self,
        queue: QueueConfig,
        group: GroupConfig,
        *,
        now: float,
        snapshot: GroupSnapshot | None = None,
        buffer_size: int = 1000,
        buffer_bytes: int = 8 * 1024 * 1024,
        message_size: int | None = None,
    ) -> None:
        """``message_size``: the queue's average stored message size, if known, to size
        the first reads (otherwise they take one message each: core/reads.py)."""
        super().__init__(queue, group, snapshot, buffer_size, buffer_bytes, message_size)
        self._next_order = 0
        self._begin(now)

    # -- events ---------------------------------------------------------------------------

    def bind(
        self,
        now: float,
        flow_id: str,
        client: str,
        window: int,
        ack_mode: AckMode,
        previous: frozenset[int] | None = None,
        *,
        owner: str | None = None,
    ) -> list[Action]:
        """Bind a flow; ``previous`` is the partition set its client held before a reconnect,
        taken back from a reservation only by a flow of the same client and ``owner`` (the
        authenticated user: another user cannot claim a client name's partitions).

        Raises Conflict if ``flow_id`` is bound already, InvalidArgument for a window or a
        client name that kg_flows cannot hold (core.ingress), so that every protocol's bind
        is refused cleanly instead of wedging the group on a write that always fails.
        The bound flow's partitions are ``partitions_of(flow_id)`` afterwards.
        """
        if flow_id in self._flows:
            raise Conflict(f"flow {flow_id!r} is already bound")
        _check_window(window)
        validate_client_name(client)
        self._begin(now)
        self._next_order += 1
        flow = Flow(flow_id, client, window, ack_mode, self._next_order, now, owner=owner)
        self._flows[flow_id] = flow
        if previous and self._group.mode is not GroupMode.SHARED:
            self._reclaim(flow, previous)
        self._out.append(FlowChanged(flow_id, client, FlowState.RUNNING, window, ack_mode))
        self._rebalance = True
        actions = self._finish(now)
        # The bind's answer (BIND_OK) carries the set this event left the flow with:
        # announcing it as a change too would tell the consumer the same thing twice.
        return [
            a for a in actions if not (isinstance(a, PartitionsChanged) and a.flow_id == flow_id)
        ]

    def reconfigure(self, queue: QueueConfig) -> None:
        """Apply altered queue settings (delays, backoff, max_deliveries, ...); they take
        effect at their next use. The partition count cannot change."""
        if queue.name != self._queue.name or queue.slots != self._queue.slots:
            raise InvalidArgument("reconfigure cannot change the queue or its partitions")
        self._queue = queue

    def unbind(self, now: float, flow_id: str, *, shutdown: bool = False) -> list[Action]:
        """The flow leaves (close, disconnect, nack(shutdown)): its unacked messages return.

        Without ``shutdown`` its partitions stay reserved for its client through the
        rebalance delay; with it they are reassigned at once. Unknown flows are ignored.
        """
        self._begin(now)
        flow = self._flows.pop(flow_id, None)
        if flow is None:
            return self._finish(now)
        self._out.append(
            FlowChanged(flow_id, flow.client, FlowState.EXITED, flow.window, flow.ack_mode)
        )
        for part in self._parts:
            if part.held[flow_id]:
                self._return_inflight(part, flow_id, now)
        keep = not shutdown and self._queue.rebalance_delay > 0
        reserved: set[int] = set()
        for p in sorted(flow.partitions):
            part = self._parts[p]
            if part.owner != flow_id:
                continue
            if keep:
                reserved.add(p)
                self._set_owner(part, None, PartitionState.UNBOUND)
                part.reserved_by = flow_id
            else:
                self._set_owner(part, None, PartitionState.UNASSIGNED)
        if reserved:
            deadline = now + self._queue.rebalance_delay
            self._reservations[flow_id] = Reservation(
                flow_id, flow.client, flow.order, deadline, reserved, owner=flow.owner
            )
        self._rebalance = True
        return self._finish(now)

    def append(self, now: float, messages: Sequence[Message]) -> list[Action]:
        """Newly committed messages; the owner passes every one, seq-ascending per partition.

        Messages that do not fit the buffer are dropped here and read later through Fetch,
        and so is any message that is not the next seq after the cursor: a gap here means
        something was missed (storage, not an append, decides that seqs do not exist).
        """
        self._begin(now)
        for message in messages:
            part = self._part(message.partition)
            part.known = max(part.known, message.seq)
            if message.seq <= part.cursor:
                continue
            if (
                part.fetching
                or part.more
                or not self._fits(part, message)
                or message.seq != part.cursor + 1
            ):
                part.more = True  # dropped here, read again through Fetch
                self._fetch_check.add(part.index)
                continue
            self._admit(part, message, now)
        return self._finish(now)

    def heads(self, now: float, heads: Mapping[int, int]) -> list[Action]:
        """Partition heads read from storage after another writer appended (a Spark job's
        dead letters, a second gateway): a head past what is known is fetched."""
        self._begin(now)
        for partition, head in heads.items():
            part = self._part(partition)
            if head > part.known:
                part.known = head
                part.more = True
                self._fetch_check.add(part.index)
        return self._finish(now)

    def loaded(self, now: float, pages: Sequence[Page]) -> list[Action]:
        """The answers to Fetches, each a Page of its partition's messages in seq order,
        taken in one step (one pump for all of them).

        Seqs in a page's ``undeliverable`` were stored but cannot be read back whole: they
        are dead-lettered (reason ``undeliverable``) in their turn, and the partition moves
        on.
        """
        self._begin(now)
        for page in pages:
            self._load(self._part(page.partition), page, now)
        return self._finish(now)

    def ack(self, now: float, flow_id: str, message_ids: Iterable[str]) -> list[Action]:
        """Settle the flow's messages by id: those in flight to it, and those taken back
        from it (a NACK, an ack timeout, a handoff that ended) until they are delivered
        again. Other ids — unknown, settled, or another flow's — are ignored, as NACK and
        reject ignore them: a flow settles only what was delivered to it."""
        self._begin(now)
        for message_id in message_ids:
            where = self._by_id.get(message_id)
            if where is None:
                continue
            part = self._parts[where[0]]
            seq = where[1]
            sent = part.inflight.get(seq)
            if sent is not None:
                if sent.flow_id != flow_id:
                    continue
                self._remove_inflight(part, seq)
            elif part.retry[seq].holder == flow_id:
                self._remove_retry(part, seq)
            else:
                continue
            self._settle(part, seq)
        return self._finish(now)

    def ack_cumulative(self, now: float, flow_id: str, partition: int, seq: int) -> list[Action]:
        """Settle every message of ``partition`` delivered to the flow with seq <= ``seq``.

        Raises InvalidArgument in shared mode or for a partition out of range.
        """
        if self._group.mode is GroupMode.SHARED:
            raise InvalidArgument("cumulative ack is not allowed in shared mode")
        self._begin(now)
        part = self._part(partition)
        done = [s for s, sent in part.inflight.items() if s <= seq and sent.flow_id == flow_id]
        for s in sorted(done):
            self._remove_inflight(part, s)
            self._settle(part, s)
        return self._finish(now)

    def nack(
        self,
        now: float,
        flow_id: str,
        message_ids: Iterable[str],
        delay: float | None = None,
    ) -> list[Action]:
        """Redeliver after ``delay`` (default: the queue's backoff) with count + 1, or
        dead-letter when this was the last allowed delivery."""
        self._begin(now)
        for part, seq in self._held_by(flow_id, message_ids):
            self._end_delivery(part, self._remove_inflight(part, seq), now, delay)
        return self._finish(now)

    def reject(self, now: float, flow_id: str, message_ids: Iterable[str]) -> list[Action]:
        """Dead-letter the flow's unacked messages now."""
        return self._dead_letter_held(now, flow_id, message_ids, DeadLetterReason.REJECTED)

    def undeliverable(self, now: float, flow_id: str, message_ids: Iterable[str]) -> list[Action]:
        """The owner could not encode these deliveries for the flow's protocol (a message
        from an older version, or a bug): dead-letter them (reason ``undeliverable``) so
        that their partition moves on instead of retrying them forever."""
        return self._dead_letter_held(now, flow_id, message_ids, DeadLetterReason.UNDELIVERABLE)

    def _dead_letter_held(
        self, now: float, flow_id: str, message_ids: Iterable[str], reason: DeadLetterReason
    ) -> list[Action]:
        self._begin(now)
        for part, seq in self._held_by(flow_id, message_ids):
            sent = self._remove_inflight(part, seq)
            self._dead_letter(part, sent.message, reason, sent.count, sent.first_time)
        return self._finish(now)

    def credit(self, now: float, flow_id: str, window: int) -> list[Action]:
        """Set the flow's window (max delivered-unacked; 0 pauses the flow)."""
        _check_window(window)
        self._begin(now)
        flow = self._flows.get(flow_id)
        if flow is not None and flow.window != window:
            flow.set_limit(window=window, behind=flow.behind)
            self._out.append(
                FlowChanged(flow_id, flow.client, FlowState.RUNNING, window, flow.ack_mode)
            )
        return self._finish(now)

    def backpressure(self, now: float, flow_id: str, on: bool) -> list[Action]:
        """The flow's connection has more than its write buffer waiting for the socket
        (``on``), or has caught up: while it is behind the flow is sent nothing, as if its
        window were full, so what is not sent stays in storage (DESIGN.md §8)."""
        self._begin(now)
        flow = self._flows.get(flow_id)
        if flow is not None:
            flow.set_limit(window=flow.window, behind=on)
        return self._finish(now)

    def release_key(self, now: float, key: str, *, skip: bool = False) -> list[Action]:
        """Let a parked key flow again (on_dead_letter = park_key), from its oldest held
        message; with ``skip`` its messages stored until now are dead-lettered instead.
        Raises KeyNotParked if the key is parked in no partition."""
        if not any(key in part.parked for part in self._parts):
            raise KeyNotParked(self._queue.name, self._group.name, key)
        self._begin(now)
        self._release(key, skip=skip)
        return self._finish(now)

    def key_dead_lettered(
        self, now: float, partition: int, key: str, seqs: Iterable[int]
    ) -> list[Action]:
        """The owner carried out a ``DeadLetterKey`` of the key in the partition: ``seqs``
        are the messages it moved to the dead-letter queue and settled."""
        self._begin(now)
        self._key_moved(self._part(partition), key, seqs)
        return self._finish(now)

    def tick(self, now: float) -> list[Action]:
        """Run the timers that are due; call it at ``next_deadline()``."""
        self._begin(now)
        return self._finish(now)

    def close(self) -> list[Action]:
        """Final state of every partition, for a clean shutdown, so that a restart counts
        exactly what was sent: a delivery record of each unacked message (its count; a
        first send in seq order has none yet), and ack state whose dispatched_seq and
        reservation end at the low-water mark (every unsettled message at or below it was
        sent), so nothing unsent counts as seen or maybe seen."""
        out: list[Action] = []
        for part in self._parts:
            low = part.low_water()
            part.reserved = min(part.reserved, low)
            if part.inflight:
                sent = tuple(
                    (seq, s.count, s.first_time) for seq, s in sorted(part.inflight.items())
                )
                out.append(RecordDispatch(part.index, low, sent, low))
            ledger = part.ledger
            out.append(OffsetUpdate(part.index, ledger.committed, ledger.ranges(), low, low))
        return out

    # -- queries --------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """The earliest time ``tick`` may have something to do (may be early, never late)."""
        times = [res.deadline for res in self._reservations.values()]
        times += [h.deadline for p in self._paused for h in self._parts[p].handoffs.values()]
        if self._timers:
            times.append(self._timers[0][0])
        skipped = (self._parts[p].skipped for p in self._skipping)
        times += [at for _, _, at in filter(None, skipped)]
        return min(times, default=None)

    def idle(self) -> bool:
        """Whether the group has nothing to keep running for: no flow bound and no
        partition reserved for a client through the rebalance delay. Until the last
        reservation has expired (at a ``tick``), its owner must keep the machine running:
        the expiry is what makes the partitions ``unassigned`` (and lets a client that
        comes back in time take its set back)."""
        return not self._flows and not self._reservations

    def partitions_of(self, flow_id: str) -> frozenset[int]:
        """The partitions ``flow_id`` is served from: those it owns; in shared mode every
        partition, as the group round-robins all of them over all its flows (a shared flow
        is never standby). Empty for a standby flow or an unknown one."""
        flow = self._flows.get(flow_id)
        if flow is None:
            return frozenset()
        if self._group.mode is GroupMode.SHARED:
            return frozenset(range(self._queue.slots))
        return frozenset(flow.partitions)

    def status(self) -> GroupStatus:
        parts = []
        for part in self._parts:
            holder = part.holder
            client = None
            if holder in self._flows:
                client = self._flows[holder].client
            elif holder in self._reservations:
                client = self._reservations[holder].client
            parts.append(
                PartitionStatus(
                    part.index,
                    part.state,
                    holder,
                    client,
                    len(part.inflight),
                    part.ledger.committed,
                    len(part.buffer),
                    part.oldest(),
                )
            )
        flows = sorted(self._flows.values(), key=lambda f: f.order)
        return GroupStatus(
            self._queue.name,
            self._group.name,
            self._group.mode,
            tuple(parts),
            tuple(flow.status(self.partitions_of(flow.flow_id)) for flow in flows),
        )

    # -- event frame ----------------------------------------------------------------------

    def _begin(self, now: float) -> None:
        self._out = []
        self._now = now
        if self._skipping:
            self._rescan_due(now)
        for res in [r for r in self._reservations.values() if r.deadline <= now]:
            del self._reservations[res.flow_id]
            for p in res.partitions:
                part = self._parts[p]
                part.reserved_by = None
                self._set_owner(part, None, PartitionState.UNASSIGNED)
            self._rebalance = True
        for p in sorted(self._paused):
            part = self._parts[p]
            for holder in [h for h, off in part.handoffs.items() if off.deadline <= now]:
                self._end_handoff(part, holder, now)
        while self._timers and self._timers[0][0] <= now:
            _, kind, p, seq, count = heapq.heappop(self._timers)
            part = self._parts[p]
            if kind == WAKE:
                self._work.add(p)
            elif kind == EXPIRE:
                self._expire_waiting(part, seq)
            elif kind == NOTE:
                self._note_due(part, seq)
            elif kind == ACK_TIMEOUT:
                sent = part.inflight.get(seq)
                if sent is not None and sent.count == count:
                    self._end_delivery(part, self._remove_inflight(part, seq), now, None)

    def _finish(self, now: float) -> list[Action]:
        if self._rebalance:
            self._rebalance = False
            self._reconcile(now)
        for p in sorted(self._paused):
            part = self._parts[p]
            for holder in [h for h in part.handoffs if not part.held[h]]:
                self._end_handoff(part, holder, now)  # it settled all it held
        self._announce()
        self._pump(now)
        self._request_fetches()
        for p in sorted(self._dirty):
            part = self._parts[p]
            ledger = part.ledger
            update = OffsetUpdate(
                p, ledger.committed, ledger.ranges(), part.low_water(), part.reserved
            )
            self._out.append(update)
        self._dirty.clear()
        out, self._out = self._out, []
        return out
