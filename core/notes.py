"""Scheduled messages held as notes, out of a group's buffers (docs/operations.md
"Limits"; DESIGN.md §4: scheduled messages enter the order at deliver_at).

How it works. A message scheduled more than HOLD seconds ahead is not buffered: its
partition keeps a note of it (``Partition.notes``: seq, when to read it back, key,
buffered_cost; ``note_cost`` each, within a notes budget of the group's own, as large as
its buffer budget) and reads on past it, so it never stops the other keys of its
partition. A NOTE timer at its deliver_at (or an earlier expire_at) marks it due; the due
notes are read back by seq (a ``Fetch`` of ``seqs``: core/reads.py), as many as the
buffer budget has room for, and admitted as they would have been then: into the buffer
in seq order, or expired, or dead-lettered after their key; one no longer stored is
settled. A note keeps the partition's low-water mark below itself, as a buffered message
does, so recovery counts it as never sent.

Beyond the notes budget a scheduled message is skipped: the partition keeps only the
seqs its skipped messages lie between and when the first of them comes due
(``Partition.skipped``: constant memory, however many), and keeps its low-water mark
below them. Then it reads that range again (``Partition.rescan``, pages that alternate
with its reads of new messages): a message there that it knows nothing of (not settled,
buffered, noted, in flight or waiting for a retry) is a skipped one, admitted as it would
have been (buffered if due, else noted or skipped again). So nothing a client schedules
grows the gateway's memory beyond the budgets, and nothing it schedules stops the other
keys of a partition: a range is read once per time its first message comes due.

``Notes`` is a base of ``DeliveryBook``, which owns the state named below.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

from core.actions import Page
from core.model import DeadLetterReason, Message
from core.partition import NOTE, Partition, Timer, buffered_cost, count_down, note_cost

# A scheduled message due within this many seconds is buffered; a later one is noted.
HOLD: Final = 1.0


class Notes:
    _buffer_bytes: int
    _parts: list[Partition]
    _timers: list[Timer]
    _noted: int
    _due_parts: set[int]
    _skipping: set[int]
    _rescanning: set[int]

    if TYPE_CHECKING:

        def _hold(self, part: Partition, message: Message, now: float) -> int: ...
        def _settle(self, part: Partition, seq: int) -> None: ...
        def _follows_dead_letter(self, part: Partition, message: Message) -> bool: ...
        def _dead_letter(
            self,
            part: Partition,
            message: Message,
            reason: DeadLetterReason,
            count: int,
            first_time: float | None,
        ) -> None: ...
        def _expire(
            self, part: Partition, message: Message, prior: tuple[int, float | None] | None
        ) -> None: ...

    def _note(self, part: Partition, message: Message) -> None:
        """Hold a scheduled message that is not due as a note if the group's notes budget
        has room; otherwise skip it (``_skip``)."""
        key = message.key
        cost = note_cost(key)
        wake = message.deliver_at
        assert wake is not None
        if message.expire_at is not None and message.expire_at < wake:
            wake = message.expire_at  # read it back to expire it
        if self._noted + cost > self._buffer_bytes:
            self._skip(part, message.seq, wake)
            return
        self._noted += cost
        if part.notes and message.seq < next(reversed(part.notes)):
            part.notes_unsorted = True  # noted again after a rescan: sorted at its end
        part.notes[message.seq] = (wake, key, buffered_cost(message))
        if key is not None:
            part.noted_keys[key] += 1
        heapq.heappush(self._timers, (wake, NOTE, part.index, message.seq, 0))

    def _skip(self, part: Partition, seq: int, wake: float) -> None:
        """Forget a scheduled message for want of note room: the partition keeps only the
        seqs such messages lie between and when the first comes due, and reads that range
        again then (``_rescan_due``)."""
        lo, hi, at = part.skipped if part.skipped is not None else (seq, seq, wake)
        part.skipped = (min(lo, seq), max(hi, seq), min(at, wake))
        self._skipping.add(part.index)

    def _rescan_due(self, now: float) -> None:
        """Start reading again the skipped range of each partition whose first skipped
        message comes due (one range at a time: a partition already reading one waits)."""
        for p in sorted(self._skipping):
            part = self._parts[p]
            assert part.skipped is not None
            lo, hi, at = part.skipped
            if at <= now and part.rescan is None:
                part.rescan = (lo - 1, hi)
                part.skipped = None
                self._skipping.discard(p)
                self._rescanning.add(p)

    def _note_due(self, part: Partition, seq: int) -> None:
        """A noted message comes due (or expires, or follows a dead letter): read it back."""
        if seq in part.notes:
            part.due.add(seq)
            self._due_parts.add(part.index)

    def _unnote(self, part: Partition, seq: int) -> bool:
        """Forget a note; whether there was one."""
        note = part.notes.pop(seq, None)
        if note is None:
            return False
        part.due.discard(seq)
        key = note[1]
        self._noted -= note_cost(key)
        if key is not None:
            count_down(part.noted_keys, key)
        return True

    def _readmit(self, part: Partition, seqs: Iterable[int], page: Page, now: float) -> None:
        """Noted messages read back (a Page answering a Fetch of ``seqs``): admitted as
        they would have been, into the buffer in seq order. One no longer stored (purged,
        moved with its key) is settled."""
        found = {message.seq: message for message in page.messages}
        back: list[Message] = []
        for seq in seqs:
            if not self._unnote(part, seq):
                continue
            message = found.get(seq)
            if message is None or part.ledger.is_settled(seq):
                part.prior.pop(seq, None)
                self._settle(part, seq)
            elif self._take_back(part, message, seq in page.undeliverable, now):
                back.append(message)
        self._buffer_back(part, back, now)

    def _rescanned(self, part: Partition, page: Page, now: float) -> None:
        """A page of a skipped range read again: its messages that the partition knows
        nothing of (not settled, buffered, noted, in flight or waiting for a retry) are the
        skipped ones, admitted now (noted again, or skipped again, if not due)."""
        assert part.rescan is not None
        after, hi = part.rescan
        back: list[Message] = []
        for message in page.messages:
            seq = message.seq
            after = min(seq, hi)
            if seq > hi:
                break
            known = seq in part.buffer or seq in part.notes or seq in part.inflight
            if known or seq in part.retry or part.ledger.is_settled(seq):
                continue
            if self._take_back(part, message, seq in page.undeliverable, now):
                back.append(message)
        if not page.messages or after >= hi:
            part.rescan = None
            self._rescanning.discard(part.index)
        else:
            part.rescan = (after, hi)
            part.rescan_yield = True  # the partition's next read may be of new messages
        self._buffer_back(part, back, now)

    def _take_back(
        self, part: Partition, message: Message, undeliverable: bool, now: float
    ) -> bool:
        """Admit a noted or skipped message read again as it would have been admitted
        then; whether it is to be buffered (``_buffer_back``)."""
        seq = message.seq
        prior = part.prior.pop(seq, None)
        count, first_time = prior if prior is not None else (0, None)
        if undeliverable:
            self._dead_letter(part, message, DeadLetterReason.UNDELIVERABLE, count, first_time)
            return False
        if self._follows_dead_letter(part, message):
            reason = DeadLetterReason.KEY_DEAD_LETTERED
            self._dead_letter(part, message, reason, count, first_time)
            return False
        moving = message.key is not None and message.key in part.key_moves
        if message.expire_at is not None and message.expire_at <= now and not moving:
            self._expire(part, message, prior)
            return False
        if prior is not None:
            part.prior[seq] = prior
        if message.deliver_at is not None and message.deliver_at > now + HOLD:
            self._note(part, message)
            return False
        return True

    def _buffer_back(self, part: Partition, messages: list[Message], now: float) -> None:
        """Buffer messages read again, and keep the buffer and the notes in seq order."""
        for message in messages:
            self._hold(part, message, now)
        if messages:
            part.reorder()
        if part.notes_unsorted:
            part.notes = dict(sorted(part.notes.items()))
            part.notes_unsorted = False


__all__ = ["HOLD", "Notes"]
