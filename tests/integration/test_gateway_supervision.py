"""The active gateway never keeps answering "active" once it cannot do its job: a lease
renewal that fails, whatever the error, is tried again until lease_ttl runs out, then the
gateway stops; a critical background task (the lease keeper, the append and dispatch
writers, housekeeping, a retention run) that ends while it runs stops it at once, with an
ERROR line — a retention run's error used to be lost with its task."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.server import Gateway
from tests.integration.conftest import start_gateway
from tests.support.wait import eventually

TTL = 1.0


def _failing_renewals(gateway: Gateway, failures: int | None) -> list[int]:
    """Make the next ``failures`` renewals (every one: None) raise an error no layer
    expects; returns the list the attempts are counted in."""
    assert gateway.store is not None
    renew = gateway.store.acquire_gateway_lease
    attempts: list[int] = []

    async def flaky(*args: object, **kwargs: object) -> int | None:
        attempts.append(1)
        if failures is None or len(attempts) <= failures:
            raise RuntimeError("something no layer expects")
        return await renew(*args, **kwargs)  # type: ignore[arg-type]

    gateway.store.acquire_gateway_lease = flaky  # type: ignore[method-assign]
    return attempts


async def test_a_renewal_failing_with_any_error_stops_the_gateway_within_lease_ttl(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = await start_gateway(sqlite_url, lease_ttl=TTL, retention_interval=3600.0)
    try:
        attempts = _failing_renewals(gateway, None)
        await asyncio.wait_for(gateway.wait_closed(), 3 * TTL)
        assert len(attempts) >= 2  # tried again before giving up
        assert gateway.lost_lease and gateway.failed
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("lease" in message for message in errors), errors
    finally:
        await gateway.stop()


async def test_a_renewal_that_fails_once_is_tried_again_and_the_gateway_stays_active(
    sqlite_url: str,
) -> None:
    gateway = await start_gateway(sqlite_url, lease_ttl=TTL, retention_interval=3600.0)
    try:
        attempts = _failing_renewals(gateway, 1)
        # Past lease_ttl since the failure: the later attempts renewed it.
        await eventually(lambda: len(attempts) >= 5, timeout=5 * TTL)
        assert not gateway.failed
        assert gateway.ports["native"] > 0
    finally:
        await gateway.stop()


async def test_a_critical_task_that_ends_stops_the_gateway_with_an_error(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = await start_gateway(sqlite_url, lease_ttl=30.0)
    try:
        assert gateway.store is not None
        gateway.store.appender.task.cancel()
        await asyncio.wait_for(gateway.wait_closed(), 10)
        assert gateway.failed and not gateway.lost_lease
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("append writer ended unexpectedly" in message for message in errors), errors
    finally:
        await gateway.stop()


async def test_a_retention_run_failing_with_an_unexpected_error_stops_the_gateway(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = await start_gateway(sqlite_url, lease_ttl=30.0, retention_interval=0.1)
    try:
        assert gateway.store is not None

        async def broken(**_: object) -> int:
            raise RuntimeError("something no layer expects")

        gateway.store.retention = broken  # type: ignore[method-assign]
        await asyncio.wait_for(gateway.wait_closed(), 10)
        assert gateway.failed and not gateway.lost_lease
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        expected = "a retention run ended unexpectedly (RuntimeError: something no layer expects)"
        assert any(expected in message for message in errors), errors
    finally:
        await gateway.stop()
