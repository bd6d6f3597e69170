"""What a metrics scrape reports of the live state: one gauge per loaded group and queue."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from core.model import QueueConfig
from gateway.metrics import GroupGauge, QueueGauge
from gateway.runtime import GroupRuntime

__all__ = ["group_gauges", "queue_gauges"]


def group_gauges(
    runtimes: Sequence[GroupRuntime], heads: Mapping[tuple[str, int], int]
) -> Iterator[GroupGauge]:
    """Backlog, in-flight, lag, owners, oldest and parked keys of every loaded group."""
    for runtime in runtimes:
        status = runtime.status()
        parts = status.partitions
        name = runtime.queue.name
        times = [p.oldest for p in parts if p.oldest is not None]
        yield GroupGauge(
            name,
            runtime.group.name,
            backlog=sum(p.buffered for p in parts),
            in_flight=sum(p.in_flight for p in parts),
            lag=sum(max(0, heads.get((name, p.partition), 0) - p.committed_seq) for p in parts),
            owners=sum(1 for flow in status.flows if flow.partitions),
            oldest=min(times, default=None),
            parked=len(runtime.parked_keys()),
        )


def queue_gauges(
    queues: Sequence[QueueConfig],
    runtimes: Sequence[GroupRuntime],
    depths: Mapping[str, Sequence[int]],
) -> Iterator[QueueGauge]:
    """Stored messages and bytes, in flight and dead letters of every queue."""
    in_flight: dict[str, int] = {}
    for runtime in runtimes:
        flying = sum(p.in_flight for p in runtime.status().partitions)
        in_flight[runtime.queue.name] = in_flight.get(runtime.queue.name, 0) + flying
    for queue in queues:
        messages, size = depths.get(queue.name, (0, 0))
        dlq = queue.dlq_name
        yield QueueGauge(
            queue.name,
            messages,
            size,
            in_flight.get(queue.name, 0),
            depths.get(dlq, (0, 0))[0] if dlq else 0,
        )
