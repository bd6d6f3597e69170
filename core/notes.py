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
does, so recovery counts it as never sent. Beyond the notes budget a scheduled message is
buffered like any other (core/delivery.py, Known limit).

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
    _timers: list[Timer]
    _noted: int
    _due_parts: set[int]

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

    def _note(self, part: Partition, message: Message) -> bool:
        """Hold a scheduled message that is not due as a note, out of memory, if the
        group's notes budget has room: whether it did."""
        key = message.key
        cost = note_cost(key)
        if self._noted + cost > self._buffer_bytes:
            return False
        self._noted += cost
        wake = message.deliver_at
        assert wake is not None
        if message.expire_at is not None and message.expire_at < wake:
            wake = message.expire_at  # read it back to expire it
        part.notes[message.seq] = (wake, key, buffered_cost(message))
        if key is not None:
            part.noted_keys[key] += 1
        heapq.heappush(self._timers, (wake, NOTE, part.index, message.seq, 0))
        return True

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
            prior = part.prior.pop(seq, None)
            if message is None or part.ledger.is_settled(seq):
                self._settle(part, seq)
                continue
            if seq in page.undeliverable:
                count, first_time = prior if prior is not None else (0, None)
                self._dead_letter(part, message, DeadLetterReason.UNDELIVERABLE, count, first_time)
                continue
            if self._follows_dead_letter(part, message):
                count, first_time = prior if prior is not None else (0, None)
                reason = DeadLetterReason.KEY_DEAD_LETTERED
                self._dead_letter(part, message, reason, count, first_time)
                continue
            moving = message.key is not None and message.key in part.key_moves
            if message.expire_at is not None and message.expire_at <= now and not moving:
                self._expire(part, message, prior)
                continue
            if prior is not None:
                part.prior[seq] = prior
            back.append(message)
        for message in back:
            self._hold(part, message, now)
        if back:
            part.reorder()


__all__ = ["HOLD", "Notes"]
