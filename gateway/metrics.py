"""Prometheus metrics. Counters are updated on the hot path; per-queue and per-group gauges
are computed at scrape time from the store's cached depths and the live state machines,
and the per-queue oldest message age from one SQL query per scrape (``refresh_oldest``)."""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from core.actions import Deliver


@dataclass(frozen=True, slots=True)
class GroupGauge:
    """One loaded group at scrape time."""

    queue: str
    group: str
    backlog: int  # loaded, not yet delivered
    in_flight: int  # delivered, not yet settled
    lag: int  # stored after the committed seq (not yet settled), per partition summed
    owners: int  # flows holding at least one partition
    oldest: float | None  # publish time of the oldest loaded unsettled message
    parked: int = 0  # keys parked by on_dead_letter = park_key


@dataclass(frozen=True, slots=True)
class QueueGauge:
    queue: str
    messages: int
    bytes: int
    in_flight: int
    dead_letters: int  # messages in the queue's dead-letter queue


class _ScrapeCollector(Collector):
    """Per-queue and per-group gauges, computed from the live state when scraped."""

    def __init__(
        self,
        queues: Callable[[], Iterable[QueueGauge]],
        groups: Callable[[], Iterable[GroupGauge]],
        clock: Callable[[], float],
        oldest: Callable[[], Mapping[str, float] | None],
    ) -> None:
        self._queues = queues
        self._groups = groups
        self._clock = clock
        self._oldest = oldest

    def collect(self) -> Iterator[GaugeMetricFamily]:
        q = ["queue"]
        queue_families = {
            "messages": GaugeMetricFamily("keygate_queue_messages", "Messages stored", labels=q),
            "bytes": GaugeMetricFamily(
                "keygate_queue_bytes", "Bytes stored (payload and properties)", labels=q
            ),
            "in_flight": GaugeMetricFamily(
                "keygate_queue_in_flight_messages", "Delivered, not yet settled", labels=q
            ),
            "dead_letters": GaugeMetricFamily(
                "keygate_queue_dead_letter_messages", "Messages in the dead-letter queue", labels=q
            ),
        }
        age = GaugeMetricFamily(
            "keygate_queue_oldest_message_age_seconds",
            "Age of the oldest message some group of the queue has not settled (no group: the "
            "oldest stored); 0 when none waits",
            labels=q,
        )
        now = self._clock()
        waiting = self._oldest()  # None: not known (the last read failed)
        for queue in self._queues():
            for name, family in queue_families.items():
                family.add_metric([queue.queue], getattr(queue, name))
            if waiting is not None:
                published = waiting.get(queue.queue, now)
                age.add_metric([queue.queue], max(0.0, now - published))
        yield from queue_families.values()
        yield age
        g = ["queue", "group"]
        group_families = {
            "backlog": GaugeMetricFamily(
                "keygate_group_backlog", "Messages loaded, not yet delivered", labels=g
            ),
            "in_flight": GaugeMetricFamily(
                "keygate_group_in_flight", "Delivered, not yet settled", labels=g
            ),
            "lag": GaugeMetricFamily(
                "keygate_group_lag_messages", "Stored messages the group has not settled", labels=g
            ),
            "owners": GaugeMetricFamily(
                "keygate_group_owners", "Consumers holding at least one partition", labels=g
            ),
            "parked": GaugeMetricFamily(
                "keygate_group_parked_keys",
                "Keys stopped after a dead letter until released (on_dead_letter = park_key)",
                labels=g,
            ),
        }
        oldest = GaugeMetricFamily(
            "keygate_group_oldest_unacked_age_seconds",
            "Age of the oldest loaded message the group has not settled",
            labels=g,
        )
        for group in self._groups():
            for name, family in group_families.items():
                family.add_metric([group.queue, group.group], getattr(group, name))
            if group.oldest is not None:
                oldest.add_metric([group.queue, group.group], max(0.0, now - group.oldest))
        yield from group_families.values()
        yield oldest


