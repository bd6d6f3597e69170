"""The active gateway's lease renewals.

How it works. The lease is renewed ``lease_ttl / 3`` after it was last renewed, by this
task or by the store's writes (a busy gateway's lease is kept by its appends:
StoreBase.write). An attempt that fails, whatever the error (the database unreachable, a
timeout, a driver's own exception, a bug), is tried again RETRY_INTERVAL later at most,
so a database that answers again before the lease's end is found in time; each attempt is
bounded by ``lease_ttl / 3`` and by that end. The keeper gives up (``on_lost``) when a
renewal finds the lease held by another gateway, or ``lease_ttl`` after the last renewal
began: the lease lapses no earlier in the database, so the gateway stops before a standby
can take it over. A run of failures is logged once when it begins, then at most every
``lease_ttl / 3``, and once more when a renewal works again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Final

from core.errors import KeygateError

__all__ = ["RETRY_INTERVAL", "keep_lease"]

log = logging.getLogger("keygate.server")

# Seconds between attempts after a failed renewal (less with a short lease_ttl).
RETRY_INTERVAL: Final = 0.5


async def keep_lease(
    renew: Callable[[], Awaitable[bool]],
    renewed_by_writes: Callable[[], float],
    on_lost: Callable[[str], None],
    *,
    ttl: float,
) -> None:
    """Run until the lease is lost (then call ``on_lost`` with the reason and return).
    ``renew`` renews it (False: another gateway holds it); ``renewed_by_writes`` says
    when the store's writes last renewed it (time.monotonic())."""
    renewed = time.monotonic()
    retry_at = -math.inf  # after a failed attempt: when to try again
    failures = 0
    told = -math.inf
    while True:
        renewed = max(renewed, renewed_by_writes())
        now = time.monotonic()
        deadline = renewed + ttl
        if now >= deadline:
            on_lost(f"lost the gateway lease: not renewed within lease_ttl ({ttl:g} s)")
            return
        due = max(renewed + ttl / 3, retry_at)
        if now < due:
            await asyncio.sleep(min(due, deadline) - now)
            continue
        try:
            async with asyncio.timeout(min(ttl / 3, deadline - now)):
                held = await renew()
        except Exception as e:
            failures += 1
            retry_at = now + min(RETRY_INTERVAL, ttl / 6)
            if now - told >= ttl / 3:
                told = now
                _failed(e, failures, deadline - now)
            continue
        if not held:
            on_lost("lost the gateway lease: another gateway holds it")
            return
        if failures:
            log.info("renewed the gateway lease again after %d failed attempt(s)", failures)
            failures, told = 0, -math.inf
        renewed = now


def _failed(error: Exception, failures: int, left: float) -> None:
    why = str(error) or "timed out"
    if isinstance(error, (KeygateError, TimeoutError)):
        log.warning(
            "renewing the gateway lease failed: %s (%d attempt(s); trying again for %.1f s)",
            why,
            failures,
            left,
        )
        return
    # Not an error the store knows: a bug, told in full, and still a renewal not made
    # (dying of it would leave the gateway active with its lease lapsed).
    log.error(
        "renewing the gateway lease failed (%d attempt(s); trying again for %.1f s)",
        failures,
        left,
        exc_info=error,
    )
