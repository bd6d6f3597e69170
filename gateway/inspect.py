"""Queue inspection for the admin API and ``keygate inspect``: the SQL views (what any user
sees with plain SQL) joined with the live flows of the running state machines."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from core.model import QueueConfig
from gateway.broker import Broker
from storage import SqlStore


def queue_json(queue: QueueConfig) -> dict[str, Any]:
    """Every setting of the queue (the API's queue object without its stats)."""
    data = asdict(queue)
    data["subscriptions"] = list(queue.subscriptions)
    data["dead_letter_queue"] = queue.dlq_name
    return data


async def queue_summary(store: SqlStore, queue: QueueConfig) -> dict[str, Any]:
    """Every setting and the stats: what ``GET /api/queues/{name}`` and ``keygate queue
    show`` print (the view listed only some settings; the rest were visible in SQL only)."""
    return {**queue_json(queue), **await store.queue_stats(queue.name)}


async def queue_summaries(store: SqlStore, queues: Iterable[QueueConfig]) -> list[dict[str, Any]]:
    """``queue_summary`` of each of ``queues``, their stats read in one statement."""
    stats = await store.all_queue_stats()
    empty = {"depth": 0, "bytes": 0, "in_flight": 0, "dead_letters": 0}
    return [{**queue_json(q), **stats.get(q.name, empty)} for q in queues]


# kg_key_status columns shown per group (docs/sql.md): the keys not simply flowing.
_KEY_COLUMNS = (
    "partition",
    "key",
    "reason",
    "detail",
    "message_id",
    "attempts",
    "messages",
    "blocked_since",
)


async def inspect_queue(broker: Broker, store: SqlStore, name: str) -> dict[str, Any]:
    """Per group: mode, per-partition state/owner/backlog/in-flight/committed/lag, the
    flows with window, slots (free window) and pending (PAI-EAS attributes style), and the
    keys held back (kg_key_status: retrying, parked, handing off)."""
    queue = broker.queue(name)
    runtimes = {rt.group.name: rt for rt in broker.runtimes(name)}
    for runtime in runtimes.values():
        await runtime.flush()
    rows = await store.partition_status(name)
    groups: dict[str, dict[str, Any]] = {}
    for group in await store.list_groups(name):
        groups[group.name] = {
            "group": group.name,
            "mode": group.mode.value,
            "key_order": group.key_order.value,
            "tags": dict(group.tags or {}),
            "partitions": [],
            "flows": [],
            "keys": [],
        }
    for row in rows:
        entry = groups.get(row["group_name"])
        if entry is not None:
            entry["partitions"].append(
                {
                    k: row[k]
                    for k in (
                        "partition",
                        "state",
                        "owner_flow",
                        "owner_client",
                        "backlog",
                        "in_flight",
                        "committed_seq",
                        "lag",
                    )
                }
            )
    for row in await store.key_status(name):
        entry = groups.get(row["group_name"])
        if entry is not None:
            entry["keys"].append({k: row[k] for k in _KEY_COLUMNS})
    for group_name, runtime in runtimes.items():
        status = runtime.status()
        live = {p.partition: p for p in status.partitions}
        entry = groups[group_name]
        for part in entry["partitions"]:
            if (state := live.get(part["partition"])) is not None:
                part["state"] = state.state.value
                part["owner_flow"] = state.flow_id
                part["owner_client"] = state.client
        entry["flows"] = [
            {
                "flow_id": flow.flow_id,
                "client": flow.client,
                "state": flow.state.value,
                "ack_mode": flow.ack_mode.value,
                "window": flow.window,
                "pending": flow.pending,
                "slots": max(0, flow.window - flow.pending),
                # Its connection is behind: it is sent nothing until the socket drains.
                "behind": flow.behind,
                "partitions": sorted(flow.partitions),
                "bound_at": flow.bound_at,
            }
            for flow in status.flows
        ]
    return {
        "queue": await queue_summary(store, queue),
        "groups": list(groups.values()),
    }
