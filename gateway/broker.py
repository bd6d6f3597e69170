"""The broker: routes publications into queues and runs every consumer group.

It implements ``protocols.sink.Sink`` for the protocol listeners, publishing and
consuming (bind, then settle events on the flow; a flow is settled only by the connection
that bound it, checked in ``settle``). Publishing resolves the
destination (queue name, or topic through the subscription index), the key and the
partition, then appends to the store, whose group commit returns after COMMIT. The store's
commit listener feeds committed messages, in commit order, to the loaded group runtimes.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence

from core.errors import (
    Conflict,
    InvalidArgument,
    PermissionDenied,
    QueueNotFound,
    Unavailable,
)
from core.model import (
    DEFAULT_MAX_MESSAGE_SIZE,
    GroupConfig,
    GroupMode,
    KeyOrder,
    Message,
    QueueConfig,
    StartPosition,
)
from core.topics import SubscriptionIndex, validate_pattern
from gateway.access import Access
from gateway.config import GatewayConfig
from gateway.gauges import group_gauges, queue_gauges
from gateway.groups import Groups
from gateway.logs import flow_fields
from gateway.metrics import GroupGauge, Metrics, QueueGauge, RuntimeMetrics
from gateway.protocol_state import ProtocolState
from gateway.publishing import Publishing
from gateway.runtime import GroupRuntime
from protocols.sink import (
    Ack,
    AckCumulative,
    Backpressure,
    BindRequest,
    BindResult,
    Credit,
    FlowOutput,
    Nack,
    Principal,
    Reject,
    Settle,
    Unbind,
    Undeliverable,
)
from storage.store import SqlStore

log = logging.getLogger("keygate.broker")

# A group with native flows is leased in SQL (kind "native") so a Spark job refuses it;
# renewed every retention interval, released when the group's last flow leaves.


class Broker(Publishing, ProtocolState):
    def __init__(
        self,
        store: SqlStore,
        config: GatewayConfig,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self.config = config
        self.metrics = metrics
        self.clock = clock
        self._queues: dict[str, QueueConfig] = {}
        self._index = SubscriptionIndex()
        # Topic -> the queues subscribed to it, as _route found them; emptied whenever a
        # queue or a subscription changes, and when it holds ROUTE_CACHE_SIZE topics.
        self._routes: dict[str, tuple[QueueConfig, ...]] = {}
        self.groups = Groups(store, config, RuntimeMetrics(metrics), self.queue, clock, log.warning)
        self._closing = False
        self.access = Access(config)
        metrics.watch(self._queue_gauges, self._group_gauges, clock)

    async def start(self) -> None:
        for queue in await self._store.list_queues():
            self._remember(queue)
        self._store.add_commit_listener(self._on_commit)

    async def close(self) -> None:
        """Flush every group's acks and stop the runtimes."""
        self._closing = True
        await self.groups.close()

    # --- queues --------------------------------------------------------------------

    def _remember(self, queue: QueueConfig) -> None:
        self._routes.clear()
        old = self._queues.get(queue.name)
        if old is not None:
            for pattern in old.subscriptions:
                self._index.remove(pattern, queue.name)
        self._queues[queue.name] = queue
        for pattern in queue.subscriptions:
            self._index.add(pattern, queue.name)

    def queue(self, name: str) -> QueueConfig:
        try:
            return self._queues[name]
        except KeyError:
            raise QueueNotFound(name) from None

    def queues(self) -> list[QueueConfig]:
        return sorted(self._queues.values(), key=lambda q: q.name)

    async def create_queue(self, config: QueueConfig, *, exist_ok: bool = False) -> QueueConfig:
        for pattern in config.subscriptions:
            validate_pattern(pattern)
        stored = await self._store.create_queue(config, exist_ok=exist_ok)
        self._remember(stored)
        if stored.dlq_name:
            self._remember(await self._store.get_queue(stored.dlq_name))
        return stored

    async def alter_queue(self, name: str, **changes: object) -> QueueConfig:
        stored = await self._store.alter_queue(name, **changes)
        self._remember(stored)
        if stored.dlq_name and stored.dlq_name not in self._queues:
            self._remember(await self._store.get_queue(stored.dlq_name))
        for runtime in self.runtimes(name):
            runtime.reconfigure(stored)
        return stored

    async def delete_queue_named(self, name: str) -> int:
        self.queue(name)
        gone = QueueNotFound(name)
        for loaded in self.runtimes(name):
            runtime = self.groups.unload(name, loaded.group.name)
            if runtime is not None:
                await runtime.close(gone)
        count = await self._store.delete_queue(name)
        old = self._queues.pop(name)
        self._routes.clear()
        for pattern in old.subscriptions:
            self._index.remove(pattern, name)
        return count

    # --- groups -------------------------------------------------------------------

    def default_mode(self, queue: str) -> GroupMode:
        """``partitioned`` for a partitioned queue, else ``shared`` (competing consumers)."""
        return GroupMode.PARTITIONED if self.queue(queue).partitions > 0 else GroupMode.SHARED

    async def create_group(self, config: GroupConfig) -> GroupConfig:
        """Create a group explicitly (DESIGN.md §2: "created explicitly or on first bind").

        Raises QueueNotFound, AlreadyExists when a group of that name exists.
        """
        self.queue(config.queue)
        group, _ = await self._store.create_group(config, exist_ok=False)
        return group

    async def delete_group(self, queue: str, name: str) -> None:
        """Delete a group and its progress. Refused (Conflict) while consumers are bound,
        as Pulsar refuses to delete a subscription with consumers: a bound consumer would
        otherwise re-create the group on its next reconnect."""
        await self._store.get_group(queue, name)
        runtime = self.groups.running(queue, name)
        if runtime is not None and runtime.outputs:
            raise Conflict(
                f"group {name!r} of {queue!r} has {len(runtime.outputs)} bound consumer(s); "
                "close them first"
            )
        if runtime is not None:
            self.groups.unload(queue, name)
            await runtime.close()
        await self.groups.release_lease(queue, name)
        await self._store.delete_group(queue, name)

    # --- Sink -----------------------------------------------------------------------

    @property
    def max_message_size(self) -> int:
        return max(
            (q.max_message_size for q in self._queues.values()), default=DEFAULT_MAX_MESSAGE_SIZE
        )

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
        user = await self.access.auth.authenticate(
            username, password, peer=peer, certificate_user=certificate_user
        )
        return Principal(user, protocol, client_id)

    def may_administer(self, principal: Principal) -> bool:
        return self.access.may_administer(principal)

    async def declare(
        self,
        principal: Principal,
        config: QueueConfig,
        *,
        exist_ok: bool,
        given: Collection[str] | None = None,
    ) -> QueueConfig:
        """Create a queue (admin only), or check an existing one with the same settings —
        which a user who may publish to or monitor it may do, as clients declare their
        queues on connect. ``given``: the settings the declare named; an existing queue
        must match those (AlreadyExists naming the first that differs) and keeps the rest
        as stored. None: only the partition count is compared."""
        if not (exist_ok and config.name in self._queues):
            self.access.check_admin(principal)
        elif not self.access.allows(principal, "publish", config.name):
            self.access.check_monitor(principal, config.name)
        if exist_ok and given is not None and config.name in self._queues:
            stored = self.queue(config.name)
            stored.check_same(config, given)
            return stored
        return await self.create_queue(config, exist_ok=exist_ok)

    def _on_commit(self, messages: Sequence[Message]) -> None:
        self.metrics.commit_batch.observe(len(messages))
        by_queue: dict[str, list[Message]] = {}
        for message in messages:
            by_queue.setdefault(message.queue, []).append(message)
        for queue, runtime in self.groups.items():
            if queue in by_queue:
                runtime.append(by_queue[queue])

    async def check_heads(self) -> None:
        """Let running groups see rows other writers appended (a Spark job's dead letters,
        a fenced-off gateway's last commits): one query for every queue with a group."""
        advanced = await self._store.foreign_heads(queue for queue, _ in self.groups.items())
        for queue, runtime in self.groups.items():
            if queue in advanced:
                runtime.heads(advanced[queue])

    async def declare_queue(
        self,
        principal: Principal,
        config: QueueConfig,
        *,
        passive: bool = False,
        exist_ok: bool = True,
        given: Collection[str] | None = None,
    ) -> QueueConfig:
        if passive:
            # Checking that a queue exists is what publishers do at start-up (and what a
            # non-passive declare of an existing queue allows them): publish suffices.
            if not self.access.allows(principal, "publish", config.name):
                self.access.check_monitor(principal, config.name)
            return self.queue(config.name)
        return await self.declare(principal, config, exist_ok=exist_ok, given=given)

    async def delete_queue(self, principal: Principal, name: str) -> int:
        self.access.check_admin(principal)
        return await self.delete_queue_named(name)

    async def purge_queue(self, principal: Principal, name: str) -> int:
        self.access.check_admin(principal)
        self.queue(name)
        return await self._store.purge_queue(name)

    async def queue_depth(self, principal: Principal, name: str) -> int:
        self.access.check_monitor(principal, name)
        self.queue(name)
        return (await self._store.depth(name))[0]

    async def subscribe(self, principal: Principal, queue: str, pattern: str) -> None:
        self.access.check_admin(principal)
        self.queue(queue)
        await self._store.add_subscription(queue, validate_pattern(pattern))
        self._remember(await self._store.get_queue(queue))

    async def unsubscribe(self, principal: Principal, queue: str, pattern: str) -> None:
        self.access.check_admin(principal)
        self.queue(queue)
        await self._store.remove_subscription(queue, pattern)
        self._remember(await self._store.get_queue(queue))

    # --- consumers --------------------------------------------------------------------

    async def bind(
        self, principal: Principal, request: BindRequest, output: FlowOutput
    ) -> BindResult:
        if self._closing:
            raise Unavailable("the gateway is shutting down")
        queue, group = request.queue, request.group
        self.access.authorize(principal, "consume", queue)  # first: no existence oracle
        config = self.queue(queue)
        window = config.window if request.window is None else request.window
        if window < 1:
            raise InvalidArgument("window must be >= 1")
        window = min(window, self.config.max_window)
        tags = dict(request.tags) if request.tags else None
        wanted = GroupConfig(
            queue,
            group,
            request.mode or self.default_mode(queue),
            request.key_order or KeyOrder.PARTITION,
            request.start or StartPosition.EARLIEST,
            tags,
            request.ack_timeout,
        )
        await self.groups.load(wanted)  # creates the group: its lease is in its row
        await self.groups.lease(queue, group)  # GroupLeased while a Spark job holds it
        # Again, with the lease ours: housekeeping may have closed the runtime meanwhile,
        # giving the group up (Groups.renew_leases); then it is loaded afresh from SQL.
        runtime = await self.groups.load(wanted)
        actual = runtime.group
        _check_settings(actual, request, tags)
        flow_id = uuid.uuid4().hex
        partitions = runtime.bind(
            flow_id,
            request.client,
            window,
            request.ack_mode,
            request.previous,
            output,
            owner=principal.username,
        )
        self.groups.add_flow(flow_id, runtime, principal, request.client)
        log.info(
            "flow %s of %s/%s bound by %s client %s with partitions %s",
            flow_id,
            queue,
            group,
            principal.protocol,
            request.client,
            sorted(partitions),
            extra=flow_fields(flow_id, queue, group, principal, request.client),
        )
        return BindResult(flow_id, partitions, actual, window)

    def settle(self, principal: Principal, flow_id: str, event: Settle) -> None:
        flow = self.groups.flow(flow_id)
        # The one ownership check: flow ids are not secret (inspection lists them).
        if flow is not None and flow.principal.connection != principal.connection:
            raise PermissionDenied("flow belongs to another connection")
        if isinstance(event, Credit) and event.window < 0:
            raise InvalidArgument("window must be >= 0 (0 pauses the flow)")
        if flow is None:
            return  # gone: its messages were already returned for redelivery
        runtime = flow.runtime
        queue, group = runtime.queue.name, runtime.group.name
        match event:
            case Ack():
                self.metrics.acked.labels(queue, group).inc(len(event.message_ids))
                runtime.ack(flow_id, event.message_ids)
            case AckCumulative():
                runtime.ack_cumulative(flow_id, event.partition, event.seq)
            case Nack():
                self.metrics.nacked.labels(queue, group, "retry").inc(len(event.message_ids))
                runtime.nack(flow_id, event.message_ids, event.delay)
            case Reject():
                self.metrics.nacked.labels(queue, group, "reject").inc(len(event.message_ids))
                runtime.reject(flow_id, event.message_ids)
            case Undeliverable():
                runtime.undeliverable(flow_id, event.message_ids)
            case Credit():
                runtime.credit(flow_id, min(event.window, self.config.max_window))
            case Backpressure():
                runtime.backpressure(flow_id, event.on)
            case Unbind():
                self.groups.remove_flow(flow_id)
                runtime.unbind(flow_id, shutdown=event.shutdown)
                log.info(
                    "flow %s of %s/%s unbound%s",
                    flow_id,
                    queue,
                    group,
                    " (shutdown)" if event.shutdown else "",
                    extra=flow_fields(flow_id, queue, group, flow.principal, flow.client),
                )

    # --- inspection ---------------------------------------------------------------------

    def runtimes(self, queue: str | None = None) -> list[GroupRuntime]:
        return self.groups.runtimes(queue)

    def _group_gauges(self) -> Iterable[GroupGauge]:
        return group_gauges(self.runtimes(), self._store.heads)

    def _queue_gauges(self) -> Iterable[QueueGauge]:
        return queue_gauges(self.queues(), self.runtimes(), self._store.depths)


def _check_settings(group: GroupConfig, request: BindRequest, tags: dict[str, str] | None) -> None:
    """Conflict if a setting the bind names (None: not named, the group's own applies)
    contradicts the group's: a consumer never gets other semantics than it asked for."""
    for name, asked, has in (
        ("mode", request.mode, group.mode),
        ("key_order", request.key_order, group.key_order),
        ("start", request.start, group.start),
        ("ack_timeout", request.ack_timeout, group.ack_timeout),
        ("tag filter", tags, dict(group.tags) if group.tags else None),
    ):
        if asked is not None and asked != has:
            raise Conflict(f"group {group.name!r} has {name} {has}, not {asked}")
