"""The queue between a connection's reader and its worker keeps arrival order, takes a run
of publishes together within its bounds, and stops the reader while it is full."""

from __future__ import annotations

import asyncio

from protocols._queue import WorkQueue


def _queue(
    *, max_items: int = 100, max_bytes: int = 1000, max_batch: int = 3, max_batch_bytes: int = 100
) -> WorkQueue[str]:
    # "p<size>" is a publish of <size> bytes; anything else is another request.
    return WorkQueue(
        max_items=max_items,
        max_bytes=max_bytes,
        max_batch=max_batch,
        max_batch_bytes=max_batch_bytes,
        batchable=lambda item: item.startswith("p"),
        size=lambda item: int(item[1:]) if item.startswith("p") else 0,
    )


async def test_requests_come_out_in_order_with_consecutive_publishes_together() -> None:
    queue = _queue()
    for item in ["p1", "p2", "ack", "p3", "p4", "p5", "p6", "commit"]:
        queue.put_nowait(item)
    taken = [await queue.take() for _ in range(5)]
    assert taken == [["p1", "p2"], ["ack"], ["p3", "p4", "p5"], ["p6"], ["commit"]]


async def test_a_batch_stops_at_its_byte_bound() -> None:
    queue = _queue(max_batch=10, max_batch_bytes=100)
    for item in ["p60", "p50", "p10"]:
        queue.put_nowait(item)
    assert await queue.take() == ["p60", "p50"]
    assert await queue.take() == ["p10"]


async def test_put_waits_while_the_queue_and_the_batch_being_done_hold_too_many_bytes() -> None:
    queue = _queue(max_bytes=100)
    await queue.put("p100")
    second = asyncio.create_task(queue.put("p1"))
    await asyncio.sleep(0)
    assert not second.done() and queue.full
    assert await queue.take() == ["p100"]
    await asyncio.sleep(0)
    assert not second.done() and queue.full  # p100 is still being stored
    coming_back = asyncio.create_task(queue.take())  # the worker is done with it
    await asyncio.wait_for(second, 1)
    assert await asyncio.wait_for(coming_back, 1) == ["p1"]


async def test_clear_gives_back_the_bytes_of_the_batch_being_done() -> None:
    queue = _queue(max_bytes=100, max_batch_bytes=1000)
    queue.put_nowait("p500")  # one publish over the bound still goes, alone
    assert await queue.take() == ["p500"]
    assert queue.full
    queue.clear()  # the worker failed on it
    assert not queue.full


async def test_put_waits_while_the_queue_holds_too_many_requests() -> None:
    queue = _queue(max_items=2)
    await queue.put("ack")
    await queue.put("ack")
    third = asyncio.create_task(queue.put("nack"))
    await asyncio.sleep(0)
    assert not third.done()
    await queue.take()
    await asyncio.wait_for(third, 1)
    assert len(queue) == 2


async def test_idle_once_the_worker_comes_back_to_an_empty_queue() -> None:
    queue = _queue()
    assert queue.idle.is_set()
    queue.put_nowait("ack")
    assert not queue.idle.is_set()
    await queue.take()
    assert not queue.idle.is_set()  # the worker is still doing it
    waiting = asyncio.create_task(queue.take())
    await asyncio.wait_for(queue.idle.wait(), 1)
    queue.put_nowait("p1")
    assert await asyncio.wait_for(waiting, 1) == ["p1"]


async def test_clear_drops_what_is_queued_and_frees_the_reader() -> None:
    queue = _queue(max_items=1)
    await queue.put("ack")
    blocked = asyncio.create_task(queue.put("nack"))
    await asyncio.sleep(0)
    queue.clear()
    await asyncio.wait_for(blocked, 1)
    assert await queue.take() == ["nack"]
