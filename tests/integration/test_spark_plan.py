"""Option parsing and read planning of the Spark source (pure functions, no SparkSession)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("pyspark")

import itertools

from core.errors import InvalidArgument
from spark.db import PartitionState
from spark.options import Start, parse_options
from spark.plan import limit_offsets, read_ranges, start_offsets
from spark.reader import property_map

BASE = {"url": "sqlite:///x.db", "queue": "orders", "group": "g"}


def test_options_are_case_insensitive_and_default_to_committed() -> None:
    options = parse_options({"URL": "sqlite:///x.db", "Queue": "orders", "GROUP": "g"})
    assert options.start is Start.COMMITTED
    assert options.end is None
    assert options.include_properties is True


def test_json_offsets_are_parsed_per_partition() -> None:
    options = parse_options({**BASE, "startingOffsets": '{"0": 4, "2": 9}'})
    assert options.start == {0: 4, 2: 9}


@pytest.mark.parametrize(
    "bad",
    [
        {"startingOffsets": "yesterday"},
        {"startingOffsets": '{"zero": 1}'},
        {"startingOffsets": '{"0": -1}'},
        {"endingOffsets": "[1, 2]"},
        {"maxOffsetsPerTrigger": "0"},
        {"minPartitions": "many"},
        {"includeProperties": "maybe"},
        {"queue": ".hidden"},
    ],
)
def test_invalid_options_are_rejected_with_invalid_argument(bad: dict[str, str]) -> None:
    with pytest.raises(InvalidArgument):
        parse_options({**BASE, **bad})


def test_missing_required_options_are_named() -> None:
    with pytest.raises(InvalidArgument, match="group"):
        parse_options({"url": "sqlite:///x.db", "queue": "orders"})


def test_properties_render_every_value_type_as_a_string() -> None:
    raw = {"s": "x", "i": 42, "f": 1.5, "t": True, "b": {"$b64": "AQI="}}
    column = property_map([raw, None])
    assert column[1].as_py() == []
    assert dict(column[0].as_py()) == {
        "s": "x",
        "i": "42",
        "f": "1.5",
        "t": "true",
        "b": "AQI=",
    }


@settings(max_examples=300, deadline=None)
@given(
    backlog=st.dictionaries(st.integers(0, 15), st.integers(0, 10_000), min_size=1),
    limit=st.integers(1, 20_000),
)
def test_trigger_limit_is_shared_by_backlog_and_never_exceeded(
    backlog: dict[int, int], limit: int
) -> None:
    start = {p: 100 for p in backlog}
    end = {p: 100 + b for p, b in backlog.items()}
    limited = limit_offsets(start, end, limit)
    moved = {p: limited[p] - start[p] for p in backlog}
    assert sum(moved.values()) == min(limit, sum(backlog.values()))
    assert all(0 <= moved[p] <= backlog[p] for p in backlog)
    total = sum(backlog.values())
    for p, b in backlog.items():
        # Proportional share, give or take the one seq handed out for rounding.
        assert abs(moved[p] - min(b, limit * b / total if total else 0)) <= 1


def test_min_partitions_splits_into_consecutive_ranges_covering_everything() -> None:
    states = {
        0: PartitionState(
            committed=10, acked_above=((15, 16),), dispatched=10, head=110, earliest=0
        ),
        1: PartitionState(committed=0, acked_above=(), dispatched=0, head=5, earliest=0),
    }
    ranges = read_ranges(
        url="sqlite:///x.db",
        queue="orders",
        group="g",
        states=states,
        start=start_offsets(states, Start.COMMITTED),
        end={0: 110, 1: 5},
        min_partitions=6,
        include_properties=True,
    )
    assert len(ranges) >= 6
    covered = {p: [(r.lo, r.hi) for r in ranges if r.partition == p] for p in states}
    for p, spans in covered.items():
        assert spans[0][0] == states[p].committed
        assert spans[-1][1] == states[p].head
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert [r.skip for r in ranges if r.partition == 0 and r.lo < 15 <= r.hi] == [((15, 16),)]
