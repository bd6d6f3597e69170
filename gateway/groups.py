"""The consumer groups running in this gateway, and the flows bound to them.

How it works. A group's ``GroupRuntime`` (its state machine and executor) is loaded on
first use — a bind, a key release — from its stored state, under a lock per group, so a
bind racing a reset or a redrive loads the group after it, never before. Every bound flow
is remembered with its runtime and the principal that bound it: ``Broker.settle`` checks
ownership against it. The native group lease (which keeps a Spark job off a group that
gateway consumers use) is held while a group has flows, or partitions reserved for a
client through the rebalance delay, and renewed by housekeeping; a group left idle —
no flow, no reservation — is closed (its state written) and only then given up, so that
what a Spark job commits next is what the next native bind starts from. A group is not
given up while a reservation runs: the runtime's timer ends it (the partitions become
``unassigned``), and a client coming back before that takes its partitions back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from core.errors import KeygateError
from core.group import GroupMachine
from core.model import GroupConfig, QueueConfig
from gateway.config import GatewayConfig
from gateway.metrics import RuntimeMetrics
from gateway.runtime import GroupRuntime
from protocols.sink import Principal
from storage import SqlStore

GROUP_LEASE_TTL: Final = 30.0

_Key = tuple[str, str]  # (queue, group)


@dataclass(frozen=True, slots=True)
class BoundFlow:
    runtime: GroupRuntime
    principal: Principal
    client: str  # the client's name at bind, kept for the flow's later log lines


class Groups:
    def __init__(
        self,
        store: SqlStore,
        config: GatewayConfig,
        hooks: RuntimeMetrics,
        queue_of: Callable[[str], QueueConfig],
        clock: Callable[[], float],
        log_warning: Callable[..., None],
    ) -> None:
        self._store = store
        self._config = config
        self._hooks = hooks
        self._queue_of = queue_of
        self._clock = clock
        self._warn = log_warning
        self._runtimes: dict[_Key, GroupRuntime] = {}
        self._loading: dict[_Key, asyncio.Lock] = {}
        self._flows: dict[str, BoundFlow] = {}
        # The lease separates native consumers from Spark jobs, not gateways from each
        # other (kg_gateway_lease does that): owned by the gateway's name, so the gateway
        # that takes over after a crash or failover keeps the groups.
        self.lease_owner = f"gateway:{config.name}"
        self._leased: set[_Key] = set()

    # --- runtimes ---------------------------------------------------------------------

    def lock(self, queue: str, group: str) -> asyncio.Lock:
        """Held while a group is loaded, unloaded or rewritten."""
        return self._loading.setdefault((queue, group), asyncio.Lock())

    async def load(self, wanted: GroupConfig) -> GroupRuntime:
        """The group's runtime, loaded (and the group created) on first use."""
        key = (wanted.queue, wanted.name)
        async with self.lock(*key):
            runtime = self._runtimes.get(key)
            if runtime is None:
                group, snapshot = await self._store.create_group(
                    wanted, exist_ok=True, limit=self._config.max_groups_per_queue
                )
                queue = self._queue_of(wanted.queue)
                stored, size = self._store.depths.get(wanted.queue, (0, 0))
                machine = GroupMachine(
                    queue,
                    group,
                    now=self._clock(),
                    snapshot=snapshot,
                    buffer_size=self._config.buffer_size,
                    buffer_bytes=self._config.group_buffer_bytes,
                    # Its first reads are sized by what the queue holds, on average.
                    message_size=size // stored if stored else None,
                )
                runtime = GroupRuntime(
                    self._store, machine, queue, group, self._hooks, clock=self._clock
                )
                runtime.start()
                self._runtimes[key] = runtime
                self._share_buffers()
        return runtime

    def _share_buffers(self) -> None:
        """Split gateway_buffer_bytes evenly across the loaded groups (each at most
        group_buffer_bytes); a group's budget applies from its next event."""
        budget = self._config.gateway_buffer_bytes // max(1, len(self._runtimes))
        budget = max(1, min(self._config.group_buffer_bytes, budget))
        for runtime in self._runtimes.values():
            runtime.set_buffer_bytes(budget)

    def running(self, queue: str, group: str) -> GroupRuntime | None:
        return self._runtimes.get((queue, group))

    def runtimes(self, queue: str | None = None) -> list[GroupRuntime]:
        """The loaded runtimes (of ``queue``), by queue and group."""
        return [rt for (q, _), rt in sorted(self._runtimes.items()) if queue in (None, q)]

    def items(self) -> Iterator[tuple[str, GroupRuntime]]:
        """(queue, runtime) of every loaded group."""
        return ((queue, rt) for (queue, _), rt in list(self._runtimes.items()))

    def unload(self, queue: str, group: str) -> GroupRuntime | None:
        """Forget a loaded runtime (the caller closes it) and the flows bound to it."""
        runtime = self._runtimes.pop((queue, group), None)
        if runtime is not None:
            self._share_buffers()
            for flow_id in list(runtime.outputs):
                self._flows.pop(flow_id, None)
        return runtime

    # --- flows ------------------------------------------------------------------------

    def add_flow(
        self, flow_id: str, runtime: GroupRuntime, principal: Principal, client: str
    ) -> None:
        self._flows[flow_id] = BoundFlow(runtime, principal, client)

    def flow(self, flow_id: str) -> BoundFlow | None:
        """The bound flow; None once its runtime unbound it (a broken output,
        gateway.handout), which is then forgotten here too."""
        bound = self._flows.get(flow_id)
        if bound is not None and flow_id not in bound.runtime.outputs:
            del self._flows[flow_id]
            return None
        return bound

    def remove_flow(self, flow_id: str) -> None:
        self._flows.pop(flow_id, None)

    def move_flow(
        self, flow_id: str, runtime: GroupRuntime, principal: Principal, client: str
    ) -> None:
        """The flow is bound again to a reloaded runtime of its group (a forced reset)."""
        self._flows[flow_id] = BoundFlow(runtime, principal, client)

    # --- native group leases ------------------------------------------------------------

    async def lease(self, queue: str, group: str) -> None:
        """Take the group's native lease; raises GroupLeased while a Spark job holds it."""
        await self._store.acquire_group_lease(
            queue, group, "native", self.lease_owner, ttl=GROUP_LEASE_TTL, now=self._clock()
        )
        self._leased.add((queue, group))

    async def release_lease(self, queue: str, group: str) -> None:
        if (queue, group) in self._leased:
            self._leased.discard((queue, group))
            await self._store.release_group_lease(queue, group, self.lease_owner)

    async def renew_leases(self) -> None:
        """Renew the native lease of every group that is not idle (bound flows, or
        partitions reserved through the rebalance delay); give the others up, their
        runtime closed first (its final state written while the lease is still held): a
        Spark job may take the group next and move it in SQL, so the next native bind
        loads it from there rather than from a runtime kept in memory."""
        for key in sorted(self._leased):
            async with self.lock(*key):
                runtime = self._runtimes.get(key)
                if runtime is not None and not runtime.idle():
                    await self._store.acquire_group_lease(
                        *key, "native", self.lease_owner, ttl=GROUP_LEASE_TTL, now=self._clock()
                    )
                    continue
                if runtime is not None:
                    self.unload(*key)
                    await runtime.close()
                await self.release_lease(*key)

    async def close(self) -> None:
        """Flush every group's acks, stop the runtimes and release the leases."""
        await asyncio.gather(*(rt.close() for rt in self._runtimes.values()))
        for queue, group in sorted(self._leased):
            try:
                await self._store.release_group_lease(queue, group, self.lease_owner)
            except KeygateError as e:
                self._warn("releasing the lease of %s/%s failed: %s", queue, group, e)
        self._leased.clear()
        self._runtimes.clear()
        self._flows.clear()


__all__ = ["GROUP_LEASE_TTL", "BoundFlow", "Groups"]
