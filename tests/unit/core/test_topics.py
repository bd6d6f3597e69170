"""Topic normalisation, MQTT pattern rules, matching and the subscription trie."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import InvalidArgument
from core.topics import SubscriptionIndex, matches, normalize_topic, validate_pattern


def test_dotted_topics_map_to_slashes() -> None:
    assert normalize_topic("orders.eu.created", separator=".") == "orders/eu/created"
    assert normalize_topic("orders/eu") == "orders/eu"


@pytest.mark.parametrize("topic", ["", "a/+/b", "a/#", "a\x00b"])
def test_bad_publish_topics_are_rejected(topic: str) -> None:
    with pytest.raises(InvalidArgument):
        normalize_topic(topic)


def test_unknown_separator_is_rejected() -> None:
    with pytest.raises(InvalidArgument):
        normalize_topic("a:b", separator=":")


@pytest.mark.parametrize("pattern", ["a/#", "#", "+", "a/+/c", "+/+/#", "$SYS/#"])
def test_valid_patterns_are_accepted(pattern: str) -> None:
    assert validate_pattern(pattern) == pattern


@pytest.mark.parametrize("pattern", ["a/#/b", "a#", "a/b+", "+a/b", "", "x\x00"])
def test_invalid_patterns_are_rejected(pattern: str) -> None:
    with pytest.raises(InvalidArgument):
        validate_pattern(pattern)


@pytest.mark.parametrize(
    ("pattern", "topic", "expected"),
    [
        ("a/b", "a/b", True),
        ("a/b", "a/c", False),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/+", "a", False),
        ("a/#", "a", True),
        ("a/#", "a/b/c", True),
        ("#", "a/b", True),
        ("+/+", "/x", True),
        ("+", "", True),
        ("#", "$SYS/x", False),
        ("+/x", "$SYS/x", False),
        ("$SYS/#", "$SYS/x", True),
        ("a/+/c", "a//c", True),
    ],
)
def test_matching_follows_mqtt_rules(pattern: str, topic: str, expected: bool) -> None:
    assert matches(pattern, topic) is expected


def test_index_matches_exact_wildcard_and_parent_levels() -> None:
    index = SubscriptionIndex()
    index.add("a/b", "q1")
    index.add("a/+", "q2")
    index.add("a/#", "q3")
    index.add("#", "q4")
    assert index.match("a/b") == {"q1", "q2", "q3", "q4"}
    assert index.match("a") == {"q3", "q4"}
    assert index.match("$SYS/a") == frozenset()


def test_index_remove_and_remove_queue_forget_subscriptions() -> None:
    index = SubscriptionIndex()
    index.add("a/b", "q1")
    index.add("a/#", "q1")
    index.add("a/b", "q2")
    index.remove("a/b", "q1")
    index.remove("never/added", "q1")
    assert index.match("a/b") == {"q1", "q2"}
    index.remove_queue("q1")
    assert index.match("a/b") == {"q2"}
    assert index.patterns_of("q1") == frozenset()
    index.remove_queue("q2")
    assert len(index) == 0
    assert index.match("a/b") == frozenset()


def test_index_with_ten_thousand_subscriptions_matches_like_a_scan() -> None:
    rng = random.Random(7)
    words = ["a", "b", "c", "d", "e", "f", "g", "h"]
    index = SubscriptionIndex()
    subs: list[tuple[str, str]] = []
    for i in range(10_000):
        levels = [rng.choice([*words, "+"]) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.2:
            levels.append("#")
        pattern = "/".join(levels)
        queue = f"q{i % 2500}"
        index.add(pattern, queue)
        subs.append((pattern, queue))
    for _ in range(200):
        topic = "/".join(rng.choice(words) for _ in range(rng.randint(1, 5)))
        expected = {queue for pattern, queue in subs if matches(pattern, topic)}
        assert index.match(topic) == expected


level = st.sampled_from(["a", "b", "", "$x"])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(["a", "b", "+", ""]), min_size=1, max_size=3)
        .map("/".join)
        .filter(bool)
        | st.lists(st.sampled_from(["a", "+"]), max_size=2).map(lambda ls: "/".join([*ls, "#"])),
        max_size=8,
    ),
    st.lists(level, min_size=1, max_size=4).map("/".join),
)
def test_index_agrees_with_matches(patterns: list[str], topic: str) -> None:
    index = SubscriptionIndex()
    for i, pattern in enumerate(patterns):
        index.add(pattern, f"q{i}")
    expected = {f"q{i}" for i, pattern in enumerate(patterns) if matches(pattern, topic)}
    assert index.match(topic) == expected