class _ConnectionCollector(Collector):
    def __init__(self, per_protocol: Mapping[str, int]) -> None:
        self._per_protocol = per_protocol

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "keygate_open_connections",
            "Open client connections (logging in or logged in), by protocol",
            labels=["protocol"],
        )
        for protocol, count in sorted(self._per_protocol.items()):
            family.add_metric([protocol], count)
        yield family


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


# How Prometheus writes a bucket's bound ("0.001", "1.0"); prometheus_client's own helper,
# which has no type annotations.
_go_float: Callable[[float], str] = floatToGoString


class RunHistogram(Collector):
    """A histogram without labels that is given a run of values at once (the deliveries
    of one send): prometheus_client's Histogram takes a lock and walks its buckets for
    every value, which was most of what the metrics cost a delivery. Observed and
    collected on the event loop's thread."""

    def __init__(
        self,
        name: str,
        documentation: str,
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._bounds = tuple(buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound
        self._sum = 0.0
        registry.register(self)

    def observe_run(self, values: Iterable[float]) -> None:
        counts, bounds = self._counts, self._bounds
        total = self._sum  # added in order, as prometheus_client does: the same float sum
        for value in values:
            counts[bisect.bisect_left(bounds, value)] += 1  # bucket "le": value <= bound
            total += value
        self._sum = total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative = list(itertools.accumulate(self._counts))
        buckets = [(_go_float(b), n) for b, n in zip(self._bounds, cumulative[:-1], strict=True)]
        buckets.append(("+Inf", cumulative[-1]))
        family = HistogramMetricFamily(self._name, self._documentation)
        family.add_metric([], buckets, self._sum)
        yield family


class Metrics:
    def __init__(self) -> None:
        # Queue -> publish time of its oldest message not settled by every group.
        self._oldest: Mapping[str, float] | None = None
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
        self.deliver_latency = RunHistogram(
            "keygate_publish_to_deliver_seconds",
            "From publish to first delivery to a consumer (includes scheduled delays)",
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0),
            registry=r,
        )
        self.active = Gauge(
            "keygate_gateway_active", "1 while this gateway holds the lease", registry=r
        )
        self.publish_latency = Histogram(
            "keygate_publish_commit_seconds",
            "From publish call to commit",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
            registry=r,
        )

    def watch(
        self,
        queues: Callable[[], Iterable[QueueGauge]],
        groups: Callable[[], Iterable[GroupGauge]],
        clock: Callable[[], float],
    ) -> None:
        """Export per-queue and per-group gauges computed from ``queues`` and ``groups``."""
        self.registry.register(_ScrapeCollector(queues, groups, clock, lambda: self._oldest))

    async def refresh_oldest(self, read: Callable[[], Awaitable[Mapping[str, float]]]) -> None:
        """Re-read the per-queue oldest waiting message (before a scrape); if the read
        fails, the gauge is left out of the scrape rather than show a stale age."""
        self._oldest = None
        self._oldest = await read()

    def watch_connections(self, per_protocol: Mapping[str, int]) -> None:
        """Export the open connections by protocol (shared by every listener)."""
        self.registry.register(_ConnectionCollector(per_protocol))

    def watch_http_connections(self, count: Callable[[], int]) -> None:
        """Export the admin HTTP port's open connections (``http`` and ``http_tls``)."""
        Gauge(
            "keygate_open_http_connections",
            "Open admin HTTP connections (http and http_tls together)",
            registry=self.registry,
        ).set_function(count)

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

    def delivered(self, queue: str, group: str, deliveries: Sequence[Deliver]) -> None:
        self._m.delivered.labels(queue, group).inc(len(deliveries))
        now = time.time()
        self._m.deliver_latency.observe_run(
            now - d.message.publish_time for d in deliveries if d.delivery_count == 1
        )

    def dead_lettered(self, queue: str, group: str, count: int) -> None:
        self._m.dead_lettered.labels(queue, group).inc(count)

    def dropped(self, queue: str, group: str, reason: str) -> None:
        self._m.dropped.labels(queue, group, reason).inc()
