"""GroupCommitter: batching, per-item outcomes, failures and draining on close."""

from __future__ import annotations

import asyncio

import pytest

from core.errors import InvalidArgument, StorageError, Unavailable
from storage.batcher import GroupCommitter


class Recorder:
    def __init__(self, fail_with: Exception | None = None) -> None:
        self.batches: list[list[int]] = []
        self.fail_with = fail_with

    async def process(self, items: list[int]) -> list[int | BaseException]:
        self.batches.append(items)
        if self.fail_with is not None:
            raise self.fail_with
        return [InvalidArgument("odd") if i % 2 else i * 10 for i in items]


async def test_concurrent_submits_form_one_batch_in_submit_order() -> None:
    recorder = Recorder()
    committer = GroupCommitter(recorder.process, max_weight=100, linger=0, name="t")
    results = await asyncio.gather(*(committer.submit(i) for i in range(0, 20, 2)))
    assert results == [i * 10 for i in range(0, 20, 2)]
    assert recorder.batches == [list(range(0, 20, 2))] and committer.commits == 1
    await committer.close()


async def test_batches_are_bounded_by_weight() -> None:
    recorder = Recorder()
    committer = GroupCommitter(recorder.process, max_weight=5, linger=0, name="t")
    await asyncio.gather(*(committer.submit(i, weight=2) for i in range(0, 12, 2)))
    assert recorder.batches == [[0, 2], [4, 6], [8, 10]]
    await committer.close()


async def test_an_item_can_fail_alone() -> None:
    committer = GroupCommitter(Recorder().process, max_weight=10, linger=0, name="t")
    ok, odd = await asyncio.gather(committer.submit(2), committer.submit(3), return_exceptions=True)
    assert ok == 20 and isinstance(odd, InvalidArgument)
    await committer.close()


@pytest.mark.parametrize("error", [StorageError("db down"), RuntimeError("bug")])
async def test_a_failed_batch_fails_every_caller_with_storage_error(error: Exception) -> None:
    recorder = Recorder(fail_with=error)
    committer = GroupCommitter(recorder.process, max_weight=10, linger=0, name="t")
    results = await asyncio.gather(committer.submit(2), committer.submit(4), return_exceptions=True)
    assert all(isinstance(r, StorageError) for r in results)
    recorder.fail_with = None
    assert await committer.submit(6) == 60
    await committer.close()


async def test_close_writes_what_was_submitted_then_refuses_more() -> None:
    recorder = Recorder()
    committer = GroupCommitter(recorder.process, max_weight=10, linger=0.01, name="t")
    # gather starts its tasks in order: the submit happens before close runs.
    result, _ = await asyncio.gather(committer.submit(8), committer.close())
    assert result == 80 and recorder.batches == [[8]]
    with pytest.raises(Unavailable):
        await committer.submit(2)


class Gated(Recorder):
    """A Recorder whose first batch commits only once ``release`` is set: what is
    submitted meanwhile is the backlog the next batches are formed from."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def process(self, items: list[int]) -> list[int | BaseException]:
        if not self.batches:
            self.batches.append(items)
            await self.release.wait()
            self.batches.pop()
        return await super().process(items)


async def test_a_lone_submission_rides_the_next_batch_not_after_another_sources_backlog() -> None:
    recorder = Gated()
    committer = GroupCommitter(recorder.process, max_weight=10, linger=0, name="t")
    first = committer.enqueue(0, source="flood")
    await asyncio.sleep(0)  # the writer takes it and commits, slowly
    flood = [committer.enqueue(n, source="flood") for n in range(2, 202, 2)]  # ten batches
    lone = committer.enqueue(1000, source="canary")
    recorder.release.set()
    assert await lone == 10000
    await asyncio.gather(first, *flood)
    assert recorder.batches[0] == [0] and 1000 in recorder.batches[1]
    assert sorted(n for batch in recorder.batches for n in batch) == [*range(0, 202, 2), 1000]
    await committer.close()


async def test_sources_take_turns_each_in_its_own_order() -> None:
    recorder = Recorder()
    committer = GroupCommitter(recorder.process, max_weight=4, linger=0, name="t")
    a = [committer.enqueue(n, source="a") for n in range(0, 12, 2)]
    b = [committer.enqueue(n, source="b") for n in range(100, 106, 2)]
    await asyncio.gather(*a, *b)
    assert recorder.batches == [[0, 100, 2, 102], [4, 104, 6, 8], [10]]
    await committer.close()


async def test_a_small_submission_fills_the_room_a_large_one_does_not_fit_in() -> None:
    recorder = Recorder()
    committer = GroupCommitter(recorder.process, max_weight=10, linger=0, name="t")
    large = [committer.enqueue(n, weight=8, source=n) for n in (0, 2)]
    small = committer.enqueue(4, weight=1, source="small")
    await asyncio.gather(*large, small)
    # The source left out keeps its turn: it goes first in the next batch.
    assert recorder.batches == [[0, 4], [2]]
    await committer.close()


async def test_a_single_source_still_fills_every_batch_in_submit_order() -> None:
    recorder = Recorder()
    committer = GroupCommitter(recorder.process, max_weight=3, linger=0, name="t")
    await asyncio.gather(*(committer.enqueue(n, source="only") for n in range(0, 14, 2)))
    assert recorder.batches == [[0, 2, 4], [6, 8, 10], [12]]
    await committer.close()
