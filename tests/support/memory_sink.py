"""An in-memory ``protocols.sink.Sink`` for unit tests of the protocol listeners.

It stores publications in a list, routes topics with ``core.topics``, and lets a test
stall commits (to prove a confirm waits for the commit) or make them fail. Consumers: it
records bound flows (with their ``FlowOutput``, so a test can push deliveries through
``flows[id].output``) and every settle event, refusing one from another connection as the
broker does.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Collection, Sequence
from dataclasses import dataclass, field, replace

from core.errors import (
    AlreadyExists,
    AuthenticationFailed,
    InvalidArgument,
    KeygateError,
    MessageTooLarge,
    NoRoute,
    PermissionDenied,
    QueueFull,
    QueueNotFound,
    StorageError,
)
from core.model import (
    DEFAULT_MAX_MESSAGE_SIZE,
    GroupConfig,
    GroupMode,
    KeyOrder,
    Publication,
    QueueConfig,
    StartPosition,
)
from core.topics import SubscriptionIndex
from protocols.sink import (
    BindRequest,
    BindResult,
    Credit,
    FlowOutput,
    Principal,
    Receipt,
    Settle,
    Unbind,
)


@dataclass
class Stored:
    queue: str
    publication: Publication
    message_id: str


@dataclass
class BoundFlow:
    principal: Principal
    request: BindRequest
    output: FlowOutput


@dataclass
class MemorySink:
    """Set ``users`` to require credentials (``admins`` to limit who may administer);
    ``gate`` (cleared) to stall commits."""

    users: dict[str, str] | None = None
    admins: set[str] | None = None
    queues: dict[str, QueueConfig] = field(default_factory=dict)
    stored: list[Stored] = field(default_factory=list)
    # State the gateway keeps for the listeners (survives a listener restart in tests).
    exchanges: dict[str, str] = field(default_factory=dict)
    mqtt_sessions: dict[str, frozenset[int]] = field(default_factory=dict)
    fail_writes: bool = False
    blocked: bool = False
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    stored_event: asyncio.Event = field(default_factory=asyncio.Event)
    bound_event: asyncio.Event = field(default_factory=asyncio.Event)
    flows: dict[str, BoundFlow] = field(default_factory=dict)
    settled: list[tuple[str, Settle]] = field(default_factory=list)
    _index: SubscriptionIndex = field(default_factory=SubscriptionIndex)
    _ids: itertools.count[int] = field(default_factory=itertools.count)
    _lots: asyncio.Future[list[Receipt | KeygateError]] | None = None  # the last publish_each

    def __post_init__(self) -> None:
        self.gate.set()

    async def authenticate(
        self,
        username: str | None,
        password: str | None,
        *,
        protocol: str,
        client_id: str | None,
        peer: str | None = None,
        certificate_user: str | None = None,
    ) -> Principal:
        if self.users is not None and self.users.get(username or "") != password:
            raise AuthenticationFailed("bad username or password")
        return Principal(username, protocol, client_id)

    def may_administer(self, principal: Principal) -> bool:
        return self.admins is None or principal.username in self.admins

    def _route(self, publication: Publication) -> list[QueueConfig]:
        if publication.queue is not None:
            if publication.queue not in self.queues:
                raise QueueNotFound(publication.queue)
            return [self.queues[publication.queue]]
        assert publication.topic is not None
        names = self._index.match(publication.topic)
        if not names:
            raise NoRoute(f"no queue subscribes to topic {publication.topic!r}")
        return [self.queues[name] for name in sorted(names)]

    async def publish_many(
        self, principal: Principal, publications: Sequence[Publication]
    ) -> list[Receipt]:
        return await self._store(publications)

    def publish_each(
        self, principal: Principal, publications: Sequence[Publication]
    ) -> Awaitable[list[Receipt | KeygateError]]:
        # Queued now, behind the calls before it, as the gateway's group commit does: a
        # lot is stored once the one before it is, however late its caller awaits it.
        self._lots = asyncio.ensure_future(self._store_each(self._lots, list(publications)))
        return self._lots

    async def _store_each(
        self, before: Awaitable[object] | None, publications: list[Publication]
    ) -> list[Receipt | KeygateError]:
        if before is not None:
            with contextlib.suppress(Exception):
                await before
        outcomes: list[Receipt | KeygateError] = []
        for publication in publications:
            try:
                outcomes.extend(await self._store([publication]))
            except KeygateError as e:
                outcomes.append(e)
        return outcomes

    async def _store(self, publications: Sequence[Publication]) -> list[Receipt]:
        routed = [(pub, self._route(pub)) for pub in publications]
        for pub, queues in routed:
            for queue in queues:
                if len(pub.payload) > queue.max_message_size:
                    raise MessageTooLarge(f"{len(pub.payload)} bytes > {queue.max_message_size}")
                depth = sum(1 for s in self.stored if s.queue == queue.name)
                if queue.max_depth_messages is not None and depth >= queue.max_depth_messages:
                    raise QueueFull(f"queue {queue.name!r} is full")
        await self.gate.wait()
        if self.fail_writes:
            raise StorageError("the write failed")
        receipts = []
        for pub, queues in routed:
            ids = []
            for queue in queues:
                message_id = f"m{next(self._ids)}"
                self.stored.append(Stored(queue.name, pub, message_id))
                ids.append(message_id)
            receipts.append(Receipt(tuple(ids), tuple(q.name for q in queues)))
        self.stored_event.set()
        return receipts

    async def publish(
        self,
        principal: Principal,
        publication: Publication,
        *,
        qos2_packet_id: int | None = None,
    ) -> Receipt:
        receipt = (await self.publish_many(principal, [publication]))[0]
        if qos2_packet_id is not None and principal.client_id is not None:
            waiting = self.mqtt_sessions.get(principal.client_id, frozenset())
            self.mqtt_sessions[principal.client_id] = waiting | {qos2_packet_id}
        return receipt

    async def declare_queue(
        self,
        principal: Principal,
        config: QueueConfig,
        *,
        passive: bool = False,
        exist_ok: bool = True,
        given: Collection[str] | None = None,
    ) -> QueueConfig:
        existing = self.queues.get(config.name)
        if passive:
            if existing is None:
                raise QueueNotFound(config.name)
            return existing
        if existing is not None and exist_ok and given is not None:
            existing.check_same(config, given)
            return existing
        if existing is not None:
            if not exist_ok or existing.partitions != config.partitions:
                raise AlreadyExists(f"queue {config.name!r} exists with other partitions")
            return existing
        self.queues[config.name] = config
        for pattern in config.subscriptions:
            self._index.add(pattern, config.name)
        return config

    def _require(self, name: str) -> QueueConfig:
        if name not in self.queues:
            raise QueueNotFound(name)
        return self.queues[name]

    async def delete_queue(self, principal: Principal, name: str) -> int:
        self._require(name)
        count = await self.purge_queue(principal, name)
        del self.queues[name]
        self._index.remove_queue(name)
        return count

    async def purge_queue(self, principal: Principal, name: str) -> int:
        self._require(name)
        before = len(self.stored)
        self.stored = [s for s in self.stored if s.queue != name]
        return before - len(self.stored)

    async def queue_depth(self, principal: Principal, name: str) -> int:
        self._require(name)
        return sum(1 for s in self.stored if s.queue == name)

    async def subscribe(self, principal: Principal, queue: str, pattern: str) -> None:
        config = self._require(queue)
        self._index.add(pattern, queue)
        self.queues[queue] = replace(config, subscriptions=(*config.subscriptions, pattern))

    async def unsubscribe(self, principal: Principal, queue: str, pattern: str) -> None:
        config = self._require(queue)
        self._index.remove(pattern, queue)
        subs = tuple(p for p in config.subscriptions if p != pattern)
        self.queues[queue] = replace(config, subscriptions=subs)

    async def bind(
        self, principal: Principal, request: BindRequest, output: FlowOutput
    ) -> BindResult:
        config = self._require(request.queue)
        window = config.window if request.window is None else request.window
        if window < 1:
            raise InvalidArgument("window must be >= 1")
        flow_id = f"flow-{next(self._ids)}"
        self.flows[flow_id] = BoundFlow(principal, request, output)
        self.bound_event.set()
        group = GroupConfig(
            request.queue,
            request.group,
            request.mode or GroupMode.SHARED,
            request.key_order or KeyOrder.PARTITION,
            request.start or StartPosition.EARLIEST,
        )
        return BindResult(flow_id, frozenset(), group, window)

    def settle(self, principal: Principal, flow_id: str, event: Settle) -> None:
        flow = self.flows.get(flow_id)
        if flow is not None and flow.principal.connection != principal.connection:
            raise PermissionDenied("flow belongs to another connection")
        if isinstance(event, Credit) and event.window < 0:  # as the broker: 0 pauses
            raise InvalidArgument("window must be >= 0 (0 pauses the flow)")
        if flow is None:
            return
        self.settled.append((flow_id, event))
        if isinstance(event, Unbind):
            del self.flows[flow_id]

    async def amqp_exchanges(self) -> dict[str, str]:
        return dict(self.exchanges)

    async def save_amqp_exchange(self, name: str, type_name: str | None) -> None:
        self._fail_if_asked()
        if type_name is None:
            self.exchanges.pop(name, None)
        else:
            self.exchanges[name] = type_name

    async def mqtt_session(self, client_id: str) -> set[int] | None:
        waiting = self.mqtt_sessions.get(client_id)
        return None if waiting is None else set(waiting)

    async def save_mqtt_session(self, client_id: str, *, expires_in: float | None) -> None:
        self._fail_if_asked()
        self.mqtt_sessions.setdefault(client_id, frozenset())

    async def mqtt_released(self, client_id: str, packet_ids: frozenset[int]) -> None:
        self._fail_if_asked()
        if client_id in self.mqtt_sessions:
            self.mqtt_sessions[client_id] = self.mqtt_sessions[client_id] - packet_ids

    async def drop_mqtt_session(self, client_id: str) -> None:
        self.mqtt_sessions.pop(client_id, None)

    def _fail_if_asked(self) -> None:
        if self.fail_writes:
            raise StorageError("the test made writes fail")

    async def wait_bound(self, timeout: float = 10.0) -> tuple[str, BoundFlow]:
        """Wait until a flow is bound (poll with a deadline); the newest one."""
        async with asyncio.timeout(timeout):
            while not self.flows:
                self.bound_event.clear()
                await self.bound_event.wait()
        return next(reversed(self.flows.items()))

    async def wait_stored(self, count: int, timeout: float = 10.0) -> list[Stored]:
        """Wait until at least ``count`` messages are stored (poll with a deadline)."""
        async with asyncio.timeout(timeout):
            while len(self.stored) < count:
                self.stored_event.clear()
                await self.stored_event.wait()
        return self.stored


@dataclass
class BatchSink(MemorySink):
    """Records the size of every ``publish_many`` and ``publish_each`` call (``publish`` is
    a call of one)."""

    batches: list[int] = field(default_factory=list)

    async def publish_many(
        self, principal: Principal, publications: Sequence[Publication]
    ) -> list[Receipt]:
        self.batches.append(len(publications))
        return await super().publish_many(principal, publications)

    def publish_each(
        self, principal: Principal, publications: Sequence[Publication]
    ) -> Awaitable[list[Receipt | KeygateError]]:
        self.batches.append(len(publications))
        return super().publish_each(principal, publications)
