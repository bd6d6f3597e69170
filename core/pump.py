"""The pump of a group's DeliveryBook: it turns buffered and due-for-retry messages into
``Deliver`` actions (DESIGN.md §4 Delivery, per-key order), and its dispatch records.

How it works (the whole picture is in core/delivery.py's docstring). Per partition, due
retries go first (seq order), then buffered messages in seq order, each only if its key
is not held back and a flow has room in its window. Each flow keeps a queue of the
partitions that have something to send and is served round-robin while it has room (a
partition keeps its turn for up to ``TURN`` sends); shared mode has one queue. A
``RecordDispatch`` precedes the partition's ``Deliver`` actions when they need one (a
redelivery, or a first send above the partition's reservation, which then reserves
``DISPATCH_AHEAD`` seqs while the partition flows); a partition that cannot send gives
its reservation back.

``Pump`` is a base of ``DeliveryBook``, which owns the state named below.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Final

from core.actions import Action, Deliver, RecordDispatch
from core.model import AckMode, GroupConfig, GroupMode, KeyOrder, Message, QueueConfig
from core.partition import (
    ACK_TIMEOUT,
    DELIVERING,
    Flow,
    Partition,
    Retry,
    Sent,
    Timer,
)

# Sends a partition makes in a row before the next one of its flow's queue gets its turn.
TURN: Final = 64
# Seqs a first-send record reserves beyond the highest one sent.
DISPATCH_AHEAD: Final = 1024


class Pump:
    _queue: QueueConfig
    _group: GroupConfig
    _parts: list[Partition]
    _flows: dict[str, Flow]
    _by_id: dict[str, tuple[int, int]]
    _timers: list[Timer]
    _rr: int
    _shared_flows: list[Flow]
    _out: list[Action]
    _fetch_check: set[int]
    _dirty: set[int]
    _work: set[int]
    _shared_work: dict[int, None]
    _reserving: set[int]
    _stuck: set[int]

    if TYPE_CHECKING:

        def _running(self) -> list[Flow]: ...
        def _remove_retry(self, part: Partition, seq: int) -> Retry: ...
        def _expire(
            self, part: Partition, message: Message, prior: tuple[int, float | None] | None
        ) -> None: ...

    def _pick(self, part: Partition) -> Flow | None:
        """The flow the partition's next message goes to, None when none has room."""
        if self._group.mode is not GroupMode.SHARED:
            if part.state not in DELIVERING or part.owner is None:
                return None
            flow = self._flows[part.owner]
            return flow if flow.has_room() else None
        running = self._shared_flows
        for i in range(len(running)):
            flow = running[(self._rr + i) % len(running)]
            if flow.has_room():
                self._rr = (self._rr + i + 1) % len(running)
                return flow
        return None

    def _pump(self, now: float) -> None:
        """Send what the flows have room for. Each partition with something new to send
        waits in the queue of the flow that owns it (shared mode: one queue); a flow's
        queue is served round-robin while the flow has room, so an event costs
        O(partitions that send), not O(partitions with a backlog). A partition stays
        queued while it has sendable messages; one whose messages all wait (held-back
        keys, not due yet) leaves the queue until an event wakes it (``_work``)."""
        running = self._shared_flows = self._running()
        shared = self._group.mode is GroupMode.SHARED
        for p in sorted(self._work):
            part = self._parts[p]
            if not part.buffer and not part.retry:
                continue
            if shared:
                self._shared_work[p] = None
            elif part.owner is not None:
                self._flows[part.owner].work[p] = None
        self._work.clear()
        if shared:
            self._serve(self._shared_work, None, now)
        else:
            for flow in running:
                self._serve(flow.work, flow, now)
        for p in sorted(self._reserving):
            part = self._parts[p]
            if part.reserved <= part.dispatched:
                self._reserving.discard(p)
            elif self._pick_room(part) is None:
                self._give_back(part)

    def _serve(self, queue: dict[int, None], flow: Flow | None, now: float) -> None:
        """Pump the queue's partitions in turn while there is room (``flow``: its owner;
        None: shared mode, any running flow)."""
        for _ in range(len(queue)):
            if not (flow.has_room() if flow else any(f.has_room() for f in self._shared_flows)):
                return
            p = next(iter(queue))
            part = self._parts[p]
            if flow is not None and (part.owner != flow.flow_id or part.state not in DELIVERING):
                del queue[p]
                continue  # moved on: _set_owner queued it for its new owner
            if self._pump_partition(part, now):
                # Stalled for room: it keeps its turn for up to TURN sends (a step then
                # touches few partitions: fewer dispatch records and offsets to write).
                if part.turn >= TURN:
                    part.turn = 0
                    del queue[p]
                    queue[p] = None
                return
            part.turn = 0
            del queue[p]
            if part.buffer:
                self._stuck.add(p)
                self._fetch_check.add(p)

    def _pick_room(self, part: Partition) -> Flow | None:
        """A flow the partition could send to but for its connection being behind (for
        now), without taking a round-robin turn: while there is one, the partition keeps
        its reservation, as a flowing one does, so the sends that follow once the socket
        caught up need no dispatch record of their own."""
        if self._group.mode is GroupMode.SHARED:
            return next((f for f in self._shared_flows if f.pending < f.window), None)
        if part.state not in DELIVERING or part.owner is None:
            return None
        flow = self._flows[part.owner]
        return flow if flow.pending < flow.window else None

    def _blocked(self, part: Partition, key: str | None, held_back: set[str]) -> bool:
        if key is None:
            return False
        # .get, not [key]: a Counter's missing key costs a Python call (__missing__), and
        # every message asks here about counts that are nearly always absent.
        if key in held_back or key in part.parked or part.retry_keys.get(key):
            return True
        if part.handoff_keys.get(key) or part.key_moves.get(key):
            return True
        return self._group.key_order is KeyOrder.STRICT and key in part.inflight_keys

    def _pump_partition(self, part: Partition, now: float) -> bool:
        """Send the partition's due retries, then its buffer, in seq order; whether it
        stalled for lack of room."""
        self._stuck.discard(part.index)
        sends: list[Deliver] = []
        redeliveries: list[tuple[int, int, float]] = []
        dispatched = part.dispatched
        held_back: set[str] = set()
        stalled = False
        for seq in sorted(part.retry):
            entry = part.retry[seq]
            key = entry.message.key
            if key is not None and (
                key in held_back
                or key in part.parked
                or part.handoff_keys[key] > 0
                or entry.due > now
                or (self._group.key_order is KeyOrder.STRICT and part.inflight_keys[key])
            ):
                held_back.add(key)
                continue
            if entry.due > now:
                continue
            if entry.message.expire_at is not None and entry.message.expire_at <= now:
                self._remove_retry(part, seq)
                self._expire(part, entry.message, (entry.count - 1, entry.first_time))
                continue
            flow = self._pick(part)
            if flow is None:
                stalled = True
                break
            self._remove_retry(part, seq)
            first_time = entry.first_time if entry.first_time is not None else now
            redeliveries.append((seq, entry.count, first_time))
            sends.append(self._send(part, flow, entry.message, entry.count, first_time, now, True))
        for seq in list(part.buffer):
            message = part.buffer[seq]
            if self._blocked(part, message.key, held_back):
                continue
            if message.deliver_at is not None and message.deliver_at > now:
                continue
            if message.expire_at is not None and message.expire_at <= now:
                part.take(seq)
                self._expire(part, message, part.prior.pop(seq, None))
                continue
            flow = self._pick(part)
            if flow is None:
                stalled = True
                break
            part.take(seq)
            prior = part.prior.pop(seq, None)
            if prior is not None:
                count, first_time = prior[0] + 1, prior[1] if prior[1] is not None else now
                if seq in part.maybe_seen:
                    part.maybe_seen.discard(seq)
                    count = min(count, self._queue.max_deliveries or count)
                redeliveries.append((seq, count, first_time))
            else:
                count, first_time = 1, now
                if seq > dispatched:
                    dispatched = seq
                else:  # sent out of seq order (held back or scheduled): record it
                    redeliveries.append((seq, 1, now))
            sends.append(self._send(part, flow, message, count, first_time, now, prior is not None))
        if sends:
            part.turn += len(sends)
            self._record(part, dispatched, redeliveries, stalled)
            self._out.extend(sends)
        if stalled and part.reserved > part.dispatched and self._pick_room(part) is None:
            self._give_back(part)
        return stalled

    def _record(
        self,
        part: Partition,
        dispatched: int,
        redeliveries: list[tuple[int, int, float]],
        stalled: bool,
    ) -> None:
        """Before the partition's sends: a RecordDispatch if any needs one (reserving ahead
        while the partition flows), else the new position for the next OffsetUpdate."""
        self._fetch_check.add(part.index)
        if dispatched != part.dispatched:
            part.dispatched = dispatched
            self._dirty.add(part.index)
        if dispatched > part.reserved or redeliveries:
            ahead = dispatched if stalled else dispatched + DISPATCH_AHEAD
            part.reserved = max(part.reserved, ahead)
            self._dirty.add(part.index)
            if part.reserved > part.dispatched:
                self._reserving.add(part.index)
            record = RecordDispatch(
                part.index, part.low_water(), tuple(redeliveries), part.reserved
            )
            self._out.append(record)

    def _give_back(self, part: Partition) -> None:
        """A partition that cannot send keeps no reservation ahead of what it sent."""
        if part.reserved > part.dispatched:
            part.reserved = part.dispatched
            self._dirty.add(part.index)

    def _send(
        self,
        part: Partition,
        flow: Flow,
        message: Message,
        count: int,
        first_time: float,
        now: float,
        redelivered: bool,
    ) -> Deliver:
        # An auto-ack delivery is held like any other until its owner acks it, which it
        # does once the message is written to the consumer's socket: the window bounds it,
        # and a consumer that dies before reading gets it redelivered to another.
        seq = message.seq
        part.inflight[seq] = Sent(message, flow.flow_id, count, first_time)
        part.held[flow.flow_id] += 1
        flow.pending += 1
        self._by_id[message.message_id] = (part.index, seq)
        key = message.key
        if key is not None:
            part.inflight_keys[key] = part.inflight_keys.get(key, 0) + 1
        if self._group.ack_timeout is not None and flow.ack_mode is AckMode.CLIENT:
            deadline = now + self._group.ack_timeout
            heapq.heappush(self._timers, (deadline, ACK_TIMEOUT, part.index, seq, count))
        return Deliver(flow.flow_id, message, count, redelivered)


__all__ = ["DISPATCH_AHEAD", "TURN", "Pump"]
