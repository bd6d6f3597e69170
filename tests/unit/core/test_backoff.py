"""Redelivery backoff."""

from __future__ import annotations

from core.backoff import redelivery_delay
from core.model import QueueConfig


def test_backoff_doubles_from_initial_and_is_capped() -> None:
    queue = QueueConfig("q")
    delays = [redelivery_delay(queue, n, None) for n in range(1, 10)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 64.0, 64.0]


def test_requested_delay_wins_over_the_policy() -> None:
    assert redelivery_delay(QueueConfig("q"), 5, 0.25) == 0.25
    assert redelivery_delay(QueueConfig("q"), 5, -3.0) == 0.0


def test_zero_initial_delay_redelivers_immediately() -> None:
    assert redelivery_delay(QueueConfig("q", backoff_initial=0.0), 7, None) == 0.0


def test_huge_delivery_counts_do_not_overflow() -> None:
    assert redelivery_delay(QueueConfig("q"), 100_000, None) == 64.0
