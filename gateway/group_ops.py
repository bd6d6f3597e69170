"""Operator actions on groups and dead-letter queues, part of the broker: replay (a group
reset), releasing a parked key, and dead-letter redrive. Each one keeps the group's state
machine out of the way while SQL is rewritten (the broker's per-group loading lock), then
lets the group load again from SQL. They reach into the broker's group registry, which is
why they live beside it in ``gateway/``."""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import TYPE_CHECKING, Final

from core.errors import Conflict, InvalidArgument
from core.model import ResetPosition
from gateway.ids import new_message_id
from protocols.sink import Principal
from storage.redrive import redrive_batch

if TYPE_CHECKING:
    from gateway.broker import Broker
    from storage import SqlStore

log = logging.getLogger("keygate.broker")

# Dead letters moved per redrive transaction.
REDRIVE_BATCH: Final = 500


async def reset_group(
    broker: Broker,
    store: SqlStore,
    queue: str,
    name: str,
    target: ResetPosition,
    *,
    force: bool = False,
) -> dict[int, int]:
    """Move a group to ``target`` (keygate group reset). Refused (Conflict) while
    consumers are bound, unless ``force``: then the group's state machine is flushed and
    reloaded at the new position, and its consumers are bound again to the reloaded
    group with the partitions they held; what they had not acked is delivered anew."""
    await store.get_group(queue, name)
    # Held while the group is rewritten, so a consumer binding meanwhile loads the group
    # after the reset, not before it.
    groups = broker.groups
    async with groups.lock(queue, name):
        runtime = groups.running(queue, name)
        bound = [] if runtime is None else runtime.status().flows
        if bound and not force:
            raise Conflict(
                f"group {name!r} of {queue!r} has {len(bound)} bound consumer(s); close "
                "them first or force the reset"
            )
        outputs = {} if runtime is None else dict(runtime.outputs)
        owners = {flow.flow_id: groups.flow(flow.flow_id) for flow in bound}
        if runtime is not None:
            groups.unload(queue, name)
            await runtime.close()
        positions = await store.reset_group(queue, name, target)
    if bound:
        assert runtime is not None
        reloaded = await groups.load(runtime.group)
        for flow in bound:
            owner = owners[flow.flow_id]
            assert owner is not None
            reloaded.bind(
                flow.flow_id,
                flow.client,
                flow.window,
                flow.ack_mode,
                frozenset(flow.partitions),
                outputs[flow.flow_id],
                owner=owner.principal.username,
            )
            groups.move_flow(flow.flow_id, reloaded, owner.principal, flow.client)
    log.info(
        "group %s/%s reset to %s: %s",
        queue,
        name,
        target.kind,
        positions,
        extra={"queue": queue, "group": name},
    )
    return positions


async def release_key(
    broker: Broker, store: SqlStore, queue: str, name: str, key: str, *, skip: bool = False
) -> list[int]:
    """Let a parked key of the group flow again (on_dead_letter = park_key); with
    ``skip`` its messages stored until now are dead-lettered first. Loads the group
    if it is not running here. Returns the partitions the key was parked in; raises
    GroupNotFound, KeyNotParked."""
    runtime = await broker.groups.load(await store.get_group(queue, name))
    partitions = [p.partition for p in runtime.parked_keys() if p.key == key]
    runtime.release_key(key, skip=skip)
    await runtime.flush()  # the release (and any skipped letters) is in SQL on return
    log.info(
        "group %s/%s: key %r released (skip=%s)",
        queue,
        name,
        key,
        skip,
        extra={"queue": queue, "group": name, "key": key},
    )
    return partitions


async def redrive(
    broker: Broker,
    store: SqlStore,
    principal: Principal,
    dlq: str,
    *,
    to: str | None = None,
    key: str | None = None,
    limit: int | None = None,
) -> dict[str, int]:
    """Move up to ``limit`` dead letters of ``dlq`` (only those of ``key`` when given) back
    to their original queue, or to ``to`` (storage.redrive), one transaction per batch.
    Refused (Conflict) while consumers are bound to the dead-letter queue; its groups
    are unloaded and kept from loading meanwhile, so none delivers a moved letter."""
    broker.access.check_admin(principal)
    if key is not None and "\x00" in key:
        # No stored key holds one (core.ingress), and PostgreSQL's text cannot compare it.
        raise InvalidArgument("key contains a NUL character")
    broker.queue(dlq)
    if to is not None:
        broker.queue(to)
    keys = sorted((dlq, g.name) for g in await store.list_groups(dlq))
    async with contextlib.AsyncExitStack() as stack:
        for k in keys:
            await stack.enter_async_context(broker.groups.lock(*k))
        busy = [rt for rt in broker.runtimes(dlq) if rt.outputs]
        if busy:
            raise Conflict(f"queue {dlq!r} has bound consumers; close them before a redrive")
        for k in keys:
            if (runtime := broker.groups.unload(*k)) is not None:
                await runtime.close()
        moved = skipped = 0
        after = (-1, 0)
        while limit is None or moved < limit:
            now = broker.clock()
            batch = await redrive_batch(
                store,
                dlq,
                to=to,
                key=key,
                after=after,
                limit=REDRIVE_BATCH if limit is None else min(REDRIVE_BATCH, limit - moved),
                new_id=functools.partial(new_message_id, now),
                now=now,
            )
            moved += len(batch.moved)
            skipped += batch.skipped
            if batch.cursor is None:
                break
            after = batch.cursor
    log.info("redrive of %s: %d moved, %d left in place", dlq, moved, skipped, extra={"queue": dlq})
    return {"moved": moved, "skipped": skipped}


__all__ = ["REDRIVE_BATCH", "redrive", "release_key", "reset_group"]
