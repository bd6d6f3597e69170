"""Publishing: a publication routed to its queues, built into messages and stored. Mixed
into Broker, whose queue table, subscription index and store it uses.

``publish`` and ``publish_many`` store all of their publications or none (an MQTT QoS 2
PUBLISH, a STOMP transaction). ``publish_each`` is the listeners' ordinary path: it routes
and queues a lot for the append writer at once (``SqlStore.append_each``) and each
publication is stored or refused alone inside one transaction, so a connection may queue
its next lot while this one commits, in order, and a refusal never makes a lot be tried
again publication by publication.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from core.errors import KeygateError, NoRoute, PermissionDenied, StorageError, Unavailable
from core.ingress import validate_publication
from core.model import Message, Publication, QueueConfig
from core.topics import SubscriptionIndex, normalize_topic
from gateway.access import Access
from gateway.messages import build_message
from gateway.metrics import Metrics
from protocols.sink import Principal, Receipt
from storage.appends import AppendOutcome
from storage.store import SqlStore

# Topics whose routes are cached; a publisher using more only costs the trie walk again.
ROUTE_CACHE_SIZE: Final = 10_000
# Messages waiting for their commit above which the gateway reports itself blocked
# (AMQP connection.blocked).
MAX_PENDING_APPENDS: Final = 50_000


class Publishing:
    _store: SqlStore
    clock: Callable[[], float]
    metrics: Metrics
    access: Access
    _queues: dict[str, QueueConfig]
    _index: SubscriptionIndex
    # Topic -> the queues subscribed to it, as _route found them; emptied whenever a
    # queue or a subscription changes, and when it holds ROUTE_CACHE_SIZE topics.
    _routes: dict[str, tuple[QueueConfig, ...]]
    _closing: bool
    queue: Callable[[str], QueueConfig]

    @property
    def blocked(self) -> bool:
        return self._store.appends_pending > MAX_PENDING_APPENDS

    def _route(self, topic: str) -> tuple[QueueConfig, ...]:
        queues = self._routes.get(topic)
        if queues is None:
            names = self._index.match(topic)
            if not names:
                raise NoRoute(f"no queue subscribes to topic {topic!r}")
            if len(self._routes) >= ROUTE_CACHE_SIZE:
                self._routes.clear()
            queues = self._routes[topic] = tuple(self._queues[name] for name in sorted(names))
        return queues

    def _messages(
        self, principal: Principal, publication: Publication, now: float
    ) -> list[Message]:
        validate_publication(publication)
        publisher = principal.username
        if publication.topic is None:
            assert publication.queue is not None
            # Permission before the lookup: no one learns which queues exist by publishing.
            self.access.authorize(principal, "publish", publication.queue)
            return [build_message(self.queue(publication.queue), publication, publisher, now, None)]
        topic = normalize_topic(publication.topic)
        out = []
        for queue in self._route(topic):
            if not self.access.allows(principal, "publish", queue.name):
                # Named by the topic: which queues subscribe to it is not the publisher's.
                raise PermissionDenied(f"{publisher!r} may not publish on topic {topic!r}")
            out.append(build_message(queue, publication, publisher, now, topic))
        return out

    async def publish(
        self,
        principal: Principal,
        publication: Publication,
        *,
        qos2_packet_id: int | None = None,
    ) -> Receipt:
        qos2 = None
        if qos2_packet_id is not None and principal.client_id is not None:
            qos2 = (principal.client_id, qos2_packet_id)
        return (await self._publish(principal, [publication], qos2))[0]

    async def publish_many(
        self, principal: Principal, publications: Sequence[Publication]
    ) -> list[Receipt]:
        return await self._publish(principal, publications, None)

    def publish_each(
        self, principal: Principal, publications: Sequence[Publication]
    ) -> Awaitable[list[Receipt | KeygateError]]:
        """Route ``publications`` and queue them for storage now, behind every append the
        connection queued before: it may call again before this one's commit without
        either overtaking the other (other connections' appends take turns with it:
        storage.batcher). Each is stored (all its queues) or refused alone; the
        awaitable gives one outcome per publication, after COMMIT."""
        now = self.clock()
        if self._closing:
            refused = Unavailable("the gateway is shutting down")
            self._refused(refused, len(publications))
            return _ready([refused] * len(publications))
        routed: list[list[Message] | KeygateError] = []
        for publication in publications:
            try:
                routed.append(self._messages(principal, publication, now))
            except KeygateError as e:
                self._refused(e, 1)
                routed.append(e.as_outcome())
        units = [batch for batch in routed if not isinstance(batch, KeygateError)]
        try:
            stored = self._store.append_each(units, now=now, source=principal.connection)
        except KeygateError as e:  # the store is closed
            self._refused(e, len(units))
            e.as_outcome()
            return _ready([e if isinstance(r, list) else r for r in routed])
        # Counted when the commit is known, whether or not anyone awaits the outcomes (a
        # connection torn down meanwhile does not).
        stored.add_done_callback(
            functools.partial(self._stored_each, principal.protocol, now, len(units))
        )
        return _receipts(publications, routed, stored)

    def _stored_each(
        self, protocol: str, now: float, units: int, stored: asyncio.Future[list[AppendOutcome]]
    ) -> None:
        """Metrics of one ``publish_each``, once its commit is known (not when the caller
        that awaited it was cancelled: the write goes on, its outcome unseen)."""
        if stored.cancelled():
            return
        self.metrics.publish_latency.observe(self.clock() - now)
        error = stored.exception()
        if error is not None:
            if isinstance(error, KeygateError):
                self._refused(error, units)
            return
        committed = []
        for result in stored.result():
            if isinstance(result, KeygateError):
                self._refused(result, 1)
            else:
                committed.extend(result)
        self._count_published(committed, protocol)

    async def _publish(
        self,
        principal: Principal,
        publications: Sequence[Publication],
        qos2: tuple[str, int] | None,
    ) -> list[Receipt]:
        if self._closing:
            raise Unavailable("the gateway is shutting down")
        now = self.clock()
        try:
            batches = [self._messages(principal, pub, now) for pub in publications]
            flat = [m for batch in batches for m in batch]
            stored = await self._store.append(flat, now=now, qos2=qos2, source=principal.connection)
        except KeygateError as e:
            self._count_refusal(e, len(publications))
            raise
        self.metrics.publish_latency.observe(self.clock() - now)
        self._count_published(stored, principal.protocol)
        receipts = []
        position = 0
        for batch, pub in zip(batches, publications, strict=True):
            receipts.append(_receipt(pub, batch, stored[position : position + len(batch)]))
            position += len(batch)
        return receipts

    def _count_published(self, stored: Sequence[Message], protocol: str) -> None:
        if len(stored) == 1:
            self.metrics.published.labels(stored[0].queue, protocol).inc()
        elif stored:
            for queue, count in Counter(m.queue for m in stored).items():
                self.metrics.published.labels(queue, protocol).inc(count)

    def _count_refusal(self, error: KeygateError, publications: int) -> None:
        """Count refused publications once each. Storage failing refuses every one of the
        call; any other refusal of a multi-publication call is not final: the listener
        stores them one by one next (protocols._io.publish_receipts, STOMP) and that counts.
        ``publish_each``'s refusals are all final: it counts them with ``_refused``."""
        if publications == 1 or isinstance(error, (StorageError, Unavailable)):
            self._refused(error, publications)

    def _refused(self, error: KeygateError, publications: int) -> None:
        self.metrics.rejected.labels(error.code).inc(publications)


