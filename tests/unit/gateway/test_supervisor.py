"""The gateway's critical background tasks: one that ends while the gateway runs stops it."""

from __future__ import annotations

import asyncio

from gateway.supervisor import Supervisor


async def _forever() -> None:
    await asyncio.Event().wait()


async def _fail() -> None:
    await asyncio.sleep(0)
    raise RuntimeError("boom")


async def _return() -> None:
    await asyncio.sleep(0)


async def test_a_task_that_raises_is_reported_with_its_name_and_error() -> None:
    failures: list[str] = []
    supervisor = Supervisor(failures.append)
    supervisor.watch("the lease keeper", asyncio.create_task(_fail()))
    await asyncio.sleep(0.01)
    assert len(failures) == 1
    assert "the lease keeper" in failures[0] and "boom" in failures[0]


async def test_a_task_that_returns_or_is_cancelled_while_running_is_reported() -> None:
    failures: list[str] = []
    supervisor = Supervisor(failures.append)
    supervisor.watch("the append writer", asyncio.create_task(_return()))
    cancelled = asyncio.create_task(_forever())
    supervisor.watch("housekeeping", cancelled)
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.sleep(0.01)
    assert sorted(failures) == [
        "housekeeping ended unexpectedly (cancelled)",
        "the append writer ended unexpectedly (returned)",
    ]


async def test_tasks_that_end_once_the_gateway_stops_are_not_failures() -> None:
    failures: list[str] = []
    supervisor = Supervisor(failures.append)
    task = asyncio.create_task(_forever())
    supervisor.watch("the lease keeper", task)
    supervisor.stand_down()
    task.cancel()
    await asyncio.sleep(0.01)
    assert failures == []


async def test_a_run_that_returns_is_not_reported_one_that_raises_is() -> None:
    failures: list[str] = []
    supervisor = Supervisor(failures.append)
    supervisor.watch("a retention run", asyncio.create_task(_return()), runs_out=True)
    supervisor.watch("a retention run", asyncio.create_task(_fail()), runs_out=True)
    await asyncio.sleep(0.01)
    assert failures == ["a retention run ended unexpectedly (RuntimeError: boom)"]
