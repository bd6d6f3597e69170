"""Balanced, sticky, deterministic assignment."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from core.assignment import assign


def lower_bound(partitions: int, flows: list[str], current: dict[int, str | None]) -> int:
    """Fewest partitions that must leave an active flow that holds them."""
    active = flows[:partitions]
    if not active:
        return 0
    base, extra = divmod(partitions, len(active))
    held = Counter(owner for owner in current.values() if owner in active)
    counts = sorted((held[f] for f in active), reverse=True)
    quotas = [base + 1] * extra + [base] * (len(active) - extra)
    return sum(max(0, c - q) for c, q in zip(counts, quotas, strict=True))


def test_first_assignment_spreads_partitions_in_bind_order() -> None:
    assert assign(4, ["a", "b"], {}) == {0: "a", 1: "a", 2: "b", 3: "b"}


def test_flows_beyond_the_partition_count_are_standby() -> None:
    result = assign(2, ["a", "b", "c"], {})
    assert set(result.values()) == {"a", "b"}


def test_a_newcomer_takes_only_what_balance_requires() -> None:
    current: dict[int, str | None] = {p: "a" for p in range(6)}
    result = assign(6, ["a", "b"], current)
    assert Counter(result.values()) == {"a": 3, "b": 3}
    assert [p for p in range(6) if result[p] == "a"] == [0, 1, 2]


def test_no_flows_leaves_everything_unassigned() -> None:
    assert assign(3, [], {0: "gone"}) == {0: None, 1: None, 2: None}


scenario = st.integers(1, 12).flatmap(
    lambda n: st.tuples(
        st.just(n),
        st.lists(st.sampled_from("abcdefgh"), unique=True, max_size=8),
        st.dictionaries(st.integers(0, n - 1), st.sampled_from("abcdefghxy") | st.none()),
    )
)


@settings(max_examples=500, deadline=None)
@given(scenario)
def test_assignment_is_balanced_minimal_and_deterministic(
    case: tuple[int, list[str], dict[int, str | None]],
) -> None:
    partitions, flows, current = case
    result = assign(partitions, flows, current)
    assert result == assign(partitions, list(flows), dict(current))
    assert set(result) == set(range(partitions))
    active = flows[:partitions]
    counts = Counter(result.values())
    if active:
        assert all(owner in active for owner in result.values())
        low, high = partitions // len(active), -(-partitions // len(active))
        assert all(low <= counts[f] <= high for f in active)
    else:
        assert set(result.values()) == {None}
    moved = sum(1 for p, o in current.items() if o in active and result[p] != o)
    assert moved == lower_bound(partitions, flows, current)
