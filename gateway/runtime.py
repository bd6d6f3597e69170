"""One consumer group at run time: a ``core.group.GroupMachine`` plus the I/O it asks for.

How it works. Events (bind, ack, appended messages, timer ticks) call the machine
synchronously — it is pure and fast — and queue the returned action lists. One executor
task drains that queue in order, merging whatever has piled up into one step:

1. ``RecordDispatch`` records are written (one group-committed write) *before* any
   ``Deliver`` of the step is handed to a flow, so delivery counts survive a crash. A
   step of first sends inside their partitions' reservations has none and sends at once.
2. ``DeadLetter`` copies are written together with the newest offsets, the parked-key
   changes (``KeyParked``/``KeyReleased``) and the ``DeadLetterKey`` moves in one
   transaction (the seqs moved go back to the machine at once, ``key_dead_lettered``);
   otherwise ``OffsetUpdate``\\ s (idempotent full state per partition) are kept in
   ``_pending_offsets`` (``RetryScheduled`` records, for inspection, in
   ``_pending_retries``) and written by the periodic flush. The flush is started by this
   task and runs beside it, so a step's deliveries never wait for it; a later flush, a
   dead letter or a dispatch record waits for it first, so an older offset can never
   overwrite a newer one (nor an older reservation a newer one).
3. Assignment and flow changes are written through; then deliveries and partition changes
   are handed to the flows' outputs in the order the machine produced them.
4. The ``Fetch`` actions of a step start one read from SQL (one query for many partitions;
   noted scheduled messages, by seq: one more), whose pages go back to ``machine.loaded``.

A storage failure while persisting is retried with a capped backoff; delivery pauses
meanwhile rather than sending something whose count is not durable. A message that cannot
be read back (``store.read_for_delivery``) or encoded for its flow (``FlowOutput.deliver``
returns it) goes back to the machine, which dead-letters it as ``undeliverable``: one
message never stops its partition. A flow output that raises (a bug in its protocol) is
unbound and ended (``gateway.handout``), so what it held is redelivered and the step's other
flows still get theirs. Any other error in a step is logged and the executor goes on (a
group's executor never dies of one step). Fenced is not retried: a gateway
that lost the lease writes nothing more, and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Final, Protocol

from core.actions import (
    Action,
    AssignmentChanged,
    DeadLetter,
    DeadLetterKey,
    Deliver,
    Dropped,
    Fetch,
    FlowChanged,
    KeyParked,
    KeyReleased,
    OffsetUpdate,
    Page,
    ParkedKey,
    PartitionsChanged,
    RecordDispatch,
    RetryScheduled,
    merge_dispatch,
)
from core.errors import Fenced, KeygateError, StorageUnavailable, Unavailable
from core.group import GroupMachine
from core.model import AckMode, DeadLetterReason, GroupConfig, Message, QueueConfig
from core.partition import GroupStatus
from gateway.handout import hand_out
from protocols.sink import FlowOutput
from storage.interfaces import GroupStore

log = logging.getLogger("keygate.runtime")

_CLOSE_TIMEOUT: Final = 10.0
_FLUSH: Final = "flush"
_DRAIN: Final = "drain"
_RETRY_MAX: Final = 2.0


class RuntimeHooks(Protocol):
    def delivered(self, queue: str, group: str, deliveries: Sequence[Deliver]) -> None: ...
    def dead_lettered(self, queue: str, group: str, count: int) -> None: ...
    def dropped(self, queue: str, group: str, reason: str) -> None: ...


class GroupRuntime:
    def __init__(
        self,
        store: GroupStore,
        machine: GroupMachine,
        queue: QueueConfig,
        group: GroupConfig,
        hooks: RuntimeHooks,
        *,
        clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.machine = machine
        self.queue = queue
        self.group = group
        # Every line this group logs carries its queue and group as fields (JSON keys).
        self._log = logging.LoggerAdapter(log, {"queue": queue.name, "group": group.name})
        self.outputs: dict[str, FlowOutput] = {}
        self._hooks = hooks
        self._clock = clock
        self._actions: asyncio.Queue[list[Action] | str] = asyncio.Queue()
        self._pending_offsets: dict[int, OffsetUpdate] = {}
        self._pending_retries: dict[tuple[int, int], RetryScheduled] = {}
        self._wake = asyncio.Event()
        self._armed: float | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._flushing: asyncio.Task[None] | None = None
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._closed = False

    # --- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self._spawn(self._execute_forever())
        self._spawn(self._timer_forever())
        self.submit(self.machine.tick(self._clock()))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._log.error(
                "group %s/%s task failed", self.queue.name, self.group.name, exc_info=exc
            )

    async def close(self, error: KeygateError | None = None) -> None:
        """Flush offsets and stop. With ``error``, every flow is terminated with it."""
        if self._closed:
            return
        self._closed = True
        self.submit(self.machine.close())
        try:
            await asyncio.wait_for(self._drain(), _CLOSE_TIMEOUT)
        except TimeoutError:
            # The database is not answering: give up on the final flush rather than hang
            # the shutdown. At most the acks since the last flush are lost (redelivered).
            self._log.error(
                "group %s/%s: final flush timed out after %.0fs",
                self.queue.name,
                self.group.name,
                _CLOSE_TIMEOUT,
            )
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if error is not None:
            for output in self.outputs.values():
                output.terminate(error)
        self.outputs.clear()

    async def flush(self) -> None:
        """Carry out everything queued so far and write the pending offsets."""
        await self._drain()

    async def _drain(self) -> None:
        """Wait until everything queued so far has been carried out."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(done)
        self._actions.put_nowait(_DRAIN)
        await done

    # --- events ----------------------------------------------------------------------

    def submit(self, actions: list[Action]) -> None:
        if actions:
            self._actions.put_nowait(actions)
        deadline = self.machine.next_deadline()
        if deadline is not None and (self._armed is None or deadline < self._armed):
            self._wake.set()

    def bind(
        self,
        flow_id: str,
        client: str,
        window: int,
        ack_mode: AckMode,
        previous: frozenset[int] | None,
        output: FlowOutput,
        *,
        owner: str | None = None,
    ) -> frozenset[int]:
        # The machine first: it refuses a bad bind before the output is registered.
        actions = self.machine.bind(
            self._clock(), flow_id, client, window, ack_mode, previous, owner=owner
        )
        self.outputs[flow_id] = output
        self.submit(actions)
        return self.machine.partitions_of(flow_id)

    def unbind(self, flow_id: str, *, shutdown: bool = False) -> None:
        if self.outputs.pop(flow_id, None) is not None:
            self.submit(self.machine.unbind(self._clock(), flow_id, shutdown=shutdown))

    def append(self, messages: Sequence[Message]) -> None:
        self.submit(self.machine.append(self._clock(), messages))

    def heads(self, heads: Mapping[int, int]) -> None:
        """Partition heads another writer advanced (Broker.check_heads)."""
        self.submit(self.machine.heads(self._clock(), heads))

    def ack(self, flow_id: str, message_ids: Sequence[str]) -> None:
        self.submit(self.machine.ack(self._clock(), flow_id, message_ids))

    def ack_cumulative(self, flow_id: str, partition: int, seq: int) -> None:
        self.submit(self.machine.ack_cumulative(self._clock(), flow_id, partition, seq))

    def nack(self, flow_id: str, message_ids: Sequence[str], delay: float | None) -> None:
        self.submit(self.machine.nack(self._clock(), flow_id, message_ids, delay))

    def reject(self, flow_id: str, message_ids: Sequence[str]) -> None:
        self.submit(self.machine.reject(self._clock(), flow_id, message_ids))

    def undeliverable(self, flow_id: str, message_ids: Sequence[str]) -> None:
        """Dead-letter messages the flow's protocol could not encode."""
        for message_id in message_ids:
            self._log.error(
                "group %s/%s: message %s cannot be encoded for flow %s; "
                "dead-lettering it as undeliverable",
                self.queue.name,
                self.group.name,
                message_id,
                flow_id,
            )
        self.submit(self.machine.undeliverable(self._clock(), flow_id, message_ids))

    def credit(self, flow_id: str, window: int) -> None:
        self.submit(self.machine.credit(self._clock(), flow_id, window))

    def backpressure(self, flow_id: str, on: bool) -> None:
        """The flow's connection is behind (``on``) or caught up (GroupMachine.backpressure)."""
        self.submit(self.machine.backpressure(self._clock(), flow_id, on))

    def release_key(self, key: str, *, skip: bool) -> None:
        """Let a parked key flow again (see GroupMachine.release_key); raises KeyNotParked."""
        self.submit(self.machine.release_key(self._clock(), key, skip=skip))

    def set_buffer_bytes(self, budget: int) -> None:
        """The group's share of gateway_buffer_bytes; applies from its next event."""
        self.machine.set_buffer_bytes(budget)

    def request_flush(self) -> None:
        if self._pending_offsets or self._pending_retries:
            self._actions.put_nowait(_FLUSH)

    def status(self) -> GroupStatus:
        return self.machine.status()

    def idle(self) -> bool:
        """No flow bound and no partition reserved (GroupMachine.idle): closing the
        runtime now loses nothing that its timers still have to do."""
        return not self.outputs and self.machine.idle()

    def parked_keys(self) -> list[ParkedKey]:
        return self.machine.parked_keys()

    def reconfigure(self, queue: QueueConfig) -> None:
        """The queue's settings were altered: they apply from their next use."""
        self.machine.reconfigure(queue)
        self.queue = queue

    # --- the executor ------------------------------------------------------------------

    async def _execute_forever(self) -> None:
        while True:
            batch: list[Action] = []
            flush = False
            item = await self._actions.get()
            while True:
                if isinstance(item, list):
                    batch.extend(item)
                elif item == _FLUSH:
                    flush = True
                else:
                    await self._step(batch, flush=True)
                    await self._flushed()
                    batch, flush = [], False
                    while self._drain_waiters:
                        self._drain_waiters.pop().set_result(None)
                try:
                    item = self._actions.get_nowait()
                except asyncio.QueueEmpty:
                    break
            if batch or flush:
                await self._step(batch, flush=flush)

    async def _step(self, actions: list[Action], *, flush: bool) -> None:
        """Carry out one step. Storage failures are retried inside (``_persist``); any
        other error is a bug: logged with what the step held, and the executor goes on
        with the next step rather than die and stop the whole group."""
        try:
            await self._carry_out(actions, flush=flush)
        except Exception:
            held = sorted(
                (a.message.partition, a.message.seq) for a in actions if isinstance(a, Deliver)
            )
            self._log.exception(
                "group %s/%s: a step failed (deliveries at (partition, seq) %s)",
                self.queue.name,
                self.group.name,
                held[:20],
            )

    async def _carry_out(self, actions: list[Action], *, flush: bool) -> None:
        dispatch: list[RecordDispatch] = []
        letters: list[DeadLetter] = []
        moves: list[DeadLetterKey] = []
        keys: list[KeyParked | KeyReleased] = []
        assignments: list[AssignmentChanged] = []
        flows: list[FlowChanged] = []
        sends: list[Deliver | PartitionsChanged] = []
        fetches: list[Fetch] = []
        for action in actions:
            match action:
                case Deliver() | PartitionsChanged():
                    sends.append(action)
                case OffsetUpdate():
                    self._pending_offsets[action.partition] = action
                case RetryScheduled():
                    self._pending_retries[action.partition, action.seq] = action
                case RecordDispatch():
                    dispatch.append(action)
                case DeadLetter():
                    letters.append(action)
                case DeadLetterKey():
                    moves.append(action)
                case KeyParked() | KeyReleased():
                    keys.append(action)
                case AssignmentChanged():
                    assignments.append(action)
                case FlowChanged():
                    flows.append(action)
                case Fetch():
                    fetches.append(action)
                case Dropped():
                    self._hooks.dropped(self.queue.name, self.group.name, action.reason)
        name, group = self.queue.name, self.group.name
        if dispatch:
            records = merge_dispatch(dispatch)
            await self._flushed()
            await self._persist(lambda: self.store.record_dispatch(name, group, records))
        if letters or moves or (flush and (self._pending_offsets or self._pending_retries)):
            await self._flushed()
            offsets = list(self._pending_offsets.values())
            self._pending_offsets.clear()
            retries = list(self._pending_retries.values())
            self._pending_retries.clear()
            if letters or moves:
                await self._dead_letter(letters, moves, offsets, keys, retries)
                keys = []
            else:
                self._flushing = self._spawn(
                    self._persist(
                        lambda: self.store.write_offsets(name, group, offsets, retries=retries)
                    )
                )
        if keys:
            await self._persist(lambda: self.store.write_key_changes(name, group, keys))
        if assignments:
            now = self._clock()
            await self._persist(
                lambda: self.store.write_assignments(name, group, assignments, now=now)
            )
        if flows:
            now = self._clock()
            await self._persist(lambda: self.store.write_flows(name, group, flows, now=now))
        self._send(sends)
        if fetches:
            self._spawn(self._fetch(fetches))

    async def _flushed(self) -> None:
        """Wait for the offset flush running beside the executor, if any."""
        if self._flushing is not None:
            flushing, self._flushing = self._flushing, None
            # A failure other than storage's is a bug, logged by _task_done; it must not
            # fail the step that waits here.
            with contextlib.suppress(Exception):
                await flushing

    async def _dead_letter(
        self,
        letters: list[DeadLetter],
        moves: list[DeadLetterKey],
        offsets: list[OffsetUpdate],
        keys: list[KeyParked | KeyReleased],
        retries: list[RetryScheduled],
    ) -> None:
        name, group, now = self.queue.name, self.group.name, self._clock()
        moved: list[list[int]] = []

        async def write() -> None:
            moved[:] = await self.store.dead_letter(
                name, group, letters, offsets, now=now, keys=keys, retries=retries, moves=moves
            )

        await self._persist(write)
        # At once, so no offset of the machine's older state is written after this one.
        for move, seqs in zip(moves, moved, strict=True):
            actions = self.machine.key_dead_lettered(self._clock(), move.partition, move.key, seqs)
            self.submit(actions)
        if self.queue.dlq_name is not None:
            self._hooks.dead_lettered(name, group, len(letters) + sum(map(len, moved)))
            return
        # No dead-letter queue (a DLQ's own setting, or dead_letter_queue ''): dropped.
        for letter in letters:
            self._hooks.dropped(name, group, letter.reason.value)
        for _ in range(sum(map(len, moved))):
            self._hooks.dropped(name, group, DeadLetterReason.KEY_DEAD_LETTERED.value)

    def _send(self, sends: list[Deliver | PartitionsChanged]) -> None:
        name, group = self.queue.name, self.group.name
        done = hand_out(sends, self.outputs, self._log, f"{name}/{group}")
        if done.sent:
            self._hooks.delivered(name, group, done.sent)
        for flow_id, message_ids in done.undeliverable.items():
            self.undeliverable(flow_id, message_ids)
        for flow_id, output in done.broken.items():
            # Its protocol cannot be trusted with the flow any more: end it as a lost
            # connection would be (partitions kept through the rebalance delay).
            self.unbind(flow_id)
            try:
                output.terminate(Unavailable("internal server error"))
            except Exception:
                self._log.exception("group %s/%s: ending flow %s failed", name, group, flow_id)

    async def _persist(self, write: Callable[[], Awaitable[object]]) -> None:
        delay = 0.05
        while True:
            try:
                await write()
                return
            except Fenced:
                return  # another gateway is active: this one writes nothing more, and stops
            except KeygateError as e:
                if not isinstance(e, StorageUnavailable):  # an outage: told by storage.outage
                    self._log.warning(
                        "group %s/%s: write failed (%s); retrying in %.2fs",
                        self.queue.name,
                        self.group.name,
                        e,
                        delay,
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX)

    async def _fetch(self, fetches: list[Fetch]) -> None:
        pages = [(f.partition, f.after_seq, f.limit, f.max_bytes) for f in fetches if not f.seqs]
        noted = [(f.partition, f.seqs) for f in fetches if f.seqs]
        delay = 0.05
        while True:
            try:
                found = await self.store.read_for_delivery(self.queue.name, pages) if pages else {}
                if noted:
                    found.update(await self.store.read_seqs(self.queue.name, noted))
                break
            except Exception as e:
                # A storage failure, or a bug: either way the partitions must not be left
                # waiting for an answer that never comes. Retry with backoff.
                if not isinstance(e, StorageUnavailable):  # an outage: told by storage.outage
                    self._log.warning(
                        "group %s/%s: read of partitions %s failed (%s)",
                        self.queue.name,
                        self.group.name,
                        [f.partition for f in fetches][:20],
                        e if isinstance(e, KeygateError) else repr(e),
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX)
        answers = []
        for fetch in fetches:
            messages, unreadable = found[fetch.partition]
            for seq in sorted(unreadable):
                self._log.error(
                    "group %s/%s: message at partition %d seq %d cannot be read; "
                    "dead-lettering it as undeliverable",
                    self.queue.name,
                    self.group.name,
                    fetch.partition,
                    seq,
                )
            answers.append(Page(fetch.partition, messages, unreadable))
        self.submit(self.machine.loaded(self._clock(), answers))

    async def _timer_forever(self) -> None:
        while True:
            deadline = self.machine.next_deadline()
            self._armed = deadline
            self._wake.clear()
            timeout = None if deadline is None else max(0.0, deadline - self._clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            now = self._clock()
            if deadline is not None and now >= deadline:
                self.submit(self.machine.tick(now))
