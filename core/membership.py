"""Membership: which flow owns which partition of a group, and the handoffs between them.

How it works. A ``GroupMachine`` event marks membership changed (a bind, an unbind, a
reservation that expired); at the end of the event ``_reconcile`` runs core.assignment
over the partitions not reserved for a disconnected client, with the running flows in bind
order (exclusive mode: only the active flow), and ``_move`` maps each partition to its new
owner. A partition whose old owner still holds unacked messages of it is ``paused``: only
the keys the old owner holds wait (key-granular handoff) until it settles them or
max_handoff_time ends, then ``_end_handoff`` returns its leftovers first to the new owner.
A partition that moves on while it waits (A -> B -> C) keeps one handoff per previous owner
that still holds messages of it, each with its own keys and deadline.
``_announce`` turns what changed into ``AssignmentChanged`` and ``PartitionsChanged``
actions, once per event and only for real changes.
"""

from __future__ import annotations

from collections import Counter

from core.actions import AssignmentChanged, GroupSnapshot, PartitionsChanged
from core.assignment import assign
from core.delivery import DeliveryBook
from core.model import GroupConfig, GroupMode, PartitionState, QueueConfig
from core.partition import BufferUse, Flow, Handoff, Partition, Reservation


class Membership(DeliveryBook):
    """Partition ownership of one group: reservations, reconciliation and handoffs."""

    def __init__(
        self,
        queue: QueueConfig,
        group: GroupConfig,
        snapshot: GroupSnapshot | None,
        buffer_size: int,
        buffer_bytes: int,
        message_size: int | None = None,
    ) -> None:
        super().__init__(queue, group, snapshot, buffer_size, buffer_bytes, message_size)
        # Partitions kept for a disconnected flow's client through the rebalance delay.
        self._reservations: dict[str, Reservation] = {}
        self._rebalance = True
        self._paused: set[int] = set()
        # Flows whose partition set changed since the last announcement.
        self._moved: set[str] = set()
        # Partitions whose write-through state may have changed; all of them at start.
        self._touched: set[int] = set(range(queue.slots))

    def _reclaim(self, flow: Flow, previous: frozenset[int]) -> None:
        mine = [
            r
            for r in self._reservations.values()
            if r.client == flow.client and r.owner == flow.owner
        ]
        for res in mine:
            back = res.partitions & previous
            if not back:
                continue
            res.partitions -= back
            flow.order = min(flow.order, res.order)
            for p in back:
                part = self._parts[p]
                part.reserved_by = None
                self._set_owner(part, flow.flow_id, self._owned_state(part, flow.flow_id))
            if not res.partitions:
                del self._reservations[res.flow_id]

    def _reconcile(self, now: float) -> None:
        running = self._running()
        if self._group.mode is GroupMode.SHARED:
            state = PartitionState.READY if running else PartitionState.UNASSIGNED
            for part in self._parts:
                if part.state is not state:
                    self._touched.add(part.index)
                    self._fetch_check.add(part.index)
                part.state = state
            return
        free = [part for part in self._parts if part.state is not PartitionState.UNBOUND]
        candidates = [flow.flow_id for flow in running]
        if self._group.mode is GroupMode.EXCLUSIVE:
            indexes = {part.index for part in free}
            active = next((f for f in running if f.partitions & indexes), None)
            candidates = [active.flow_id] if active else candidates[:1]
        current = {i: part.owner for i, part in enumerate(free) if part.owner in self._flows}
        desired = assign(len(free), candidates, current)
        for i, part in enumerate(free):
            self._move(part, desired[i], now)

    def _move(self, part: Partition, target: str | None, now: float) -> None:
        """Key-granular handoff (DESIGN.md §4): the partition maps to ``target`` at once;
        only the keys the old owner still holds unacked messages of wait, until it settles
        them or max_handoff_time ends (then they return, first, to the new owner). A
        handoff still pending from an earlier move keeps its keys and its deadline."""
        owner = part.owner
        if target == owner:
            return
        if target is not None and target in part.handoffs:
            # Moving back to a flow it was leaving: what it holds is its own again.
            self._drop_handoff(part, target)
        if owner is not None and part.held[owner]:
            if target is not None and self._queue.max_handoff_time > 0:
                self._start_handoff(part, owner, now)
            else:  # no wait: its leftovers go first to the new owner
                self._return_inflight(part, owner, now)
        self._set_owner(part, target, self._owned_state(part, target))

    def _owned_state(self, part: Partition, owner: str | None) -> PartitionState:
        """The state of a partition mapped to ``owner``: paused while any previous owner's
        handoff is pending."""
        if owner is None:
            return PartitionState.UNASSIGNED
        return PartitionState.PAUSED if part.handoffs else PartitionState.READY

    def _start_handoff(self, part: Partition, holder: str, now: float) -> None:
        keys = Counter(
            sent.message.key
            for sent in part.inflight.values()
            if sent.flow_id == holder and sent.message.key is not None
        )
        part.handoffs[holder] = Handoff(keys, now, now + self._queue.max_handoff_time)
        part.handoff_keys.update(keys)
        self._paused.add(part.index)

    def _drop_handoff(self, part: Partition, holder: str) -> None:
        """Forget a previous owner's handoff: its keys no longer wait for it."""
        handoff = part.handoffs.pop(holder)
        part.handoff_keys -= handoff.keys
        if not part.handoffs:
            self._paused.discard(part.index)
        self._touched.add(part.index)  # the oldest pending handoff may be another now

    def _end_handoff(self, part: Partition, holder: str, now: float) -> None:
        """A previous owner's leftovers return for redelivery (first, to the owner); its
        keys flow, and with no handoff left every key of the partition does."""
        self._drop_handoff(part, holder)
        if part.held[holder]:
            self._return_inflight(part, holder, now)
        if not part.handoffs and part.state is PartitionState.PAUSED:
            part.state = PartitionState.READY
            self._touched.add(part.index)
        self._work.add(part.index)

    def _set_owner(self, part: Partition, owner: str | None, state: PartitionState) -> None:
        if (part.owner is None) != (owner is None):
            self._owned += 1 if owner is not None else -1
        old = self._flows.get(part.owner) if part.owner is not None else None
        if old is not None:
            old.partitions.discard(part.index)
        part.owner = owner
        part.state = state
        new = self._flows.get(owner) if owner is not None else None
        if new is not None:
            new.partitions.add(part.index)
        # What it holds buffered counts against its new owner's share from now on.
        part.owner_use.bytes -= part.buffered_bytes
        part.owner_use = new.use if new is not None else BufferUse()
        part.owner_use.bytes += part.buffered_bytes
        for flow in (old, new):
            if flow is not None:
                self._moved.add(flow.flow_id)
        self._touched.add(part.index)
        self._work.add(part.index)
        self._fetch_check.add(part.index)

    def _announce(self) -> None:
        for p in sorted(self._touched):
            part = self._parts[p]
            since = None
            if part.state is PartitionState.PAUSED:
                # The keys that wait now began to at the oldest pending handoff's move
                # (A -> B -> C while A still holds keys: A -> B).
                since = min(h.since for h in part.handoffs.values())
            now_state = (part.state, part.holder, since)
            if part.announced != now_state:
                part.announced = now_state
                self._out.append(AssignmentChanged(p, part.state, part.holder, since))
        self._touched.clear()
        moved = [self._flows[f] for f in self._moved if f in self._flows]
        self._moved.clear()
        for flow in sorted(moved, key=lambda f: f.order):
            current = frozenset(flow.partitions)
            if current != flow.announced:
                flow.announced = current
                self._out.append(PartitionsChanged(flow.flow_id, current))
        if not self._flows:
            self._rr = 0
