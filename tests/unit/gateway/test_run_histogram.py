"""RunHistogram, the publish-to-deliver histogram fed a run of deliveries at a time, must
be scraped exactly as prometheus_client's own Histogram given the same values."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.metrics import RunHistogram

BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0)


def _scrape(registry: CollectorRegistry) -> list[str]:
    # prometheus_client adds a _created sample (the creation time) that RunHistogram has not.
    return [
        line for line in generate_latest(registry).decode().splitlines() if "_created" not in line
    ]


@given(st.lists(st.lists(st.sampled_from([*BUCKETS, 0.0, 0.0015, 0.3, 29.9, 31.0, 1e6]))))
def test_a_run_histogram_scrapes_as_prometheus_clients_own(runs: list[list[float]]) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram("kg_seconds", "doc", buckets=BUCKETS, registry=theirs)
    run_histogram = RunHistogram("kg_seconds", "doc", buckets=BUCKETS, registry=ours)
    for run in runs:
        for value in run:
            histogram.observe(value)
        run_histogram.observe_run(run)
    assert _scrape(ours) == _scrape(theirs)
