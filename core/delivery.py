"""The message half of GroupMachine: buffers, in-flight and retry records, settling, and
the pump that turns them into Deliver actions (DESIGN.md §4 Delivery, Settle, per-key order).

How it works. Per partition, due retries go first (seq order), then buffered messages in
seq order, each only if its key is not held back and a flow has room in its window;
a ``RecordDispatch`` precedes the partition's ``Deliver`` actions when they need one (a
redelivery, or a first send above the partition's reservation). A message of key K is
held back while an earlier message of K waits for redelivery (both key orders) or while a
message of K is unacked (``strict``). A scheduled message (deliver_at) takes its place in
its key's order when it becomes due: it does not hold back later messages of its key, and
once due it waits like any other. Seq gaps between messages read from storage are settled
as they are seen, so the committed seq advances over them.

Dispatch reservation (docs/performance.md). A record that must precede a first send also
reserves ``DISPATCH_AHEAD`` seqs beyond it while the partition flows, so the first sends
that follow need no commit of their own; the position sent travels lazily with the next
``OffsetUpdate``, as a low-water mark (``Partition.low_water``: every unsettled seq at or
below it was sent; a held-back or scheduled message keeps it below itself). A partition
that cannot send (no owner, window full) gives its reservation back at once in memory and
with that update in storage; one whose flow only waits for its connection's socket
(``backpressure``) keeps it, as a flowing one does. Recovery (``_recovered_count``)
counts an unsettled seq with no record at or below dispatched_seq as seen once; one in
(dispatched_seq, reserved_seq] as maybe seen: counted too, but that count alone never
dead-letters it (it is delivered once more, flagged redelivered, with its count capped at
max_deliveries and recorded before it is sent, so a message that crashes the gateway
still reaches the dead-letter queue); and none that cannot have been sent (not due yet;
in strict key order, behind an earlier unsettled message of its key).
``GroupMachine.close`` records every unacked message and ends the reservation at the
low-water mark, so a clean restart counts exactly.

Poison policy (QueueConfig.on_dead_letter). When a message of key K is dead-lettered for
failing (max deliveries, rejected; not expiry), ``park_key`` parks K in its partition: its
later messages (buffered or waiting for retry) are held back until ``release_key``;
``dead_letter_key`` makes every stored message of K follow it to the dead-letter queue
in seq order, in the same action list (so one transaction): those waiting in memory as
DeadLetters, those after the cursor as one ``DeadLetterKey`` that storage carries out;
K is held until ``key_dead_lettered`` reports the seqs moved (messages of K read
meanwhile wait: storage moved them, or they were stored after and flow). Those in flight
follow if they come back unsettled.

Buffers (docs/operations.md "Limits"). A group's buffered messages are bounded in bytes
(``buffered_cost``); when a partition reads its next page and how large it is are
core/reads.py's. The pump serves, per flow, a queue of the partitions that have something
to send, round-robin while the flow has room (a partition keeps its turn for up to TURN
sends), so an event costs O(partitions that send), not O(partitions with a backlog); a
partition whose buffered messages all wait leaves that queue until an event of its own
wakes it (``_work``), and reads on past them while the group holds less than half its
budget.

Scheduled messages due more than HOLD seconds ahead are held as notes, out of the
buffers, and read back by seq when due (core/notes.py).

Known limit: a buffer full of held-back or parked messages (up to buffer_size, and half
the group's budget) delays later messages of other keys of that partition until it
drains (or the partition is re-read). Scheduled messages do not fill it (core/notes.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Final

from core.actions import (
    Action,
    DeadLetter,
    DeadLetterKey,
    Dropped,
    GroupSnapshot,
    KeyParked,
    KeyReleased,
    ParkedKey,
    PartitionSnapshot,
    RetryScheduled,
)
from core.backoff import redelivery_delay
from core.errors import InvalidArgument
from core.model import (
    DeadLetterPolicy,
    DeadLetterReason,
    GroupConfig,
    KeyOrder,
    Message,
    QueueConfig,
)
from core.notes import HOLD, Notes
from core.partition import (
    EXPIRE,
    MESSAGE_OVERHEAD,
    WAKE,
    BufferUse,
    Flow,
    Partition,
    Retry,
    Sent,
    Timer,
    count_down,
    has_tags,
)
from core.pump import Pump
from core.reads import Reads

# Dead letters that apply the queue's on_dead_letter policy to the rest of their key.
_FAILURES: Final = frozenset({DeadLetterReason.MAX_DELIVERIES, DeadLetterReason.REJECTED})


class DeliveryBook(Notes, Reads, Pump):
    """Per-partition message state shared by every GroupMachine event."""

    def __init__(
        self,
        queue: QueueConfig,
        group: GroupConfig,
        snapshot: GroupSnapshot | None,
        buffer_size: int,
        buffer_bytes: int,
        message_size: int | None = None,
    ) -> None:
        if buffer_size < 1:
            raise InvalidArgument("buffer_size must be >= 1")
        self._queue = queue
        self._group = group
        self._buffer_size = buffer_size
        self._buffer_bytes = 0
        self.set_buffer_bytes(buffer_bytes)
        # Buffered cost of a typical message (moving average), to size fetch pages; until
        # one was seen or the queue's average size given, pages are of one message
        # (core/reads.py).
        self._sized = message_size is not None
        self._msg_cost = (1024 if message_size is None else message_size) + MESSAGE_OVERHEAD
        # Partitions with an owner (the ones that buffer outside shared mode).
        self._owned = 0
        saved = snapshot.partitions if snapshot else {}
        self._use = BufferUse()
        self._parts = [
            Partition(p, saved.get(p, PartitionSnapshot()), self._use) for p in range(queue.slots)
        ]
        for parked in snapshot.parked if snapshot else ():
            if 0 <= parked.partition < queue.slots:
                self._parts[parked.partition].parked[parked.key] = parked
        self._now = 0.0  # the current event's time (set by GroupMachine._begin)
        self._flows: dict[str, Flow] = {}
        self._by_id: dict[str, tuple[int, int]] = {}
        self._timers: list[Timer] = []
        self._rr = 0
        self._shared_flows: list[Flow] = []
        self._out: list[Action] = []
        self._fetch_check: set[int] = set(range(queue.slots))
        # Partitions whose next message found no room (Partition.next_cost): checked
        # after every event, since room can come from any partition's buffer draining.
        self._room_wait: set[int] = set()
        self._dirty: set[int] = set()
        # Partitions that may have something new to send, routed by the next pump to the
        # queue of the flow that owns them (flow.work; shared mode: _shared_work).
        self._work: set[int] = set()
        self._shared_work: dict[int, None] = {}
        # Partitions holding a dispatch reservation ahead of what they sent.
        self._reserving: set[int] = set()
        # Partitions whose buffered messages all wait (held-back keys, not due yet) while
        # their flow has room: they may read on beyond their share (_request_fetches).
        self._stuck: set[int] = set()
        # Shared mode: the partitions waiting for room to read, in the order they asked
        # (otherwise each flow's Flow.reads).
        self._read_queue: dict[int, None] = {}
        # What the partitions' notes count (note_cost), within the group's budget; the
        # partitions with noted messages due to read back (Partition.due).
        self._noted = 0
        self._due_parts: set[int] = set()
        # Partitions with skipped scheduled messages (Partition.skipped), and those reading
        # a skipped range again (Partition.rescan).
        self._skipping: set[int] = set()
        self._rescanning: set[int] = set()

    def _running(self) -> list[Flow]:
        return sorted(self._flows.values(), key=lambda f: f.order)

    # -- message bookkeeping --------------------------------------------------------------

    def _part(self, partition: int) -> Partition:
        if not 0 <= partition < len(self._parts):
            raise InvalidArgument(f"partition {partition} out of range 0..{len(self._parts) - 1}")
        return self._parts[partition]

    def _admit(
        self, part: Partition, message: Message, now: float, *, undeliverable: bool = False
    ) -> None:
        """Take a message read or appended in seq order after ``part.cursor``."""
        seq = message.seq
        if seq <= part.cursor:
            return
        # No message has the seqs between the cursor and this one.
        if seq > part.cursor + 1 and part.ledger.settle_range(part.cursor + 1, seq - 1):
            self._dirty.add(part.index)
        part.cursor = seq
        part.next_cost = 0
        prior = part.records.pop(seq, None)
        if part.ledger.is_settled(seq):
            return
        if prior is None and seq <= part.restored_reserved:
            prior = self._recovered_count(part, message, now)
        if undeliverable:
            count, first_time = prior if prior is not None else (0, None)
            self._dead_letter(part, message, DeadLetterReason.UNDELIVERABLE, count, first_time)
            return
        if self._group.tags and not has_tags(message, self._group.tags.items()):
            self._out.append(Dropped(message, "filtered"))
            self._settle(part, seq)
            return
        if (
            seq <= part.restored_reserved
            and message.key is not None
            and message.deliver_at is None
            and self._group.key_order is KeyOrder.STRICT
        ):
            part.recovered_keys.add(message.key)
        if self._follows_dead_letter(part, message):
            count, first_time = prior if prior is not None else (0, None)
            self._dead_letter(part, message, DeadLetterReason.KEY_DEAD_LETTERED, count, first_time)
            return
        # A message storage may be moving waits for its report, whatever becomes of it.
        moving = message.key is not None and message.key in part.key_moves
        if prior is not None:
            # A parked key's messages wait for an operator who asked for them to flow:
            # their next delivery decides (recovery may count one it never had).
            over = self._queue.max_deliveries and prior[0] >= self._queue.max_deliveries
            if (
                over
                and message.key not in part.parked
                and seq not in part.maybe_seen
                and not moving
            ):
                self._dead_letter(part, message, DeadLetterReason.MAX_DELIVERIES, *prior)
                return
            part.prior[seq] = prior
        if message.expire_at is not None and message.expire_at <= now and not moving:
            self._expire(part, message, prior)
            return
        if message.deliver_at is not None and message.deliver_at > now + HOLD:
            self._note(part, message)
            return
        cost = self._hold(part, message, now)
        if self._sized:
            self._msg_cost += (cost - self._msg_cost) // 8
        else:
            self._msg_cost, self._sized = cost, True

    def _hold(self, part: Partition, message: Message, now: float) -> int:
        """Buffer the message, with its timers; returns its buffered_cost."""
        cost = part.put(message)
        self._work.add(part.index)
        seq = message.seq
        if message.deliver_at is not None and message.deliver_at > now:
            heapq.heappush(self._timers, (message.deliver_at, WAKE, part.index, seq, 0))
        if message.expire_at is not None:
            heapq.heappush(self._timers, (message.expire_at, EXPIRE, part.index, seq, 0))
        return cost

    def _recovered_count(
        self, part: Partition, message: Message, now: float
    ) -> tuple[int, float | None] | None:
        """Recovery, for an unsettled message up to the restored reservation with no
        delivery record: (1, None) if it may have been sent before the restart, None if it
        cannot have been. Not due yet: never sent. At or below dispatched_seq (a low-water
        mark): sent. Above it: maybe seen (counted, flagged, never dead-lettered for that
        count alone), except in strict key order behind an earlier unsettled message of
        its key, which was in flight or waiting before it (a scheduled one does not hold
        its key until due, so it proves nothing)."""
        if message.deliver_at is not None and message.deliver_at > now:
            return None
        if message.seq <= part.restored_dispatched:
            return (1, None)
        if message.key is not None and message.key in part.recovered_keys:
            return None
        part.maybe_seen.add(message.seq)
        return (1, None)

    def _settle(self, part: Partition, seq: int) -> None:
        if part.ledger.settle(seq):
            self._dirty.add(part.index)

    def _dead_letter(
        self,
        part: Partition,
        message: Message,
        reason: DeadLetterReason,
        count: int,
        first_time: float | None,
    ) -> None:
        self._out.append(DeadLetter(message, reason, count, first_time))
        self._settle(part, message.seq)
        if message.key is None or reason not in _FAILURES:
            return
        policy = self._queue.dead_letter_policy
        if policy is DeadLetterPolicy.PARK_KEY and message.key not in part.parked:
            parked = ParkedKey(part.index, message.key, self._now, message.message_id, reason)
            part.parked[message.key] = parked
            self._out.append(KeyParked(parked))
        elif policy is DeadLetterPolicy.DEAD_LETTER_KEY:
            self._drain_key(part, message.key)

    # -- poison policy --------------------------------------------------------------------

    def _follows_dead_letter(self, part: Partition, message: Message) -> bool:
        """Whether the message is one of its key's stored messages that follow a dead letter."""
        key = message.key
        if key is None or key not in part.draining:
            return False
        if message.seq <= part.draining[key]:
            return True
        skipped = part.skipped is not None or part.rescan is not None
        if not part.inflight_keys[key] and not part.noted_keys[key] and not skipped:
            del part.draining[key]  # none of those in flight or noted back then is left
        return False

    def _drain_key(self, part: Partition, key: str) -> None:
        """Dead-letter the key's stored messages, in seq order: the waiting and the stored
        ones at once, those in flight if they come back unsettled."""
        part.draining[key] = part.cursor
        if part.noted_keys[key]:
            # Noted ones follow once read back (they need their bodies for the copy).
            for seq in [seq for seq, note in part.notes.items() if note[1] == key]:
                self._note_due(part, seq)
        if part.skipped is not None:
            part.skipped = (*part.skipped[:2], self._now)  # and skipped ones: read them now
        waiting = [seq for seq, entry in part.retry.items() if entry.message.key == key]
        waiting += [seq for seq, message in part.buffer.items() if message.key == key]
        for seq in sorted(waiting):
            if seq in part.retry:
                entry = self._remove_retry(part, seq)
                count, first_time = entry.count - 1, entry.first_time
                message = entry.message
            else:
                message = part.take(seq)
                count, first_time = part.prior.pop(seq, (0, None))
            self._dead_letter(part, message, DeadLetterReason.KEY_DEAD_LETTERED, count, first_time)
        part.key_moves[key] += 1
        tags = tuple(sorted((self._group.tags or {}).items()))
        self._out.append(DeadLetterKey(part.index, key, part.cursor, tags))
        self._dirty.add(part.index)  # storage merges the moved seqs into this update
        self._fetch_check.add(part.index)

    def _key_moved(self, part: Partition, key: str, seqs: Iterable[int]) -> None:
        """Storage carried out a DeadLetterKey: the seqs it moved are settled; the key's
        messages read meanwhile that it did not move (stored after) flow."""
        for seq in seqs:
            part.records.pop(seq, None)
            part.prior.pop(seq, None)
            part.discard(seq)
            self._settle(part, seq)
        part.key_moves[key] -= 1
        if part.key_moves[key] <= 0:
            del part.key_moves[key]
        self._work.add(part.index)
        self._fetch_check.add(part.index)

    def _release(self, key: str, *, skip: bool) -> None:
        """Un-park the key in every partition it is parked in; with ``skip`` its messages
        stored until now are dead-lettered first."""
        for part in self._parts:
            if part.parked.pop(key, None) is None:
                continue
            self._out.append(KeyReleased(part.index, key))
            if skip:
                self._drain_key(part, key)
            self._work.add(part.index)

    def parked_keys(self) -> list[ParkedKey]:
        """Every parked key, by partition then key."""
        return [part.parked[key] for part in self._parts for key in sorted(part.parked)]

    def _expire(
        self, part: Partition, message: Message, prior: tuple[int, float | None] | None
    ) -> None:
        count, first_time = prior if prior is not None else (0, None)
        if self._queue.dead_letter_expired and self._queue.dlq_name is not None:
            self._dead_letter(part, message, DeadLetterReason.EXPIRED, count, first_time)
        else:
            self._out.append(Dropped(message, "expired"))
            self._settle(part, message.seq)

    def _expire_waiting(self, part: Partition, seq: int) -> None:
        """TTL timer: expire the message if it is still waiting (buffered or for retry);
        one storage may be moving is expired by the pump once it knows."""
        message = part.buffer.get(seq)
        if message is not None and message.key is not None and part.key_moves[message.key]:
            return
        if message is not None:
            part.take(seq)
            self._expire(part, message, part.prior.pop(seq, None))
            self._fetch_check.add(part.index)
        elif seq in part.retry:
            entry = self._remove_retry(part, seq)
            self._expire(part, entry.message, (entry.count - 1, entry.first_time))

    def _held_by(self, flow_id: str, message_ids: Iterable[str]) -> list[tuple[Partition, int]]:
        found = []
        for message_id in message_ids:
            where = self._by_id.get(message_id)
            if where is None:
                continue
            part = self._parts[where[0]]
            sent = part.inflight.get(where[1])
            if sent is not None and sent.flow_id == flow_id:
                found.append((part, where[1]))
        return found

    def _remove_inflight(self, part: Partition, seq: int) -> Sent:
        sent = part.inflight.pop(seq)
        del self._by_id[sent.message.message_id]
        count_down(part.held, sent.flow_id)
        flow = self._flows.get(sent.flow_id)
        if flow is not None:
            flow.pending -= 1
        self._work.add(part.index)
        key = sent.message.key
        if key is not None:
            count_down(part.inflight_keys, key)
            handoff = part.handoffs.get(sent.flow_id) if part.handoffs else None
            if handoff is not None and handoff.keys.get(key):
                count_down(handoff.keys, key)
                count_down(part.handoff_keys, key)
        return sent

    def _remove_retry(self, part: Partition, seq: int) -> Retry:
        entry = part.retry.pop(seq)
        del self._by_id[entry.message.message_id]
        self._work.add(part.index)  # its key may flow again
        key = entry.message.key
        if key is not None:
            count_down(part.retry_keys, key)
        return entry

    def _return_inflight(self, part: Partition, flow_id: str, now: float) -> None:
        """The flow's unacked messages of the partition come back for immediate redelivery."""
        for seq in sorted(s for s, sent in part.inflight.items() if sent.flow_id == flow_id):
            self._end_delivery(part, self._remove_inflight(part, seq), now, 0.0)

    def _end_delivery(self, part: Partition, sent: Sent, now: float, delay: float | None) -> None:
        """The ``sent.count``-th delivery ended unsettled: retry later, or dead-letter."""
        message, count, first_time = sent.message, sent.count, sent.first_time
        if self._follows_dead_letter(part, message):
            reason = DeadLetterReason.KEY_DEAD_LETTERED
            self._dead_letter(part, message, reason, count, first_time)
            return
        if self._queue.max_deliveries and count >= self._queue.max_deliveries:
            self._dead_letter(part, message, DeadLetterReason.MAX_DELIVERIES, count, first_time)
            return
        due = now + redelivery_delay(self._queue, count, delay)
        part.retry[message.seq] = Retry(message, count + 1, first_time, due, sent.flow_id)
        self._out.append(RetryScheduled(part.index, message.seq, count, first_time, due))
        self._by_id[message.message_id] = (part.index, message.seq)
        if message.key is not None:
            part.retry_keys[message.key] += 1
        self._work.add(part.index)
        if due > now:
            heapq.heappush(self._timers, (due, WAKE, part.index, message.seq, 0))
        if message.expire_at is not None:
            heapq.heappush(self._timers, (message.expire_at, EXPIRE, part.index, message.seq, 0))
