"""A connection's tasks end with it: close cancels and awaits them all, a failing task is
reported once, and nothing can be started after close."""

from __future__ import annotations

import asyncio
import logging

import pytest

from protocols._tasks import Tasks


async def test_close_cancels_every_running_task_and_waits_for_it() -> None:
    tasks = Tasks("test")
    ended: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.append(name)

    tasks.spawn(forever("reader"), name="reader")
    tasks.spawn(forever("writer"), name="writer")
    await asyncio.sleep(0)
    assert len(tasks) == 2
    await tasks.close()
    assert sorted(ended) == ["reader", "writer"] and len(tasks) == 0


async def test_a_finished_task_is_forgotten() -> None:
    tasks = Tasks("test")
    assert await tasks.spawn(asyncio.sleep(0, result=7)) == 7
    await asyncio.sleep(0)
    assert len(tasks) == 0 and not tasks.failed.is_set()


async def test_a_failing_task_is_logged_and_sets_failed(caplog: pytest.LogCaptureFixture) -> None:
    tasks = Tasks("conn 1")

    async def broken() -> None:
        raise ValueError("bug")

    with caplog.at_level(logging.ERROR, logger="keygate.io"):
        task = tasks.spawn(broken(), name="worker")
        await asyncio.wait_for(tasks.failed.wait(), 5)
    assert isinstance(task.exception(), ValueError)
    assert "conn 1: task worker failed" in caplog.text
    await tasks.close()


async def test_nothing_can_be_spawned_after_close() -> None:
    tasks = Tasks("test")
    await tasks.close()
    coro = asyncio.sleep(0)
    with pytest.raises(RuntimeError):
        tasks.spawn(coro)
    assert coro.cr_frame is None  # closed unrun: no "never awaited" warning


async def test_wait_lets_running_tasks_finish_within_a_timeout() -> None:
    tasks = Tasks("test")
    quick = tasks.spawn(asyncio.sleep(0.01))
    assert await tasks.wait(5) and quick.done()
    stuck = tasks.spawn(asyncio.Event().wait())
    assert not await tasks.wait(0.01) and not stuck.done()
    await tasks.close()


async def test_tasks_of_one_connection_can_share_their_failure() -> None:
    tasks = Tasks("conn")
    publishes = Tasks("conn publishes", failed=tasks.failed)

    async def broken() -> None:
        raise ValueError("bug")

    publishes.spawn(broken())
    await asyncio.wait_for(tasks.failed.wait(), 5)
    await publishes.close()
