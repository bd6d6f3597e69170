"""The gateway's periodic work, in one task.

Every ``ack_flush_interval`` it asks each group runtime to write its pending acks. Every
``retention_interval`` it deletes the expired MQTT sessions, writes each flow's pending
count to ``kg_flows``, renews the native group leases and starts a retention run (unless
the last one is still going): a task of its own that deletes what every group settled in
short transactions paced over half the interval, so publishes, which share SQLite's one
writer, never wait behind more than one of them (a burst of them every 5 s was the 99th
percentile of publish latency, docs/performance.md). In between, about every 0.2 s, it
runs retention early, unpaced, while a depth-limited queue is at least half full: depth
counts stored rows, so settled messages waiting for retention must not make it refuse
publishes.
Every HEAD_CHECK_INTERVAL it reads the heads of the queues with running groups (one
query), so rows that another writer appended reach those groups within about a second;
on PostgreSQL such an append also notifies (``kg_heads``), and the heads are read at the
next tick (procrastinate's pattern: the notification is the hint, the poll the guarantee).

Failures. A step that fails with a storage error is logged and done again at its next
turn; while the database cannot be reached (StorageUnavailable) nothing is logged here:
the store's OutageLog tells the outage once (storage.outage), where a line per step would
repeat it every tick. Any other exception ends the task, or the retention run, which the
gateway's supervisor (gateway.supervisor) watches: the gateway stops, as when any of its
critical tasks ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Final

from core.errors import KeygateError, StorageUnavailable
from gateway.broker import Broker
from gateway.supervisor import Supervisor
from storage import SqlStore

log = logging.getLogger("keygate.housekeeping")

# Ticks (ack_flush_interval each) between early retention runs of a filling queue.
PROMPT_RETENTION_TICKS: Final = 4
# Seconds between checks for rows appended by other writers (Spark, another gateway).
HEAD_CHECK_INTERVAL: Final = 0.5


class Housekeeping:
    def __init__(
        self,
        broker: Broker,
        store: SqlStore,
        supervisor: Supervisor,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.broker = broker
        self.store = store
        self._supervisor = supervisor
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._retention: asyncio.Task[None] | None = None
        # Set by another writer's notification (PostgreSQL): check the heads at the next tick.
        self._hinted = False
        self._stopping = asyncio.Event()

    def start(self) -> asyncio.Task[None]:
        """Start the periodic work; returns its task, which runs until ``stop``."""
        self._task = asyncio.create_task(self._run(), name="housekeeping")
        return self._task

    async def stop(self) -> None:
        """End the periodic work between two steps, and the retention run now. A step is
        not cancelled: one cancelled while its transaction begins on SQLite leaves the
        transaction open, holding the database's write lock, and the gateway's last writes
        (the acks, the lease) then waited for SQLite's busy timeout."""
        self._stopping.set()
        if self._retention is not None:
            self._retention.cancel()
        tasks = [task for task in (self._task, self._retention) if task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)

    def _hint(self) -> None:
        self._hinted = True

    async def _run(self) -> None:
        try:
            stop_listening = await self.store.listen_heads(self._hint)
        except KeygateError as e:
            log.warning("cannot listen for other writers' appends (polling only): %s", e)
        else:
            try:
                await self._loop()
            finally:
                await stop_listening()
            return
        await self._loop()

    async def _loop(self) -> None:
        broker, store = self.broker, self.store
        interval = broker.config.ack_flush_interval
        retention_every = max(1, round(broker.config.retention_interval / interval))
        heads_every = max(1, round(HEAD_CHECK_INTERVAL / interval))
        ticks = 0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._stopping.wait()
            if self._stopping.is_set():
                return
            for runtime in broker.runtimes():
                runtime.request_flush()
            ticks += 1
            try:
                if ticks % retention_every == 0:
                    if self._retention is None or self._retention.done():
                        spread = broker.config.retention_interval / 2
                        self._retention = asyncio.create_task(
                            self._retain(spread), name="retention"
                        )
                        self._supervisor.watch("a retention run", self._retention, runs_out=True)
                    await store.expire_mqtt_sessions(now=self._clock())
                    await self._write_pending()
                    await broker.groups.renew_leases()
                elif ticks % PROMPT_RETENTION_TICKS == 0 and await self._filling():
                    await store.retention(now=self._clock(), on_expired=self._expired)
                if self._hinted or ticks % heads_every == 0:
                    self._hinted = False
                    await broker.check_heads()
            except KeygateError as e:
                _failed("housekeeping", e)

    async def _retain(self, spread: float) -> None:
        try:
            await self.store.retention(now=self._clock(), spread=spread, on_expired=self._expired)
        except KeygateError as e:
            _failed("retention", e)

    def _expired(self, queue: str, count: int, dead_lettered: bool) -> None:
        """Expired messages of a queue without groups: counted as a group counts its own,
        under the group label ``""``."""
        metrics = self.broker.metrics
        if dead_lettered:
            metrics.dead_lettered.labels(queue, "").inc(count)
        else:
            metrics.dropped.labels(queue, "", "expired").inc(count)

    async def _filling(self) -> bool:
        """Whether a queue with max_depth is at least half full."""
        for queue in self.broker.queues():
            if queue.max_depth_messages is None and queue.max_depth_bytes is None:
                continue
            messages, size = await self.store.depth(queue.name)
            if (queue.max_depth_messages and 2 * messages >= queue.max_depth_messages) or (
                queue.max_depth_bytes and 2 * size >= queue.max_depth_bytes
            ):
                return True
        return False

    async def _write_pending(self) -> None:
        pending = {
            flow.flow_id: flow.pending
            for runtime in self.broker.runtimes()
            for flow in runtime.status().flows
        }
        if pending:
            await self.store.update_flow_pending(pending, now=self._clock())


def _failed(what: str, error: KeygateError) -> None:
    """Log a failed step, unless the database could not be reached (module doc)."""
    if not isinstance(error, StorageUnavailable):
        log.warning("%s failed: %s", what, error)
