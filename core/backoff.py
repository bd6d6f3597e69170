"""Redelivery backoff (DESIGN.md §2, §4): exponential, capped, overridable per nack."""

from __future__ import annotations

from core.model import QueueConfig


def redelivery_delay(queue: QueueConfig, delivery_count: int, requested: float | None) -> float:
    """Seconds to wait before redelivering a message whose ``delivery_count``-th delivery
    failed.

    A delay requested with the nack wins (negative values mean now). Otherwise
    ``initial * multiplier ** (delivery_count - 1)`` capped at ``backoff_max``; an initial
    delay of 0 redelivers immediately.
    """
    if requested is not None:
        return max(0.0, requested)
    if queue.backoff_initial <= 0:
        return 0.0
    exponent = max(0, delivery_count - 1)
    try:
        delay = queue.backoff_initial * queue.backoff_multiplier**exponent
    except OverflowError:
        return queue.backoff_max
    return min(delay, queue.backoff_max)
