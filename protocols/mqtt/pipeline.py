"""The publish pipeline of one MQTT connection: PUBLISHes in, commits, acks out in order.

How it works. The reader decodes every complete packet of a socket read in one pass and
``put``s each PUBLISH here, in arrival order, without yielding between them (unless the
pipeline is full), so the publishes of one read are queued together. One worker task
takes from the head:

- a run of consecutive QoS 0/1 publishes (up to ``MAX_BATCH`` messages and
  ``MAX_BATCH_BYTES``): stored with one ``publish_in_order`` call, i.e. one
  ``Sink.publish_each`` group-commit submission in which each publication is stored or
  refused alone (no route, too large, queue full, not permitted): only the refused ones
  fail, and the batch is never tried again publication by publication;
- a QoS 2 publish, alone: stored with its packet id recorded in the stored session in the
  same transaction (``Sink.publish(..., qos2_packet_id=)``), so a PUBLISH re-sent after a
  failover is answered, not stored again;
- a publish the connection answers itself (``AnsweredPublish``: refused before storage
  for its payload format or ``x-delay``, or a QoS 2 one re-sent after it was stored),
  alone: nothing to store, its error (None: already stored) is its outcome. It waits here
  only so that its ack leaves after those of the publishes before it.

There is one worker and it stores one batch at a time, so a connection's messages are
stored in the order sent, QoS 2 ones included. After a batch is committed its PUBACK /
PUBREC go out in arrival order (MQTT 3.1.1 §4.6, MQTT 5 [MQTT-4.6.0-2/3]), refusals
included, each publish counted once as stored or rejected. A QoS 1/2 publish
that was not stored gets a reason code on MQTT 5; on 3.1.1, which has no negative ack,
the connection is closed instead (``ServerConnection.complete``), counted in
``unconfirmed_closes``, and the client sends it again after reconnecting.

Back-pressure: ``put`` waits while the pipeline holds ``max_count`` publishes (Receive
Maximum, QoS 0 included) or its ``ByteBudget`` of unconfirmed bytes is spent; the reader
then stops reading and TCP pushes back on the client. Both are given back when a publish
has been acknowledged.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, cast

from core.errors import KeygateError, StorageError, Unavailable
from protocols._io import publish_in_order
from protocols._limits import ByteBudget, publication_bytes
from protocols._log import ConnectionLog
from protocols._tasks import Tasks
from protocols.mqtt.connection import AnsweredPublish, PublishRequest, ServerConnection, State
from protocols.mqtt.errors import publish_reason
from protocols.mqtt.events import ReasonCode
from protocols.mqtt.stored_session import StoredSession
from protocols.sink import Principal, Sink

MAX_BATCH: Final = 1024
MAX_BATCH_BYTES: Final = 4 * 1024 * 1024


@dataclass
class MqttStats:
    """Counters a metrics exporter can read."""

    connections: int = 0
    publishes: int = 0
    rejected: int = 0
    qos0_dropped: int = 0
    protocol_errors: int = 0
    wills: int = 0
    # MQTT 3.1.1 connections closed instead of acknowledging a QoS 1/2 publish that was
    # not stored (3.1.1 has no negative ack; the client resends after reconnecting).
    unconfirmed_closes: int = 0


Queued = PublishRequest | AnsweredPublish


def _alone(request: Queued) -> bool:
    """Taken as a batch of its own: a QoS 2 publish (stored with its packet id) or a
    refusal (nothing to store)."""
    return (request.qos == 2 and request.packet_id is not None) or type(request) is AnsweredPublish


class Pipeline:
    """The publishes of one connection between its reader and the sink (see above)."""

    def __init__(
        self,
        sink: Sink,
        principal: Principal,
        conn: ServerConnection,
        stored: StoredSession,
        stats: MqttStats,
        log: ConnectionLog,
        *,
        max_count: int,
        max_bytes: int,
        tasks: Tasks,
        flush: Callable[[], Awaitable[None]],
        close: Callable[[], None],
    ) -> None:
        self._sink = sink
        self._principal = principal
        self._conn = conn
        self._stored = stored
        self._stats = stats
        self._log = log
        self._flush = flush
        self._close = close
        # Each publish with its size in bytes, as counted against the budget.
        self._queue: deque[tuple[Queued, int]] = deque()
        self._ended = False
        self._ready = asyncio.Event()
        self._slots = asyncio.Semaphore(max_count)
        self.budget = ByteBudget(max_bytes)
        self._worker = tasks.spawn(self._run(), name="mqtt publishes")

    async def put(self, request: PublishRequest) -> None:
        """Queue a publish, first waiting while the pipeline is full."""
        size = publication_bytes(request.publication)
        await self._slots.acquire()
        await self.budget.acquire(size)
        self._queue.append((request, size))
        self._ready.set()

    async def answer(self, answered: AnsweredPublish) -> None:
        """Queue an answer behind the publishes before it (it holds a place, no bytes)."""
        await self._slots.acquire()
        self._queue.append((answered, 0))
        self._ready.set()

    async def finish(self, timeout: float) -> bool:
        """No more publishes: wait (at most ``timeout``) until the worker has stored and
        acknowledged those queued; False when it did not finish in time."""
        self._ended = True
        self._ready.set()
        done, _ = await asyncio.wait([self._worker], timeout=timeout)
        return bool(done)

    async def _run(self) -> None:
        """The worker: store batch after batch, acknowledge each after its commit."""
        while (batch := await self._take()) is not None:
            requests = [request for request, _ in batch]
            outcomes = await self._store(requests)
            failed = next((o for o in outcomes if isinstance(o, StorageError | Unavailable)), None)
            if failed is not None:
                self._log.warning(
                    "mqtt %s: publish of %d message(s) failed: %s",
                    self._conn.client_id,
                    len(batch),
                    failed.message,
                )
            for (request, size), outcome in zip(batch, outcomes, strict=True):
                self._complete(request, size, outcome)
            await self._flush()

    async def _take(self) -> list[tuple[Queued, int]] | None:
        """A QoS 2 publish or a refusal alone, or the longest run of QoS 0/1 publishes
        within the bounds; None once ended and empty."""
        queue = self._queue
        while not queue:
            if self._ended:
                return None
            self._ready.clear()
            await self._ready.wait()
        batch = [queue.popleft()]
        if _alone(batch[0][0]):
            return batch
        size = batch[0][1]
        while queue and not _alone(queue[0][0]):
            if len(batch) >= MAX_BATCH or size >= MAX_BATCH_BYTES:
                break
            batch.append(queue.popleft())
            size += batch[-1][1]
        return batch

    async def _store(self, batch: list[Queued]) -> list[KeygateError | None]:
        """One outcome per publish of ``batch`` (None: stored and committed)."""
        request = batch[0]
        if not _alone(request):
            run = cast("list[PublishRequest]", batch)  # _take puts no answer in a run
            publications = [r.publication for r in run]
            return await publish_in_order(
                self._sink, self._principal, publications, stop_at_refusal=False, log=self._log
            )
        if isinstance(request, AnsweredPublish):
            return [request.error]
        try:
            await self._sink.publish(
                self._principal, request.publication, qos2_packet_id=request.packet_id
            )
        except KeygateError as e:
            return [e]
        except Exception:
            self._log.exception("mqtt %s: publish failed unexpectedly", self._conn.client_id)
            return [Unavailable("internal server error")]
        self._stored.saved = True  # the session's row exists now
        return [None]

    def _complete(self, request: Queued, size: int, outcome: KeygateError | None) -> None:
        """Count one publish, send its ack (or close, on 3.1.1) and free its place."""
        stats, conn = self._stats, self._conn
        self._slots.release()
        self.budget.release(size)
        if outcome is None:
            if type(request) is PublishRequest:  # not a re-sent one already counted
                stats.publishes += 1
            conn.complete(request.qos, request.packet_id, ReasonCode.SUCCESS)
            return
        reason, detail = publish_reason(outcome), outcome.message
        self._log.info(
            "mqtt %s: publish to %r not stored: %s",
            conn.client_id,
            request.topic,
            reason.name,
        )
        stats.rejected += 1
        if request.qos == 0:
            stats.qos0_dropped += 1
        was_open = conn.state is not State.CLOSED
        conn.complete(request.qos, request.packet_id, reason, detail)
        if was_open and conn.state is State.CLOSED:
            # MQTT 3.1.1 refusal: no PUBACK, the connection ends (see conn.complete).
            stats.unconfirmed_closes += 1
            self._log.warning(
                "mqtt %s: closing without acknowledging packet %s (%s: %s); "
                "the client resends it after reconnecting",
                conn.client_id,
                request.packet_id,
                reason.name,
                detail,
            )
            self._close()


__all__ = ["MAX_BATCH", "MAX_BATCH_BYTES", "MqttStats", "Pipeline"]
