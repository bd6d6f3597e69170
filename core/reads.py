"""Reads of a group's DeliveryBook: when a partition asks storage for its next page, how
large the page is, and what of it the buffers take (docs/operations.md "Limits",
docs/performance.md *Twelfth session*).

How it works. A group's buffered messages are bounded in bytes (``buffered_cost``): what
its partitions hold buffered plus what the reads on their way reserved stays within its
budget, and (outside shared mode) what each flow's partitions hold within the flow's part
of it, its partitions' shares (budget x its partitions / the partitions that deliver).
A partition asks for its next page (Fetch, sized in messages from the average cost; one
message until the group has seen one, so a first read cannot guess a backlog of large
messages into memory) once
it holds half a page or less, and a page is a turn's worth of messages (TURN, what the
pump sends from a partition before the next one's turn) or, with few partitions, its
share of the budget (up to buffer_size and its flow's part). A read reserves what its
page will cost before it is issued; partitions that find no room wait in the order they
asked (each flow's ``Flow.reads``; shared mode: ``_read_queue``) and read as the flow's
sends free room, so the pages stay large however many partitions there are and what is
buffered is what the flows send next. A message larger than the room left waits for room
(``next_cost``); one larger than the budget is read on its own once nothing else is
buffered or on its way.

Two exceptions keep every key flowing. A stuck partition (every buffered message waits:
a held-back, parked or scheduled key) reads on past them while the group holds less than
half its budget (up to buffer_size messages). And when a flow has room, nothing to send
and no read on its way while the group's budget is full (another flow stopped acking and
holds its part; parked keys), its empty partitions read anyway, within the flow's own
part: a flow never waits on another's blocked messages, and the group then holds up to
twice its budget.

Scheduled messages (core/notes.py): noted ones that came due are read back by seq (a
Fetch of ``seqs``) before any page, as many as the budgets have room for; a skipped range
is read again in pages that alternate with the partition's reads of new messages.

``Reads`` is a base of ``DeliveryBook``, which owns the state named below.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from core.actions import Action, Fetch, Page
from core.errors import InvalidArgument
from core.model import GroupConfig, GroupMode, Message
from core.partition import BufferUse, Flow, Partition, buffered_cost
from core.pump import TURN


class Reads:
    _group: GroupConfig
    _parts: list[Partition]
    _flows: dict[str, Flow]
    _out: list[Action]
    _buffer_size: int
    _buffer_bytes: int
    _msg_cost: int
    _sized: bool
    _owned: int
    _use: BufferUse
    _fetch_check: set[int]
    _room_wait: set[int]
    _stuck: set[int]
    _read_queue: dict[int, None]
    _due_parts: set[int]
    _rescanning: set[int]

    if TYPE_CHECKING:

        def _admit(
            self, part: Partition, message: Message, now: float, *, undeliverable: bool = False
        ) -> None: ...
        def _readmit(
            self, part: Partition, seqs: Iterable[int], page: Page, now: float
        ) -> None: ...
        def _rescanned(self, part: Partition, page: Page, now: float) -> None: ...

    def set_buffer_bytes(self, buffer_bytes: int) -> None:
        """The group's buffer budget: the bytes (``buffered_cost``) its partitions may hold
        buffered and reserve for their reads. A partition with nothing buffered may always
        load one message, whatever its size."""
        if buffer_bytes < 1:
            raise InvalidArgument("buffer_bytes must be >= 1")
        self._buffer_bytes = buffer_bytes

    def _share(self) -> int:
        """The budget over the delivering partitions (those with an owner; all of them in
        shared mode): a partition's page when that is larger than a turn."""
        shared = self._group.mode is GroupMode.SHARED and bool(self._flows)
        return self._buffer_bytes // max(1, len(self._parts) if shared else self._owned)

    def _load(self, part: Partition, page: Page, now: float) -> None:
        """Admit what fits of a Page (``GroupMachine.loaded``): what its read reserved
        (within its owner's part of the budget as it is now: a smaller budget applies at
        once), then what the budget has room for; note whether the partition has more to
        read."""
        before = part.cursor
        part.fetching = False
        allowance = self._unreserve(part)
        self._fetch_check.add(part.index)
        if part.fetch_seqs:
            seqs, part.fetch_seqs = part.fetch_seqs, ()
            self._readmit(part, seqs, page, now)
            return
        if part.fetch_rescan:
            part.fetch_rescan = False
            self._rescanned(part, page, now)
            return
        budget = self._budget(part)
        full = len(page.messages) >= part.fetch_limit
        for message in page.messages:
            if message.partition != part.index:
                raise InvalidArgument(f"loaded message of partition {message.partition}")
            cost = buffered_cost(message)
            reserved = (
                cost <= allowance
                and len(part.buffer) < self._buffer_size
                and part.owner_use.bytes + cost <= budget
            )
            if not reserved and not self._room(part, cost):
                full = True  # the rest is read again once the buffer has room for it
                part.next_cost = cost
                break
            allowance -= cost
            self._admit(part, message, now, undeliverable=message.seq in page.undeliverable)
        if part.cursor == before and part.known == part.known_at_fetch and not full:
            # Nothing after the cursor, and nothing was appended while the query ran: what
            # was announced before it is gone (purged), so there is nothing more to read.
            # (If an append did arrive meanwhile, the query may predate its commit: read
            # again rather than lose it.)
            part.known = part.cursor
        part.known = max(part.known, part.cursor)
        part.more = full or part.known > part.cursor

    def _request_fetches(self) -> None:
        """Issue the Fetches this event allows (the module's docstring): first to the
        partitions waiting for room, in order; then to those the event touched; then, if
        nothing is on its way, to the waiting empty partitions of flows with room. Noted
        messages that came due, and skipped ranges, are read again before all of them."""
        if self._due_parts or self._rescanning:
            for p in sorted(self._due_parts):
                self._read_due(self._parts[p])
            for p in sorted(self._rescanning):
                self._read_skipped(self._parts[p])
        for _flow, queue in self._queues():
            while queue:
                p = next(iter(queue))
                part = self._parts[p]
                page = self._page(part) if self._wants_read(part) else None
                if page is not None and not self._admits(part, page[1]):
                    break
                del queue[p]
                if page is not None:
                    self._read(part, *page)
        for p in sorted(self._fetch_check | self._room_wait):
            part = self._parts[p]
            self._room_wait.discard(p)
            if not self._wants_read(part):
                continue
            page = self._page(part)
            if page is not None:
                queue = self._waiting(part)
                if p in queue:
                    continue
                if queue or not self._admits(part, page[1]):
                    queue[p] = None
                else:
                    self._read(part, *page)
            elif p in self._stuck and len(part.buffer) < self._buffer_size:
                room = self._buffer_bytes // 2 - self._use.bytes - self._use.reading
                if part.next_cost > room:
                    self._room_wait.add(p)  # the next message did not fit: read it once it can
                    continue
                limit = min(self._buffer_size - len(part.buffer), room // self._msg_cost)
                if limit >= 1:
                    self._read(part, limit, limit * self._msg_cost)
        self._fetch_check.clear()
        for flow, queue in self._queues():
            account = flow.use if flow is not None else self._use
            if not queue or account.reading or not self._starving(flow):
                continue
            for p in list(queue):
                part = self._parts[p]
                page = self._page(part) if self._wants_read(part) else None
                if page is None:
                    del queue[p]
                elif not part.buffer:
                    del queue[p]
                    room = self._budget(part) - account.bytes - account.reading
                    limit = max(1, min(page[0], room // self._msg_cost))
                    self._read(part, limit, limit * self._msg_cost)

    def _read_due(self, part: Partition) -> None:
        """Read back the partition's noted messages that came due, in seq order, as many as
        the budgets have room for (at least one when they hold nothing)."""
        if not part.due:
            self._due_parts.discard(part.index)
            return
        if part.fetching or not self._delivering(part):
            return
        seqs: list[int] = []
        cost = 0
        taken = self._use.bytes + self._use.reading
        held = part.owner_use.bytes + part.owner_use.reading
        for seq in sorted(part.due):
            size = part.notes[seq][2]
            if seqs:
                fits = taken + cost + size <= self._buffer_bytes
                fits = fits and held + cost + size <= self._budget(part)
            else:
                fits = self._admits(part, size)
            if not fits or len(seqs) >= self._buffer_size:
                break
            seqs.append(seq)
            cost += size
        if seqs:
            part.due.difference_update(seqs)
            self._read(part, len(seqs), cost, tuple(seqs))

    def _read_skipped(self, part: Partition) -> None:
        """Read the next page of the partition's skipped range again, as large as the
        budgets have room for (one message at least, when they hold nothing); after a
        page, a read of new messages goes first if the partition wants one."""
        if part.fetching or not self._delivering(part):
            return
        if part.rescan_yield:
            part.rescan_yield = False
            if self._wants_read(part) and self._page(part) is not None:
                return
        assert part.rescan is not None
        taken = self._use.bytes + self._use.reading
        room = min(self._buffer_bytes - taken, self._budget(part) - part.owner_use.bytes)
        limit = max(1, min(self._buffer_size, room // self._msg_cost))
        if self._admits(part, limit * self._msg_cost):
            self._read(part, limit, limit * self._msg_cost, after=part.rescan[0])
            part.fetch_rescan = True

    def _queues(self) -> list[tuple[Flow | None, dict[int, None]]]:
        """Each flow's queue of partitions waiting for room to read; shared mode's."""
        if self._group.mode is GroupMode.SHARED:
            return [(None, self._read_queue)]
        return [(flow, flow.reads) for flow in self._flows.values()]

    def _owner(self, part: Partition) -> Flow | None:
        """The flow whose part of the budget the partition reads in (None in shared mode,
        where flows share every partition, or without an owner: the group's budget)."""
        if self._group.mode is GroupMode.SHARED or part.owner is None:
            return None
        return self._flows[part.owner]

    def _waiting(self, part: Partition) -> dict[int, None]:
        """Where the partition waits for room to read."""
        flow = self._owner(part)
        return self._read_queue if flow is None else flow.reads

    def _wants_read(self, part: Partition) -> bool:
        """Whether the partition may have something to read and someone to deliver it to."""
        return self._delivering(part) and part.more and not part.fetching

    def _delivering(self, part: Partition) -> bool:
        """Whether the partition has someone to deliver what it reads to."""
        return part.owner is not None or (
            self._group.mode is GroupMode.SHARED and bool(self._flows)
        )

    def _page(self, part: Partition) -> tuple[int, int] | None:
        """The page the partition asks for, (messages, bytes reserved), or None while it
        holds more than half a page."""
        size = len(part.buffer)
        # Before the group has seen a message it cannot tell how many fit its budget: one
        # each (a page of 1 KiB guesses read 170 MiB of 256 KiB messages for 1 MiB).
        target = max(TURN, self._share() // self._msg_cost) if self._sized else 1
        target = max(1, min(self._buffer_size, self._budget(part) // self._msg_cost, target))
        if size > target // 2:
            return None
        limit = max(1, target - size)
        return limit, max(limit * self._msg_cost, part.next_cost)

    def _budget(self, part: Partition) -> int:
        """The part of the budget the partition's owner may hold buffered and reading: its
        partitions' shares (``_owner`` None: the whole budget)."""
        flow = self._owner(part)
        if flow is None:
            return self._buffer_bytes
        return self._buffer_bytes * len(flow.partitions) // max(1, self._owned)

    def _admits(self, part: Partition, cost: int) -> bool:
        """Whether a read of ``cost`` bytes fits the group's budget and its owner's part of
        it, beside what is buffered and being read (each always, when it holds nothing: a
        message larger than the budget is read on its own)."""
        taken = self._use.bytes + self._use.reading
        if taken and taken + cost > self._buffer_bytes:
            return False
        held = part.owner_use.bytes + part.owner_use.reading
        return not held or held + cost <= self._budget(part)

    def _read(
        self,
        part: Partition,
        limit: int,
        cost: int,
        seqs: tuple[int, ...] = (),
        *,
        after: int | None = None,
    ) -> None:
        part.fetching = True
        part.fetch_seqs = seqs
        part.fetch_limit = limit
        part.fetch_bytes = cost
        part.fetch_use = part.owner_use
        part.known_at_fetch = part.known
        self._use.reading += cost
        part.owner_use.reading += cost
        start = part.cursor if after is None else after
        self._out.append(Fetch(part.index, start, limit, cost, seqs))

    def _unreserve(self, part: Partition) -> int:
        """Give back what the partition's read reserved; returns it."""
        reserved, part.fetch_bytes = part.fetch_bytes, 0
        self._use.reading -= reserved
        if part.fetch_use is not None:
            part.fetch_use.reading -= reserved
            part.fetch_use = None
        return reserved

    def _starving(self, flow: Flow | None) -> bool:
        """Whether the flow (None, shared mode: any flow) has room and, the pump having
        run, nothing to send."""
        if flow is None:
            return any(f.has_room() for f in self._flows.values())
        return flow.has_room()

    def _fits(self, part: Partition, message: Message) -> bool:
        """Whether an appended message may join the partition's buffer (``_room``)."""
        return self._room(part, buffered_cost(message))

    def _room(self, part: Partition, cost: int) -> bool:
        """Whether a message of ``cost`` may join the partition's buffer: an empty one
        takes any; otherwise within buffer_size and, beside what is buffered and being
        read, the group's budget."""
        if not part.buffer:
            return True
        if len(part.buffer) >= self._buffer_size:
            return False
        return self._use.bytes + self._use.reading + cost <= self._buffer_bytes
