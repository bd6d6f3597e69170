"""The delayed-delivery scenario every publishing protocol's test runs (DESIGN.md §3.6).

A publisher sends ``b"later"`` (key ``later-key``) with a delay of ``DELAY_MS`` and then
``b"now"`` (key ``now-key``) without one; an SDK consumer must get ``now`` at once and
``later`` no earlier than its publish time + the delay.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gateway.client import Client, Consumer

DELAY_MS = 1500
DELAYED, UNDELAYED = (b"later", "later-key"), (b"now", "now-key")
_WAIT = 15.0


async def assert_delay_honoured(url: str, queue: str, publish_both: Callable[[], None]) -> None:
    """Run the scenario: ``publish_both`` (blocking, run on a worker thread) sends DELAYED
    with the protocol's delay header, then UNDELAYED, and returns once both are confirmed."""
    async with Client(url) as client:
        consumer: Consumer = await client.subscribe(queue, group="delay-check")
        await asyncio.to_thread(publish_both)
        first = await consumer.receive(timeout=_WAIT)
        first_at = time.time()
        await consumer.acknowledge(first)
        second = await consumer.receive(timeout=_WAIT)
        second_at = time.time()
        await consumer.acknowledge(second)
    assert (first.payload, first.key) == UNDELAYED
    assert (second.payload, second.key) == DELAYED
    # The gateway stamps publish_time from the same clock as time.time() here. The
    # undelayed message, published after the delayed one, did not wait for it (measured
    # from the delayed publish, so a slow client connection cannot fail the check) ...
    due = second.publish_time + DELAY_MS / 1000
    assert first_at < due
    # ... and the delayed one was not delivered before its time.
    assert second_at >= due