def _receipt(
    publication: Publication, built: Sequence[Message], stored: Sequence[Message]
) -> Receipt:
    """What one publication's stored copies confirm; ``duplicate`` when the publication
    asked for dedup and an earlier message came back in place of a copy built."""
    ids: tuple[str, ...]
    queues: tuple[str, ...]
    if len(stored) == 1:  # most publications: one queue
        ids, queues = (stored[0].message_id,), (stored[0].queue,)
    else:
        ids, queues = tuple(m.message_id for m in stored), tuple(m.queue for m in stored)
    duplicate = publication.dedup_id is not None and ids != tuple(m.message_id for m in built)
    return Receipt(ids, queues, duplicate)


async def _receipts(
    publications: Sequence[Publication],
    routed: list[list[Message] | KeygateError],
    stored: Awaitable[list[AppendOutcome]],
) -> list[Receipt | KeygateError]:
    """One outcome per publication: refused before the store (``routed``), by it, or
    stored."""
    try:
        results = await stored
    except KeygateError as e:
        results = [e.as_outcome()] * sum(not isinstance(r, KeygateError) for r in routed)
    outcomes: list[Receipt | KeygateError] = []
    unit = iter(results)
    for publication, batch in zip(publications, routed, strict=True):
        if isinstance(batch, KeygateError):
            outcomes.append(batch)
            continue
        result = next(unit)
        outcomes.append(
            result if isinstance(result, KeygateError) else _receipt(publication, batch, result)
        )
    return outcomes


async def _ready(outcomes: list[Receipt | KeygateError]) -> list[Receipt | KeygateError]:
    return outcomes


__all__ = ["ROUTE_CACHE_SIZE", "Publishing"]
