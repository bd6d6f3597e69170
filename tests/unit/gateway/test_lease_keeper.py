"""The lease keeper: failed renewals are tried again until lease_ttl runs out, never
later, and a database that answers again before then keeps the lease."""

from __future__ import annotations

import asyncio
import time

import pytest

from core.errors import StorageUnavailable
from gateway.lease_keeper import keep_lease

TTL = 1.2


async def _keep(renew_outcome: object) -> tuple[asyncio.Task[None], list[str], list[float]]:
    """Run the keeper with ``renew_outcome(attempt time)`` as each renewal; returns the
    task, the reasons it gave up with, and the attempts' times (since the start)."""
    lost: list[str] = []
    attempts: list[float] = []
    start = time.monotonic()

    async def renew() -> bool:
        attempts.append(time.monotonic() - start)
        outcome = renew_outcome(attempts[-1])  # type: ignore[operator]
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is None:
            await asyncio.Event().wait()  # hangs
        return bool(outcome)

    task = asyncio.create_task(keep_lease(renew, lambda: start, lost.append, ttl=TTL))
    return task, lost, attempts


async def test_a_database_answering_again_just_before_the_lease_ends_keeps_it() -> None:
    back = TTL - 0.25

    def outcome(at: float) -> object:
        return StorageUnavailable("storage unavailable") if at < back else True

    task, lost, attempts = await _keep(outcome)
    try:
        deadline = time.monotonic() + 3 * TTL
        while len([at for at in attempts if at >= back]) < 3:
            assert time.monotonic() < deadline, attempts
            await asyncio.sleep(0.05)
        assert lost == []
        assert len([at for at in attempts if at < back]) >= 3  # tried again and again
    finally:
        task.cancel()


@pytest.mark.parametrize(
    "failure",
    [StorageUnavailable("storage unavailable"), RuntimeError("a bug"), None],
    ids=["unavailable", "unexpected", "hangs"],
)
async def test_renewals_that_keep_failing_give_up_at_lease_ttl(failure: object) -> None:
    task, lost, attempts = await _keep(lambda at: failure)
    started = time.monotonic()
    await asyncio.wait_for(task, 2 * TTL)
    assert lost == [f"lost the gateway lease: not renewed within lease_ttl ({TTL:g} s)"]
    assert time.monotonic() - started <= TTL + 0.1
    assert attempts


async def test_a_renewal_finding_the_lease_taken_gives_up_at_once() -> None:
    task, lost, attempts = await _keep(lambda at: False)
    await asyncio.wait_for(task, TTL)
    assert lost == ["lost the gateway lease: another gateway holds it"]
    assert len(attempts) == 1
