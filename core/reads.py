"""Reads of a group's DeliveryBook: when a partition asks storage for its next page, how
large the page is, and what of it the buffers take (docs/operations.md "Limits",
docs/performance.md *Twelfth session*).

How it works. A group's buffered messages are bounded in bytes (``buffered_cost``): what
its partitions hold buffered plus what the reads on their way reserved stays within its
budget. A partition asks for its next page (Fetch, sized in messages from the average
cost) once it holds half a page or less, and a page is a turn's worth of messages (TURN,
what the pump sends from a partition before the next one's turn) or, with few partitions,
its share of the budget (up to buffer_size). A read reserves what its page will cost
before it is issued; partitions that find no room wait in the order they asked
(``_read_queue``) and read as the flows' sends free room, so the pages stay large however
many partitions there are and what is buffered is what the flows send next. A message
larger than the room left waits for room (``next_cost``); one larger than the budget is
read on its own once nothing else is buffered or on its way.

Two exceptions keep every key flowing. A stuck partition (every buffered message waits:
a held-back, parked or scheduled key) reads on past them while the group holds less than
half its budget (up to buffer_size messages). And when nothing is on its way and the
budget is full of messages no flow can send now (a flow that stopped acking, parked
keys), an empty partition whose flow has room and nothing to send reads anyway, what
room there is and at least one message: no flow waits for ever on another's blocked
messages, though it then gets a message per read until they drain.

``Reads`` is a base of ``DeliveryBook``, which owns the state named below.
"""

from __future__ import annotations

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
    _owned: int
    _use: BufferUse
    _fetch_check: set[int]
    _room_wait: set[int]
    _stuck: set[int]
    _reading: int
    _read_queue: dict[int, None]

    if TYPE_CHECKING:

        def _admit(
            self, part: Partition, message: Message, now: float, *, undeliverable: bool = False
        ) -> None: ...

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
        """Admit what fits of a Page (``GroupMachine.loaded``): what its read reserved,
        then what the budget has room for; note whether the partition has more to read."""
        before = part.cursor
        part.fetching = False
        allowance, part.fetch_bytes = part.fetch_bytes, 0
        self._reading -= allowance
        full = len(page.messages) >= part.fetch_limit
        for message in page.messages:
            if message.partition != part.index:
                raise InvalidArgument(f"loaded message of partition {message.partition}")
            cost = buffered_cost(message)
            reserved = (
                cost <= allowance
                and len(part.buffer) < self._buffer_size
                and self._use.bytes + cost <= self._buffer_bytes
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
        self._fetch_check.add(part.index)

    def _request_fetches(self) -> None:
        """Issue the Fetches this event allows (the module's docstring): first to the
        partitions waiting for room, in order; then to those the event touched; then, if
        nothing is on its way, to the waiting empty partitions of flows with room."""
        queue = self._read_queue
        while queue:
            p = next(iter(queue))
            part = self._parts[p]
            page = self._page(part) if self._wants_read(part) else None
            if page is not None and not self._admits(page[1]):
                break
            del queue[p]
            if page is not None:
                self._read(part, *page)
        for p in sorted(self._fetch_check | self._room_wait):
            part = self._parts[p]
            self._room_wait.discard(p)
            if p in queue or not self._wants_read(part):
                continue
            page = self._page(part)
            if page is not None:
                if queue or not self._admits(page[1]):
                    queue[p] = None
                else:
                    self._read(part, *page)
            elif p in self._stuck and len(part.buffer) < self._buffer_size:
                room = self._buffer_bytes // 2 - self._use.bytes - self._reading
                if part.next_cost > room:
                    self._room_wait.add(p)  # the next message did not fit: read it once it can
                    continue
                limit = min(self._buffer_size - len(part.buffer), room // self._msg_cost)
                if limit >= 1:
                    self._read(part, limit, limit * self._msg_cost)
        self._fetch_check.clear()
        if queue and not self._reading:
            for p in list(queue):
                part = self._parts[p]
                if not self._wants_read(part):
                    del queue[p]
                elif not part.buffer and self._starving(part):
                    del queue[p]
                    room = self._buffer_bytes - self._use.bytes - self._reading
                    limit = max(1, min(self._buffer_size, room // self._msg_cost))
                    self._read(part, limit, limit * self._msg_cost)

    def _wants_read(self, part: Partition) -> bool:
        """Whether the partition may have something to read and someone to deliver it to."""
        wanted = part.owner is not None or (
            self._group.mode is GroupMode.SHARED and bool(self._flows)
        )
        return wanted and part.more and not part.fetching

    def _page(self, part: Partition) -> tuple[int, int] | None:
        """The page the partition asks for, (messages, bytes reserved), or None while it
        holds more than half a page."""
        size = len(part.buffer)
        target = max(TURN, self._share() // self._msg_cost)
        target = max(1, min(self._buffer_size, self._buffer_bytes // self._msg_cost, target))
        if size > target // 2:
            return None
        limit = max(1, target - size)
        return limit, max(limit * self._msg_cost, part.next_cost)

    def _admits(self, cost: int) -> bool:
        """Whether a read of ``cost`` bytes fits the budget beside what is buffered and
        what is being read (always, when there is neither: a message larger than the
        budget is read on its own)."""
        taken = self._use.bytes + self._reading
        return not taken or taken + cost <= self._buffer_bytes

    def _read(self, part: Partition, limit: int, cost: int) -> None:
        part.fetching = True
        part.fetch_limit = limit
        part.fetch_bytes = cost
        part.known_at_fetch = part.known
        self._reading += cost
        self._out.append(Fetch(part.index, part.cursor, limit))

    def _starving(self, part: Partition) -> bool:
        """Whether the partition's flow (shared mode: any flow) has room and, the pump
        having run, nothing to send."""
        if self._group.mode is GroupMode.SHARED:
            return any(flow.has_room() for flow in self._flows.values())
        flow = self._flows.get(part.owner) if part.owner is not None else None
        return flow is not None and flow.has_room()

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
        return self._use.bytes + self._reading + cost <= self._buffer_bytes
