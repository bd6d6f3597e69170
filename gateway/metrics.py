"""Prometheus metrics. Counters are updated on the hot path; per-group gauges (backlog,
in-flight) are computed at scrape time from the live state machines."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields, is_dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

GroupGauges = Callable[[], Iterable[tuple[str, str, int, int]]]
"""Yields (queue, group, backlog, in_flight) for every loaded group."""


class _GroupCollector(Collector):
    def __init__(self, source: GroupGauges) -> None:
        self._source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        backlog = GaugeMetricFamily(
            "keygate_group_backlog", "Messages not yet delivered", labels=["queue", "group"]
        )
        in_flight = GaugeMetricFamily(
            "keygate_group_in_flight", "Delivered, not yet settled", labels=["queue", "group"]
        )
        for queue, group, waiting, flying in self._source():
            backlog.add_metric([queue, group], waiting)
            in_flight.add_metric([queue, group], flying)
        yield backlog
        yield in_flight


class _ListenerCollector(Collector):
    """A listener's own counters (a dataclass of ints), e.g. MQTT protocol errors, wills."""

    def __init__(self, name: str, stats: object) -> None:
        self._name = name
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        for field in fields(self._stats):  # type: ignore[arg-type]
            family = CounterMetricFamily(
                f"keygate_listener_{field.name}", f"{field.name} of a listener", labels=["listener"]
            )
            family.add_metric([self._name], getattr(self._stats, field.name))
            yield family


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.published = Counter(
            "keygate_published", "Messages stored", ["queue", "protocol"], registry=r
        )
        self.rejected = Counter(
            "keygate_publish_rejected", "Publishes refused", ["reason"], registry=r
        )
        self.delivered = Counter(
            "keygate_delivered", "Messages sent to consumers", ["queue", "group"], registry=r
        )
        self.acked = Counter("keygate_acked", "Ack requests", ["queue", "group"], registry=r)
        self.nacked = Counter(
            "keygate_nacked", "Nack requests", ["queue", "group", "outcome"], registry=r
        )
        self.dead_lettered = Counter(
            "keygate_dead_lettered", "Messages dead-lettered", ["queue", "group"], registry=r
        )
        self.dropped = Counter(
            "keygate_dropped", "Messages settled unsent", ["queue", "group", "reason"], registry=r
        )
        self.commit_batch = Histogram(
            "keygate_group_commit_batch_messages",
            "Messages per group-commit transaction",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=r,
        )
        self.publish_latency = Histogram(
            "keygate_publish_commit_seconds",
            "From publish call to commit",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )

    def watch_groups(self, source: GroupGauges) -> None:
        self.registry.register(_GroupCollector(source))

    def watch_listener(self, name: str, stats: object) -> None:
        """Export a listener's ``stats`` dataclass of counters."""
        if is_dataclass(stats):
            self.registry.register(_ListenerCollector(name, stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RuntimeMetrics:
    """Adapts ``Metrics`` to gateway.runtime.RuntimeHooks."""

    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics

    def delivered(self, queue: str, group: str, count: int) -> None:
        self._m.delivered.labels(queue, group).inc(count)

    def dead_lettered(self, queue: str, group: str, count: int) -> None:
        self._m.dead_lettered.labels(queue, group).inc(count)

    def dropped(self, queue: str, group: str, reason: str) -> None:
        self._m.dropped.labels(queue, group, reason).inc()
