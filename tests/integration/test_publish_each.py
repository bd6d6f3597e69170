"""Broker.publish_each, the listeners' publish path: the lot is queued for the store when
the call returns, and what it stored is counted even if nobody awaits its outcome (a
connection torn down before its confirm task ran)."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, cast

from prometheus_client.parser import text_string_to_metric_families

from core.model import Publication, QueueConfig
from gateway.broker import Broker
from gateway.config import GatewayConfig
from gateway.metrics import Metrics
from protocols.sink import Principal
from storage import SqlStore
from tests.support.wait import eventually

ME = Principal(None, "native", "c", connection="native:c")


def _samples(broker: Broker) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = broker.metrics.render().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_a_lot_nobody_awaits_is_stored_counted_and_leaves_no_backlog(
    store: SqlStore,
) -> None:
    broker = Broker(store, GatewayConfig(), Metrics())
    await broker.start()
    try:
        await broker.create_queue(QueueConfig("q"))
        lot = [Publication(b"x", queue="q"), Publication(b"y", queue="nowhere")]
        pending = broker.publish_each(ME, lot)
        assert store.appends_pending == 1  # queued by the time the call returned
        cast(Coroutine[Any, Any, Any], pending).close()  # nobody will await it
        await eventually(lambda: store.appends_pending == 0)
        assert [m.payload for m in await store.read("q", 0, 0, 10)] == [b"x"]
        samples = _samples(broker)
        published = ("keygate_published_total", frozenset({("queue", "q"), ("protocol", "native")}))
        refused = ("keygate_publish_rejected_total", frozenset({("reason", "queue-not-found")}))
        assert (samples.get(published), samples.get(refused)) == (1.0, 1.0)
        assert not broker.blocked
    finally:
        await broker.close()
